"""One paging session: the pager, the swap space, and every hook that pages training state.

Created by the switch when an adopted model's training state does not fit the compute level's
budget (see :mod:`apt_model.memory.placement`). Everything it installs goes through the switch's
:class:`~apt_model.base.patches.PatchSet`; closing it (``disable()``) brings every page back
into memory, removes the hooks and deletes the swap folder. Its close is a *critical* undo: when
some page's bytes cannot be read back (a corrupt or missing swap file), every other tensor is
still restored and ``disable()`` raises the
:class:`~apt_model.memory.swap.PagingRecoveryError` naming the lost ones, with their folder kept.
"""
from __future__ import annotations

import copy
import functools
import threading
import weakref

import torch
import torch.nn as nn

from apt_model.base.errors import VBError
from apt_model.base.forward_scope import ForwardScopes
from apt_model.base.log import get_logger
from apt_model.memory.host import RSSWatch, return_big_blocks_to_os
from apt_model.memory.pager import Pager
from apt_model.memory.pages import Category, Page, State, live_page, other_holders, storage_ptr
from apt_model.memory.paging import backward_hooks, compiled, threads
from apt_model.memory.paging.backward_hooks import THREAD_FAULTS
from apt_model.memory.paging.backward_step import BackwardStep
from apt_model.memory.paging.clip import make_clip_grad_norm, make_clip_grad_value
from apt_model.memory.paging.fault import PageFaultMode
from apt_model.memory.paging.model import PagedModel
from apt_model.base.patches import SessionHook
from apt_model.memory.paging.optimizer import OptimizerPaging
from apt_model.memory.paging.saved import SavedPins
from apt_model.memory.placement import params_state_sizes
from apt_model.memory.stores import pinned_bytes
from apt_model.base.sizes import format_size
from apt_model.memory.swap import SwapError, SwapSpace
from apt_model.memory.waits import TimedLock

log = get_logger(__name__)

#: Dynamo's graph-break reason for the paging session's ``torch.autograd.backward`` / ``grad``.
EAGER_BACKWARD = ("apt_model tracks each backward call while paging (the step inside backward, the pins of a "
                  "gradient penalty): torch.autograd.backward and grad run eagerly under torch.compile")


class SparseGradientError(VBError, RuntimeError):
    """A paged model's parameter received a sparse (not strided) gradient, which paging cannot page.
    The switch leaves such models unpaged where it can see it coming
    (:func:`~apt_model.memory.paging.step.sparse_gradient_sources`); this is the case it could not."""


