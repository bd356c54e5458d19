"""The global switch: ``enable()``, ``disable()``, and the patches that adopt models.

What enabling installs (every item is undone by :func:`disable`):

* ``nn.Module.to`` / ``nn.Module.cuda`` wrappers: a model moved after enabling is adopted, and
  when CUDA is absent ``.cuda()`` / ``.to("cuda")`` go to the selected device instead
  (``redirect_cuda``); ``torch.Tensor.cuda`` / ``torch.Tensor.to`` are redirected likewise, but
  only on machines where that redirection is needed.
* A global forward pre-hook that adopts a model the first time it is called (for scripts that
  never move their model). It costs one set lookup per module call.

Adoption itself is in :mod:`apt_model.switch.adoption`; the decisions are in the report.
"""
from __future__ import annotations

import functools
import itertools
import numbers
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.modules.module as module_mod
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parameter import is_lazy
from torch.nn.utils.parametrize import ParametrizationList
from torch.optim.optimizer import register_optimizer_step_pre_hook

from apt_model.base import functional_call
from apt_model.base.version import __version__
from apt_model.devices.rank_agreement import RankAgreement
from apt_model.devices.ranking import Selection, select_device
from apt_model.distributed.wrappers import skip_adoption
from apt_model.base.errors import DeviceSelectionError
from apt_model.base.log import get_logger
from apt_model.base.feature import StepSession
from apt_model.switch.adoption import Adopter, builtin_overrides, model_device
from apt_model.switch.config import VBConfig, build_config
from apt_model.switch import cuda_contexts
from apt_model.switch.fast_path import ForwardFastPath
from apt_model.switch.modes import FEATURES
from apt_model.base.patches import PatchSet, end_session_hooks
from apt_model.base.post_import import when_imported
from apt_model.base.module_attrs import is_internal, module_attr
from apt_model.switch.report import DecisionLog

log = get_logger(__name__)


class _State:
    def __init__(self):
        self.enabled = False
        self.config: VBConfig | None = None
        self.selection: Selection | None = None
        self.log = DecisionLog()
        self.patches = PatchSet()
        self.adopter: Adopter | None = None
        self.stack = None
        self.distributed = None  # apt_model.distributed.session.DistributedSession
        self.steps = None  # apt_model.switch.steps.StepRecorder: per-step time and memory for the report
        self.fast_path: ForwardFastPath | None = None  # adopt="auto": the global hook steps aside in adopted forwards
        self.seen: weakref.WeakSet = weakref.WeakSet()
        #: each module of an adopted model -> a weak reference to that model (the latest adopted that
        #: holds it; weak both ways: a model the script drops is freed)
        self.model_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.checked_optimizers: weakref.WeakSet = weakref.WeakSet()  # checked for adopted parameters
        self.last_checked: weakref.ref | None = None  # the optimizer checked last (most scripts step one)
        self.unadopted_once: weakref.WeakSet = weakref.WeakSet()  # stepped once over no adopted model's parameters
        #: modules inside a model whose adoption waits for its lazy parameters (nn.LazyLinear...):
        #: not adopted as models of their own meanwhile
        self.lazy_parts: weakref.WeakSet = weakref.WeakSet()
        self.suspended = 0
        self.redirect_target: torch.device | None = None
        self.counters = {"cuda_redirects": 0, "adoptions": 0}
        self.enabled_at: float | None = None
        self.disabled_at: float | None = None  # uptime stops counting at disable()
        self.source = "api"
        self.lock = threading.RLock()
        self.tls = threading.local()


_state = _State()


# ---------------------------------------------------------------------------- public API


def enable(mode: str | None = None, **overrides: Any) -> VBConfig:
    """Turn the switch on (or reconfigure it if it is on).

    Args:
        mode: ``performance`` (alias ``speed``), ``balanced``, ``memory`` or ``full``; None (the
            default) means ``VB_MODE``, else the ``.vbrc`` file's ``mode``, else ``balanced``.
        **overrides: feature toggles (``attention``, ``mixed_precision``, ``fp4``,
            ``activation_checkpointing``, ``activation_offload``, ``paging``) and settings
            (``device``, ``prefer``, ``redirect_cuda``, ``adopt``, ``autocast_min_speedup``,
            ``sdpa_min_speedup``, ``verbose``, ``banner``). See ``docs/modes.md``. Values not given
            come from ``VB_*`` variables, then ``.vbrc`` files (``docs/configuration.md``).

    Returns:
        The resolved configuration.

    Raises:
        ConfigError: unknown mode, option or value (the message lists the valid ones); a malformed
            ``.vbrc`` (``ConfigFileError``: the path, the line and what is wrong).
        DeviceSelectionError: ``device=`` / ``VB_DEVICE`` names a device that is not usable here, or
            under a launcher this node has more local ranks than visible devices of the chosen
            kind (raised on every rank, before any collective).
    """
    source = overrides.pop("_source", "api")
    config = build_config(mode, overrides)
    selection = select_device(prefer=config.prefer, device=config.device)
    from apt_model.distributed.session import DistributedSession

    distributed = DistributedSession(config, selection)  # reads the launcher variables; changes nothing yet
    with _state.lock:
        stack = None
        if config.paging != "off" or config.activation_offload:  # the swap folder is checked now: errors at enable
            from apt_model.memory.levels import HEADROOM, VGPUStack

            try:  # before a running session is let go: a bad swap folder leaves it on, as any bad value does
                stack = VGPUStack(selection.device, config.device_budget, config.host_budget,
                                  distributed.swap_dir(config.swap_dir), config.swap_budget,
                                  headroom=HEADROOM["tight" if config.paging == "tight" else "over_budget"], measure=False,
                                  sharing=distributed.ranks_on_this_host())
            except BaseException:
                distributed.release_swap_dir()
                raise
        if _state.enabled:
            _disable(forget_banner=False)  # a reconfiguration: the banner then shows only what changed
        st = _state
        st.config, st.selection, st.source = config, selection, source
        st.log = DecisionLog(echo=config.verbose)
        st.patches = PatchSet()
        st.stack = stack
        if stack is not None:
            # undone newest first: the rank's (then empty) swap folder goes after the stack's own folder
            st.patches.add_undo(distributed.release_swap_dir, "the rank's swap folder, when empty")
            st.patches.add_undo(stack.close, "VGPU stack swap folder")
            from apt_model.memory import interrupts

            interrupts.install(st.patches)  # a signal's handler waits until the pager is between two states
        _import_adoption_modules()
        # "agreement": rank 0's trial verdicts hold for every rank of a job (devices/rank_agreement.py)
        services = {"distributed": distributed, "overrides": builtin_overrides(), "agreement": RankAgreement()}
        distributed.attach(services)  # the distributed policy sees the paging session through these
        st.adopter = Adopter(StepSession(config, selection.device, st.patches, stack, services), st.log)
        st.distributed = distributed
        st.seen = weakref.WeakSet()
        st.model_of = weakref.WeakKeyDictionary()
        st.checked_optimizers = weakref.WeakSet()
        st.last_checked = None
        st.unadopted_once = weakref.WeakSet()
        st.fast_path = None
        st.lazy_parts = weakref.WeakSet()
        st.counters = {"cuda_redirects": 0, "adoptions": 0}
        st.enabled_at, st.disabled_at = time.time(), None
        st.log.record("switch", "mode", mode or config.mode, config.mode,
                      f"enabled from {source}; mode from {config.sources['mode']}")
        st.log.record("device", "device", config.device or "auto", str(selection.device), selection.reason,
                      [f"{c}" for c in selection.ranking])
        for name, spec in FEATURES.items():
            value = config.features[name]
            if not spec.built and value not in (False, "off"):
                st.log.record("switch", name, value, "off", "not built in this version")
        _install_patches(st)
        _install_step_recorder(st)
        distributed.start(st.log, st.patches)  # the rank's device, process-group and wrapper patches
        st.enabled = True
    if config.banner:
        _print_banner(config, distributed, stack)
    log.info("Virtual Blackwell enabled: mode=%s device=%s", config.mode, selection.device)
    return config


