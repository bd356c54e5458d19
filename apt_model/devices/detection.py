"""Find every device kind's candidates, with status and reason, once per process.

:func:`detect_devices` asks each registered backend what it sees. The result lists *every*
kind — found (name, count), package not installed, or the exact error text of a failed
probe — so a user can read why an NPU machine would otherwise silently train on the CPU.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from apt_model.devices.backend import AVAILABLE, ERROR, AcceleratorBackend, Detection
from apt_model.devices.plugins import describe_exception
from apt_model.devices.registry import registered_backends
from apt_model.base.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One device kind as detected on this machine.

    Attributes:
        kind: reported kind (``cuda``, ``rocm``, ``dcu``, ``npu``, ``mlu``, ``xpu``, ``mps``, ``cpu``...).
        device_type: torch device type used to address it (``cuda`` for rocm/dcu).
        vendor: vendor and software stack.
        status: ``available``, ``unavailable``, ``not_installed`` or ``error``.
        reason: what was found, or why not (exact error text for failures).
        count: number of usable devices.
        names: device names when known.
        priority: ranking position (lower first).
        dist_backend: torch.distributed backend for this kind, or None.
        visible_devices_env: the variable that restricts visible devices, or None.
        details: extra facts from detection.
    """

    kind: str
    device_type: str
    vendor: str
    status: str
    reason: str
    count: int
    names: tuple[str, ...]
    priority: int
    dist_backend: str | None
    visible_devices_env: str | None
    details: dict[str, Any] = field(default_factory=dict)
    backend: AcceleratorBackend | None = field(default=None, compare=False, repr=False)

    @property
    def available(self) -> bool:
        return self.status == AVAILABLE

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("backend", None)
        d["names"] = list(self.names)
        return d


_lock = threading.Lock()
_cache: dict[bool, list[Candidate]] = {}


def _candidate(backend: AcceleratorBackend, allow_init: bool) -> Candidate:
    try:
        det = backend.detect(allow_init=allow_init)
        if not isinstance(det, Detection):
            raise TypeError(f"{type(backend).__name__}.detect() returned {type(det).__name__}, not Detection")
    except Exception as err:  # noqa: BLE001 - one broken backend must not hide the others
        det = Detection(ERROR, f"detection raised {describe_exception(err)}")
    return Candidate(
        kind=det.kind or backend.kind,
        device_type=backend.device_type,
        vendor=backend.vendor,
        status=det.status,
        reason=det.reason,
        count=det.count if det.status == AVAILABLE else 0,
        names=tuple(det.names),
        priority=backend.priority,
        dist_backend=backend.dist_backend,
        visible_devices_env=backend.visible_devices_env,
        details=dict(det.details),
        backend=backend,
    )


def detect_devices(refresh: bool = False, allow_init: bool = False) -> list[Candidate]:
    """Every registered device kind with its status, in priority order (cached per process).

    Args:
        refresh: detect again instead of returning the cached list.
        allow_init: allow backends to initialize devices to read names and architectures
            (the CLI does; library code does not, because an initialized CUDA breaks ``fork``).

    Returns:
        One :class:`Candidate` per registered kind, available or not.
    """
    with _lock:
        if refresh:
            _cache.clear()
        if allow_init not in _cache:
            _cache[allow_init] = [_candidate(b, allow_init) for b in registered_backends()]
            for c in _cache[allow_init]:
                log.debug("device candidate %s: %s (%s)", c.kind, c.status, c.reason)
        return list(_cache[allow_init])


def clear_detection_cache() -> None:
    """Forget detected candidates (after registering a backend or changing visible devices)."""
    with _lock:
        _cache.clear()
