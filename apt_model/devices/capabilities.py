"""Probed device capabilities, cached per device (and per probe width for speed).

* :func:`get_support` — what runs: dtypes, SDPA backends, FP8 and FP4 matrix products.
* :func:`get_speed` — what is faster on this device: SDPA vs hand-written attention, and
  autocast (bf16 by default) vs fp32, for a transformer block of a given width.

Nothing here runs at import time. Probes run on first use, which for an accelerator is the
moment the switch adopts a model onto it (the device is being initialized by the user's
``model.to(device)`` anyway), so detection alone never initializes a device before a ``fork``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from apt_model.devices import probes
from apt_model.log import get_logger

log = get_logger(__name__)

#: Probe block width cap per device class: past this the fp32/bf16 ratio stops changing much,
#: while the probe's cost grows with the square of the width.
_MAX_WIDTH = {"cpu": 512}
_DEFAULT_WIDTH = {"cpu": 256}
_SHAPE = {"cpu": (256, 4)}  # (seq, batch): 1024 tokens keeps the CPU probe under a second
_ACCEL_SHAPE = (1024, 8)
_ACCEL_WIDTH, _ACCEL_MAX_WIDTH = 1024, 4096


@dataclass
class Support:
    """What runs on one device (see :mod:`apt_model.devices.probes` for each field's format)."""

    device: str
    dtypes: dict = field(default_factory=dict)
    sdpa_backends: dict = field(default_factory=dict)
    fp8_matmul: dict = field(default_factory=dict)
    fp4_matmul: dict = field(default_factory=dict)
    seconds: float = 0.0

    def dtype_computes(self, name: str) -> bool:
        """Whether matmul and add run in dtype ``name`` (e.g. ``"bfloat16"``)."""
        d = self.dtypes.get(name, {})
        return bool(d.get("matmul") and d.get("add"))

    def sdpa_backends_for(self, dtype: str = "float32") -> list[str]:
        """Names of the SDPA backends that ran for ``dtype``."""
        return [b for b, per in self.sdpa_backends.items() if per.get(dtype) == "ok"]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Speed:
    """Measured speed ratios on one device for a block of ``width`` (medians, forward + backward).

    ``attention["speedup"]`` is hand-written attention time / SDPA time; ``autocast[dtype]["speedup"]``
    is fp32 time / autocast time. Above 1 means the optimization is faster.
    """

    device: str
    width: int
    seq: int
    batch: int
    threads: int
    attention: dict = field(default_factory=dict)
    autocast: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


_lock = threading.RLock()
_support: dict[str, Support] = {}
_speed: dict[tuple, Speed] = {}


def _key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, 0)
    return device


def _properties(device: torch.device) -> dict:
    if device.type == "cpu":
        return {}
    from apt_model.devices.registry import registered_backends

    for backend in registered_backends():
        if backend.device_type == device.type:
            try:
                return backend.device_properties(device.index or 0)
            except Exception:  # noqa: BLE001 - properties only refine the FP4 reason
                return {}
    return {}


def get_support(device: torch.device | str) -> Support:
    """Probe (once per process) what runs on ``device``: dtypes, SDPA backends, FP8/FP4 matmul."""
    dev = _key(device)
    with _lock:
        if str(dev) in _support:
            return _support[str(dev)]
        t0 = time.perf_counter()
        sup = Support(
            device=str(dev),
            dtypes=probes.probe_dtypes(dev),
            sdpa_backends=probes.probe_sdpa_backends(dev),
            fp8_matmul=probes.probe_fp8_matmul(dev),
            fp4_matmul=probes.probe_fp4_matmul(dev, _properties(dev)),
        )
        sup.seconds = round(time.perf_counter() - t0, 4)
        _support[str(dev)] = sup
        log.debug("support probe on %s took %.3f s", dev, sup.seconds)
        return sup


def probe_width(device: torch.device | str, width: int | None) -> int:
    """The block width a speed probe uses on ``device`` for a model of hidden size ``width``."""
    dev = _key(device)
    default = _DEFAULT_WIDTH.get(dev.type, _ACCEL_WIDTH)
    cap = _MAX_WIDTH.get(dev.type, _ACCEL_MAX_WIDTH)
    w = default if not width else int(width)
    w = max(64, min(cap, w))
    return (w // 64) * 64 if w >= 64 else 64


def get_speed(device: torch.device | str, width: int | None = None,
              dtypes: tuple[str, ...] = ("bfloat16",)) -> Speed:
    """Probe (once per process per width) whether SDPA and autocast are faster on ``device``.

    Args:
        device: where to measure.
        width: hidden size of the model the decision is for; clamped to a per-device range
            (see :func:`probe_width`). None uses the device's default.
        dtypes: autocast dtypes to time against fp32.
    """
    dev = _key(device)
    w = probe_width(dev, width)
    seq, batch = _SHAPE.get(dev.type, _ACCEL_SHAPE)
    key = (str(dev), w, tuple(dtypes), torch.get_num_threads())
    with _lock:
        if key in _speed:
            return _speed[key]
        t0 = time.perf_counter()
        sp = Speed(device=str(dev), width=w, seq=seq, batch=batch, threads=torch.get_num_threads())
        sp.attention = probes.probe_attention_speed(dev, w, seq, batch)
        sp.autocast = probes.probe_autocast_speed(dev, w, seq, batch, tuple(dtypes))
        sp.seconds = round(time.perf_counter() - t0, 4)
        _speed[key] = sp
        log.debug("speed probe on %s (width %d) took %.3f s", dev, w, sp.seconds)
        return sp


def clear_capability_cache() -> None:
    """Forget all probe results (tests, or after changing the thread count)."""
    with _lock:
        _support.clear()
        _speed.clear()