#: The lines of the last banner this process printed (so a job prints it once, and a
#: reconfiguration only what changed); forgotten by a user's ``disable()``.
_banner_shown: tuple[str, list[str]] | None = None


def banner_is_long(config: VBConfig) -> bool:
    """Whether ``enable()`` prints the long banner: ``verbose=True``, or the ``apt_model`` logger at
    INFO or DEBUG (``VB_LOG_LEVEL=INFO``)."""
    import logging

    from apt_model.base.log import ROOT_LOGGER

    return bool(config.verbose) or logging.getLogger(ROOT_LOGGER).getEffectiveLevel() <= logging.INFO


def _print_banner(config: VBConfig, distributed, stack) -> None:
    """Print the enable banner (the user asked for it: ``banner=True``) on rank 0 only, once per
    process, and not in a spawned worker re-importing the script (its parent printed it): a later
    ``enable()`` with the same result prints nothing, one that changes something
    prints a ``reconfigured`` header and the lines that changed."""
    global _banner_shown
    from apt_model.switch.banner import banner_lines

    env = distributed.env
    rank = env.rank if env is not None and env.multi_process else 0
    if rank not in (None, 0):
        log.debug("enable banner left to rank 0 (this is rank %s)", rank)
        return
    from apt_model.switch.env import reimporting_parent_script

    if reimporting_parent_script():  # a spawned DataLoader worker: the parent printed it
        log.debug("enable banner left to the parent process (a spawned multiprocessing child)")
        return
    act_budget = _state.adopter.session.services["activations"].budget()  # the setting, or the manager's default
    facts = {"device_type": _state.selection.device.type, "budget": stack.compute_budget if stack is not None else None,
             "activation_budget": act_budget, "world_size": (env.world_size if env is not None else None) or 1}
    cfg = get_config()
    long = banner_is_long(config)
    # what the banner states, without the free-memory figures that drift between two enable() calls
    key = repr((long, cfg["mode"], cfg["device"], sorted((k, repr(f["value"])) for k, f in cfg["features"].items()),
                sorted((k, repr(v["value"])) for k, v in cfg["settings"].items())))
    lines = banner_lines(cfg, _state.selection, facts, long=long)
    last = _banner_shown
    if last is not None and last[0] == key:
        return
    shown = lines
    if last is not None:
        changed = [line for line in lines[1:] if line not in last[1]]
        shown = [lines[0].replace(" enabled: ", " reconfigured: ", 1), *changed]
    _banner_shown = (key, lines)
    print("\n".join(shown), flush=True)  # the enable banner: the user asked for it


def disable() -> None:
    """Turn the switch off and restore every patch. Adopted models keep their placement and
    parameters, and keep working (their hooks are removed, attention implementations restored).
    The next ``enable()`` prints its banner in full again.

    Raises:
        PagingRecoveryError: (``apt_model.memory.swap``) paged tensors whose bytes could not be
            read back (a corrupt or missing swap file), named with their files; everything else
            was restored and the switch is off; the swap folder is kept for inspection.
    """
    _disable(forget_banner=True)


def _disable(forget_banner: bool) -> None:
    global _banner_shown
    if forget_banner:
        _banner_shown = None
    with _state.lock:
        if not _state.enabled:
            return
        raised = None
        try:
            failures = _state.patches.restore_all()
        except Exception as err:  # a critical undo failed (paging: PagingRecoveryError); the rest is undone
            failures, raised = list(getattr(err, "undo_failures", [])), err
        try:  # copies of its hooks a library registered again: out, and inert wherever they are
            end_session_hooks(m for rec in (_state.adopter.records if _state.adopter is not None else ())
                              if rec.ref is not None and (model := rec.ref()) is not None for m in model.modules())
        except Exception as err:  # noqa: BLE001 - a sweep for strays must not stop disable()
            log.debug("disable: stray session hooks: %s", err)
        _state.enabled = False
        _state.disabled_at = time.time()
        _state.redirect_target = None
        _state.log.record("switch", "mode", _state.config.mode, "off", "disabled")
        for f in failures:
            log.warning("could not undo a patch: %s", f)
        if raised is not None:
            raise raised


def is_enabled() -> bool:
    """Whether the switch is on."""
    return _state.enabled


