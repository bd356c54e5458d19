"""Probed device capabilities, cached per device (and per probe width for speed), in memory and on disk.

* :func:`get_support` — what runs: dtypes, SDPA backends, FP8 and FP4 matrix products.
* :func:`get_speed` — what is faster on this device: SDPA vs hand-written attention, and
  autocast (bf16 by default) vs fp32, for a transformer block of a given width.

Nothing here runs at import time. Probes run on first use, which for an accelerator is the
moment the switch adopts a model onto it (the device is being initialized by the user's
``model.to(device)`` anyway), so detection alone never initializes a device before a ``fork``.

Results are kept for the process, and on disk for later processes
(:mod:`apt_model.devices.probe_cache`: per device model, torch version and apt_model version;
``VB_PROBE_CACHE=0`` turns the disk cache off, ``VB_PROBE_CACHE=refresh`` probes again). Each
record says where it came from: ``cached`` (True when read from disk), ``cache`` (the file, or why
there is none), ``seconds`` (what this process spent on it: the read, or the probe) and
``probed_seconds`` (what the probe took when it ran). Probes are silent; the warnings PyTorch
raised during them are in each record's ``warnings`` (``{trial: [text, ...]}``).
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, fields

import torch

from apt_model.devices import probe_cache, probes
from apt_model.base.log import get_logger

log = get_logger(__name__)

#: Probe block width cap per device class: past this the fp32/bf16 ratio stops changing much,
#: while the probe's cost grows with the square of the width.
_MAX_WIDTH = {"cpu": 512}
_DEFAULT_WIDTH = {"cpu": 256}
_ACCEL_WIDTH, _ACCEL_MAX_WIDTH = 1024, 4096


@dataclass(frozen=True)
class ProbePlan:
    """How much work the speed probes do on one device class.

    Attributes:
        seq, batch: full-size input shape of both speed probes.
        reps: the most timed rounds after the warm-up.
        attention_budget_s, autocast_budget_s: time budgets in seconds (None: no budget); a probe
            stops after two rounds once its budget is used (see ``probes.time_interleaved``).
        pilots: ``(seq, batch)`` pilot shapes for the autocast probe (see
            :func:`apt_model.devices.probes.probe_autocast_speed`).
    """

    seq: int
    batch: int
    reps: int
    attention_budget_s: float | None = None
    autocast_budget_s: float | None = None
    pilots: tuple[tuple[int, int], ...] = ()


#: CPUs: 512 tokens, three rounds, about 1.7 s of budget; bf16 on a CPU without bf16 units is
#: 10-50x slower than fp32 and is ruled out on a 16-token pilot before any full-size run.
_PLANS = {"cpu": ProbePlan(seq=256, batch=2, reps=3, attention_budget_s=0.5, autocast_budget_s=1.2,
                           pilots=((16, 1), (64, 2)))}
#: Accelerators: 8192 tokens (small work for a GPU), five rounds, no pilot (kernel launches dominate tiny shapes).
_ACCEL_PLAN = ProbePlan(seq=1024, batch=8, reps=5)


def probe_plan(device: torch.device | str) -> ProbePlan:
    """The :class:`ProbePlan` the speed probes use on ``device``'s kind."""
    return _PLANS.get(torch.device(device).type, _ACCEL_PLAN)


