"""One switch session's multi-device policy: ties the launcher environment, the process group,
device binding, DDP wrapping, DataParallel and the paging guards together, and reports them.

The switch calls it at four points (everything else happens through the patches it installs,
each undone by ``disable()``):

* ``DistributedSession(config, selection)`` in ``enable()``, before anything is changed: reads
  the launcher environment (a malformed one is a ``ConfigError`` then);
* :meth:`DistributedSession.swap_dir`: each rank gets its own swap folder;
* :meth:`DistributedSession.start`: makes the rank's device current, installs the patches,
  records the decisions;
* :meth:`DistributedSession.decide` / :meth:`DistributedSession.apply`, from the switch's
  distributed step (:mod:`apt_model.distributed.step`): per model, whether data parallelism
  applies (and so whether paging must stay off: the decision's ``paging_blocked`` fact).

The policy, per adopted model (the ``distributed`` setting is ``auto``):

1. already under a wrapper (DDP, FSDP2, FSDP, DataParallel, DTensor parameters): left to it;
2. a single process (no launcher, ``WORLD_SIZE=1``, no multi-rank group): nothing to do;
3. the script initialized the default process group itself and has not wrapped the model by its
   first training forward: left as written — such a script manages its ranks (pipeline stages,
   a model per rank, its own gradient all-reduce), and DDP's collectives would hang or change it;
4. otherwise DDP is attached in place at the model's first training forward with a trainable
   parameter (:mod:`apt_model.distributed.ddp`) — unless by then the script wrapped it itself,
   which is then respected — after initializing the default process group
   (:mod:`apt_model.distributed.process_group`); it is rebuilt where the set of trainable
   parameters changes.

Paging (``apt_model.memory``) frees parameter and gradient storage and assumes one process;
DDP's reducer, FSDP's sharding and DataParallel's replicas read that storage. So a model that
data parallelism applies to is never paged (its paging decision says why), and handing a model
the switch already pages to DDP, FSDP2 or DataParallel raises :class:`DistributedError`.
"""
from __future__ import annotations

import atexit
import socket
import weakref
from pathlib import Path

import torch
import torch.nn as nn

from apt_model.devices.binding import set_current_device
from apt_model.distributed.data_parallel import check_device_ids, visible_data_parallel_devices
from apt_model.distributed.ddp import DistributedModelHook, InPlaceDDP
from apt_model.base.launch import read_launch_env
from apt_model.distributed.process_group import BY_SWITCH, ProcessGroupManager
from apt_model.distributed.wrappers import install_guards, wrapper_kind
from apt_model.base.errors import DistributedError
from apt_model.base.feature import Decision
from apt_model.base.log import get_logger

log = get_logger(__name__)

SCOPE = "distributed"


def rank_folder_name(rank: int) -> str:
    """``rank<R>-<host>``: a rank's swap folder name (the host keeps ranks of jobs on different
    nodes that share a swap dir apart, so no process removes another node's live files)."""
    host = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in socket.gethostname()) or "host"
    return f"rank{rank}-{host}"