def adopt(model: nn.Module) -> nn.Module:
    """Adopt ``model`` now (with ``adopt="explicit"``, the only way). Returns the same object.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        RuntimeError: when the switch is off.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"vb.adopt() takes a torch.nn.Module, got {type(model).__module__}.{type(model).__qualname__}")
    if not _state.enabled:
        raise RuntimeError("the switch is off: call vb.enable() before vb.adopt(model)")
    _maybe_adopt(model, "adopt()")
    return model


def device() -> torch.device:
    """The device the switch selected (or the ranking's choice when the switch is off)."""
    if _state.enabled and _state.selection is not None:
        return _state.selection.device
    return select_device().device


def selection() -> Selection | None:
    """The current device selection, or None when the switch is off."""
    return _state.selection if _state.enabled else None


@dataclass(frozen=True)
class SessionView:
    """A read-only view of the switch's current session, for benchmarks, tests and tools that
    need more than the report. Nothing here should be changed by the caller.

    Attributes:
        config: the resolved ``VBConfig``.
        device: the selected device.
        stack: the memory levels (``apt_model.memory.levels.VGPUStack``: ``levels``, ``swap``,
            ``compute_budget``), or None when neither paging nor activation offload was requested.
        paging: the ``PagingSession`` (``pager``, ``param_pages``, ``residency()``,
            ``level_stats()``), or None before a model is paged.
        activations: the ``ActivationManager`` (``offloader``, ``budget()``).
        distributed: the ``DistributedSession``.
        models: the adopted models' records (``ModelRecord``), in adoption order.
        steps: the feature steps, in adoption order (``FeatureStep``: ``name``, ``report()``, ``stats()``).
    """

    config: Any
    device: torch.device
    stack: Any
    paging: Any
    activations: Any
    distributed: Any
    models: tuple
    steps: tuple


def session() -> SessionView | None:
    """The current switch session (read-only view), or None when the switch is off."""
    st = _state
    if not st.enabled or st.adopter is None:
        return None
    services = st.adopter.session.services
    return SessionView(st.config, st.selection.device, st.stack, services.get("paging"), services.get("activations"),
                       st.distributed, tuple(st.adopter.records), tuple(st.adopter.steps))


def ensure_process_group() -> bool:
    """Initialize the default process group the way the switch does, now, if nobody has.

    Under a launcher (``WORLD_SIZE`` > 1 with ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``) and with the switch on (``distributed="auto"``), the group is initialized
    with the selected device kind's backend — as the switch otherwise does at the first training
    forward. Useful before collectives of the script's own (a barrier, an all-reduced metric).

    Returns:
        Whether a default group with more than one rank exists afterwards.

    Raises:
        RuntimeError: the switch is off (call ``vb.enable()`` first).
        whatever ``torch.distributed.init_process_group`` raises.
    """
    dist = _state.distributed
    if not _state.enabled or dist is None:
        raise RuntimeError("the switch is off: call vb.enable() before ensure_process_group()")
    return dist.pg.ensure("call to ensure_process_group()")


def get_config() -> dict:
    """The configuration in force: mode (and where it came from), each feature's value, status and
    source, the settings with their sources, and the ``.vbrc`` files that supplied values.

    Sources: ``argument``, ``environment:<VAR>``, ``file:<path>``, ``mode:<name>``, ``default``.
    """
    cfg = _state.config
    if cfg is None:
        return {"enabled": False, "mode": None, "mode_source": None, "features": {}, "settings": {},
                "config_files": []}
    features = {}
    for name, spec in FEATURES.items():
        value = cfg.features[name]
        status = "off" if value in (False, "off") else ("requested" if spec.built else "not built")
        features[name] = {"value": value, "status": status, "source": cfg.sources.get(name),
                          "description": spec.description}
    settings = cfg.shown_settings()
    return {"enabled": _state.enabled, "mode": cfg.mode, "mode_source": cfg.sources.get("mode"),
            "device": str(_state.selection.device) if _state.selection else None,
            "features": features, "settings": settings, "config_files": cfg.config_files()}


def get_stats() -> dict:
    """Counters and memory figures for the current (or last) session of the switch.

    Keys: ``enabled``, ``mode``, ``device``, ``uptime_s``, ``adopted_models``, ``attention_routed``
    (models whose attention runs on SDPA), ``autocast_models``, ``autocast_calls``,
    ``cuda_redirects``, ``probe_seconds``, ``decisions``, ``memory`` (bytes; None where the device
    cannot report a figure), ``forward_fast_path`` (:meth:`ForwardFastPath.describe
    <apt_model.switch.fast_path.ForwardFastPath.describe>`; None with ``adopt="explicit"``).
    """
    st = _state
    ad = st.adopter
    records = ad.records if ad else []
    step_stats = ad.stats() if ad else {}
    probe_s = ad.probes.seconds() if ad else 0.0
    mem = None
    if st.selection is not None:
        from apt_model.devices.device_backend import DeviceBackend

        b = DeviceBackend(st.selection.device)
        mem = {"allocated": b.memory_allocated(), "reserved": b.memory_reserved(), "peak": b.max_memory_allocated(),
               "free": b.free_memory(), "total": b.total_memory()}
    return {
        "levels": _level_stats(),
        "enabled": st.enabled,
        "mode": st.config.mode if st.config else None,
        "device": str(st.selection.device) if st.selection else None,
        "uptime_s": round((st.disabled_at or time.time()) - st.enabled_at, 3) if st.enabled_at else 0.0,
        "adopted_models": len(records),
        "attention_routed": sum(1 for r in records if r.features.get("attention", {}).get("chosen") == "sdpa"),
        "autocast_models": sum(1 for r in records if r.features.get("mixed_precision", {}).get("chosen") in ("bf16", "fp16")),
        "autocast_calls": step_stats.get("autocast_calls", 0),
        "cuda_redirects": st.counters["cuda_redirects"],
        "probe_seconds": round(probe_s, 4),
        "decisions": len(st.log.entries),
        "memory": mem,
        "forward_fast_path": st.fast_path.describe() if st.fast_path is not None else None,
    }


def _level_stats() -> list[dict] | None:
    """Per-level figures of the VGPU stack: capacity, resident bytes, traffic, hits/misses, GB/s, stalls."""
    st = _state
    stack = st.stack
    if stack is None:
        return None
    session = _paging_session(st)
    out = []
    for level in stack.levels:
        row = {"level": level.index, "kind": level.kind, "device": level.device, "capacity": level.capacity,
               "measured_gbps": level.gbps}
        if session is not None:
            row.update(session.level_stats(level))
        out.append(row)
    return out


def get_report() -> dict:
    """The full report: configuration, device choice with every candidate, probed capabilities,
    adopted models with per-feature decisions, the decision timeline, and the stats (JSON-safe)."""
    from apt_model.devices.detection import detect_devices

    st = _state
    ad = st.adopter
    return {
        "version": __version__,
        "torch": torch.__version__,
        "config": get_config(),
        "device": {
            "selection": st.selection.to_dict() if st.selection else None,
            "candidates": [c.to_dict() for c in detect_devices()],
        },
        "capabilities": {"support": dict(ad.probes.supports) if ad else {}, "speed": dict(ad.probes.speeds) if ad else {}},
        "models": [r.to_dict() for r in (ad.records if ad else [])],
        "memory": {
            "stack": st.stack.describe() if st.stack is not None else None,
            "paging": _step_report(ad, "paging"),
        },
        "activations": _step_report(ad, "activation_checkpointing"),
        "distributed": st.distributed.report() if st.distributed is not None else None,
        "decisions": st.log.to_list(),
        "steps": st.steps.to_dict() if st.steps is not None else None,
        "stats": get_stats(),
    }


def _paging_session(st: _State):
    """The session's PagingSession, or None (no model paged yet, or the switch never enabled)."""
    return st.adopter.session.services.get("paging") if st.adopter is not None else None


def _step_report(ad: Adopter | None, feature: str) -> dict | None:
    step = ad.step(feature) if ad is not None else None
    return step.report() if step is not None else None


def _install_step_recorder(st: _State) -> None:
    """Record every optimizer step's time and memory (and, while paging, the bytes per level) for
    the report; the hooks are in the session's undo stack."""
    from apt_model.switch.steps import StepRecorder

    def levels():
        session = _paging_session(st)
        return session.residency(st.stack.levels) if session is not None and st.stack is not None else None

    st.steps = StepRecorder(st.selection.device, levels)
    st.steps.install(st.patches)


def print_stats() -> None:
    """Print the stats and the per-model decisions as a short table (the user asked for output)."""
    from apt_model.switch.banner import format_stats

    print(format_stats(get_report()))


@contextmanager
def enabled(mode: str | None = None, **overrides: Any):
    """Context manager: the switch is on inside the block; the previous state is restored after.

    Example:
        >>> with vb.enabled("memory"):
        ...     train()
    """
    prev = (_state.config, _state.enabled)
    config = enable(mode, **overrides)
    try:
        yield config
    finally:
        disable()
        old_cfg, was_on = prev
        if was_on and old_cfg is not None:
            restored = {k: v for k, v in {**old_cfg.features, **old_cfg.settings}.items()
                        if old_cfg.sources.get(k) == "argument"}
            restored["banner"] = False
            enable(old_cfg.mode, **restored)


# ---------------------------------------------------------------------------- patches


def _import_adoption_modules() -> None:
    """Import now the small modules a model's adoption would import: adoption may run inside the
    script's ``torch.profiler``, whose stack tracer (``with_stack=True``) keeps pointers to the names
    of code objects freed while it records, such as an imported module's body, and
    ``key_averages()`` then raised ``UnicodeDecodeError`` (a PyTorch defect a probe found the
    switch setting off, 2026-11-28). Not paging's modules: they import TorchDynamo (1.4 s), which
    a session that never pages must not pay for at ``enable()``."""
    import importlib

    for name in ("apt_model.base.user_cache", "apt_model.memory.bandwidth"):
        importlib.import_module(name)


def _redirect_device(value: Any) -> Any:
    """``value`` (a device argument: str, ``torch.device`` or index) with CUDA replaced by the
    redirect target, counted in ``cuda_redirects`` (and noted for the adoption's reason).
    Unchanged when nothing is redirected.

    Raises:
        DeviceSelectionError: a CUDA index beyond the target kind's device count."""
    target = _state.redirect_target
    if target is None:
        return value
    if isinstance(value, str) and value.split(":", 1)[0].strip() == "cuda":
        value = torch.device(value)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool) and not torch.accelerator.is_available():
        # .to(local_rank) / .to(0) of a script written for CUDA (NumPy integers too: torch takes
        # them as indices): an index of the accelerator, which torch refuses where there is none
        # ("Cannot access accelerator device"); where there is one (an NPU, an XPU) torch maps it
        # itself (a review probe's observation)
        value = torch.device("cuda", int(value))
    if isinstance(value, torch.device) and value.type == "cuda":
        index = value.index or 0
        cand = _state.selection.candidate
        if target.type != "cpu" and index >= cand.count:
            raise DeviceSelectionError(
                f"{value} was redirected to {target.type} (CUDA is absent), which has {cand.count} device(s)"
            )
        _state.counters["cuda_redirects"] += 1
        _state.tls.redirected = str(value)
        return torch.device("cpu") if target.type == "cpu" else torch.device(target.type, index)
    return value


