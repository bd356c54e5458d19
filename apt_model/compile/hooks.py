"""The script's module hooks, which compiled code would run differently: no rung where they are.

``torch.compile`` of a model's forward traces the hooks of its submodules into the graph, and by
default installs no guard on the hook dictionaries, so a hook added after compilation is never run
(``torch._dynamo.config.skip_nnmodule_hook_guards``). A probe (2026-11-28) trained a 2-block model
with a forward hook recording an activation, a full backward hook on another submodule, and at
step 30 a new forward hook and a forward pre-hook halving an input: once balanced mode's override
rung was kept — the script never asked for compilation — the first hook ran at 16 of 40 steps,
the late ones never, and the loss went its own way (0.089 against 0.209). Plain
``torch.compile(model.forward)`` does the same; the switch must not do it uninvited.

So the ladder (:mod:`apt_model.compile.ladder`) tries no rung on a model whose submodules carry
hooks of the script (forward, forward pre-, backward and backward pre-hooks, the module's own or
the global ones of ``torch.nn.modules.module``), and a hook the script registers later on a
submodule of a model on a rung — warming up, on trial or kept — sends that model back to eager
(:class:`HookWatch`, installed once per switch session). Hooks on the model itself run outside
the compiled forward (``Module.__call__`` runs them around it) and do not count; nor do the
switch's own hooks.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch.nn as nn
import torch.nn.modules.module as module_mod

from apt_model.base.module_hooks import is_switch_hook, script_hooks
from apt_model.base.patches import PatchSet


def hooks_inside_reason(hooked: list[str]) -> str:
    """Why no rung is tried on a model holding the script's hooks (``hooked``: from
    :func:`~apt_model.base.module_hooks.script_hooks`)."""
    return (f"the script's hooks inside the model ({', '.join(hooked)}): compiled code would run them differently "
            "from eager (torch.compile traces hooks into its graph and does not see hooks added later)")


#: ``nn.Module`` methods that register a hook compiled code would trace.
MODULE_REGISTRARS = {
    "register_forward_hook": "forward hook",
    "register_forward_pre_hook": "forward pre-hook",
    "register_full_backward_hook": "full backward hook",
    "register_full_backward_pre_hook": "full backward pre-hook",
    "register_backward_hook": "backward hook",
}

#: The global registrars of ``torch.nn.modules.module`` (every module's calls run these hooks).
GLOBAL_REGISTRARS = {
    "register_module_forward_hook": "global forward hook",
    "register_module_forward_pre_hook": "global forward pre-hook",
    "register_module_full_backward_hook": "global full backward hook",
    "register_module_full_backward_pre_hook": "global full backward pre-hook",
    "register_module_backward_hook": "global backward hook",
}


class HookWatch:
    """Sees the script register a module hook (the registrars of :data:`MODULE_REGISTRARS` and
    :data:`GLOBAL_REGISTRARS`, patched in ``patches``) and tells the ladders it concerns:
    ``ladder.script_hook_added(description)`` — every watched ladder for a global hook, those whose
    model holds the module (as a submodule) for a module's hook. Ladders are held weakly."""

    def __init__(self, patches: PatchSet):
        self._ladders: list[weakref.ref] = []
        self._install(patches)

    def watch(self, ladder) -> None:
        self._ladders = [r for r in self._ladders if r() is not None] + [weakref.ref(ladder)]

    def _tell(self, module: nn.Module | None, description: str, inserted: bool = False) -> None:
        """Tell the ladders concerned: all for a global hook (``module`` None); those whose model
        holds ``module`` as a submodule; for a submodule ``inserted`` into ``module``, also the
        ladder of the model ``module`` is."""
        for ref in list(self._ladders):
            ladder = ref()
            if ladder is not None and (module is None or ladder.holds_submodule(module)
                                       or (inserted and ladder.model_ref is module)):
                ladder.script_hook_added(description)

    def _inserted(self, parent: nn.Module, name: str, submodule):
        """Torch's module-registration hook: a submodule put into a module (``model.head = new``,
        a fine-tuning head swap) that already carries the script's hooks is as if they were
        registered now (a probe: a pre-hook on a head swapped in after the rung was kept never ran)."""
        if isinstance(submodule, nn.Module) and script_hooks(submodule, include_root=True, include_global=False):
            self._tell(parent, f"hooks on a {type(submodule).__name__} inserted as {name!r}", inserted=True)
        return None

    def _install(self, patches: PatchSet) -> None:
        patches.add_handle(module_mod.register_module_module_registration_hook(self._inserted),
                           "module registration hook (a submodule with the script's hooks, inserted later)")
        for name, kind in MODULE_REGISTRARS.items():
            patches.set_attr(nn.Module, name, self._registrar(getattr(nn.Module, name), kind, per_module=True),
                             label=f"nn.Module.{name} (compiled code would not run a hook added later)")
        for name, kind in GLOBAL_REGISTRARS.items():
            patches.set_attr(module_mod, name, self._registrar(getattr(module_mod, name), kind, per_module=False),
                             label=f"torch.nn.modules.module.{name} (compiled code would not run a hook added later)")

    def _registrar(self, real: Callable, kind: str, per_module: bool) -> Callable:
        """``real`` (a module's registrar: ``(module, hook, ...)``; a global one: ``(hook, ...)``),
        telling the ladders when the hook is the script's."""
        watch = self

        @functools.wraps(real)
        def register(*args, **kwargs):
            handle = real(*args, **kwargs)
            module = args[0] if per_module else None
            rest = args[1:] if per_module else args
            hook = kwargs.get("hook", rest[0] if rest else None)
            if hook is not None and not is_switch_hook(hook):
                watch._tell(module, f"a {kind} on {type(module).__name__}" if per_module else f"a {kind}")
            return handle

        return register
