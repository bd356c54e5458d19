"""Import torch so that a broken out-of-tree device plugin cannot take the user's program down.

Since torch 2.5, ``import torch`` auto-loads every ``torch.backends`` entry point (torch_npu,
torch_mlu, ...). If one of them fails — the classic case is ``torch_npu`` installed on a machine
without Huawei's CANN libraries — ``import torch`` itself raises ``RuntimeError: Failed to load
the backend extension``. When apt_model is imported before torch, :func:`import_torch` turns the
auto-loading off for the duration of the import, then loads each plugin itself, one by one,
recording the exact error text of any that fails. Torch ends up in the same state it would have
with working plugins; a broken one is reported as the failed candidate of its device kind.
"""
from __future__ import annotations

import os
import sys
import traceback
from importlib.metadata import entry_points

from apt_model.base.log import get_logger

log = get_logger(__name__)

#: Errors of device plugins that failed to load, keyed by the plugin's top-level module
#: (``torch_npu``) and by its entry-point name; values are ``"ExcType: message"``.
PLUGIN_ERRORS: dict[str, str] = {}

_AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def describe_exception(err: BaseException) -> str:
    """One line with the exception type and message, and the root cause when chained."""
    text = f"{type(err).__name__}: {err}".strip()
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text


def load_device_plugins() -> dict[str, str]:
    """Load every ``torch.backends`` entry point as torch's auto-loader would, but survive failures.

    Returns:
        The errors of plugins that failed, ``{module_or_entry_point_name: error_text}``.
    """
    errors: dict[str, str] = {}
    for ep in entry_points(group="torch.backends"):
        module = ep.value.split(":", 1)[0].split(".", 1)[0]
        try:
            ep.load()()
        except Exception as err:  # noqa: BLE001 - any plugin failure must be survivable
            text = describe_exception(err)
            errors[module] = errors[ep.name] = text
            log.warning("device plugin %r (%s) failed to load: %s", ep.name, ep.value, text)
            log.debug("plugin traceback:\n%s", traceback.format_exc())
    PLUGIN_ERRORS.update(errors)
    return errors


def import_torch():
    """Return the ``torch`` module, importing it with plugin failures contained if not yet imported.

    If torch is already imported, or the user disabled auto-loading
    (``TORCH_DEVICE_BACKEND_AUTOLOAD`` other than ``1``), this is a plain ``import torch``.
    """
    if "torch" in sys.modules or os.environ.get(_AUTOLOAD, "1") != "1":
        import torch

        return torch
    os.environ[_AUTOLOAD] = "0"
    try:
        import torch
    finally:
        os.environ[_AUTOLOAD] = "1"
    load_device_plugins()
    return torch