def _as_cuda_device(device: Any) -> torch.device:
    """The device ``.cuda(device)`` means: None -> cuda, int i -> cuda:i, else the given device."""
    if device is None:
        return torch.device("cuda")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def _redirect_location(location: Any) -> Any:
    """``torch.load``'s ``map_location`` with CUDA devices redirected: a str or device, or the
    values of a ``{saved: target}`` dict; a callable is left as it is."""
    if isinstance(location, dict):
        return {k: str(_redirect_device(v)) if isinstance(v, (str, torch.device)) else v  # torch wants str here
                for k, v in location.items()}
    if isinstance(location, (str, torch.device)):
        return _redirect_device(location)
    return location


def _redirect_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if args:
        first = _redirect_device(args[0])
        if first is not args[0]:
            args = (first, *args[1:])
    if "device" in kwargs:
        kwargs = dict(kwargs)
        kwargs["device"] = _redirect_device(kwargs["device"])
    return args, kwargs


def _install_patches(st: _State) -> None:
    cfg, sel = st.config, st.selection
    from apt_model.devices.detection import detect_devices

    cuda_present = any(c.available and c.device_type == "cuda" for c in detect_devices())  # no CUDA init
    needs_redirect = cfg.redirect_cuda and sel.device.type != "cuda" and not cuda_present
    st.redirect_target = sel.device if needs_redirect else None
    orig_module_to = nn.Module.to
    orig_module_cuda = nn.Module.cuda

    def module_to(self, *args, **kwargs):
        st.tls.redirected = None
        if st.redirect_target is not None:
            args, kwargs = _redirect_args(args, kwargs)
        out = orig_module_to(self, *args, **kwargs)
        if st.enabled and st.config.adopt == "auto":
            note = f" (redirected from {st.tls.redirected}: CUDA is absent)" if st.tls.redirected else ""
            _maybe_adopt(self, "to()", note)
        return out

    def module_cuda(self, device=None):
        if st.redirect_target is None:
            return orig_module_cuda(self, device)
        return self.to(_as_cuda_device(device))

    module_to.__doc__ = orig_module_to.__doc__
    module_cuda.__doc__ = orig_module_cuda.__doc__
    st.patches.set_attr(nn.Module, "to", module_to, label="nn.Module.to")
    st.patches.set_attr(nn.Module, "cuda", module_cuda, label="nn.Module.cuda")
    if needs_redirect:
        orig_tensor_to = torch.Tensor.to

        plain, device_type, dtype_type = torch.Tensor, torch.device, torch.dtype

        def tensor_to(self, *args, **kwargs):
            # the common call first, with no further Python call: a plain tensor (no lazy parameter
            # to ask) to a dtype, a non-CUDA device or a tensor, no device= keyword (~0.6 us a
            # call less; a step of a small model calls .to() for each batch tensor)
            if type(self) is plain and args and "device" not in kwargs:
                first = args[0]
                kind = type(first)
                if kind is dtype_type or (kind is device_type and first.type != "cuda") \
                        or (kind is str and "cuda" not in first) or kind is plain:
                    return orig_tensor_to(self, *args, **kwargs)
            args, kwargs = _redirect_args(args, kwargs)
            return _call_to(orig_tensor_to, self, args, kwargs)

        def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
            dev = _redirect_device(_as_cuda_device(device))
            return _call_to(orig_tensor_to, self, (dev,), {"non_blocking": non_blocking, "memory_format": memory_format})

        # what the page-fault handler asks to see a conversion to what a tensor already is (it gets
        # this replacement as the op: torch hands modes torch.Tensor.to as it is now)
        tensor_to.to_arguments = _redirect_args
        tensor_cuda.to_arguments = lambda args, kwargs: (
            (_redirect_device(_as_cuda_device(args[0] if args else kwargs.get("device"))),),
            {k: v for k, v in kwargs.items() if k in ("non_blocking", "memory_format")})
        st.patches.set_attr(torch.Tensor, "to", tensor_to, label="torch.Tensor.to")
        orig_to_empty, orig_load = nn.Module.to_empty, torch.load

        def module_to_empty(self, *, device, recurse=True):
            return orig_to_empty(self, device=_redirect_device(device), recurse=recurse)

        def load(*args, **kwargs):
            # map_location="cuda" (a str, a device, or a {from: to} dict) of a script written for CUDA
            if "map_location" in kwargs:
                kwargs["map_location"] = _redirect_location(kwargs["map_location"])
            elif len(args) > 1:
                args = (args[0], _redirect_location(args[1]), *args[2:])
            return orig_load(*args, **kwargs)

        functools.update_wrapper(module_to_empty, orig_to_empty)
        functools.update_wrapper(load, orig_load)
        st.patches.set_attr(nn.Module, "to_empty", module_to_empty, label="nn.Module.to_empty")
        st.patches.set_attr(torch, "load", load, label="torch.load (map_location)")
        st.patches.set_attr(torch.Tensor, "cuda", tensor_cuda, label="torch.Tensor.cuda")
        cuda_contexts.install(st.patches, _redirect_device)  # with torch.device("cuda"), set_default_device
        # Dynamo knows the original Tensor.to by the identity torch.Tensor.to had when Dynamo was
        # imported: after this patch it found neither (an unknown builtin called by a Python
        # function), so every .to() in a script's compiled code was a graph break: 2.3x the step
        # time (a probe's finding, 2026-11-28). As a graph node the replacement runs whole.
        stop = when_imported("torch._dynamo", lambda dynamo: [dynamo.allow_in_graph(f) for f in (tensor_to, tensor_cuda)])
        if stop is not None:
            st.patches.add_undo(stop, "watch for torch._dynamo (redirected Tensor.to as a graph node)")
        st.log.record("device", "redirect_cuda", cfg.redirect_cuda, str(sel.device),
                      f"CUDA is absent: .cuda() and .to('cuda') on modules and tensors, and torch.device('cuda') "
                      f"contexts go to {sel.device}")
    functional_call.install(st.patches)  # its swaps are no model to adopt, no surgery to follow
    if cfg.adopt == "auto":
        handle = register_module_forward_pre_hook(_global_pre_hook)
        st.patches.add_handle(handle, "global forward pre-hook")
        st.patches.add_handle(module_mod.register_module_module_registration_hook(_module_put_in),
                              "submodules put into adopted models")
        # an adopted model's submodules skip the global hook (switch/fast_path.py); undone before the handle
        st.fast_path = ForwardFastPath(module_mod._global_forward_pre_hooks, handle.id, _global_pre_hook,
                                       (module_mod._global_forward_hooks, module_mod._global_backward_hooks,
                                        module_mod._global_backward_pre_hooks),
                                       on_stop=lambda why: st.log.record("switch", "forward_fast_path", "on", "off", why),
                                       owner_of=_owner_of, is_seen=lambda m: m in _state.seen)
        st.patches.add_undo(st.fast_path.close, "forward fast path")
        st.fast_path.watch_dynamo(st.patches)
        st.fast_path.watch_new_modules(st.patches)
        fp = st.fast_path
        st.log.record("switch", "forward_fast_path", "auto", "on" if fp.on else "off",
                      f"after an adopted model's first {fp.warm_calls} calls, its submodules run without the "
                      "switch's global forward pre-hook (PyTorch's hook-free path); off from the first Dynamo "
                      "compilation" if fp.on else fp.off_reason)
        st.patches.add_handle(register_optimizer_step_pre_hook(_check_first_step), "optimizer first-step adoption check")
        orig_module_compile = nn.Module.compile

        def module_compile(self, *args, **kwargs):
            _stop_fast_path(st, "Module.compile()")
            st.tls.module_compile = True  # its torch.compile(self._call_impl): adopted by the wrapper below
            try:
                out = orig_module_compile(self, *args, **kwargs)
            finally:
                st.tls.module_compile = False
            if st.enabled and st.config.adopt == "auto" and self._compiled_call_impl is not None:
                self._compiled_call_impl = _adopting_first_call(self, self._compiled_call_impl)
            return out

        module_compile.__doc__ = orig_module_compile.__doc__
        st.patches.set_attr(nn.Module, "compile", module_compile, label="nn.Module.compile")
        orig_torch_compile = torch.compile

        def torch_compile(*args, **kwargs):
            target = args[0] if args else kwargs.get("model")
            owner = getattr(target, "__self__", None)
            ladder = isinstance(owner, nn.Module) and owner in st.seen and not getattr(st.tls, "module_compile", False)
            # the switch's own compile ladder compiles an adopted model's forward: the script called
            # no torch.compile, and the reason must not say it did (a probe's finding)
            _stop_fast_path(st, f"the compile ladder's torch.compile() of {type(owner).__name__}'s forward" if ladder
                            else "torch.compile()")
            out = orig_torch_compile(*args, **kwargs)
            if target is None or isinstance(target, (nn.Module, type)) or out is target or not callable(out):
                # a decorator (it calls torch.compile again), a module (adopted at its first call),
                # a class (torch.compile gives it back, compiled), or nothing compiled (disable=True)
                return out
            if getattr(st.tls, "module_compile", False) or (isinstance(owner, nn.Module) and owner in st.seen):
                # model.compile() (its own wrapper adopts), or a method of an adopted model (the
                # compile ladder's rungs): nothing to adopt, so no per-call look at the arguments
                return out
            return _adopting_reachable(target, out)

        functools.update_wrapper(torch_compile, orig_torch_compile)
        st.patches.set_attr(torch, "compile", torch_compile, label="torch.compile")


