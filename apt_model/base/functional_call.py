"""Whether ``torch.func.functional_call`` has swapped tensors into a module's parameter slots.

``torch.func.functional_call(module, {name: tensor}, args)`` (and the older
``torch.nn.utils.stateless.functional_call``) puts the given tensors into the module's
``_parameters`` for one call and the module's own parameters back after it — MAML's inner loop,
hypernetworks, per-sample gradients. During that call the slots hold someone else's tensors:
adoption must not plan from them (a non-leaf weight made adoption fail with "post accumulate grad
hooks cannot be registered on non-leaf tensors", and detached ones hid the gradients and states
from the plan: found 2026-11-27 by a probe), paging must not take the swap for model surgery, and
activation checkpointing must not recompute with the module's own parameters in backward.

``enable()`` wraps torch's private context manager that does the swap
(``torch.nn.utils.stateless._reparametrize_module``) to count the calls under way; where torch
lacks it, :func:`swapped` falls back to looking for slots that hold a tensor that is not an
``nn.Parameter`` (which misses ``nn.Parameter`` objects passed to ``functional_call``).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from apt_model.base.log import get_logger

log = get_logger(__name__)

def in_function_transform() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``vmap``...) is running on this
    thread (functorch's interpreter stack is not empty). The features stand aside there (the
    forward runs as written): ``torch.func.grad`` refuses saved-tensor hooks ("torch.func.{grad,
    vjp, jacrev, hessian} don't yet support saved tensor hooks"), which activation offload and
    non-reentrant checkpointing are built on; and PyTorch's own bf16 autocast inside
    ``vmap(grad(...))`` fails in the transform's backward ("expected scalar type BFloat16 but found
    Float"), where no retry can run."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


_calls = [0]  # functional_call swaps under way, any thread
_counted = [False]  # whether the wrapper is installed (else swapped() looks at the slots)


def install(patches) -> bool:
    """Count ``functional_call``'s swaps from now on (until ``patches`` are undone, by the
    :class:`~apt_model.base.patches.PatchSet` ``patches``). Returns False, changing nothing, where
    torch has no ``torch.nn.utils.stateless._reparametrize_module``."""
    from torch.nn.utils import stateless

    real = getattr(stateless, "_reparametrize_module", None)
    if real is None:
        log.debug("torch.nn.utils.stateless._reparametrize_module not found: functional_call is seen by its slots only")
        return False

    @functools.wraps(real)
    @contextlib.contextmanager
    def _reparametrize_module(*args, **kwargs):
        _calls[0] += 1
        try:
            with real(*args, **kwargs):
                yield
        finally:
            _calls[0] -= 1

    patches.set_attr(stateless, "_reparametrize_module", _reparametrize_module,
                     label="torch.nn.utils.stateless._reparametrize_module (functional_call counted)")
    _counted[0] = True
    patches.add_undo(lambda: _counted.__setitem__(0, False), "functional_call no longer counted")
    return True


def swapped(module: nn.Module | None = None) -> bool:
    """Whether a ``functional_call`` swap is under way (counted, on any thread), or — where the
    calls are not counted and ``module`` is given — whether ``module``'s slots hold a tensor that
    is not an ``nn.Parameter``. Cost: an integer test; the fallback walks ``module``."""
    if _calls[0]:
        return True
    if _counted[0] or module is None:
        return False
    return any(p is not None and not isinstance(p, nn.Parameter)
               for m in module.modules() for p in m._parameters.values())