class DistributedSession:
    """Multi-device state of one ``enable()`` .. ``disable()`` session.

    Args:
        config: the switch's :class:`~apt_model.switch.config.VBConfig` (settings ``distributed``
            and ``ddp_options``).
        selection: the device selection (already bound to the local rank by the ranking policy).

    Raises:
        ConfigError: malformed launcher variables (``RANK``, ``WORLD_SIZE``... not integers).
    """

    def __init__(self, config, selection):
        self.setting = config.distributed
        self.options = dict(config.ddp_options or {})
        self.selection = selection
        self.env = read_launch_env()
        self.log = None
        self.patches = None
        self.services: dict = {}  # the switch session's shared services (attach())
        self.device_note = None
        self.guards: list[str] = []
        self.models: list[dict] = []
        self.wrappers: list[dict] = []
        self._script_ddp: weakref.WeakSet = weakref.WeakSet()
        self._hooks: list[DistributedModelHook] = []
        self._ddp_owner: dict[int, str] = {}  # id(param) -> scope of the model whose in-place DDP reduces it
        self.pg = ProcessGroupManager(selection, self.env, self.setting == "auto", self._record)

    # ------------------------------------------------------------------ enable()
    def ranks_on_this_host(self) -> int:
        """Processes of this job on this host: the launcher's ``LOCAL_WORLD_SIZE`` (1 without a
        launcher, or when it does not say). The memory levels sized by default share the host's
        RAM and swap disk between them."""
        n = getattr(self.env, "local_world_size", None) if self.env is not None else None
        return n if isinstance(n, int) and n >= 1 else 1

    def swap_dir(self, swap_dir):
        """The swap dir for this rank: ``<swap dir>/rank<R>-<host>`` under a multi-process launcher
        (created inside an existing swap dir), else ``swap_dir`` unchanged. A swap dir that does
        not exist is passed on unchanged, so the memory stack reports it as usual."""
        if self.env is None or not self.env.multi_process or self.env.rank is None:
            return swap_dir
        from apt_model.base.settings import read_env
        from apt_model.memory.settings import SWAP_DIR
        from apt_model.memory.swap import default_swap_root

        explicit = swap_dir is not None or read_env(SWAP_DIR) is not None
        root = Path(swap_dir) if swap_dir is not None else default_swap_root()
        try:
            if not explicit:
                root.mkdir(parents=True, exist_ok=True)  # the default root is created, as the swap level does
            if not root.is_dir():
                return swap_dir  # the memory stack reports a missing or bad swap dir as usual
            folder = root / rank_folder_name(self.env.rank)
            created = not folder.exists()
            folder.mkdir(exist_ok=True)
        except OSError:
            return swap_dir
        if created:  # removed again when empty: at disable() (after the stack's own folder) or at exit
            self._made_swap_dir = folder
            atexit.register(self.release_swap_dir)  # registered before the swap folder's: runs after it
        return str(folder)

    def release_swap_dir(self) -> None:
        """Remove the rank's swap folder made by :meth:`swap_dir` if it is empty (the swap level
        removes its own folder inside it first); a folder still holding files — another job's on
        this host — is left alone. Safe to call more than once."""
        folder = getattr(self, "_made_swap_dir", None)
        if folder is None:
            return
        self._made_swap_dir = None
        try:
            atexit.unregister(self.release_swap_dir)
        except Exception:  # noqa: BLE001
            pass
        try:
            folder.rmdir()
        except OSError as err:  # not empty (another job's folder), or already gone
            log.debug("rank swap folder %s kept: %s", folder, err.strerror or err)

    def start(self, log_, patches) -> None:
        """Record the setup, make the rank's device current, install the patches."""
        self.log, self.patches = log_, patches
        self.pg.observe()
        env, sel = self.env, self.selection
        if self.setting == "off":
            self._record("launcher", "off", "untouched", "distributed=off: the switch leaves torch.distributed alone "
                         "(no process group, no DDP, no backend mapping)")
        elif env is None and not self.pg.initialized:
            self._record("launcher", "auto", "single process", "no launcher variables (WORLD_SIZE unset) and no process group")
        else:
            what = env.describe() if env is not None else "no launcher variables"
            if self.pg.initialized:
                chosen, why = str(self.pg.backend()), f"{what}; {self.pg.reason}"
            else:
                ok, why = self.pg.can_initialize()
                chosen = f"{self.pg.backend()} (at first use)" if ok else "none"
                if ok:
                    why += ("; initialized at the first training forward of an adopted model, unless the script "
                            "initializes it first (its backend is then mapped if needed)")
                elif env is not None and env.multi_process:
                    self.pg.refuse(why)
            self._record("launcher", "auto", chosen, why)
        if self.setting == "auto":
            if env is not None and env.multi_process and sel.device.type != "cpu":
                prev, self.device_note = set_current_device(sel.device)
                if prev is not None and prev != sel.device.index:
                    patches.add_undo(lambda p=prev, t=sel.device.type: set_current_device(torch.device(t, p)),
                                     "current device")
                self._record("device", str(sel.device), str(sel.device), f"{sel.reason}; {self.device_note}")
            self.pg.install(patches)
            patches.add_undo(self.pg.close, "process group created by the switch")
        self.guards = install_guards(patches, self._on_script_ddp, self._on_data_parallel, self._on_fsdp_params)
        patches.add_undo(self._remove_hooks, "in-place DDP")

    def attach(self, services: dict) -> None:
        """See the switch session's shared services (``services.get("paging")``: the paging
        session, whose paged parameters DDP and DataParallel must refuse)."""
        self.services = services

    # ------------------------------------------------------------------ adoption
    def data_parallel_world(self) -> tuple[int, str]:
        """The number of data-parallel ranks models will train over, and why."""
        if self.pg.initialized:
            return self.pg.world_size(), f"process group of {self.pg.world_size()} rank(s), backend {self.pg.backend()}"
        if self.setting == "auto":
            ok, why = self.pg.can_initialize()
            if ok:
                return self.env.world_size, why
            return 1, why
        return 1, "distributed=off and no process group"

    def decide(self, model: nn.Module, rec) -> Decision:
        """Decide data parallelism for an adopted model, changing nothing. ``decision.act`` means
        the DDP hooks are to be attached (:meth:`apply`); ``decision.facts["paging_blocked"]`` is the
        reason paging must stay off for the model, when it must.

        Args:
            model: the model being adopted.
            rec: its :class:`~apt_model.base.feature.ModelRecord`.
        """
        kind = wrapper_kind(model)
        if kind is not None:
            reason = f"under {kind}, applied by the script or a library: left to it, never wrapped again"
            self._row(rec, kind, reason)
            return Decision("distributed", self.setting, kind, reason, facts={
                "paging_blocked": f"the model is under {kind}, which reads parameter and gradient storage that paging frees"})
        world, why = self.data_parallel_world()
        if world <= 1:
            self._row(rec, "single process", why)
            return Decision("distributed", self.setting, "single process", why)
        block = {"paging_blocked": f"paging is off under data parallelism ({world} ranks): DDP/FSDP read and reduce "
                                   "parameter and gradient storage that paging frees; paging applies to single-process runs"}
        if self.setting == "off":
            reason = f"distributed=off: the script's own wrapping applies ({why})"
            self._row(rec, "as written", reason)
            return Decision("distributed", "off", "as written", reason, facts=block)
        self._row(rec, "pending", "DDP at first training forward")
        return Decision("distributed", "auto", "DDP at first training forward",
                        f"{why}; DDP is attached in place (same object, state_dict keys and optimizer) at the model's "
                        "first forward with gradients enabled, unless the script wraps it first (DDP, FSDP2, "
                        "Accelerate), which is then respected", act=True, facts={**block, "ddp": True})

    def apply(self, model: nn.Module, rec, record_later) -> DistributedModelHook:
        """Attach the hooks that decide DDP at the model's first training forward;
        ``record_later(decision)`` records that verdict. Returns the hook (its ``pre`` must also run
        when adoption happened inside that first forward)."""
        hook = DistributedModelHook(self._decide_wrap, rec,
                                    lambda r, chosen, reason: record_later(Decision("distributed", "auto", chosen, reason)))
        self.patches.add_handle(model.register_forward_pre_hook(hook.pre, with_kwargs=True), f"distributed pre-hook {rec.scope}")
        self.patches.add_handle(model.register_forward_hook(hook.post), f"distributed hook {rec.scope}")
        self.patches.set_attr(model, "_vb_distributed", hook, label=f"{rec.scope}._vb_distributed")
        self._hooks.append(hook)
        return hook

    def _decide_wrap(self, hook: DistributedModelHook, module: nn.Module) -> None:
        """The policy at a model's first training forward (see the module docstring)."""
        from torch.nn.parallel import DistributedDataParallel

        rec = hook.rec

        def leave(chosen, reason):
            hook.state = "left"
            hook.record(rec, chosen, reason)
            self._row(rec, chosen, reason)

        kind = wrapper_kind(module)
        active = DistributedDataParallel._active_ddp_module  # set while a DDP wrapper's forward runs
        ours = {id(h.ddp.ddp) for h in self._hooks if h.ddp is not None}
        if module in self._script_ddp or (active is not None and id(active) not in ours):
            return leave("DDP", "wrapped in DistributedDataParallel by the script or a library (Accelerate, the "
                                "Trainer): left to it, not wrapped twice")
        if kind is not None:
            return leave(kind, f"under {kind}, applied by the script: left to it, not wrapped twice")
        if hook.ddp is not None:  # the trainable parameters changed since DDP was built over them: rebuilt
            old, hook.ddp = hook.ddp, None
            old.remove()
            for key in old.trainable:
                if self._ddp_owner.get(key) == rec.scope:
                    del self._ddp_owner[key]
            hook.state = "undecided"
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:  # frozen for now (fine-tuning that unfreezes later): decided at a training forward with some
            if not any(r["model"] == rec.scope and r["wrapper"] == "not wrapped yet" for r in self.models):
                reason = ("no trainable parameters at this training forward: nothing to synchronize yet; DDP is "
                          "attached at the first training forward where some parameter requires grad")
                hook.record(rec, "not wrapped yet", reason)
                self._row(rec, "not wrapped yet", reason)
            return None
        owned = {self._ddp_owner[id(p)] for p in params if id(p) in self._ddp_owner}
        if all(id(p) in self._ddp_owner for p in params):
            return leave("part of a DDP model", f"its parameters are reduced by the DDP of {', '.join(sorted(owned))}")
        if self.pg.initialized and self.pg.status != BY_SWITCH:
            return leave("as written", (
                f"the script initialized the process group itself ({self.pg.world_size()} ranks, backend "
                f"{self.pg.backend()}) and runs this model unwrapped: left as written, since such a script manages "
                "its ranks itself (pipeline stages, a model per rank, its own gradient all-reduce). For the "
                "switch's DDP let the switch create the group (drop the script's init_process_group, or call "
                "vb.ensure_process_group() instead), or wrap the model in DistributedDataParallel"))
        if not self.pg.ensure(f"first training forward of {rec.scope}"):
            return leave("single process", self.pg.reason if self.pg.status != "not initialized"
                         else "the process group has a single rank")
        import torch.distributed as dist

        ignore = [n for n, p in module.named_parameters() if id(p) in self._ddp_owner]
        if ignore:
            self.patches.set_attr(module, "_ddp_params_and_buffers_to_ignore", ignore,
                                  label=f"{rec.scope}._ddp_params_and_buffers_to_ignore")
        try:
            hook.ddp = InPlaceDDP(module, self.options)
        except Exception as err:
            raise DistributedError(f"could not attach DDP to {rec.scope} (world size {dist.get_world_size()}, "
                                   f"backend {dist.get_backend()}): {type(err).__name__}: {err}") from err
        for p in params:
            self._ddp_owner.setdefault(id(p), rec.scope)
        rebuilt = hook.builds > 0
        hook.builds += 1
        hook.state = "ddp"
        opts = ", ".join(f"{k}={v}" for k, v in sorted(self.options.items())) or "DDP defaults"
        reason = (f"DDP over {dist.get_world_size()} ranks (backend {dist.get_backend()}, rank {dist.get_rank()}): "
                  f"parameters and buffers broadcast from rank 0 now, gradients averaged across ranks in buckets "
                  f"during backward; attached in place ({opts})"
                  + (f"; {len(ignore)} parameter(s) left to {', '.join(sorted(owned))}" if ignore else "")
                  + "; forwards without gradients run locally"
                  + (f"; rebuilt ({hook.builds} builds) because the set of trainable parameters changed (now "
                     f"{len(params)}): DDP reduces the parameters that required grad when it was built" if rebuilt else ""))
        hook.record(rec, "DDP", reason)
        self._row(rec, "DDP", reason)

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._ddp_owner.clear()

    # ------------------------------------------------------------------ guards
    def _paged(self, params) -> list[str]:
        session = self.services.get("paging")
        if session is None:
            return []
        return [session.param_label(p) for p in params if id(p) in session.params]

    def _refuse_if_paged(self, params, what: str) -> None:
        paged = self._paged(params)
        if paged:
            raise DistributedError(
                f"{what}: {len(paged)} parameter(s) of this model are paged by the switch ({', '.join(paged[:3])}"
                f"{', ...' if len(paged) > 3 else ''}): their storage leaves memory between uses, which {what} "
                "cannot follow. Initialize the process group (or start under torchrun) before moving the model, so "
                "the switch keeps it resident, or enable the switch with paging='off'")

    def _on_script_ddp(self, module: nn.Module) -> None:
        self._refuse_if_paged(list(module.parameters()), "DistributedDataParallel")
        self._script_ddp.add(module)
        hook = vars(module).get("_vb_distributed")  # set on the instance; not the class's __getattr__
        if isinstance(hook, DistributedModelHook) and hook.state == "ddp":
            hook.remove()
            hook.state = "left"
            for p in module.parameters():
                self._ddp_owner.pop(id(p), None)
            reason = "the script wrapped it in DistributedDataParallel itself: the switch's in-place DDP was removed"
            hook.record(hook.rec, "DDP", reason)
            self._row(hook.rec, "DDP", reason)
        self.wrappers.append({"wrapper": "DDP", "model": type(module).__name__,
                              "reason": "constructed by the script or a library"})

    def _on_data_parallel(self, module: nn.Module, device_ids, output_device) -> tuple:
        """DataParallel's constructor is about to run: refuse a paged model, fit ``device_ids`` to the
        visible devices (:func:`~apt_model.distributed.data_parallel.check_device_ids`), log and record
        a narrowing, and return the ``(device_ids, output_device)`` to construct it with.

        Raises:
            DistributedError: the model is paged by the switch.
            DeviceSelectionError: ids that cannot be honoured (none visible, repeated, the CPU...).
        """
        self._refuse_if_paged(list(module.parameters()), "DataParallel")
        dtype, count, env_name, env_value = visible_data_parallel_devices()
        plan = check_device_ids(device_ids, output_device, dtype, count, env_name, env_value)
        if plan.narrowed:
            log.warning("DataParallel: %s", plan.reason)
        requested = repr(list(device_ids)) if device_ids is not None else "all"
        used = repr(plan.device_ids) if plan.device_ids is not None else "all"
        if self.log is not None:
            self._record("DataParallel", requested, used if dtype is not None else "as is", plan.reason)
        self.wrappers.append({"wrapper": "DataParallel", "model": type(module).__name__, "device_type": dtype,
                              "requested_device_ids": [str(d) for d in device_ids] if device_ids is not None else None,
                              "device_ids": [str(d) for d in plan.device_ids] if plan.device_ids is not None else None,
                              "narrowed": plan.narrowed, "reason": plan.reason})
        return plan.device_ids, plan.output_device

    def _on_fsdp_params(self, params) -> None:
        self._refuse_if_paged(params, "fully_shard (FSDP2)")

    # ------------------------------------------------------------------ report
    def _record(self, feature, requested, chosen, reason) -> None:
        if self.log is not None:
            self.log.record(SCOPE, feature, requested, chosen, reason)

    def _row(self, rec, wrapper: str, reason: str) -> None:
        for row in self.models:
            if row["model"] == rec.scope:
                row.update(wrapper=wrapper, reason=reason)
                return
        self.models.append({"model": rec.scope, "wrapper": wrapper, "reason": reason})

    def report(self) -> dict:
        """The ``distributed`` section of ``vb.get_report()``: rank, world size, backend and why."""
        pg = self.pg.report()
        return {
            "setting": self.setting,
            "ddp_options": dict(self.options),
            "launcher": self.env.to_dict() if self.env is not None else None,
            "rank": pg["rank"],
            "local_rank": self.env.local_rank if self.env is not None else None,
            "world_size": pg["world_size"],
            "backend": pg["backend"],
            "process_group": pg["status"],
            "reason": pg["reason"],
            "device": str(self.selection.device),
            "device_reason": self.selection.reason,
            "current_device": self.device_note,
            "backend_calls": pg["calls"],
            "models": [dict(r) for r in self.models],
            "wrappers": [dict(w) for w in self.wrappers],
            "guards": list(self.guards),
        }