def _owner_of(module: nn.Module) -> nn.Module | None:
    """The adopted model ``module`` belongs to (None: none, or freed)."""
    ref = _state.model_of.get(module)
    return ref() if ref is not None else None


def _stop_fast_path(st: _State, what: str) -> None:
    """Anything compiles from now on: the global hook stays in place for good (switch/fast_path.py)."""
    fp = st.fast_path
    if fp is not None and fp.on and st.enabled:
        fp.stop(f"{what} was called: compiled code is traced with the global hook in place, and stays so")


def _module_put_in(parent: nn.Module, name: str, child) -> None:
    """PyTorch's global submodule-registration hook: ``child`` is being put into ``parent`` under
    ``name`` (``model.head = nn.Linear(...)``, a block appended). Where ``parent`` belongs to an
    adopted model and ``child`` was never seen, ``child`` and its modules become that model's own:
    never adopted as a model of their own (whose features would run nested inside the model's:
    a second mixed-precision trial, compile trial and activation offload for a new head, and a
    second entry in the report, until 2026-11-28: a probe's finding). The model's recorded
    parameter count follows. A ``child`` already adopted (moved with ``.to()`` before it was put
    in) stays a model of its own. Runs inside the script's assignment: never raises."""
    st = _state
    try:
        if not isinstance(child, nn.Module) or not st.enabled or child in st.seen:
            return None
        owner = _owner_of(parent)
        if owner is None:
            return None
        with st.lock:
            for m in child.modules():
                st.seen.add(m)
                st.model_of[m] = weakref.ref(owner)
            old = parent._modules.get(name)
            had = {id(p) for p in owner.parameters()}  # a parameter tied to one the model has counts once
            change = sum(p.numel() for p in child.parameters() if id(p) not in had)
            if isinstance(old, nn.Module):
                change -= sum(p.numel() for p in old.parameters())
            for rec in (st.adopter.records if st.adopter is not None else ()):
                if rec.ref is not None and rec.ref() is owner:
                    rec.parameters += change
        if st.fast_path is not None:
            st.fast_path.note_seen(child)
    except Exception as err:  # noqa: BLE001 - a missed note adopts the module as before, never breaks the script
        log.debug("module put into an adopted model: %s.%s: %s", type(parent).__name__, name, err)
    return None