@dataclass
class Support:
    """What runs on one device (see :mod:`apt_model.devices.probes` for each field's format).

    ``warnings``: ``{trial: [warning text]}`` PyTorch raised during the probes (kept, not printed);
    ``cached``/``cache``/``seconds``/``probed_seconds``: see the module docstring.
    """

    device: str
    dtypes: dict = field(default_factory=dict)
    sdpa_backends: dict = field(default_factory=dict)
    fp8_matmul: dict = field(default_factory=dict)
    fp4_matmul: dict = field(default_factory=dict)
    warnings: dict = field(default_factory=dict)
    seconds: float = 0.0
    probed_seconds: float = 0.0
    cached: bool = False
    cache: str = ""

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
    is fp32 time / autocast time. Above 1 means the optimization is faster. ``reps`` is the most
    timed rounds; ``warnings``, ``cached``, ``cache``, ``seconds``, ``probed_seconds``: as in
    :class:`Support`.
    """

    device: str
    width: int
    seq: int
    batch: int
    threads: int
    reps: int = 5
    attention: dict = field(default_factory=dict)
    autocast: dict = field(default_factory=dict)
    warnings: dict = field(default_factory=dict)
    seconds: float = 0.0
    probed_seconds: float = 0.0
    cached: bool = False
    cache: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


_lock = threading.RLock()
_support: dict[str, Support] = {}
_speed: dict[tuple, Speed] = {}
#: Fields that describe this process's copy of a record, not the probe result: never stored on disk.
_RUNTIME = ("device", "seconds", "cached", "cache")
_TYPES = {"dict": dict, "int": int, "float": (int, float), "str": str, "bool": bool}


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


def _payload(rec: Support | Speed) -> dict:
    data = rec.to_dict()
    for k in _RUNTIME:
        data.pop(k, None)
    return data


def _restore(cls: type, data: dict, device: str):
    """Rebuild a record from its stored payload. Raises ValueError when a field is missing or mistyped."""
    kwargs = {"device": device}
    for f in fields(cls):
        if f.name in _RUNTIME:
            continue
        if f.name not in data:
            raise ValueError(f"field {f.name!r} missing")
        expected = _TYPES.get(str(f.type))
        if expected is not None and not isinstance(data[f.name], expected):
            raise ValueError(f"field {f.name!r} is {type(data[f.name]).__name__}, not {f.type}")
        kwargs[f.name] = data[f.name]
    return cls(**kwargs)


def _identity(dev: torch.device) -> dict | None:
    """The device's hardware identity for the disk cache (None: do not cache it)."""
    return probe_cache.device_identity(dev, _properties(dev))


def _cached(cls: type, dev: torch.device, entry: str, mode: str, ident: dict | None, check=None):
    """``(record or None, why)`` from the disk cache; a corrupt or mistyped file counts as a miss."""
    if mode == "off":
        return None, f"off ({probe_cache.ENV_MODE}=0)"
    if ident is None:
        return None, f"not cached: {dev} has no stable identity (no device name)"
    if mode == "refresh":
        return None, f"refresh ({probe_cache.ENV_MODE}=refresh)"
    data, why = probe_cache.load(ident, entry)
    if data is None:
        return None, why
    try:
        rec = _restore(cls, data, str(dev))
        if check is not None:
            check(rec)
    except (TypeError, ValueError) as err:
        log.debug("probe cache entry %s for %s has the wrong shape, probing again: %s", entry, dev, err)
        return None, f"corrupt cache entry ignored ({err})"
    rec.cached = True
    rec.cache = why
    return rec, why


def _store(rec: Support | Speed, entry: str, mode: str, ident: dict | None, miss: str) -> str:
    if mode == "off" or ident is None:
        return miss
    _, why = probe_cache.store(ident, entry, _payload(rec))
    return f"{miss}; probed and {why}"


def get_support(device: torch.device | str) -> Support:
    """What runs on ``device``: dtypes, SDPA backends, FP8/FP4 matmul; probed once per device model.

    Served from this process's memory, else from the disk cache, else probed (silently) and
    written to the disk cache.

    Raises:
        ConfigError: when ``VB_PROBE_CACHE`` has an invalid value.
    """
    dev = _key(device)
    with _lock:
        if str(dev) in _support:
            return _support[str(dev)]
        mode = probe_cache.mode()
        t0 = time.perf_counter()
        props = _properties(dev)
        ident = probe_cache.device_identity(dev, props) if mode != "off" else None
        sup, why = _cached(Support, dev, "support", mode, ident)
        if sup is None:
            notes: dict[str, list[str]] = {}
            with probes.quiet(notes, "other"), probes.isolated(dev):
                sup = Support(
                    device=str(dev),
                    dtypes=probes.probe_dtypes(dev, notes),
                    sdpa_backends=probes.probe_sdpa_backends(dev, notes),
                    fp8_matmul=probes.probe_fp8_matmul(dev, notes),
                    fp4_matmul=probes.probe_fp4_matmul(dev, props, notes),
                )
            sup.warnings = notes
            sup.probed_seconds = round(time.perf_counter() - t0, 4)
            sup.cache = _store(sup, "support", mode, ident, why)
        sup.seconds = round(time.perf_counter() - t0, 4)
        _support[str(dev)] = sup
        log.debug("support of %s: %.3f s (%s)", dev, sup.seconds, sup.cache)
        return sup


