"""The default process group: initialized by the switch when the script has not, and the script's
own ``init_process_group`` / ``new_group`` calls given a backend that works on this machine.

When the switch initializes
    Lazily: at the first training forward of an adopted model that needs DDP (or when
    :func:`vb.ensure_process_group() <apt_model.switch.controller.ensure_process_group>` is called), and only under a launcher
    (``WORLD_SIZE`` > 1 with ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set), through
    the launcher's ``env://`` rendezvous, with the selected kind's backend (plus gloo for CPU
    tensors on an accelerator: ``cpu:gloo,npu:hccl``). Not at
    ``enable()``: a script that calls ``init_process_group`` itself — often through a name it
    imported before the switch was on (``from torch.distributed import init_process_group``),
    which no patch can reach — would otherwise fail with "trying to initialize the default
    process group twice". By its first training step every such script has initialized.

What the patches do
    ``torch.distributed.init_process_group`` and ``new_group`` (the module attributes, and those
    of ``torch.distributed.distributed_c10d``) map the backend through
    :func:`~apt_model.distributed.backend_mapping.map_backend` and record the call; a
    ``device_id`` of an absent device type (``cuda:1`` on an Ascend machine) is mapped to the
    selected type. If the switch had already initialized the default group, a script call asking
    for the same backend is a no-op, and one asking for another backend replaces it.
    ``disable()`` restores both functions and destroys a group the switch created.
"""
from __future__ import annotations

import functools
import inspect
import itertools

import torch

from apt_model.distributed.backend_mapping import BackendChoice, map_backend, own_backend
from apt_model.base.launch import LaunchEnv
from apt_model.base.log import get_logger

log = get_logger(__name__)

_GENERATION = itertools.count()  # groups the switch initialized in this process (store key prefixes)

#: Statuses of the default process group, as reports show them.
NOT_INITIALIZED = "not initialized"
BY_SWITCH = "initialized by the switch"
BY_SCRIPT = "initialized by the script"
REFUSED = "refused"
DESTROYED = "destroyed by the script"


def _dist():
    import torch.distributed as dist

    return dist