def _global_pre_hook(module: nn.Module, args: tuple):
    if torch.compiler.is_compiling():  # inside a captured graph: a model being compiled was adopted already
        return None
    st = _state
    if st.suspended:
        return None
    if module in st.seen:
        if st.fast_path is not None:
            st.fast_path.step_aside(module)  # an adopted model past its first calls: until its call ends
        return None
    if functional_call.in_function_transform() or functional_call.swapped(module):
        # torch.func (grad, vmap), or functional_call outside them: the module's parameters are
        # the transform's wrappers or the caller's tensors for now, not its own; it is adopted at
        # its first ordinary call (inside a transform the features stand aside anyway)
        return None
    if torch.jit.is_tracing():
        # torch.jit.trace: adopting inside the trace changed the module between the trace and its
        # check ("Graphs differed across invocations"), and sizes came back as traced tensors (a
        # probe's finding); adopted at its first ordinary call
        return None
    first_call = _maybe_adopt(module, "first forward")
    if first_call is not None:  # PyTorch listed this call's pre-hooks before adoption added the steps' own: run them now
        for fn in first_call:
            fn(module, args, {})
        if st.fast_path is not None:
            # this call is the model's first: noted as a root call (its exit hook, added by the
            # adoption, ends it), so the parts it calls are not counted as called by the script
            st.fast_path.step_aside(module)
    return None


