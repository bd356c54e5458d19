"""The contract every device kind implements: :class:`AcceleratorBackend`.

One subclass per kind of device (NVIDIA CUDA, AMD ROCm / Hygon DCU, Huawei Ascend NPU,
Cambricon MLU, Intel XPU, Apple MPS, CPU). A new kind is added by subclassing and registering
with :func:`apt_model.devices.registry.register_backend` (or the ``apt_model.backends`` entry
point); ``docs/backends.md`` gives the contract and the verification checklist.

The rules a backend follows:

* :meth:`AcceleratorBackend.detect` finds devices **without initializing them** unless
  ``allow_init`` is true (initializing CUDA before ``fork`` breaks every forked child that uses
  CUDA). It never raises for an expected condition; it returns a :class:`Detection` whose
  ``status`` and ``reason`` say what was found or what went wrong (with the exact error text).
* The figure methods (``memory_info``, ``memory_allocated``, ...) return bytes, or raise
  :class:`~apt_model.base.errors.FigureUnavailable` with the reason. The public facade
  (:class:`apt_model.optimization.npu_backend.DeviceBackend`) turns that into ``None`` plus a
  readable reason.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from apt_model.devices.plugins import PLUGIN_ERRORS, describe_exception
from apt_model.base.errors import FigureUnavailable

#: Detection statuses, in the order reports list them.
AVAILABLE = "available"
UNAVAILABLE = "unavailable"  # the software is there, no usable device
NOT_INSTALLED = "not_installed"  # the vendor package / torch build is missing
ERROR = "error"  # a probe failed; ``reason`` carries the error text
STATUSES = (AVAILABLE, UNAVAILABLE, NOT_INSTALLED, ERROR)


@dataclass(frozen=True)
class Detection:
    """What :meth:`AcceleratorBackend.detect` found.

    Attributes:
        status: one of ``available``, ``unavailable``, ``not_installed``, ``error``.
        reason: human-readable explanation (device names and count, or the exact error text).
        count: number of usable devices of this kind (0 unless ``available``).
        names: device names, one per device, when they could be read without initializing
            the device (or with ``allow_init``); otherwise empty.
        kind: the reported kind; a backend may refine its class kind (``rocm`` -> ``dcu``).
        details: extra facts (driver/runtime versions, visible-devices value, ...).
    """

    status: str
    reason: str
    count: int = 0
    names: tuple[str, ...] = ()
    kind: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


class AcceleratorBackend:
    """Base class of a device kind. Subclasses set the class attributes and implement ``detect``.

    Class attributes:
        kind: name used in reports, ``VB_DEVICE`` and ``prefer=``: ``cuda``, ``rocm``, ``npu``...
        device_type: the torch device type this kind runs on (``rocm`` and ``dcu`` use ``cuda``).
        refined_kinds: other kinds :meth:`detect` may report for its devices (``rocm`` -> ``dcu``):
            each names this kind too, in ``VB_DEVICE`` and ``prefer=``, whatever was detected.
        vendor: vendor and product family, for reports.
        priority: ranking position; lower is preferred (CUDA 0 ... CPU 100).
        package: the Python package that provides the device (``torch_npu``), or None when
            stock torch does.
        dist_backend: the ``torch.distributed`` backend for this kind (``nccl``, ``hccl``, ...).
        visible_devices_env: the environment variable that restricts visible devices.
    """

    kind: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    refined_kinds: ClassVar[tuple[str, ...]] = ()
    vendor: ClassVar[str] = ""
    priority: ClassVar[int] = 50
    package: ClassVar[str | None] = None
    dist_backend: ClassVar[str | None] = None
    visible_devices_env: ClassVar[str | None] = None

    # ------------------------------------------------------------------ detection
    def detect(self, allow_init: bool = False) -> Detection:
        """Find devices of this kind. Must not raise and must not initialize the device
        unless ``allow_init`` is true."""
        raise NotImplementedError

    def visible_devices(self) -> str | None:
        """The value of this kind's visible-devices variable, or None when unset."""
        return os.environ.get(self.visible_devices_env) if self.visible_devices_env else None

    # ------------------------------------------------------------------ torch module access
    def device_module(self):
        """The torch device module (``torch.cuda``, ``torch.npu``...). Raises FigureUnavailable."""
        mod = getattr(torch, self.device_type, None)
        if mod is None:
            raise FigureUnavailable(f"torch has no '{self.device_type}' device module")
        return mod

    def _is_current_accelerator(self) -> bool:
        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        return acc is not None and acc.type == self.device_type

    def _call(self, what: str, fn_name: str, *args: Any, accelerator_fn: str | None = None) -> Any:
        """Call ``torch.accelerator.<accelerator_fn or fn_name>(*args)`` when this kind is the current
        accelerator, else (or if that fails) ``torch.<device_type>.<fn_name>(*args)``.

        ``torch.accelerator`` is preferred (one API for every in-tree and PrivateUse1 device); the
        device module covers what it lacks (it is only for the *current* accelerator, and raises
        on a CPU-only machine). Raises FigureUnavailable listing every error when all fail.
        """
        acc_name = accelerator_fn or fn_name
        attempts: list[tuple[str, Callable[[], Any]]] = []
        if self._is_current_accelerator() and hasattr(torch.accelerator, acc_name):
            attempts.append((f"torch.accelerator.{acc_name}", lambda: getattr(torch.accelerator, acc_name)(*args)))
        mod = getattr(torch, self.device_type, None)
        if mod is not None and hasattr(mod, fn_name):
            attempts.append((f"torch.{self.device_type}.{fn_name}", lambda: getattr(mod, fn_name)(*args)))
        if not attempts:
            raise FigureUnavailable(f"{what} unavailable on {self.kind}: no torch API provides {fn_name}")
        errors = []
        for label, fn in attempts:
            try:
                return fn()
            except Exception as err:  # noqa: BLE001 - collect the reason, try the next source
                errors.append(f"{label}: {describe_exception(err)}")
        raise FigureUnavailable(f"{what} unavailable on {self.kind}: " + "; ".join(errors))

    # ------------------------------------------------------------------ figures (bytes)
    def device_name(self, index: int = 0) -> str:
        """Marketing name of device ``index``. May initialize the device."""
        return str(self._call("device name", "get_device_name", index))

    def device_properties(self, index: int = 0) -> dict[str, Any]:
        """Properties of device ``index`` as a plain dict (names and values as torch reports them)."""
        props = self._call("device properties", "get_device_properties", index)
        out: dict[str, Any] = {}
        for attr in dir(props):
            if attr.startswith("_"):
                continue
            try:
                value = getattr(props, attr)
            except Exception:  # noqa: BLE001 - some properties raise on some drivers
                continue
            if isinstance(value, (int, float, str, bool)) or value is None:
                out[attr] = value
            elif isinstance(value, (tuple, list)):
                out[attr] = list(value)
            elif not callable(value):
                out[attr] = str(value)
        return out

    def memory_info(self, index: int = 0) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of device ``index``."""
        free, total = self._call("memory info", "mem_get_info", index, accelerator_fn="get_memory_info")
        return int(free), int(total)

    def memory_allocated(self, index: int = 0) -> int:
        """Bytes currently held by tensors on device ``index``."""
        return int(self._call("memory allocated", "memory_allocated", index))

    def memory_reserved(self, index: int = 0) -> int:
        """Bytes reserved by the caching allocator on device ``index``."""
        return int(self._call("memory reserved", "memory_reserved", index))

    def max_memory_allocated(self, index: int = 0) -> int:
        """Peak bytes held by tensors on device ``index`` since start or the last reset."""
        return int(self._call("peak memory allocated", "max_memory_allocated", index))

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        """Reset the peak counter read by :meth:`max_memory_allocated`."""
        self._call("peak reset", "reset_peak_memory_stats", index)

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver."""
        self._call("empty_cache", "empty_cache")

    def synchronize(self, index: int | None = None) -> None:
        """Wait for all queued work on device ``index`` (the current device when None)."""
        self._call("synchronize", "synchronize", index)

    # ------------------------------------------------------------------ compilation
    #: registered overrides of this kind: tag -> rewrite (see :meth:`register_override`)
    _overrides: ClassVar[dict[str, Callable]] = {}

    def compile_backend(self) -> tuple[str | Callable | None, str]:
        """The ``torch.compile`` backend the compile rung uses on this kind, and why; ``(None,
        reason)`` when the kind offers no compiler. Default: TorchInductor (``"inductor"``).
        A kind with its own graph mode (an NPU's) returns its backend (a name or a callable)."""
        return "inductor", "TorchInductor (torch.compile's default backend)"

    def compile(self, fn: Callable, tag: str, backend: str | Callable | None = None, **options) -> Callable:
        """Compile ``fn`` (a module's eager forward) for the compile rung; returns the compiled
        callable (nothing is changed in place). ``tag`` names the model in errors; ``backend``
        defaults to :meth:`compile_backend`'s choice; ``options`` go to ``torch.compile``
        (``dynamic``, ``mode``).

        Raises:
            RuntimeError: the kind offers no compiler (the reason named).
            whatever ``torch.compile`` raises (the ladder records it and falls a rung).
        """
        chosen = backend if backend is not None else self.compile_backend()[0]
        if chosen is None:
            raise RuntimeError(f"{self.kind}: no compiler for {tag}: {self.compile_backend()[1]}")
        return torch.compile(fn, backend=chosen, **options)

    @classmethod
    def register_override(cls, tag: str, fn: Callable) -> None:
        """Register an override rung rewrite for this kind (and kinds derived from it): ``fn(gm)``
        rewrites a captured ``torch.fx.GraphModule`` in place and returns the sites it rewrote
        (an empty list when nothing matched). A vendor backend registers its fused kernels here.

        Raises:
            ValueError: an empty tag or a non-callable ``fn``.
        """
        if not tag or not callable(fn):
            raise ValueError(f"register_override(tag={tag!r}, fn={fn!r}): a non-empty tag and a callable")
        if "_overrides" not in cls.__dict__:
            cls._overrides = dict(cls._overrides)  # this kind's own table, starting from its base's
        cls._overrides[tag] = fn

    @classmethod
    def overrides(cls) -> dict[str, Callable]:
        """The override rewrites registered for this kind (tag -> rewrite), in registration order."""
        return dict(cls._overrides)

    # ------------------------------------------------------------------ helpers for subclasses
    @staticmethod
    def package_installed(name: str) -> bool:
        """Whether a top-level package can be imported (without importing it)."""
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    def import_package(self) -> str | None:
        """Import :attr:`package`; return None on success or the exact error text on failure.

        A failure recorded when torch auto-loaded the plugin is returned as is.
        """
        if self.package is None:
            return None
        if self.package in PLUGIN_ERRORS:
            return PLUGIN_ERRORS[self.package]
        try:
            importlib.import_module(self.package)
        except Exception as err:  # noqa: BLE001 - a broken vendor plugin must be survivable
            text = describe_exception(err)
            PLUGIN_ERRORS[self.package] = text
            return text
        return None