def _builds_graph(args, kwargs) -> bool:
    """Whether an op with these arguments records a graph (some tensor argument requires grad)."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def _grad_of(ref: weakref.ref) -> torch.Tensor | None:
    """A gradient page's tensor: the parameter's ``.grad`` (None once the parameter is gone)."""
    p = ref()
    return None if p is None else p.grad


class PagingSession:
    """Pages parameters, gradients and optimizer states of adopted models.

    Args:
        budget: bytes of training state the compute level may hold (level 0): the pages and the
            categories the placement plan keeps resident (see :meth:`page_model`).
        swap: the swap space (level below).
        patches: the switch's undo stack.
        page_states: whether optimizer states are paged (decided by the placement plan).
        device: the compute device whose memory is level 0.
        host_budget: bytes of the host level below an accelerator (default: ``budget``).
        host_level: put the host level between the device and the swap files (default: on any
            device but the CPU; the tests set it to run the accelerator path with the CPU
            standing in for the device).
        step_in_backward: ``"auto"`` (step each parameter as its gradient lands where the loop
            allows it, see :mod:`~apt_model.memory.paging.backward_step`) or ``"off"``.
        reuse_memory: on a CPU-only run, keep evicted pages' memory for the next load of the same
            size, within the budget (the ``paging_reuse_memory`` setting; see the pager).
    """

    def __init__(self, budget: int, swap: SwapSpace, patches, page_states: bool = True,
                 device: torch.device | str = "cpu", host_budget: int | None = None, host_level: bool | None = None,
                 step_in_backward: str = "auto", reuse_memory: bool = True, resident=None):
        device = torch.device(device)
        self.level_budget = int(budget)
        store = None
        if host_level if host_level is not None else device.type != "cpu":
            from apt_model.memory.io_engine import IOEngine
            from apt_model.memory.stores import DiskStore, HostStore

            io = IOEngine()
            # the swap folder is the VGPU stack's (closed last, by its own undo): the activation
            # offloader shares it, and a backward after disable() reads its saved activations
            store = HostStore(device, host_budget or budget, DiskStore(swap, io, owns_swap=False))
            self.pager = Pager(budget, swap, io=io, store=store, device=device)
        else:
            self.pager = Pager(budget, swap, device=device, reuse_memory=reuse_memory, owns_swap=False)
        self.swap = swap
        self.host_is_level0 = store is None  # no host level: the compute level is host memory (a CPU run)
        if device.type == "cpu":  # the compute level is host RAM: freed pages must leave the RSS at once
            return_big_blocks_to_os()
        self.host_rss = RSSWatch()  # the process's RSS from the first page-out on (report: host_rss)
        self.pager.rss = self.host_rss
        self.patches = patches
        # Models and parameters are held weakly: a model the script drops is freed (see
        # :meth:`retire_dead`). The id-keyed maps lose a parameter's entries the moment it dies,
        # so a new tensor given its id is never taken for it.
        self.models: list[PagedModel] = []  # live ones (replaced, never mutated: a finalizer edits it)
        self._closed_report: dict | None = None  # the report at a clean close (models let go: _let_go)
        self.param_pages: dict[int, Page] = {}
        self.grad_pages: dict[int, Page] = {}
        self.params: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(p) -> p
        self.labels: dict[int, str] = {}
        self.released_models = 0  # paged models the script dropped, freed
        self._dead_pages: list[Page] = []  # pages of parameters since garbage-collected (finalizers' queue)
        self._released: list[PagedModel] = []  # dropped models whose kept bytes still count (finalizers' queue)
        self._finalizers: list[weakref.finalize] = []
        self.optimizers = OptimizerPaging(self, page_states)
        self.host_step = None  # a HostStep once a model's plan steps its optimizer on the host
        self.backward_step = BackwardStep(self, step_in_backward)
        self._traffic_marks: dict[int, tuple] = {}  # step -> counters after it (the first and the last)
        self.optimizers.after_step.append(self._mark_traffic)
        self._backwards = 0  # backward passes since the last optimizer step
        self._backwards_per_step = 1  # as many as the last step followed (gradient accumulation)
        self.optimizers.after_step.append(self._count_backwards)
        self.optimizers.after_step.append(lambda step: self.host_rss.sample())
        self._bw_pinned: dict[int, Page] = {}  # pinned by units' backward hooks (let go by the next forward)
        self._saved_pinned: dict[int, Page] = {}  # saved by a graph where saved-tensor hooks are off: to the end of a backward
        self._callback_queued = False  # the end-of-backward callback is queued on the running backward
        self._accumulating: set[int] = set()  # id(param) whose gradient page the pre-accumulate hook pinned
        #: labels of parameters whose gradient shares its memory with other tensors (kept resident)
        self.shared_grads: set[str] = set()
        self._in_unit: dict[int, int] = {}  # id(page) -> forwards under way of units owning it
        # per thread: the units whose forward is under way (payload (unit, pages)), and the paged
        # models' outermost forwards; entries of calls an interrupt ended are let go (ForwardScopes)
        self._unit_scopes = ForwardScopes(on_abandon=self._abandon_unit)
        self._root_scopes = ForwardScopes(on_abandon=self._abandon_root)
        self._grad_calls = 0  # torch.autograd.grad calls under way (they accumulate into no gradient)
        self._backward_calls = 0  # torch.autograd.backward calls under way (they do)
        self.kept: list[dict] = []  # per paged model: the bytes its plan keeps resident on level 0
        # the models kept whole on level 0 (not paged: ResidentModels), whose bytes the pages' room excludes too
        self.resident = resident
        self._resident_seen = -1  # len(resident) at the last fit: a resident model freed gives its room back
        # modules and parameters registered anywhere since paging began (torch's global registration
        # hooks): a paged model walks itself for ones added to it when this changed (PagedModel._check_slots)
        self.registrations = 0
        self.forward_depth = 0  # > 0 while a paged model's forward runs
        self.uncovered_accesses = 0  # ops in a forward on a paged tensor no module hook had pinned
        self._lock = TimedLock("paging session")
        self.mode = PageFaultMode(self.pager.by_tensor, self)
        self._alias_lock = threading.Lock()  # the alias map (PageFaultMode.aliases); finalizers take it
        self.mode.__enter__()
        threads.warn_if_off_main_thread()
        self._install_global()
        patches.add_undo(self.close, "paging session", critical=True)

    # ------------------------------------------------------------------ setup
    def _install_global(self) -> None:
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_mod

        self.optimizers.install(self.patches)
        from torch.nn.modules.module import (register_module_module_registration_hook,
                                             register_module_parameter_registration_hook)

        for register, what in ((register_module_module_registration_hook, "module"),
                               (register_module_parameter_registration_hook, "parameter")):
            self.patches.add_handle(register(self._registered), f"global {what} registration hook")
        norm = make_clip_grad_norm(clip_mod.clip_grad_norm_, self.grad_page, self._acquire_one, self._release_one,
                                   self.pager.defer_scale)
        value = make_clip_grad_value(clip_mod.clip_grad_value_, self.grad_page, self._acquire_one, self._release_one)
        norm, value = self._noting_clip(norm), self._noting_clip(value)
        self._patch_backward()
        self._patch_pickling()
        backward_hooks.install(self.mode, self.patches)  # user hooks in backward see the fault handler
        threads.install(self.patches)  # and threads started from now on
        compiled.install(self.patches)  # torch.compile runs paged models eagerly
        compiled.install_graph_inputs(self, self.patches)  # and loads pages a compiled graph reads directly
        from torch.amp import GradScaler

        unscale = GradScaler.unscale_

        @functools.wraps(unscale)
        def unscale_(scaler, optimizer):
            self.backward_step.grads_modified("GradScaler.unscale_ rescales the gradients between backward and "
                                              "optimizer.step()")
            return unscale(scaler, optimizer)
        self.patches.set_attr(GradScaler, "unscale_", unscale_, label="torch.amp.GradScaler.unscale_")
        for mod in (nn_utils, clip_mod):
            self.patches.set_attr(mod, "clip_grad_norm_", norm, label=f"{mod.__name__}.clip_grad_norm_")
            self.patches.set_attr(mod, "clip_grad_value_", value, label=f"{mod.__name__}.clip_grad_value_")

    def _patch_pickling(self) -> None:
        """``Tensor.__reduce_ex__`` (pickling: ``torch.save``, ``copy``) of a paged tensor loads its
        page and keeps it pinned while the storage it hands to the pickler lives. A plain tensor's
        ``__reduce_ex__`` takes a fast path that no torch function sees: ``torch.save(optimizer)``
        (or its ``state``, or a checkpoint dict holding it) wrote 0-byte records for paged-out
        optimizer states, and ``torch.load`` failed ("record size (0 bytes) does not match"),
        until 2026-11-26. Parameters pickle through ``.data``, which the fault handler sees."""
        real = torch.Tensor.__reduce_ex__
        lookup = self.pager.by_tensor

        @functools.wraps(real)
        def __reduce_ex__(t, proto):
            page = live_page(lookup, t) if self.mode.active else None
            if page is None:
                return real(t, proto)
            held = self.enter([page])
            out = None
            try:
                out = real(t, proto)
            finally:
                self.exit(held, out, [page])
            return out

        self.patches.set_attr(torch.Tensor, "__reduce_ex__", __reduce_ex__, label="torch.Tensor.__reduce_ex__")

    def _patch_backward(self) -> None:
        """``torch.autograd.backward`` (which ``Tensor.backward`` calls) and ``torch.autograd.grad``
        tell the step inside backward that a backward starts — whether it keeps its graph — and
        that it failed; one that builds a graph (``create_graph=True``) runs under
        :class:`~apt_model.memory.paging.saved.SavedPins`, so the parameters its formulas save
        stay resident while the new graph lives (a gradient penalty)."""
        real_backward, real_grad = torch.autograd.backward, torch.autograd.grad
        entered = threading.local()  # this thread is inside a wrapper, before autograd runs a graph

        def run(fn, args, kwargs, keeps_graph: bool, create_graph: bool, accumulates: bool):
            if getattr(entered, "depth", 0) and torch._C._current_graph_task_id() == -1:
                # the real function dispatching itself again through torch's function modes
                # (arguments with __torch_function__): already announced
                return fn(*args, **kwargs)
            self.backward_step.backward_call(keeps_graph, nested=torch._C._current_graph_task_id() != -1)
            entered.depth = getattr(entered, "depth", 0) + 1
            if accumulates:
                self._backward_calls += 1
            else:
                self._grad_calls += 1
            try:
                if create_graph and SavedPins.available():
                    with SavedPins(self.pager):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            except BaseException as err:
                self.backward_step.backward_failed(err)
                raise
            finally:
                entered.depth -= 1
                if accumulates:
                    self._backward_calls -= 1
                else:
                    self._grad_calls -= 1

        @functools.wraps(real_backward)
        def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, *args, **kwargs):
            return run(real_backward, (tensors, grad_tensors, retain_graph, create_graph, *args), kwargs,
                       bool(retain_graph) or bool(create_graph), bool(create_graph), True)

        @functools.wraps(real_grad)
        def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, *args, **kwargs):
            return run(real_grad, (outputs, inputs, grad_outputs, retain_graph, create_graph, *args), kwargs,
                       bool(retain_graph) or bool(create_graph), bool(create_graph), False)
        # Dynamo runs them eagerly (a compiled training step calling loss.backward() breaks its graph
        # there anyway): traced, their bookkeeping was compiled into a resume function and replayed
        backward = torch.compiler.disable(backward, reason=EAGER_BACKWARD)
        grad = torch.compiler.disable(grad, reason=EAGER_BACKWARD)
        # autograd reads the pages itself, through the module hooks: the fault handler lets these
        # calls through instead of loading every parameter named in ``inputs=`` for their duration
        self.mode.passthrough.update((real_backward, real_grad, backward, grad, torch.Tensor.backward))
        self.patches.set_attr(torch.autograd, "backward", backward, label="torch.autograd.backward")
        self.patches.set_attr(torch.autograd, "grad", grad, label="torch.autograd.grad")

    def _registered(self, *args) -> None:
        """Torch's global module / parameter registration hook: count (the registration stands)."""
        self.registrations += 1

    def _noting_clip(self, fn):
        """``fn`` (a clip function) telling the step in backward that the loop clips."""
        @functools.wraps(fn)
        def clip(*args, **kwargs):
            self.backward_step.clip_called()
            return fn(*args, **kwargs)
        return clip

    def owns_all(self, model: nn.Module) -> bool:
        """Whether every parameter of ``model`` (it has some) is already a paged model's: a module
        the script added to a paged model, which that model's forward adopted (``PagedModel._adopt_new``)."""
        ids = [id(p) for p in model.parameters()]
        return bool(ids) and all(i in self.params for i in ids)

    def page_model(self, model: nn.Module, page_params: bool, page_grads: bool,
                   state_factor: float = 2.0) -> PagedModel:
        """Start paging ``model``'s parameters and/or gradients (optimizer states are paged when
        its optimizer first steps).

        What the plan keeps resident — the parameters when they are not paged, the gradients
        when they are not, and the optimizer states (``state_factor`` bytes per trainable byte,
        Adam's m and v by default) when states are not paged — stays on level 0 outside the
        pages, so the pages get the budget minus those bytes: level 0 as a whole keeps the budget.
        """
        self.retire_dead()
        pm = PagedModel(self, model, page_params, page_grads)
        pm.state_factor = state_factor
        pm.planned_trainable = {id(p) for p in model.parameters() if p.requires_grad}
        pm.kept = self._keep_resident(model, page_params, page_grads, state_factor)
        pm.install(self.patches)
        if pm.shared:
            self._keep_shared(pm, list(pm.shared))
        backward_hooks.wrap_existing(model, self.patches)  # hooks registered before paging
        compiled.add_model(model, self.patches)  # runs eagerly under torch.compile
        self.models = self.models + [pm]
        self._on_death(model, self._model_died, pm)
        # state_dict() detaches every parameter; for paged ones the post-hook swaps in materialized
        # copies, so the fault handler stays out of the way meanwhile (no load, no dirty mark).
        # torch tags the hook object itself, which a bound method does not allow: wrap it
        self.patches.add_handle(model.register_state_dict_pre_hook(SessionHook(lambda *a: self._before_state_dict())),
                                "paging state_dict pre-hook")
        self.patches.add_handle(model.register_state_dict_post_hook(SessionHook(lambda *a: self._state_dict_hook(*a))),
                                "paging state_dict hook")
        if self.host_rss.start is None:
            self.host_rss.begin()  # the first model is paged out (and trimmed): growth counts from here
        return pm

    def add_param(self, p: nn.Parameter, label: str) -> None:
        """Know ``p`` as a paged model's parameter (paged or kept resident by the plan)."""
        self.params[id(p)] = p
        self.labels[id(p)] = label
        self._on_death(p, self._param_died, id(p))

    def forget_param(self, pid: int) -> None:
        """A paged model let go of parameter ``pid`` (it left the model, or moved within it): it
        is no paged model's any more (its gradient page, if any, stays until it dies)."""
        self.params.pop(pid, None)
        self.labels.pop(pid, None)

    def model_grew(self, pm: PagedModel, model: nn.Module, new_shared: list[str]) -> None:
        """``pm`` adopted parameters the script added to ``model`` after it was paged: count what
        its plan keeps resident again (the parameters, gradients or states it does not page, and
        the added parameters that share memory: ``new_shared`` names them), and wrap and register
        the new modules as adoption does."""
        pm.kept.clear()
        pm.kept.update(self._kept_entry(pm.params, pm.page_params, pm.page_grads, pm.state_factor))
        self._keep_shared(pm, new_shared)
        backward_hooks.wrap_existing(model, self.patches)
        compiled.add_model(model, self.patches)

    def step_on_host(self, model: nn.Module, exact: bool) -> None:
        """Step ``model``'s parameters on the host from now on (see :mod:`~apt_model.memory.paging.host_step`);
        the host copies, states and gradient buffers come out of the host level's budget.

        Args:
            exact: keep the kernels the user's optimizer would use (else the CPU's fused kernel
                where there is one).
        """
        from apt_model.memory.paging.host_step import HostStep

        if self.host_step is None:
            self.host_step = HostStep(self, fused=not exact)
        params = [p for p in model.parameters() if p.requires_grad]
        self.host_step.add(params)
        pool = getattr(self.pager.store, "pool", None)
        if pool is not None:
            sizes = [p.numel() * p.element_size() for p in params]
            pinned = sum(pinned_bytes(n, pool.pin) for n in sizes)  # each one rounded up where pinned
            need = 2 * pinned + 2 * sum(sizes)  # host copies and gradient buffers (pinned); Adam's m and v
            pool.shrink(need)

    def _keep_resident(self, model: nn.Module, page_params: bool, page_grads: bool, state_factor: float) -> dict:
        """Count what ``model``'s plan keeps resident against level 0 — of its parameters no paged
        model adopted before (a wrapper's inner model keeps its own) — and return its entry in
        ``kept``."""
        own = [p for p in model.parameters() if id(p) not in self.params]
        entry = self._kept_entry(own, page_params, page_grads, state_factor)
        self.kept.append(entry)
        self._fit_kept(warn=True, adding=model)
        return entry

    def _kept_entry(self, params: list[nn.Parameter], page_params: bool, page_grads: bool, state_factor: float) -> dict:
        """What a plan keeps resident of ``params``: ``{category: bytes}``, the categories with none
        left out."""
        p_bytes, t_bytes = params_state_sizes(params)
        kept = {"parameters": 0 if page_params else p_bytes, "gradients": 0 if page_grads else t_bytes,
                "optimizer states": 0 if self.optimizers.page_states else int(state_factor * t_bytes)}
        return {k: v for k, v in kept.items() if v}

    def trainable_grew(self, pm: PagedModel, p: nn.Parameter) -> None:
        """``p``, frozen when ``pm``'s plan was made, received a gradient (progressive unfreezing):
        what the plan keeps resident of it — its gradient where the plan keeps gradients, its
        optimizer states where states are not paged — is counted now, so the pages get the budget
        minus that (level 0 as a whole keeps the budget where they can make room), and the report
        says so. Until 2026-11-29 such gradients and states were resident and counted nowhere: four
        times the training state over the budget, with the report unchanged (a probe's finding).
        The plan is not made again (gradients kept resident stay so); said once per model."""
        pm.planned_trainable.add(id(p))
        nbytes = p.numel() * p.element_size()
        grew = {}
        if not pm.page_grads:
            grew["gradients"] = nbytes
        if not self.optimizers.page_states:
            grew["optimizer states"] = int(pm.state_factor * nbytes)
        for key, n in grew.items():
            pm.kept[key] = pm.kept.get(key, 0) + n
        pm.grown = getattr(pm, "grown", 0) + sum(grew.values())
        total = self._fit_kept()
        if grew and not getattr(pm, "said_grown", False):
            pm.said_grown = True
            log.warning("parameters of %s frozen when its paging plan was made have become trainable: the plan keeps "
                        "their %s resident, counted against the level-0 budget from now on; it is not made again. "
                        "Unfreeze before the model is adopted to have them planned", type(pm.model).__name__,
                        " and ".join(grew))
        if total >= self.level_budget and not getattr(pm, "said_full", False):
            pm.said_full = True
            log.warning("the training state kept resident (%s, after parameters of %s were unfrozen) fills the "
                        "level-0 budget %s: pages get no room and every paged tensor will be loaded over it",
                        format_size(total), type(pm.model).__name__, format_size(self.level_budget))

    def _keep_shared(self, pm: PagedModel, labels: list[str]) -> None:
        """Count the parameters ``pm`` could not page — their storage is held by other tensors too
        (see :func:`~apt_model.memory.pages.other_holders`) — as kept resident, each storage once,
        and say which (``labels``: those not said before) and why."""
        storages = {key: nbytes for _, key, nbytes in pm.shared.values()}
        if storages:
            pm.kept["parameters sharing memory"] = sum(storages.values())
        self._fit_kept(warn=True, adding=pm.model)
        if not labels:
            return
        names = ", ".join(f"{label} ({pm.shared[label][0]} other)" for label in labels)
        log.warning("paging keeps %d parameter(s) of %s resident (%s, not paged): other tensors share their memory — "
                    "%s — views, .data/.detach() aliases or a state dict the script kept, or the parameters of one "
                    "flat buffer; paging frees a tensor's memory in place, which those would then read. Drop such "
                    "references before the model is adopted (or added to it) to have them paged",
                    len(labels), type(pm.model).__name__,
                    format_size(sum({pm.shared[label][1]: pm.shared[label][2] for label in labels}.values())), names)

    def kept_total(self) -> int:
        """Bytes the paged models' plans keep resident on level 0 now (the next plan has the rest)."""
        return sum(sum(k.values()) for k in self.kept)

    def resident_total(self, adding: nn.Module | None = None) -> int:
        """Bytes of the models kept whole on level 0 (not paged), less their parameters paged since
        through a model that wraps them (``adding``: one being paged now, whose parameters are not
        in ``params`` yet)."""
        if self.resident is None:
            return 0
        self._resident_seen = len(self.resident)
        return self.resident.bytes(exclude=adding, paged=self.params)

    def _resident_changed(self) -> bool:
        """Whether a model kept whole was adopted or freed since the room was last fitted (cheap:
        a length)."""
        return self.resident is not None and len(self.resident) != self._resident_seen

    def _fit_kept(self, warn: bool = False, adding: nn.Module | None = None) -> int:
        """Give the pages the level's budget minus the bytes kept resident (by the paged models'
        plans and by the models kept whole; ``adding``: a model being paged now, see
        :meth:`resident_total`); returns those bytes. With ``warn``, say so when what is kept
        leaves the pages no room."""
        total = self.kept_total() + self.resident_total(adding)
        self.pager.kept_bytes = total
        self.pager.level_budget = self.level_budget
        self.pager.budget = max(self.level_budget - total, 0)
        if warn and total >= self.level_budget:
            log.warning("the training state kept resident (%s) fills the level-0 budget %s: pages get no room "
                        "and every paged tensor will be loaded over it", format_size(total),
                        format_size(self.level_budget))
        return total

    # ------------------------------------------------------------------ dropped models
    def _on_death(self, obj, fn, *args) -> None:
        f = weakref.finalize(obj, fn, *args)
        f.atexit = False  # nothing to free at exit
        self._finalizers.append(f)

    def _model_died(self, pm: PagedModel) -> None:
        """A finalizer: the script dropped ``pm``'s model. The session lets go of its units and
        parameters at once (lists are replaced, not mutated: this may run inside any iteration,
        on any thread the garbage collector runs on); its kept bytes go at :meth:`retire_dead`."""
        self.models = [m for m in self.models if m is not pm]
        pm.release()
        self._released.append(pm)

    def _param_died(self, pid: int) -> None:
        """A finalizer: a paged parameter was garbage-collected. Its id leaves every id-keyed map
        now (a new tensor may get the id next); its pages are discarded at :meth:`retire_dead`
        (that takes the pager's lock, which this thread may hold)."""
        for pages in (self.param_pages, self.grad_pages):
            page = pages.pop(pid, None)
            if page is not None:
                self._dead_pages.append(page)
        self.labels.pop(pid, None)
        self._accumulating.discard(pid)
        self.backward_step.forget(pid)
        if self.host_step is not None:
            self.host_step.params.discard(pid)

    def retire_dead(self) -> None:
        """Free what dropped models left: their parameters' pages (memory and swap files, without
        reading anything back: nobody holds the tensors) and the bytes their plans kept resident.
        Runs where no pager call is under way on this thread: when a model is adopted, when a
        paged model's forward starts, and in the report."""
        self.optimizers.retire_dead()
        self.backward_step.retire_dead()
        if self.host_step is not None:
            self.host_step.retire_dead()
        while self._dead_pages:
            self.pager.discard(self._dead_pages.pop())
        if len(self._finalizers) > 64 and any(not f.alive for f in self._finalizers):
            self._finalizers = [f for f in self._finalizers if f.alive]  # fired: nothing left to detach
        if self._resident_changed():
            self._fit_kept()  # a model kept whole was adopted or freed
        if self._released:
            released, self._released = self._released, []
            self.kept = [k for k in self.kept if not any(k is pm.kept for pm in released)]
            self._fit_kept()
            self.released_models += len(released)
            log.info("freed %d paged model(s) the script dropped", len(released))
            self.patches.prune()  # their hooks' undo entries

    def param_label(self, p: torch.Tensor) -> str:
        """A paged parameter's name (``model.blocks.0.weight``); another one is named by its shape
        and address (``a parameter of shape (16, 8) (@7f...)``)."""
        label = self.labels.get(id(p))
        if label is not None:
            return label
        return f"a parameter of shape {tuple(p.shape)} (@{id(p):x})"

    def grad_page(self, p: torch.Tensor) -> Page | None:
        """``p``'s gradient page, reconciled with ``p.grad`` (a replaced gradient is followed, its
        cached norm dropped), or None when ``p`` has no paged gradient now."""
        page = self.grad_pages.get(id(p))
        if page is None or self.pager.sync(page) is None:
            return None
        return page if page.state is not State.ABSENT else None

    def _acquire_one(self, page: Page, for_write: bool) -> None:
        self.pager.acquire([page], for_write=for_write)

    def _release_one(self, page: Page) -> None:
        self.pager.release([page], evict=page.category is not Category.PARAM)

    # ------------------------------------------------------------------ backward bookkeeping
    def pin_for_backward(self, pages: list[Page]) -> None:
        """Pin a unit's pages for its backward (called from autograd: on accelerators, on autograd's
        device thread) and make sure the end-of-backward callback is queued on this backward (once:
        a backward nested in it, such as reentrant checkpointing's, must not release its pins)."""
        with self._lock:
            fresh = [p for p in pages if id(p) not in self._bw_pinned]
            if fresh:
                self.pager.acquire(fresh)
                for p in fresh:
                    self._bw_pinned[id(p)] = p
            if not self._callback_queued:
                self.pager.phase = "backward"
                self._callback_queued = True
                self.host_rss.sample()  # a backward starts: activations and the first gradients peak here
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def forward_starts(self) -> None:
        """A paged model's outermost forward begins (outside any backward): pages still pinned for
        a backward are let go, and no end-of-backward callback is pending any more — a backward
        that raised (an out-of-memory, a hook's error) never ran its callback, and without this
        the next backward would not queue its own and would keep its pages pinned through the
        optimizer step."""
        if torch._C._current_graph_task_id() != -1:
            return  # a forward recomputed inside a backward (reentrant checkpointing)
        with self._lock:
            self._callback_queued = False
        self.release_backward_pins()
        self.backward_step.forward_starts()  # a step never claimed: undone

    def unpin_for_backward(self, page: Page) -> None:
        with self._lock:
            if self._bw_pinned.pop(id(page), None) is not None:
                self.pager.release([page])

    def _release_pins(self, pins: dict[int, Page]) -> None:
        with self._lock:
            pages = list(pins.values())
            pins.clear()
            if pages:
                self.pager.release(pages)

    def release_backward_pins(self) -> None:
        """Let go of the pages units' backward hooks pinned."""
        self._release_pins(self._bw_pinned)

    def release_saved_pins(self) -> None:
        """Let go of the pages ops saved into a graph where torch had disabled saved-tensor hooks
        (see :meth:`graph_saves`): a backward ended. Not at the next forward, which may be a no-grad
        one before this graph's backward."""
        self._release_pins(self._saved_pinned)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.pager.phase = "other"
        self.release_backward_pins()
        self.release_saved_pins()
        self._backwards += 1
        # the step's first chunk is prefetched where the step comes next: after as many backwards as
        # the last step had (gradient accumulation: the last of them), never for a step taken inside it
        if (self.optimizers.first_chunk and self.backward_step.pending is None
                and self._backwards >= self._backwards_per_step):
            self.pager.prefetch(self.optimizers.first_chunk)

    def _count_backwards(self, step: int) -> None:
        """After a step: the backwards it followed are the loop's count per step from now on."""
        self._backwards_per_step, self._backwards = max(1, self._backwards), 0

    # ------------------------------------------------------------------ gradients
    def grad_only(self) -> bool:
        """Whether the backward under way is ``torch.autograd.grad``'s (gradients returned, none
        accumulated). A ``grad`` call inside a backward (a hook's) counts as the backward."""
        return bool(self._grad_calls) and not self._backward_calls

    def before_grad_accumulate(self, p: nn.Parameter, label: str) -> None:
        """Autograd is about to accumulate into ``p.grad``: a paged-out gradient comes back (pinned)
        so accumulation adds in place exactly as without paging. A gradient the user set to None,
        replaced (``p.grad = p.grad * 0.5``) or edited is reconciled first (see ``Pager.sync``)."""
        page = self.grad_pages.get(id(p))
        if page is None:
            return
        if self.pager.sync(page) is None:
            return  # no gradient now (zero_grad(set_to_none=True)): autograd creates a new one
        self.pager.acquire([page], for_write=True)  # accumulate in place into the restored bytes
        self._accumulating.add(id(p))

    def after_grad_accumulate(self, p: nn.Parameter, label: str, page_grad: bool = True) -> None:
        """``p.grad`` is complete for this backward: bind the page to it (autograd may have made a
        new tensor), step ``p`` now where the step runs inside backward, and write the gradient
        behind (``page_grad=False``: the plan keeps gradients resident, only the step runs). Then
        a resident ``p``'s pre-step copy starts (queued after its gradient's copy down, which is
        what frees device memory)."""
        self._grad_complete(p, label, page_grad)
        if p.grad is not None:
            self.optimizers.grad_landed(p)

    def _grad_complete(self, p: nn.Parameter, label: str, page_grad: bool) -> None:
        g = p.grad
        pinned = id(p) in self._accumulating
        self._accumulating.discard(id(p))
        if g is not None and g.layout is not torch.strided:
            raise SparseGradientError(
                f"the gradient of {label} is {g.layout}: paging pages dense tensors only, and this model's parameters "
                "are paged. Build the module that produces it with dense gradients (nn.Embedding(sparse=False)), or "
                "train this model with paging='off'")
        if self.host_step is not None and g is not None:
            self.host_step.landed(p)  # the host step takes the gradients in the order they land
        page = self.grad_pages.get(id(p))
        if g is None:
            if pinned and page is not None:
                self.pager.release([page])
            return
        if page is None and not page_grad:
            self.backward_step.grad_landed(p)  # a gradient the plan keeps resident
            return
        if page is None and other_holders(g):
            self._keep_shared_grad(p, label)
            return
        norm = self._norm(g)
        if page is None:
            page = self.pager.register(Category.GRAD, functools.partial(_grad_of, weakref.ref(p)), f"{label}:grad")
            self.grad_pages[id(p)] = page
            page.cached_norm = norm
            self.backward_step.grad_landed(p)  # stepped now where the step runs inside backward
            self.pager.write_behind([page])  # written as it is produced, kept in memory while there is room
            return
        self.pager.sync(page)  # a new tensor (autograd's, or the first after a None) is bound now
        page.dirty = True
        if pinned:
            self.pager.release([page], evict=False)
        page.cached_norm = norm  # set after release: the page is unpinned, its data final for now
        self.backward_step.grad_landed(p)
        self.pager.write_behind([page])

    def _keep_shared_grad(self, p: nn.Parameter, label: str) -> None:
        """``p.grad`` shares its memory with other tensors: the gradients of parameters joined by
        ``torch.cat``/``torch.stack`` in forward (their backward hands each a view of one tensor,
        which autograd keeps as ``.grad``), or views of one flat buffer the script set (apex and
        DeepSpeed style, DDP's ``gradient_as_bucket_view``). A page frees its storage in place,
        which the others then read: a segfault or a ``SwapError`` (a probe's finding, 2026-11-28).
        Such a gradient is kept resident, not paged, and said once."""
        if label not in self.shared_grads:
            self.shared_grads.add(label)
            log.warning("paging keeps the gradient of %s resident (not paged): other tensors share its memory — views "
                        "of one gradient (parameters joined by torch.cat/torch.stack in forward) or of a flat buffer "
                        "the script set as .grad; paging frees a tensor's memory in place, which those would then "
                        "read", label)
        self.backward_step.grad_landed(p)

    @staticmethod
    def _norm(g: torch.Tensor) -> torch.Tensor:
        """The 2-norm ``clip_grad_norm_`` would compute for ``g`` (same call, so the same bits)."""
        with torch.no_grad(), torch._C.DisableTorchFunction():
            return torch._foreach_norm([g], 2.0)[0]

    # ------------------------------------------------------------------ faults
    def enter(self, pages: list[Page], writes: bool = False,
              written: list[Page] | None = None) -> list[tuple[Page, bool]]:
        """Fault handler, before an op (``writes``: it may write its arguments; ``written``: the
        pages it writes, None for any of them): load and pin the pages nobody pinned, and mark
        written the pinned pages it writes; returns the pages it pinned."""
        held, marked = [], []
        self.backward_step.touched(pages, writes)  # a value stepped inside backward, used before step(): undone
        with torch._C.DisableTorchFunction():
            for page in dict.fromkeys(pages):
                if self.pager.sync(page) is None:
                    continue  # its tensor was dropped or replaced: the old one has its bytes back
                if page.pins > 0 and writes and (written is None or any(page is w for w in written)):
                    marked.append(page)  # pinned (a module's hooks acquired it clean) and written in place
                if page.pins > 0 or page.state is State.ABSENT:
                    continue
                if self.forward_depth:
                    self.uncovered_accesses += 1  # a forward needs the op-level handler (see paging/model.py)
                    self._learn_owner(page)
                loaded = page.state is not State.RESIDENT
                if loaded:
                    self.pager.stats.faults += 1
                self.pager.acquire([page], for_write=True)  # unknown access: it may write through an alias
                held.append((page, loaded))
        if marked:
            self.pager.mark_written(marked)
        return held

    def root_forward_starts(self) -> None:
        """A paged model's forward begins (its root pre-hook, before ``forward_depth`` is read and
        raised): root forwards on this thread that an interrupt ended (their forward hook, which
        lowers ``forward_depth``, never ran) stop counting, so the next outermost forward is seen
        as one — :meth:`forward_starts` lets go of an unfinished backward's pins and undoes a step
        taken inside a backward nobody claimed."""
        self._root_scopes.unwind()
        self._root_scopes.push(None, True)
        if self._dead_pages or self._released or self._resident_changed():
            self.retire_dead()

    def root_forward_ends(self) -> None:
        self._root_scopes.unwind()
        self._root_scopes.pop()

    def _abandon_root(self, _payload) -> None:
        self.forward_depth = max(0, self.forward_depth - 1)

    def unit_forward_starts(self, unit, pages: list[Page]) -> None:
        """``unit``'s forward begins (its pre-hook acquired ``pages``): they are covered — backward
        brings them back through the unit's own hook — until :meth:`unit_forward_ends`."""
        self._unit_scopes.unwind()
        stack = self._unit_scopes.stack()
        if stack:
            stack[-1][1][0].inner = True  # the enclosing unit is a container (Unit.forward_pages)
        for pg in pages:
            self._in_unit[id(pg)] = self._in_unit.get(id(pg), 0) + 1
        self._unit_scopes.push(None, (unit, pages))

    def unit_forward_ends(self, unit) -> list[Page]:
        """``unit``'s forward ended: returns the pages its start covered (to release them; a page
        learned meanwhile, :meth:`_learn_owner`, is acquired by the unit from its next forward on).
        [] when its start was never recorded (its pre-hook raised before): nothing to release."""
        self._unit_scopes.unwind()  # inner units an interrupt ended
        entry = self._unit_scopes.pop()
        if entry is None:
            return []
        _, (owner, pages) = entry
        self._uncount(pages)
        if owner is not unit:  # not this call's (cannot happen while every pre-hook pushes): let it go too
            self.pager.release(pages)
            return []
        return pages

    def _uncount(self, pages: list[Page]) -> None:
        for pg in pages:
            n = self._in_unit.get(id(pg), 0) - 1
            if n > 0:
                self._in_unit[id(pg)] = n
            else:
                self._in_unit.pop(id(pg), None)

    def _abandon_unit(self, payload) -> None:
        """A unit forward an interrupt ended (a ``KeyboardInterrupt`` skips PyTorch's always-called
        hooks): its pins and counts go, so its pages can be evicted again and no page is learned
        into a unit no longer running."""
        _, pages = payload
        self._uncount(pages)
        self.pager.release(pages)

    def _learn_owner(self, page: Page) -> None:
        """A forward used ``page`` (a parameter's) outside the module that owns it, inside the
        forward of the innermost unit under way on this thread (``nn.MultiheadAttention`` passes
        ``out_proj.weight`` and ``.bias`` to a function; ``out_proj`` itself is never called): the
        page becomes that unit's too, so its pre-hook loads it from then on. A recomputation
        inside backward (activation checkpointing) runs without the fault handler, and reached the
        page only through that hook: without it, it read an evicted parameter ("setStorage: ...
        out of bounds for storage of size 0"). Not for the model's root module, whose forward
        spans the whole pass (a tied output layer there would stay pinned all along); a container
        unit learns it but acquires it only where the handler is off (``Unit.forward_pages``)."""
        if page.category is not Category.PARAM:
            return
        self._unit_scopes.unwind()
        stack = self._unit_scopes.stack()
        if not stack:
            return
        unit = stack[-1][1][0]
        if not unit.name or any(pg is page for pg in unit.pages) or any(pg is page for pg in unit.learned):
            return
        unit.learned = [*unit.learned, page]  # a new list: forwards under way release what they acquired
        log.debug("paging: %s is used inside %s's forward: loaded with it from now on", page.label, unit.name)

    def graph_saves(self, hit: list[Page], args, kwargs) -> SavedPins | None:
        """Fault handler, around an op on ``hit`` pages: the saved-tensor hooks that keep the pages
        autograd may save from it resident while its graph lives, or None when the op builds no
        graph (grad mode off, no argument requiring grad). Pages of a unit whose forward is under
        way do not count: the unit's backward hook brings them back (an op on another module's
        parameter, or outside every module — a regularizer, a block called directly — counts).
        Where torch disabled saved-tensor hooks, the pages are pinned to the end of the next
        backward instead (and None is returned)."""
        if not torch.is_grad_enabled():
            return None
        in_unit = self._in_unit
        pages = [pg for pg in hit if id(pg) not in in_unit] if in_unit else hit
        if not pages or not _builds_graph(args, kwargs):
            return None
        if SavedPins.available():
            return SavedPins(self.pager, pages)
        with self._lock:
            fresh = list({id(pg): pg for pg in pages if id(pg) not in self._saved_pinned}.values())
            if fresh:
                self.pager.acquire(fresh)  # resident (the op holds them): pins only
                for pg in fresh:
                    self._saved_pinned[id(pg)] = pg
        return None

    def storage_replaced(self, page: Page) -> None:
        """Fault handler: ``page``'s tensor got new storage (``p.data = x``; see ``Pager.restorage``)."""
        self.pager.restorage(page)

    def data_alias(self, pages: list[Page]) -> None:
        """Fault handler: ``.data`` was read from ``pages`` (an alias no version counter follows)."""
        self.backward_step.data_alias(pages)

    def watched_access(self, kinds: set, writes: bool) -> None:
        """Fault handler: an op on a watched tensor (see ``paging/fault.py``)."""
        if writes and "early" in kinds:
            self.optimizers.early_written()  # a parameter written after its pre-step copy began
        self.backward_step.watched_access(kinds, writes)

    def zero_lower(self, page: Page) -> bool:
        """Fault handler: zero a paged-out tensor without reading it (see ``Pager.zero_lower``)."""
        return self.pager.zero_lower(page)

    def exit(self, held: list[tuple[Page, bool]], output, pages: list[Page] | None = None) -> None:
        """Fault handler, after the op: keep pages the output aliases — any page the op saw
        (``pages``), also one someone else had pinned, whose pin may go before the alias does —
        and release the rest."""
        if not held and not pages:
            return
        from torch.utils._pytree import tree_leaves

        with torch._C.DisableTorchFunction():
            by_ptr = {}
            for page in (pages if pages is not None else [pg for pg, _ in held]):  # held ones are among pages
                st = page.storage()
                if st is not None and st.nbytes():
                    by_ptr[st.data_ptr()] = page
            for t in tree_leaves(output):
                if isinstance(t, (torch.TypedStorage, torch.UntypedStorage)):  # pickling hands out the storage
                    st = t._untyped_storage if isinstance(t, torch.TypedStorage) else t
                    page = by_ptr.get(st.data_ptr()) if st.device.type == self.pager.device.type else None
                    if page is not None:
                        self._pin_alias(t, page, st.data_ptr())
                    continue
                if isinstance(t, torch.Tensor) and t.device.type == self.pager.device.type:
                    ptr = storage_ptr(t)
                    page = by_ptr.get(ptr)
                    # an in-place op returns the paged tensor itself (``p.grad.zero_()``): that is
                    # the page's own tensor, freed and refilled by paging, not an alias to protect
                    if page is not None and t is not page.bound():
                        self._pin_alias(t, page, ptr)
                        if page.category is Category.GRAD:
                            self.backward_step.grad_alias(page, t)  # writes through it are seen
            self.pager.release([page for page, _ in held])

    def _pin_alias(self, alias, page: Page, ptr: int) -> None:
        """Keep ``page`` pinned while ``alias`` (a tensor or storage sharing its memory) lives, and
        map the storage to the page for the fault handler (``PageFaultMode.aliases``)."""
        self.pager.acquire([page])
        self._track_alias(alias, page, ptr)

    def _track_alias(self, alias, page: Page, ptr: int) -> None:
        """``alias`` holds a pin of ``page`` (taken by the caller): map its storage to the page and
        let the pin go when the alias dies."""
        with self._alias_lock:
            entry = self.mode.aliases.get(ptr)
            if entry is not None and entry[0] is page:
                entry[1] += 1
            else:
                self.mode.aliases[ptr] = [page, 1]
        weakref.finalize(alias, self._release_alias, page, ptr)

    def _release_alias(self, page: Page, ptr: int) -> None:
        # a finalizer: it runs on whatever thread drops the alias last (an I/O thread's garbage
        # collection, autograd's device thread), possibly while the training thread holds the
        # pager lock waiting for that thread, so it only queues the release (the alias map's own
        # lock guards nothing else and is never held while waiting)
        with self._alias_lock:
            entry = self.mode.aliases.get(ptr)
            if entry is not None and entry[0] is page:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self.mode.aliases[ptr]
        if not self.pager._closed:
            self.pager.defer_release(page)

    def fault_handler_on(self) -> bool:
        """Whether the page-fault handler sees this thread's ops now: on its torch-function mode
        stack (not on a thread without it, not inside an op it passes through, such as the
        backward a checkpoint recomputes in), active, and torch functions not disabled."""
        if not (self.mode.active and torch._C._is_torch_function_enabled()):
            return False
        stack = torch.overrides._get_current_function_mode_stack()
        return self.mode in stack or (THREAD_FAULTS in stack and backward_hooks.open_handler() is self.mode)

    def suspend_fault_handler(self):
        """Take the page-fault handler (or its stand-in on a thread started while paging:
        :class:`~apt_model.memory.paging.backward_hooks.ThreadFaults`) off this thread's
        torch-function mode stack, if it is on top (a mode pushed above it stays untouched, and so
        does the handler). Returns the mode taken off, or None; :meth:`restore_fault_handler` puts
        it back."""
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or (stack[-1] is not self.mode and stack[-1] is not THREAD_FAULTS):
            return None
        return torch._C._pop_torch_function_stack()

    def restore_fault_handler(self, mode) -> None:
        """Put the handler (or its thread stand-in) :meth:`suspend_fault_handler` returned back
        on the stack."""
        torch._C._push_on_torch_function_stack(mode)

    # ------------------------------------------------------------------ state_dict
    def _pause_faults(self) -> None:
        self.mode.active = False

    def _before_state_dict(self) -> None:
        self.backward_step.settle("the model's state_dict() was taken between backward and optimizer.step()")
        self._pause_faults()

    def in_backward(self, fn, *args) -> None:
        """Run the paging hook ``fn(*args)`` from autograd; if it raises, a step taken inside this
        backward is rolled back before the error propagates (autograd abandons the backward)."""
        try:
            fn(*args)
        except BaseException as err:
            self.backward_step.backward_failed(err)
            raise

    def resume_faults(self) -> None:
        self.mode.active = True

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        """``model.state_dict()``'s entries for paged parameters (taken with the handler paused:
        aliases of storages that may be freed). Where the compute level is host memory (a CPU
        run) each becomes what plain PyTorch gives, an alias of the parameter — its page loaded,
        pinned while the alias lives and written back after, so writes through it reach the model
        (an EMA kept with ``ema_v.copy_(...)`` over ``ema.state_dict().values()``, as timm's
        ``ModelEmaV2`` does, was lost with the copies given until 2026-11-27) — at the cost of
        the whole model resident while the state dict lives, as the copies were (level 0's
        ``peak_resident`` counts it). With a host level (an accelerator) each is a host copy of
        the page (the model may not fit the device at once).
        ``keep_vars=True`` entries are the parameters themselves, paged through the handler."""
        aliases = self.host_is_level0
        given: dict[str, torch.Tensor] = {}  # page key -> its entry: tied weights stay one tensor
        try:
            with torch._C.DisableTorchFunction():
                for name, p in module.named_parameters(remove_duplicate=False):
                    page = self.param_pages.get(id(p))
                    key = prefix + name
                    if page is None or key not in state_dict or state_dict[key] is p:
                        continue
                    if page.key not in given:
                        given[page.key] = self._alias(page, p) if aliases else self.pager.materialize(page)
                    state_dict[key] = given[page.key]
        finally:
            self.resume_faults()
        return None

    def _alias(self, page: Page, p: torch.Tensor) -> torch.Tensor:
        """``p.detach()``, its page loaded and pinned (for write: what is written through it is
        written back) until the alias is garbage-collected."""
        try:
            self.pager.acquire([page], for_write=True)
        except SwapError as err:  # no room: evicting others would write to a full or failing disk
            log.warning("state_dict(): %s is a copy, not an alias of the parameter (writes through it do not reach "
                        "the model): loading it needs room on level 0, and %s", page.label, err)
            return self.pager.materialize(page)
        alias = p.detach()
        self._track_alias(alias, page, storage_ptr(alias))
        return alias

    # ------------------------------------------------------------------ teardown and report
    def close(self) -> None:
        """Bring every page back into memory, stop faulting, delete the swap folder.

        Every page whose bytes can be read comes back, whatever failed before (a full or
        read-only swap disk, a corrupt file, a frozen parameter's stale gradient page...).

        Raises:
            PagingRecoveryError: some tensors' bytes could not be read back; they are named (with
                their files), hold NaN instead of 0-byte storage, and the swap folder is kept.
        """
        self.mode.active = False
        try:
            stack = torch.overrides._get_current_function_mode_stack()
            if stack and stack[-1] is self.mode:
                self.mode.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - never let teardown fail the user's program
            log.debug("could not pop the page-fault mode", exc_info=True)
        self.mode.detach()  # still on threads started while paging was on: it holds nothing of this session
        try:
            self.release_backward_pins()
            self.release_saved_pins()
        except Exception:  # noqa: BLE001 - pins only matter to a pager that is closing anyway
            log.debug("could not release the backward pins", exc_info=True)
        self._bw_pinned.clear()
        self._saved_pinned.clear()
        for f in self._finalizers:
            f.detach()  # a model dropped after disable() has nothing left here to free
        self._finalizers.clear()
        try:
            self.optimizers.drop_early()
            self.backward_step.close()
        finally:
            self.pager.close()
        self._let_go()

    def _let_go(self) -> None:
        """After a clean close: keep the report, drop the models. The switch's report reads a
        closed session until the next ``enable()``; it held every parameter and gradient of the
        models paged in it (through ``models``), so a model the script dropped after ``disable()``
        was not freed."""
        self._closed_report = self.report()
        self.models = []
        self._released = []
        self.param_pages.clear()
        self.grad_pages.clear()
        self.labels.clear()

    def report(self) -> dict:
        if self._closed_report is not None:
            out = copy.deepcopy(self._closed_report)  # the caller's to change, as a live report is
            # the swap folder is the VGPU stack's, deleted after this session closed: read its
            # counters now (0 once it is gone), not as they were at the close
            out["swap"].update(bytes_on_disk=self.swap.bytes_on_disk, stale_bytes=self.swap.stale_bytes)
            return out
        self.retire_dead()
        store = self.pager.store
        return {
            "pager": self.pager.report(),
            "host_level": store.stats() if store.level_kind == "host" else None,
            "swap": {"folder": str(self.swap.folder), "bytes_on_disk": self.swap.bytes_on_disk,
                     "stale_bytes": self.swap.stale_bytes,
                     "written": self.pager.io.write_stats.to_dict(), "read": self.pager.io.read_stats.to_dict()},
            "models": [m.describe() for m in self.models],
            "models_released": self.released_models,
            "kept_resident": self.kept,
            "shared_gradients": sorted(self.shared_grads),
            "optimizer_steps": self.optimizers.steps,
            "host_rss": self.host_rss_report(),
            "host_step": self.host_step.report() if self.host_step is not None else None,
            "step_in_backward": self.backward_step.report(),
        }

    def host_rss_report(self) -> dict:
        """What the process's RSS above its value at the first page-out is made of, in bytes:
        ``budget`` (the host bytes paging may hold: the level budget on a CPU-only run, plus the
        host level's), ``rss_at_start``, ``peak_rss_growth`` (sampled: see ``note``),
        ``pages_resident_peak`` (the pager's peak on a CPU-only run, plus the host level's slabs),
        ``staging_buffers`` (the swap I/O threads' O_DIRECT buffers), ``other`` (the growth minus
        those two) and ``samples``."""
        store, w = self.pager.store, self.host_rss
        on_host = self.pager.device.type == "cpu"
        budget = self.level_budget if on_host else 0
        pages = self.pager.stats.peak_resident if on_host else 0
        pool = getattr(store, "pool", None) if store.level_kind == "host" else None
        if pool is not None:
            budget += int(pool.budget)
            pages += sum(int(s.numel() * s.element_size()) for s in pool.slabs)  # allocated once, kept
        staging = int(getattr(self.swap, "staging_bytes", 0))
        growth = w.growth
        return {"budget": budget, "rss_at_start": w.start, "peak_rss_growth": growth, "pages_resident_peak": pages,
                "staging_buffers": staging, "other": growth - pages - staging, "samples": w.samples,
                "note": "RSS sampled at each backward's start, each optimizer step's end and before each "
                        "malloc_trim (no thread: a lower bound of the peak); 'other' is activations, autograd's "
                        "saved tensors, optimizer temporaries, freed memory the allocator still holds, code and "
                        "Python objects loaded since the start; the page cache of the swap files is not RSS"}

    def residency(self, levels) -> dict[str, int]:
        """Bytes of paged training state per level now (cheap counters only).

        Args:
            levels: the stack's levels (``VGPUStack.levels``: ``index``, ``kind``).

        Returns:
            ``{"level0:<kind>": bytes, "level1:host": bytes, "level2:nvme": bytes}`` for the
            levels given (0 for a host level this session does not use).
        """
        out = {}
        store = self.pager.store
        for level in levels:
            label = f"level{level.index}:{level.kind}"
            if level.index == 0:
                out[label] = int(self.pager.resident_bytes)
            elif level.kind == "host":
                pool = getattr(store, "pool", None) if store.level_kind == "host" else None
                out[label] = int(pool.used) if pool is not None else 0
            elif level.kind == "nvme":
                out[label] = int(self.swap.bytes_on_disk)
        return out

    def level_stats(self, level) -> dict:
        """This session's figures for one level of the stack (read-only): for level 0 the pager's
        resident bytes, peak, traffic (bytes), hits/misses/faults and stall seconds; for a host
        level below the device its resident bytes, traffic, hits/misses, spills, side streams of its
        copies (``copy_streams``: 2, one per direction; 0 on the CPU) and host waits for one copy's
        event (``copy_waits``); for the NVMe
        level the bytes on disk, bytes written/read, GB/s and operation counts. Level 0's stall is also
        split by phase (``stall_s_by_phase``: forward, backward, optimizer, other). On a CPU level 0 also
        ``free_page_buffers`` (evicted pages' memory kept for reuse: held bytes, hits, misses; see
        :mod:`~apt_model.memory.page_buffers`) and ``peak_with_free_buffers``. ``{}`` for a level the
        session does not use.
        """
        if level.index == 0:
            pr = self.pager.report()
            out = {k: pr[k] for k in ("resident_bytes", "peak_resident", "bytes_in", "bytes_out", "hits", "misses",
                                      "faults", "stall_s", "stall_s_by_phase", "over_budget_bytes")}
            if pr["free_page_buffers"] is not None:
                out["free_page_buffers"] = pr["free_page_buffers"]
                out["peak_with_free_buffers"] = pr["peak_with_free_buffers"]
            return out
        if level.kind == "host":
            hs = self.pager.store.stats() if self.pager.store.level_kind == "host" else {}
            return {k: hs.get(k) for k in ("resident_bytes", "bytes_in", "bytes_in_by_kind", "bytes_out", "hits", "misses",
                                           "spills_to_disk", "copy_streams", "copy_waits")}
        if level.kind == "nvme":
            io = self.pager.io
            return {"resident_bytes": self.swap.bytes_on_disk, "stale_bytes": self.swap.stale_bytes,
                    "bytes_in": io.write_stats.bytes,
                    "bytes_out": io.read_stats.bytes, "write_gbps": io.write_stats.gbps, "read_gbps": io.read_stats.gbps,
                    "writes": io.write_stats.ops, "reads": io.read_stats.ops}
        return {}

    def _counters(self) -> tuple[int, int, float]:
        """(bytes moved up into level 0, bytes written to the level below, seconds stalled) so far."""
        store = self.pager.store
        down = store.stats().get("bytes_in", 0) if store.level_kind == "host" else self.pager.io.write_stats.bytes
        st = self.pager.stats
        return int(st.bytes_in), int(down or 0), float(st.stall_s)

    def _mark_traffic(self, step: int) -> None:
        marks = self._traffic_marks
        now = (step, *self._counters(), dict(self.pager.stats.stall_by_phase))
        if step == 1 or 1 not in marks:
            marks[1] = now
        marks[0] = now  # the latest

    def traffic(self) -> dict | None:
        """What paging moved per optimizer step, measured: the steps after the first (which also
        pages everything out once), averaged. ``read_bytes_per_step`` (moved up into level 0),
        ``write_bytes_per_step`` (written to the level below), ``stall_s_per_step`` (the training
        thread waiting for pages) and ``stall_s_per_step_by_phase`` (forward, backward, optimizer,
        other), over ``steps`` steps; None before two steps."""
        first, last = self._traffic_marks.get(1), self._traffic_marks.get(0)
        if first is None or last is None or last[0] <= first[0]:
            return None
        n = last[0] - first[0]
        return {"steps": n, "read_bytes_per_step": (last[1] - first[1]) // n,
                "write_bytes_per_step": (last[2] - first[2]) // n,
                "stall_s_per_step": round((last[3] - first[3]) / n, 4),
                "stall_s_per_step_by_phase": {k: round((v - first[4].get(k, 0.0)) / n, 4) for k, v in last[4].items()}}