def _check_first_step(opt: torch.optim.Optimizer, args: tuple, kwargs: dict):
    """At an optimizer's second step under the switch (``adopt="auto"``): if none of its parameters
    belongs to an adopted model, say so (a warning, and an entry in the report's decisions). The
    switch then does nothing for that training: its model was never moved with ``.to()`` and was
    first called inside a compiled function that does not name it where
    :mod:`~apt_model.switch.reachable` looks (its arguments and their attributes, closure, globals,
    bound object), or the parameters belong to no module. Not at the first: ``enable()`` called
    between a forward and its step adopts the model at its next forward.
    Never raises; does nothing while anything compiles."""
    st = _state
    try:
        if torch.compiler.is_compiling() or not st.enabled:  # registered only with adopt="auto"
            return None
        if st.fast_path is not None:
            st.fast_path.at_step()  # after an interrupted forward or a torch._dynamo.reset() (switch/fast_path.py)
        last = st.last_checked
        if last is not None and last() is opt:  # no new weak reference, as a WeakSet look-up makes
            return None
        if opt in st.checked_optimizers:
            st.last_checked = weakref.ref(opt)
            return None
        params = {id(p) for g in opt.param_groups for p in g["params"]}
        models = (rec.ref() for rec in (st.adopter.records if st.adopter is not None else ()) if rec.ref is not None)
        adopted = not params or any(m is not None and any(id(p) in params for p in m.parameters()) for m in models)
        if not adopted and opt not in st.unadopted_once:
            st.unadopted_once.add(opt)  # asked again at its next step
            return None
        st.checked_optimizers.add(opt)
        if adopted:
            return None
        if not any(isinstance(p, nn.Parameter) for g in opt.param_groups for p in g["params"]):
            # bare tensors (SAC's learnable temperature log_alpha, torch.func.stack_module_state's
            # stacked weights): no module holds them, so there is no model to adopt, and the warning
            # told the user to adopt one (a probe's finding)
            st.log.record("switch", "adoption", "auto", "no model for this optimizer",
                          f"{type(opt).__name__} steps {len(params)} tensor(s) that are no nn.Parameter of a module (a "
                          "learnable temperature, torch.func.stack_module_state's weights): the switch does nothing "
                          "for them")
            return None
        reason = (f"{type(opt).__name__} steps {len(params)} parameter tensors of no adopted model: the switch does "
                  "nothing for them. A model first called inside a compiled function that reaches it other than "
                  "through its arguments, their attributes, its closure, globals or bound object, or called only through "
                  "torch.func.functional_call (and never moved with .to() or compiled with model.compile()), is not adopted: call model.to(device) after enable(), or "
                  "vb.adopt(model)")
        st.log.record("switch", "adoption", "auto", "no model for this optimizer", reason)
        log.warning(reason)
    except Exception as err:  # noqa: BLE001 - a diagnostic must never break training
        log.debug("first-step adoption check: %s", err)
    return None


def _adopting_first_call(module: nn.Module, compiled):
    """The call ``module.compile()`` leaves, wrapped so that the module's first call adopts it.

    A compiled module's calls run inside the compiled code, where :func:`_global_pre_hook` cannot
    adopt it (it must not change a model while Dynamo traces it). This wrapper runs eagerly, before
    the compiled code: it puts ``compiled`` back (so it costs one call), then adopts the module
    unless it was seen — a block compiled on its own inside a model that is not (``for b in
    model.blocks: b.compile()``) is seen by then, as the model's own first forward adopted the
    whole model. Adoption sees the compiled call (paging takes it off while the model is paged);
    if it did, this call runs eagerly. While anything compiles or exports (Dynamo tracing a
    compiled caller, ``torch.export`` tracing without Dynamo, another thread compiling:
    ``torch.compiler.is_compiling()``) it only calls ``compiled`` and stays, to adopt at a later
    call. It carries ``compiled``'s attributes (``functools.wraps``), so paging still sees what the
    compiled call wraps."""
    @functools.wraps(compiled)
    def first_call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return compiled(*args, **kwargs)
        if module._compiled_call_impl is first_call:
            module._compiled_call_impl = compiled
        if _state.enabled and _state.config.adopt == "auto":
            _maybe_adopt(module, "compile()")
        call = module._compiled_call_impl
        return call(*args, **kwargs) if call is not None else module._call_impl(*args, **kwargs)

    return first_call


def _adopting_reachable(fn, compiled):
    """The call ``torch.compile(fn)`` returns for a function (not a module), wrapped so that the
    models it can reach are adopted before the compiled code runs (trigger ``compiled function``).

    A model first called inside the compiled code would never be adopted: the global forward
    pre-hook must not change a model while Dynamo traces it. So before each call, eagerly, the
    models among the call's arguments are adopted, and at the first call also those of ``fn``'s
    closure, the globals its code names and its bound object (:func:`~apt_model.switch.reachable.reachable_modules`,
    which says where it does not look). Nothing is adopted while anything compiles (a compiled
    caller tracing this call inlines it), while the switch is off, or with ``adopt`` not ``auto``.
    Carries ``compiled``'s attributes (``functools.wraps``); after ``disable()`` it only calls
    ``compiled``. Adoption itself is the same as at a model's first forward."""
    from apt_model.switch.reachable import reachable_modules

    first = [True]

    @functools.wraps(compiled)
    def call(*args, **kwargs):
        st = _state
        if st.enabled and st.config.adopt == "auto" and not st.suspended and not torch.compiler.is_compiling():
            whole, first[0] = first[0], False
            for m in reachable_modules(fn, args, kwargs, through_function=whole, exclude=st.seen):
                _maybe_adopt(m, "compiled function")  # a block of a model adopted just before is seen by now
        return compiled(*args, **kwargs)

    # TorchDynamo finds the function it compiled through these (torch._dynamo.eval_frame.innermost_fn,
    # for torch.compile / torch.compiler.disable / export of this call): the copies wraps() made
    # would name the compiled call with another object's id, and Dynamo would stop at this wrapper
    call.__wrapped__ = getattr(compiled, "__wrapped__", fn)
    call._torchdynamo_orig_callable = getattr(compiled, "_torchdynamo_orig_callable", fn)
    call._torchdynamo_wrapper_id = id(call)
    return call


