"""Run code when a module is imported: now if it already is, else right after its first import.

For patches on classes of a costly, optional part of torch (FSDP2 pulls in DTensor and SymPy: about
a second) that most scripts never import: the switch must not import it itself just to patch it,
yet must patch it before the script uses it. :func:`when_imported` puts a finder at the front of
``sys.meta_path`` that, for that one module name, lets the other finders find it and hands the
import machinery their spec with a stand-in loader, which runs the module with the real one and then
the callback (the module is in ``sys.modules`` then, its classes defined), before the ``import``
statement returns to the script. The real loader is never changed (one may serve many modules, as
a zip archive's does), and the module keeps it. This is the "post-import hook" of PEP 369
(withdrawn; ``wrapt.register_post_import_hook`` ships one), in a few lines for one name.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Callable

from apt_model.base.log import get_logger

log = get_logger(__name__)


class _Watch(importlib.abc.MetaPathFinder):
    """The finder for one module name (see the module docstring)."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]):
        self.name = name
        self.callback = callback
        self.active = True
        self._finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or not self.active or getattr(self._finding, "on", False):
            return None
        self._finding.on = True
        try:  # the other finders' answer (this one steps aside while they are asked)
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.on = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        # the spec found carries a stand-in for its loader: the loader itself may serve other
        # modules (one zipimporter per archive, the built-in and frozen importers' classes), and a
        # spec found only to ask whether the module exists must change nothing
        spec.loader = _WatchedLoader(loader, self)
        return spec

    def remove(self) -> None:
        """Stop watching and drop the callback (what it holds is freed with it)."""
        self.active = False
        self.callback = None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


class _WatchedLoader(importlib.abc.Loader):
    """Stands in for a watched module's loader in the spec :class:`_Watch` returns: runs the
    module with the real loader (which the module keeps: ``__loader__``, ``__spec__.loader``),
    then the callback. Any other attribute is the real loader's."""

    def __init__(self, loader, watch: _Watch):
        self._loader = loader
        self._watch = watch

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        loader, watch = self._loader, self._watch
        module.__loader__ = loader  # the module's code, and everyone after, see its own loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = loader
        loader.exec_module(module)
        self._watch = None
        callback = watch.callback
        watch.remove()
        if callback is None:  # stopped watching while the module was found
            return
        try:
            callback(module)
        except Exception as err:  # noqa: BLE001 - the script's import must not fail for our patch
            log.warning("after importing %s: %s: %s", module.__name__, type(err).__name__, err)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> Callable[[], None] | None:
    """Call ``callback(module)`` for the module ``name`` (a full dotted name): at once if it is
    imported already, else right after its first import (once; in the importing thread).

    Returns:
        None when the callback ran at once; else a function that stops watching (for an undo
        stack: after it, a later import runs no callback). An exception from a callback run at
        import is logged as a warning, never raised into the script's ``import``; one run at once
        is raised to the caller.
    """
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return None
    watch = _Watch(name, callback)
    sys.meta_path.insert(0, watch)
    return watch.remove
