"""CUDA redirection for default-device contexts: ``with torch.device("cuda")`` and
``torch.set_default_device("cuda")``.

Where CUDA is absent and ``redirect_cuda`` is on, the switch sends ``.cuda()`` / ``.to("cuda")``
to the selected device (``switch/controller.py``). A script written for CUDA may also build its
model inside ``with torch.device("cuda"):`` (parameters made on the device at once) or call
``torch.set_default_device("cuda")``; both raised torch's "Torch not compiled with CUDA enabled"
at the first tensor made, until 2026-11-28. Both construct ``torch.utils._device.DeviceContext``
(PyTorch's C++ ``torch.device.__enter__`` calls it by name): its ``__init__`` is patched for the
session to rewrite the device.

Why factory calls with ``device="cuda"`` (``torch.zeros(..., device="cuda")``,
``nn.Linear(..., device="cuda")``) are *not* redirected: it would mean replacing ``torch.zeros``
and its kind in the ``torch`` namespace, and PyTorch looks those functions up by identity in
tables built once per process (TorchDynamo's trace rules, TorchScript's builtins, the device
context's constructors). A table built while the replacements were in place left compiled code
calling the real ``torch.arange`` with a graph break, after ``disable()`` too (tried and measured
2026-11-28): slower code for the rest of the process, which the switch must never cause.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from apt_model.base.log import get_logger
from apt_model.base.patches import PatchSet

log = get_logger(__name__)


def install(patches: PatchSet, redirect: Callable[[Any], Any]) -> bool:
    """Patch ``torch.utils._device.DeviceContext.__init__`` so that its device passes through
    ``redirect`` (a str, ``torch.device`` or index in; the device to use out, unchanged unless it
    names CUDA); removed when ``patches`` is restored.

    Returns:
        Whether the patch was made (False where this torch has no ``DeviceContext``).
    """
    try:
        from torch.utils._device import DeviceContext
    except ImportError as err:
        log.debug("default-device contexts: torch.utils._device.DeviceContext unavailable: %s", err)
        return False
    orig_init = DeviceContext.__init__

    def init(self, device) -> None:
        orig_init(self, redirect(device))

    functools.update_wrapper(init, orig_init)
    patches.set_attr(DeviceContext, "__init__", init,
                     label="torch.utils._device.DeviceContext.__init__ (torch.device context, set_default_device)")
    return True