class ProcessGroupManager:
    """The default process group of one switch session.

    Args:
        selection: the switch's :class:`~apt_model.devices.ranking.Selection` (its candidate's
            ``dist_backend`` is the switch's backend).
        env: the launcher environment, or None for a single process.
        enabled: False when the ``distributed`` setting is ``off`` (never initialize; the
            patches are not installed either).
        record: ``record(feature, requested, chosen, reason)`` appending to the decision timeline.
    """

    def __init__(self, selection, env: LaunchEnv | None, enabled: bool, record):
        self.selection = selection
        self.env = env
        self.enabled = enabled
        self.record = record
        self.status = NOT_INITIALIZED
        self.reason = "no process group yet"
        self.backend_choice: BackendChoice | None = None
        self.calls: list[dict] = []
        self._orig_init = None
        self._created = None  # the default group object the switch created

    def observe(self) -> None:
        """Note a default group the script initialized before ``enable()`` (called by the session's start)."""
        if self.initialized and self._created is None:
            self.status = BY_SCRIPT
            self.reason = f"initialized by the script before enable(): backend {_dist().get_backend()}"

    # ------------------------------------------------------------------ state
    @property
    def initialized(self) -> bool:
        dist = _dist()
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        """World size of the default group if initialized, else what the launcher promises (1 without one)."""
        if self.initialized:
            return _dist().get_world_size()
        return self.env.world_size if self.env is not None and self.env.world_size else 1

    def rank(self) -> int:
        if self.initialized:
            return _dist().get_rank()
        return self.env.rank if self.env is not None and self.env.rank is not None else 0

    def backend(self) -> str | None:
        """The default group's backend, or the one the switch would initialize with (None where it refuses)."""
        if self.initialized:
            return str(_dist().get_backend())
        return self.init_backend()

    def init_backend(self) -> str | None:
        """The backend string the switch initializes with: the selected kind's backend, plus gloo for
        CPU tensors on an accelerator (``cpu:gloo,npu:hccl``, as torch's own default pairs them)."""
        backend, _ = own_backend(self.selection.candidate)
        dev_type = self.selection.device.type
        if backend is None or dev_type == "cpu":
            return backend
        return f"cpu:gloo,{dev_type}:{backend}"

    def can_initialize(self) -> tuple[bool, str]:
        """Whether :meth:`ensure` would initialize a multi-process group, and why (not)."""
        if not _dist().is_available():
            return False, "this torch build has no torch.distributed"
        if not self.enabled:
            return False, "distributed=off: the switch leaves torch.distributed alone"
        if self.env is None:
            return False, "single process: no launcher variables (WORLD_SIZE unset)"
        if not self.env.multi_process:
            return False, f"{self.env.launcher} started a single process (WORLD_SIZE=1): nothing to synchronize"
        if not self.env.complete:
            return False, (f"launcher variables incomplete ({self.env.describe()}): init_process_group(init_method="
                           "'env://') needs RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
        backend, why = own_backend(self.selection.candidate)
        if backend is None:
            return False, why
        return True, f"{self.env.describe()}; {why}"

    def refuse(self, why: str) -> None:
        """Record that a multi-process launch will not get a process group from the switch, and why."""
        self.status, self.reason = REFUSED, why
        log.warning("process group not initialized by the switch: %s", why)

    # ------------------------------------------------------------------ initialization
    def ensure(self, trigger: str) -> bool:
        """Initialize the default group with the selected kind's backend unless it exists or cannot be.

        Args:
            trigger: what asked for it, for the report (``"first training forward of GPT#1"``).

        Returns:
            Whether a default group with more than one rank exists afterwards.

        Raises:
            whatever ``torch.distributed.init_process_group`` raises (a rendezvous that times out,
            an unavailable backend) — a multi-process job that cannot synchronize must not
            silently train each rank alone.
        """
        dist = _dist()
        if self.initialized:
            return dist.get_world_size() > 1
        if self.status in (BY_SCRIPT, BY_SWITCH, DESTROYED):
            # the script destroyed the default group (dist.destroy_process_group() at the end of its
            # training): a model trained afterwards (a rank-0-only linear probe) is the script's to run
            # as written; initializing again waited forever for ranks that had finished (a probe's
            # finding, 2026-11-28)
            if self.status != DESTROYED:
                self.status = DESTROYED
                self.reason = ("the script destroyed the process group (dist.destroy_process_group()): models trained "
                               "after it run as written in this process, without DDP; the switch does not initialize "
                               "a group again, since the other ranks may have finished")
                self.record("process_group", "auto", "none", self.reason)
            return False
        ok, why = self.can_initialize()
        if not ok:
            if self.status == NOT_INITIALIZED and self.env is not None and self.env.multi_process and self.enabled:
                self.refuse(why)
                self.record("process_group", "auto", "none", why)
            return False
        backend = self.init_backend()
        init = self._orig_init or dist.init_process_group
        # The launcher's store, with a prefix of our own: a later init_process_group of the script (after
        # disable() destroyed this group) must not read this group's keys from the same store as its own.
        store, rank, world = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"apt_model/default_pg/{next(_GENERATION)}", store)
        init(backend=backend, store=store, rank=rank, world_size=world)
        self._created = dist.GroupMember.WORLD
        self.status = BY_SWITCH
        self.reason = f"initialized by the switch at the {trigger}: {why}"
        self.record("process_group", "auto", backend, self.reason)
        log.info("process group initialized: backend %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
        return dist.get_world_size() > 1

    def close(self) -> None:
        """Destroy the default group if the switch created it and it is still the default one."""
        dist = _dist()
        if self._created is not None and self.initialized and dist.GroupMember.WORLD is self._created:
            dist.destroy_process_group()
            log.info("destroyed the process group the switch initialized")
        self._created = None

    # ------------------------------------------------------------------ the script's calls
    def _map(self, call: str, backend) -> BackendChoice:
        choice = map_backend(backend, self.selection.candidate)
        entry = {"call": call, **choice.to_dict()}
        self.calls.append(entry)
        if choice.mapped:
            log.info("%s(backend=%r) -> %r: %s", call, choice.requested, choice.chosen, choice.reason)
        self.record("backend", choice.requested, choice.chosen, f"{call}: {choice.reason}")
        return choice

    def _map_device_id(self, device_id, entry: dict | None):
        """A ``device_id`` naming an absent device type (``cuda:1`` on an Ascend machine) -> the selected type."""
        if device_id is None or isinstance(device_id, int):
            return device_id
        dev = torch.device(device_id)
        sel = self.selection.device
        from apt_model.devices.detection import detect_devices

        present = {c.device_type for c in detect_devices() if c.available}
        if dev.type != sel.type and dev.type not in present and sel.type != "cpu":
            mapped = torch.device(sel.type, dev.index if dev.index is not None else (sel.index or 0))
            if entry is not None:
                entry["device_id"] = f"{dev} -> {mapped} ({dev.type} is absent)"
            return mapped
        return device_id

    def install(self, patches) -> None:
        """Patch ``init_process_group`` and ``new_group`` (undone through ``patches``)."""
        dist = _dist()
        if not dist.is_available():
            return
        import torch.distributed.distributed_c10d as c10d

        orig_init = c10d.init_process_group
        orig_new = c10d.new_group
        self._orig_init = orig_init
        init_sig = inspect.signature(orig_init)
        new_sig = inspect.signature(orig_new)
        manager = self

        @functools.wraps(orig_init)
        def init_process_group(*args, **kwargs):
            bound = init_sig.bind(*args, **kwargs)
            choice = manager._map("init_process_group", bound.arguments.get("backend"))
            if "backend" in bound.arguments or choice.chosen is not None:
                bound.arguments["backend"] = choice.chosen
            if "device_id" in bound.arguments:
                bound.arguments["device_id"] = manager._map_device_id(bound.arguments["device_id"], manager.calls[-1])
            if manager.status == BY_SWITCH and manager.initialized:
                current = str(dist.get_backend())
                if choice.chosen is None or str(choice.chosen) == current:
                    manager.calls[-1]["note"] = f"the group the switch initialized ({current}) is kept"
                    return None
                manager.close()
            orig_init(*bound.args, **bound.kwargs)
            manager._created = None
            manager.status = BY_SCRIPT
            manager.reason = (f"initialized by the script: init_process_group(backend={choice.requested!r}) -> "
                              f"{dist.get_backend()} ({choice.reason})")
            return None

        @functools.wraps(orig_new)
        def new_group(*args, **kwargs):
            bound = new_sig.bind(*args, **kwargs)
            entry = None
            if bound.arguments.get("backend") is not None:
                bound.arguments["backend"] = manager._map("new_group", bound.arguments["backend"]).chosen
                entry = manager.calls[-1]
            if "device_id" in bound.arguments:
                bound.arguments["device_id"] = manager._map_device_id(bound.arguments["device_id"], entry)
            return orig_new(*bound.args, **bound.kwargs)

        for mod in (dist, c10d):
            patches.set_attr(mod, "init_process_group", init_process_group, label=f"{mod.__name__}.init_process_group")
            patches.set_attr(mod, "new_group", new_group, label=f"{mod.__name__}.new_group")

    def report(self) -> dict:
        return {"status": self.status, "reason": self.reason, "backend": self.backend(),
                "rank": self.rank(), "world_size": self.world_size(), "calls": list(self.calls)}