def _call_to(orig_to, tensor: torch.Tensor, args: tuple, kwargs: dict):
    """``orig_to(tensor, *args, **kwargs)``. An uninitialized (lazy) parameter allows only a list
    of functions, checked by identity in its ``__torch_function__``, which is handed
    ``torch.Tensor.to`` as it is now — this replacement — and raised; it is handed the original.
    Not asked while Dynamo traces (``is_lazy`` there is a torch function returning no tensor: a
    graph break at every ``.to()`` of a compiled forward, 2.3x the step time of a script's own
    ``torch.compile``: a probe's finding)."""
    if not torch.compiler.is_compiling() and is_lazy(tensor):
        return type(tensor).__torch_function__(orig_to, (type(tensor),), (tensor, *args), kwargs)
    return orig_to(tensor, *args, **kwargs)


def _has_lazy_tensors(module: nn.Module) -> bool:
    """Whether ``module`` still has uninitialized (lazy) parameters or buffers."""
    return any(is_lazy(t) for t in itertools.chain(module.parameters(), module.buffers()))


def _maybe_adopt(module: nn.Module, trigger: str, moved_note: str = ""):
    """Adopt ``module`` unless it was seen (or is internal, parameterless, on meta, a replica).
    Returns the steps' first-call hooks (a list, maybe empty; to run when adoption happened inside
    the model's first forward) when it was adopted now, else None."""
    st = _state
    if not st.enabled or st.suspended or module in st.seen:
        return None
    try:
        with st.lock:
            return _adopt_unseen(st, module, trigger, moved_note)
    finally:
        if st.fast_path is not None:
            st.fast_path.note_seen(module)  # whatever was decided, the modules it had pending may be seen now


def _adopt_unseen(st: _State, module: nn.Module, trigger: str, moved_note: str):
    """:func:`_maybe_adopt`'s decision for a module not seen yet (under ``st.lock``)."""
    if module in st.seen:
        return None
    if isinstance(module, ParametrizationList) or type(module).__module__ == "torch.nn.utils.parametrizations":
        # torch's holder of a parametrized tensor, called whenever the tensor is read, and its
        # parametrizations (spectral_norm's, called while the layer is built): part of their
        # module's model, never models of their own
        for m in module.modules():
            st.seen.add(m)
        return None
    dev = model_device(module)
    if skip_adoption(module, st.seen):  # a DataParallel replica, or a DDP wrapper of an adopted model
        return None
    # module_attr: a script's __getattr__ may raise something other than AttributeError (a config
    # lookup's KeyError), which crashed the model's first call until 2026-11-28
    inner = module_attr(module, "_orig_mod")  # torch.compile(model)'s OptimizedModule
    if isinstance(inner, nn.Module) and inner in st.seen:
        # the script compiled a model already adopted: the same parameters, not a second model
        # (it was reported twice, its parameters counted twice, until 2026-11-26)
        st.seen.add(module)
        return None
    if is_internal(module) or isinstance(module, torch.jit.ScriptModule):
        # one of our probes; or TorchScript (torch.jit.load, torch.jit.script), which refuses
        # Python hooks ("register_forward_hook is not supported on ScriptModules" at its first
        # call, until 2026-11-28: a probe's finding). Never adopted, nor anything inside them
        for m in module.modules():
            st.seen.add(m)
        return None
    if dev is None:  # parameterless (a loss, an activation): nothing to adopt
        st.seen.add(module)
        return None
    if dev.type == "meta":  # not materialized yet; adopt when it is moved
        return None
    if module in st.lazy_parts:  # part of a lazy model adopted once its parameters exist
        return None
    owner = _view_of_adopted(module)
    if owner is not None:
        # a new container of modules of one adopted model, made as it runs (``self.layers[:k](x)``
        # slices an nn.Sequential at every call): part of that model, not a model of its own.
        # Until 2026-11-28 every slice was adopted, so each step adopted new models and the step
        # time grew without bound (0.5 ms plain, 7.3 ms after 1600 steps: a probe's finding)
        st.seen.add(module)
        st.model_of[module] = weakref.ref(owner)
        return None
    if _has_lazy_tensors(module):
        # nn.LazyLinear & co. get their parameters in their first forward: adopt at a later call
        # or move (until 2026-11-28 adoption counted their parameters and raised "Attempted to
        # use an uninitialized parameter", in every mode)
        for m in module.modules():
            if m is not module:
                st.lazy_parts.add(m)
        return None
    for m in module.modules():
        st.seen.add(m)
    st.patches.prune()  # undo entries of models the script dropped (a sweep adopts model after model)
    st.suspended += 1
    try:
        _, ctx = st.adopter.adopt(module, trigger, moved_note)
        st.counters["adoptions"] += 1
        if st.fast_path is not None:
            st.fast_path.attach(module, st.patches)
    finally:
        st.suspended -= 1
        for m in module.modules():  # modules the steps put in (FP4Linear, ...) belong to this model
            st.seen.add(m)
            st.model_of[m] = weakref.ref(module)
    return ctx.take_first_call_hooks()


def _view_of_adopted(module: nn.Module) -> nn.Module | None:
    """The adopted model whose modules are the only ones with state under ``module``, when
    ``module`` is a container made from them (a slice of its ``nn.Sequential``, an
    ``nn.ModuleList`` of some of its blocks, a ``Sequential`` of such slices, with new parameterless
    layers such as ``nn.Identity`` among them) and is not that model itself; else None. Children
    adopted as models of their own (an encoder and a decoder moved with ``.to()`` in ``__init__``)
    are not one model's modules: the whole that holds them is adopted as before. Until 2026-11-28
    only direct children counted, so nested containers or a new ``nn.Identity`` made a new model
    at every call (a probe's finding)."""
    st = _state
    owners: dict[int, nn.Module] = {}

    def walk(m: nn.Module) -> bool:  # False: state of no adopted model under ``m``
        ref = st.model_of.get(m) if m is not module else None
        if ref is not None:
            owner = ref()
            if owner is None:
                return False
            owners[id(owner)] = owner
            return True
        if next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None:
            return False
        return all(walk(c) for c in m.children())

    if not walk(module) or len(owners) != 1:
        return None
    (owner,) = owners.values()
    if owner is module or any(c is owner for c in module.children()):
        return None
    return owner