def probe_width(device: torch.device | str, width: int | None) -> int:
    """The block width a speed probe uses on ``device`` for a model of hidden size ``width``."""
    dev = _key(device)
    default = _DEFAULT_WIDTH.get(dev.type, _ACCEL_WIDTH)
    cap = _MAX_WIDTH.get(dev.type, _ACCEL_MAX_WIDTH)
    w = default if not width else int(width)
    w = max(64, min(cap, w))
    return (w // 64) * 64 if w >= 64 else 64


def _speed_errors(sp: Speed) -> list[str]:
    """The errors among ``sp``'s timings (``"attention: ..."``, ``"autocast bfloat16: ..."``)."""
    out = [f"attention: {sp.attention['error']}"] if "error" in (sp.attention or {}) else []
    out += [f"autocast {d}: {r['error']}" for d, r in (sp.autocast or {}).items() if "error" in r]
    return out


def get_speed(device: torch.device | str, width: int | None = None,
              dtypes: tuple[str, ...] = ("bfloat16",)) -> Speed:
    """Whether SDPA and autocast are faster on ``device``; probed once per device model, width,
    dtypes and thread count (served from memory, else the disk cache, else probed and written).

    Args:
        device: where to measure.
        width: hidden size of the model the decision is for; clamped to a per-device range
            (see :func:`probe_width`). None uses the device's default.
        dtypes: autocast dtypes to time against fp32.

    Raises:
        ConfigError: when ``VB_PROBE_CACHE`` has an invalid value.
    """
    dev = _key(device)
    w = probe_width(dev, width)
    plan = probe_plan(dev)
    threads = torch.get_num_threads()
    key = (str(dev), w, tuple(dtypes), threads)
    with _lock:
        if key in _speed:
            return _speed[key]
        mode = probe_cache.mode()
        t0 = time.perf_counter()
        ident = _identity(dev) if mode != "off" else None
        entry = f"speed-w{w}-s{plan.seq}x{plan.batch}-r{plan.reps}-t{threads}-{'+'.join(dtypes)}"

        def same_probe(sp: Speed) -> None:
            got = (sp.width, sp.seq, sp.batch, sp.threads, sp.reps, tuple(sp.autocast))
            if got != (w, plan.seq, plan.batch, threads, plan.reps, tuple(dtypes)):
                raise ValueError(f"entry is for {got}")

        sp, why = _cached(Speed, dev, entry, mode, ident, same_probe)
        if sp is None:
            notes: dict[str, list[str]] = {}
            sp = Speed(device=str(dev), width=w, seq=plan.seq, batch=plan.batch, threads=threads, reps=plan.reps)
            with probes.quiet(notes, "other"), probes.isolated(dev):
                sp.attention = probes.probe_attention_speed(dev, w, plan.seq, plan.batch, plan.reps,
                                                            budget_s=plan.attention_budget_s, notes=notes)
                sp.autocast = probes.probe_autocast_speed(dev, w, plan.seq, plan.batch, tuple(dtypes), plan.reps,
                                                          budget_s=plan.autocast_budget_s, pilots=plan.pilots,
                                                          notes=notes)
            sp.warnings = notes
            sp.probed_seconds = round(time.perf_counter() - t0, 4)
            failed = _speed_errors(sp)
            # a failed timing is this moment's (memory taken by the script, a driver hiccup): not
            # written for later processes, which probe again
            sp.cache = f"{why}; probed, not cached: {failed[0]}" if failed else _store(sp, entry, mode, ident, why)
        sp.seconds = round(time.perf_counter() - t0, 4)
        _speed[key] = sp
        log.debug("speed on %s (width %d): %.3f s (%s)", dev, w, sp.seconds, sp.cache)
        return sp


def clear_capability_cache(on_disk: bool = False) -> None:
    """Forget all probe results in this process (tests, or after changing the thread count);
    with ``on_disk``, also delete the cached files (:func:`apt_model.devices.probe_cache.clear`)."""
    with _lock:
        _support.clear()
        _speed.clear()
        if on_disk:
            probe_cache.clear()
