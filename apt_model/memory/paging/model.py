"""Paging one model's parameters and gradients through its own forward and backward.

Units are the modules that directly own paged parameters. A unit also takes on the pages its
forward uses outside the modules that own them (``nn.MultiheadAttention`` passes
``out_proj.weight`` to a function and never calls ``out_proj``), learned by the fault handler at
the first such use (``PagingSession._learn_owner``; not for the model's root module). A
recomputation inside backward (activation checkpointing) runs without the fault handler, so it
relies on these hooks. A container unit (another unit's forward runs inside its own) acquires
such pages only where the handler is off (``Unit.forward_pages``): pinned with it, they would stay
through its children's forwards. For each unit:

* forward pre-hook: its parameters are acquired (loaded if needed, pinned), and the next units
  in execution order — recorded during the first forward — are prefetched;
* forward hook: the parameters are released (evictable again); if autograd will come back
  through this unit, a hook on its outputs' gradients (``register_multi_grad_hook``, "any";
  the bases of outputs that are views too: an in-place op on a view silences the view's hook)
  marks the start of its backward: the parameters are acquired again and the units before it
  are prefetched (backward runs the recorded order in reverse);
* a parameter's post-accumulate-grad hook releases it once its gradient is complete; anything
  still pinned for backward is released by a callback queued on autograd's engine, which runs
  when the backward pass ends.

Gradients ("moved down as they are produced"): a tensor hook that runs before
``AccumulateGrad`` (or, in ``torch.autograd.grad``, lets the parameter go: no accumulation and no
post-accumulate hook follow) brings a paged-out gradient back so accumulation over several backward passes
happens in place, exactly as without paging; the post-accumulate-grad hook then (re)binds the
page to ``param.grad`` and writes it behind. A gradient the user set to None is dropped.

Op-level faults stay on in a forward. The session's page-fault handler
(:mod:`~apt_model.memory.paging.fault`) runs Python on every tensor op while it is on the stack,
and inside a forward whose paged tensors are all reached through the modules that own them the
hooks above already hold every page it touches. Taking the handler off for such forwards, once
learned, was built and reviewed and found unsafe: learning sees only the branches its forwards
took (a later branch that reads another module's evicted weight reads freed storage: garbage or a
crash), a ``KeyboardInterrupt`` skips the root hook that would put it back, and the mode stack is
per thread while forwards may overlap on two threads. So the handler stays on in forwards; each
model still records, per kind of forward (training or eval, grad on or off), whether its forwards
have touched a paged tensor its module hooks had not pinned (``op_level_faults`` in its report:
where the handler is needed). The streamed optimizer step runs without it (see
:mod:`~apt_model.memory.paging.optimizer`): there every page is acquired by the step itself, on
one thread, and a ``try``/``finally`` puts it back.

Parameters may be frozen and unfrozen at any time (``requires_grad_``), tied ones included: a
unit's parameters are brought back for its backward whenever its outputs need gradients — a
frozen layer between trainable ones still takes part in backward (its weight computes the input's
gradient) — and the gradient hooks of a parameter that becomes trainable after adoption are
registered at the next forward.
"""
from __future__ import annotations

import sys
import weakref

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.weak import WeakIdKeyDictionary

from apt_model.base import functional_call
from apt_model.base.log import get_logger
from apt_model.base.outputs import gradient_watch, output_tensors
from apt_model.memory.pages import Category, Page, State, other_holders, tensor_nbytes
from apt_model.base.patches import SessionHook

log = get_logger(__name__)


class Unit:
    """A module that owns paged parameters directly.

    ``pages`` are its own parameters'; ``learned`` the pages its forward used outside the modules
    that own them (``PagingSession._learn_owner``). ``inner`` turns true once another unit's
    forward ran inside its forward (a container: ``transformer`` owning a position embedding).
    """

    def __init__(self, name: str, module: nn.Module, pages: list[Page]):
        self.rename(name)
        self.module = module
        self.pages = pages
        self.learned: list[Page] = []
        #: parameter name -> id() of the paged parameter registered under it at adoption
        self.slots: dict[str, int] = {}
        self.inner = False
        self.position: int | None = None  # in the recorded execution order

    def rename(self, name: str) -> None:
        """Its qualified name in the model, and that name's parts (the path checked each forward)."""
        self.name = name
        self.path = tuple(name.split(".")) if name else ()

    def forward_pages(self, handler_on: bool) -> list[Page]:
        """The pages its forward acquires: its own, and the learned ones unless it is a container
        running where the fault handler is on. A container's forward spans its children's, so a
        learned page (a tied output weight applied after the blocks) pinned with it would stay
        resident through all of them, past the plan; the handler loads it where it is used. A
        recomputation inside backward, or a forward on a thread without the handler, has only
        these hooks: there the learned pages come too."""
        if not self.learned or (self.inner and handler_on):
            return self.pages
        return self.pages + self.learned


class PagedModel:
    """Hooks that page one model's parameters (and gradients) through forward and backward.

    Args:
        session: the :class:`~apt_model.memory.paging.session.PagingSession`.
        model: the adopted model.
        page_params: page the parameters (else they stay resident; only gradients are paged).
        page_grads: page the gradients.
        prefetch_units: how many units ahead to prefetch.
    """

    def __init__(self, session, model: nn.Module, page_params: bool, page_grads: bool, prefetch_units: int = 2):
        self.session = session
        self._model = weakref.ref(model)  # the session must not keep a model the script dropped
        self.page_params = page_params
        self.page_grads = page_grads
        self.prefetch_units = prefetch_units
        self.units: list[Unit] = []
        self.order: list[Unit] = []
        self._recording = True
        self._seen_this_pass: set[int] = set()
        self.params: list[nn.Parameter] = []
        self.names: dict[int, str] = {}
        self.clean_forwards: dict[tuple[bool, bool], int] = {}  # kind -> forwards without an uncovered access; -1: seen one
        self._kind: tuple[bool, bool] | None = None  # the outermost forward's kind while it runs
        self._uncovered_mark = 0
        self.kept: dict = {}  # what its plan keeps resident on level 0 (the session's entry)
        # label -> (other tensors on its storage, the storage's address, its bytes): not paged
        self.shared: dict[str, tuple[int, int, int]] = {}

    @property
    def model(self) -> nn.Module | None:
        """The adopted model, or None once the script dropped it (see ``PagingSession.retire_dead``)."""
        return self._model()

    def release(self) -> None:
        """Let go of the units and parameters: the script dropped the model. The lists are
        replaced, not cleared (this runs in a finalizer, possibly inside an iteration over them).
        Hooks left on modules the script still holds keep working (each holds its own unit)."""
        self.units, self.order, self.params = [], [], []

    # ------------------------------------------------------------------ setup
    def install(self, patches) -> None:
        self._patches = patches
        # by identity, weakly (a new parameter may get a dead one's id): gradient hooks registered;
        # added after adoption and left resident
        self._hooked, self._declined = WeakIdKeyDictionary(), WeakIdKeyDictionary()
        self._registrations = self.session.registrations
        adopted = self._adopt_modules(self.model.named_modules(), _recomputed_aliases(self.model), seen={})
        patches.add_handle(self.model.register_forward_pre_hook(SessionHook(lambda m, a: self._root_pre())),
                           "paging root pre-hook")
        patches.add_handle(self.model.register_forward_hook(SessionHook(lambda m, a, o: self._root_post()), always_call=True),
                           "paging root hook")
        self._hook_trainable()
        # evict everything now: the model's state leaves memory at adoption
        self._evict(adopted)

    def _evict(self, params: list[nn.Parameter]) -> None:
        pager = self.session.pager
        pager.evict_now(self.session.param_pages[id(p)] for p in params if id(p) in self.session.param_pages)
        pager.flush()

    def _adopt_modules(self, named_modules, known: dict[int, int], seen: dict[int, Page | None],
                       late: bool = False) -> list[nn.Parameter]:
        """Page the parameters of ``named_modules`` not paged yet; returns them.

        A module that owns a paged parameter becomes a :class:`Unit` (or, already one, gets the
        new pages). ``seen`` maps the ids of this model's parameters handled so far to their page
        (None: resident), so a tied parameter is paged once and acquired by every module that owns
        it; a parameter another paged model adopted first is left to that model's hooks (a
        wrapper around it, a LoRA-injected layer's base weight). ``known``: storage aliases that
        are safe to page under (:func:`_recomputed_aliases`). ``late``: after adoption (only
        ``nn.Parameter`` objects count as added then)."""
        adopted = []
        units = {id(u.module): u for u in self.units}
        for mname, module in named_modules:
            unit = units.get(id(module))
            slots = unit.slots if unit is not None else {}
            pages, new_slots = [], {}
            for pname, p in module.named_parameters(recurse=False):
                if slots.get(pname) == id(p) or late and not isinstance(p, nn.Parameter):
                    continue  # a tensor swapped in for one call (functional_call) was not added
                if id(p) not in seen:
                    if id(p) in self.session.params or p in self._declined:
                        continue
                    label = f"{mname}.{pname}" if mname else pname
                    if late:
                        why = self._cannot_page(module, p)
                        if not why:
                            try:
                                seen[id(p)] = self._adopt_param(p, label, known)
                            except Exception as err:  # noqa: BLE001 - an odd tensor stays as it is, not paged
                                why = f"adopting it failed ({type(err).__name__}: {err})"
                        if why:
                            self._declined[p] = True
                            log.warning("paging: %s was added to the model after it was paged but %s: it stays "
                                        "resident, not paged", label, why)
                            continue
                    else:
                        seen[id(p)] = self._adopt_param(p, label, known)
                    adopted.append(p)
                if seen[id(p)] is not None:
                    pages.append(seen[id(p)])
                    new_slots[pname] = id(p)
            if not pages:
                continue
            if unit is None:
                unit = Unit(mname, module, pages)
                unit.slots = new_slots
                self._hook_unit(unit)
                self.units.append(unit)
                units[id(module)] = unit
            else:
                unit.pages = unit.pages + pages
                unit.slots.update(new_slots)
        return adopted

    def _cannot_page(self, module: nn.Module, p: nn.Parameter) -> str:
        """Why a parameter added to ``module`` after adoption cannot be paged ('' if it can)."""
        if p.is_meta:
            return "it is on the meta device (no data)"
        if p.layout is not torch.strided:
            return f"its layout is {p.layout} (paging pages dense tensors)"
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            return "its module produces sparse gradients (paging pages dense tensors)"
        device = self.session.pager.device
        if p.device.type != device.type or (device.index is not None and p.device.index != device.index):
            return f"it is on {p.device}, not on the paged device {device}"
        return ""

    def _adopt_param(self, p: nn.Parameter, label: str, known: dict[int, int]) -> Page | None:
        """Register ``p`` with the model (and the session) and, where the plan pages parameters
        and nothing else holds its storage, give it a page; returns the page (None: resident)."""
        page = None
        # an empty parameter (a layer stored in FP4 holds its released weight so) has nothing to
        # page, and a page of it made the state dict's entry its empty alias (a probe's finding)
        if self.page_params and p.numel() > 0:
            if not p.untyped_storage().resizable():  # e.g. memory-mapped weights: own a copy
                with torch.no_grad():
                    p.data = p.data.clone()
            holders = other_holders(p) - known.get(id(p), 0)
            if holders:  # freed in place, its storage would be freed under them: stays resident
                self.shared[label] = (holders, p.untyped_storage().data_ptr(), tensor_nbytes(p))
            else:
                page = self.session.pager.register(Category.PARAM, weakref.ref(p), label)  # weakly: see PagingSession
                self.session.param_pages[id(p)] = page
        self.params.append(p)
        self.names[id(p)] = label
        self.session.add_param(p, label)
        return page

    def _hook_unit(self, unit: Unit) -> None:
        """The forward hooks that acquire and release ``unit``'s pages, and the ``load_state_dict``
        hooks that load into them."""
        patches, module, name = self._patches, unit.module, unit.name
        # first among the module's pre-hooks: one the script made before adoption (torch.nn.utils.prune
        # computes ``weight`` from ``weight_orig``) reads the unit's pages, also when a non-reentrant
        # checkpoint recomputes the forward inside backward, where no fault handler runs: appended,
        # it read freed storage there (a segfault, or silently wrong training: a probe's finding)
        patches.add_handle(module.register_forward_pre_hook(SessionHook(lambda m, a, u=unit: self._pre(u)), prepend=True),
                           f"paging pre-hook {name}")
        patches.add_handle(module.register_forward_hook(SessionHook(lambda m, a, o, u=unit: self._post(u, o)),
                                                        always_call=True), f"paging hook {name}")
        pager = self.session.pager
        patches.add_handle(module.register_load_state_dict_pre_hook(
            SessionHook(lambda *a, u=unit: pager.acquire(u.pages, for_write=True))), f"paging load pre-hook {name}")
        patches.add_handle(module.register_load_state_dict_post_hook(
            SessionHook(lambda m, keys, u=unit: pager.release(u.pages, evict=True))), f"paging load post-hook {name}")

    def _adopt_new(self, model: nn.Module) -> None:
        """Page the parameters the script added to the model since it was paged (a new head, a
        block appended, a parameter reassigned, a parametrization's originals), as adoption would
        have; the execution order is learned again at the next forward."""
        present = {id(p) for p in model.parameters()}
        left = [p for p in self.params if id(p) not in present]  # resident by the plan (paged ones: _unregister)
        if left:
            self.params = [p for p in self.params if id(p) in present]
            for p in left:
                self.shared.pop(self.names.get(id(p)), None)
        before = len(self.shared)
        seen = {id(p): self.session.param_pages.get(id(p)) for p in self.params}
        adopted = self._adopt_modules(model.named_modules(), _recomputed_aliases(model), seen, late=True)
        if not adopted and not left:
            return
        if adopted:
            log.info("paging: %d parameter(s) added to %s after it was paged are %s now (%s)", len(adopted),
                     type(model).__name__, "paged" if self.page_params else "adopted (kept resident by its plan)",
                     ", ".join(self.names[id(p)] for p in adopted))
        self.session.model_grew(self, model, new_shared=list(self.shared)[before:])
        if not adopted:
            return
        self._hook_trainable()
        self._evict(adopted)
        self.order, self._recording = [], True  # learned again: the new units have no place in it yet
        for u in self.units:
            u.position = None

    def _hook_trainable(self) -> None:
        """Register the gradient hooks of every trainable parameter that has none yet (hooks can
        only be registered on a tensor that requires grad: a parameter unfrozen after adoption
        gets them at the next forward)."""
        for p in self.params:
            if not p.requires_grad or p in self._hooked:
                continue
            self._hooked[p] = True
            # the parameter held weakly by its own hook: a cycle through it took two collections to free
            self._patches.add_handle(p.register_hook(SessionHook(lambda g, r=weakref.ref(p): self._before_accumulate(r()))),
                                     f"grad pre-hook {self.names[id(p)]}")
            self._patches.add_handle(p.register_post_accumulate_grad_hook(SessionHook(self._after_accumulate)),
                                     f"post-accumulate hook {self.names[id(p)]}")

    # ------------------------------------------------------------------ forward
    def _root_pre(self) -> None:
        if not self.session.forward_depth:
            self._check_slots()
        if torch.is_grad_enabled():
            self._hook_trainable()
        self._seen_this_pass = set()
        self.session.resume_faults()  # in case a state_dict() call raised half-way
        self.session.root_forward_starts()  # roots an interrupt ended no longer count in forward_depth
        if not self.session.forward_depth:
            self.session.forward_starts()  # pins of a backward that never ended are let go
            if torch._C._current_graph_task_id() == -1:
                self.session.pager.phase = "forward"
            kind = (self.model.training, torch.is_grad_enabled())
            if self.clean_forwards.get(kind, 0) >= 0:
                self._kind, self._uncovered_mark = kind, self.session.uncovered_accesses
        self.session.forward_depth += 1

    def first_call(self) -> None:
        """The call that adopted the model, already under way: run what the root pre-hook (added
        during that call, which PyTorch does not run for it) does, so its forward counts in
        ``forward_depth`` and the pages its units use outside their own are learned there. Until
        2026-11-28 they were not: ``nn.MultiheadAttention``'s use of ``out_proj.weight`` was first
        seen nowhere, and the first recomputation of an activation checkpoint (which runs without
        the fault handler) read it evicted, "setStorage: ... out of bounds for storage of size 0"
        (a probe's finding). The root's forward hook does run for that call (torch reads forward
        hooks after the forward)."""
        self._root_pre()

    def _root_post(self) -> None:
        self.session.root_forward_ends()
        self.session.forward_depth = max(0, self.session.forward_depth - 1)
        if not self.session.forward_depth:
            if self.session.pager.phase == "forward":
                self.session.pager.phase = "other"
            raised = sys.exc_info()[0] is not None  # the hook runs inside torch's except block
            if self._kind is not None:
                n = self.clean_forwards.get(self._kind, 0)
                if self.session.uncovered_accesses != self._uncovered_mark:
                    self.clean_forwards[self._kind] = -1
                elif not raised and n >= 0:
                    self.clean_forwards[self._kind] = n + 1
                self._kind = None
        if self._recording and self.order:
            self._recording = False
            for i, u in enumerate(self.order):
                u.position = i

    def _check_slots(self) -> None:
        """Follow the surgery the script did on the model since the last forward.

        Paged parameters taken out of the model — out of their module (``fc.weight =
        nn.Parameter(...)``, ``del fc.weight``, a parametrization such as ``weight_norm``, whose new
        parameters may share the old one's storage), or with a module that left the model
        (``model.head = nn.Linear(...)``, ``del model.blocks[1]``, a pruned layer rebuilt around a
        slice of the old weight) — are brought back into memory and no longer paged (see
        :meth:`_unregister`); a module that left lets go of its unit. Parameters added to the model
        are paged (:meth:`_adopt_new`). Cost per forward: a dict lookup per paged parameter and per
        level of each unit's path; the model is walked only when a path changed, a paged
        parameter left, or a module or parameter was registered anywhere since the last walk
        (torch's global registration hooks count them: ``PagingSession.registrations``). Skipped
        while ``torch.func.functional_call`` has swapped tensors into the slots
        (:mod:`apt_model.base.functional_call`)."""
        model = self.model
        if model is None or functional_call.swapped():  # functional_call's swap, undone after the call
            return
        moved = any(not self._on_path(model, u) for u in self.units)
        if moved:
            self._drop_detached(model)
        gone = [(unit, pname, pid) for unit in self.units for pname, pid in unit.slots.items()
                if id(unit.module._parameters.get(pname)) != pid]
        for unit, pname, pid in gone:
            self._unregister(unit, pname, pid)
        registrations = self.session.registrations
        if moved or gone or registrations != self._registrations:
            self._adopt_new(model)
            self._registrations = registrations  # after: a walk that raised is done again next time

    @staticmethod
    def _on_path(model: nn.Module, unit: Unit) -> bool:
        """Whether ``unit.module`` is still at ``unit.name`` in ``model``."""
        m = model
        for part in unit.path:
            m = m._modules.get(part)
            if m is None:
                return False
        return m is unit.module

    def _drop_detached(self, model: nn.Module) -> None:
        """Some unit is no longer where it was: units whose module moved within the model get their
        new name; those whose module left it are dropped, their parameters unpaged."""
        where = {id(m): name for name, m in model.named_modules()}
        left = []
        for unit in self.units:
            name = where.get(id(unit.module))
            if name is None:
                left.append(unit)
            else:
                unit.rename(name)
        for unit in left:
            for pname, pid in list(unit.slots.items()):
                self._unregister(unit, pname, pid, module_left=True)
        if left:
            self.units = [u for u in self.units if u not in left]
            self.order = [u for u in self.order if u not in left]
            for i, u in enumerate(self.order):
                u.position = i

    def _unregister(self, unit: Unit, pname: str, pid: int, module_left: bool = False) -> None:
        """The parameter ``pid`` is no longer ``unit.module``'s ``pname``. Paging it on would free
        its storage at its next eviction, under whatever shares it now (a new ``nn.Parameter`` made
        over it: a crash), and keep it alive for the model's life; so, unless another module still
        holds it (a tied weight), its bytes come back into memory and its page goes. The parameter
        that took its place is paged by :meth:`_adopt_new`, in the same check."""
        del unit.slots[pname]
        label = f"{unit.name}.{pname}" if unit.name else pname
        if any(pid in u.slots.values() for u in self.units):
            return  # still another module's (a tied weight untied here): paged on through that one
        page = self.session.param_pages.get(pid)
        if page is not None:
            pager = self.session.pager
            pager.acquire([page])  # its bytes back (and with them those of a tensor sharing its storage)
            pager.discard(page)  # no longer managed: its tensor keeps the memory
            self.session.param_pages.pop(pid, None)
            for u in self.units:
                u.pages = [pg for pg in u.pages if pg is not page]
                u.learned = [pg for pg in u.learned if pg is not page]
        self.params = [p for p in self.params if id(p) != pid]
        self.session.forget_param(pid)  # moved elsewhere in the model (a parametrization's original): adopted again
        if module_left:
            log.info("paging: module %s left the model after it was paged: its parameter %s is no longer paged "
                     "(its bytes are back in memory)", unit.name or "(root)", pname)
            return
        log.info("paging: %s was replaced or removed after the model was paged: the old parameter is no longer "
                 "paged (its bytes are back in memory)", label)

    def _pre(self, unit: Unit) -> None:
        if self._recording and id(unit) not in self._seen_this_pass:
            self.order.append(unit)
        self._seen_this_pass.add(id(unit))
        # this call's: a page the unit learns meanwhile is acquired from its next call on
        pages = unit.forward_pages(unit.inner and bool(unit.learned) and self.session.fault_handler_on())
        self.session.pager.acquire(pages)
        self.session.unit_forward_starts(unit, pages)
        self._prefetch(unit, +1)

    def _post(self, unit: Unit, output) -> None:
        covered = self.session.unit_forward_ends(unit)
        self.session.pager.release(covered)
        # backward comes through this unit whenever its outputs need gradients — for its own
        # parameters' gradients, or (a frozen unit) for its input's, which needs its weights too
        if torch.is_grad_enabled():
            outs = [t for t in output_tensors(output) if t.requires_grad]
            if outs:
                # backward brings back what this forward acquired: the other pages it used were
                # saved for backward outside the unit (paging/saved.py)
                register_multi_grad_hook(gradient_watch(outs), lambda grads, u=unit, pages=covered or unit.pages:
                                         self._backward_start(u, pages), mode="any")
                if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
                    self.session.backward_step.unit_forward(id(unit))

    def _prefetch(self, unit: Unit, direction: int) -> None:
        """Start loading the units that run next (forward: later ones; backward: earlier ones), up
        to a quarter of the budget and at least ``prefetch_units`` units."""
        if unit.position is None or not self.order:
            return
        ahead, nbytes = [], 0
        limit = self.session.pager.budget // 4
        j = unit.position + direction
        k = 0
        while 0 <= j < len(self.order) and (k < self.prefetch_units or nbytes < limit):
            pages = self.order[j].forward_pages(handler_on=True)  # a hint: what a forward usually acquires
            nbytes += sum(pg.nbytes for pg in pages)
            if k >= self.prefetch_units and nbytes > limit:
                break
            ahead.extend(pages)
            j += direction
            k += 1
        if ahead:
            self.session.pager.prefetch(ahead)

    # ------------------------------------------------------------------ backward
    def _backward_start(self, unit: Unit, pages: list[Page]) -> None:
        self.session.in_backward(self._pin_for_backward, unit, pages)

    def _pin_for_backward(self, unit: Unit, pages: list[Page]) -> None:
        self.session.pin_for_backward(pages)
        self._prefetch(unit, -1)

    def _before_accumulate(self, p: nn.Parameter) -> None:
        if self.session.grad_only():
            # torch.autograd.grad: ``p``'s gradient is final and returned, not accumulated (no
            # post-accumulate hook comes): every node that used ``p`` has run, its page may go
            page = self.session.param_pages.get(id(p))
            if page is not None:
                self.session.unpin_for_backward(page)
        elif self.page_grads:
            self.session.in_backward(self.session.before_grad_accumulate, p, self.names[id(p)])
        return None

    def _after_accumulate(self, p: nn.Parameter) -> None:
        page = self.session.param_pages.get(id(p))
        if page is not None:
            self.session.unpin_for_backward(page)
        planned = getattr(self, "planned_trainable", None)
        if planned is not None and id(p) not in planned and p.grad is not None:
            self.session.trainable_grew(self, p)  # unfrozen after the plan: counted now
        self.session.in_backward(self.session.after_grad_accumulate, p, self.names[id(p)], self.page_grads)

    # ------------------------------------------------------------------ report
    def describe(self) -> dict:
        return {
            "units": len(self.units),
            "largest_unit_bytes": max((sum(pg.nbytes for pg in u.pages) for u in self.units), default=0),
            "order_recorded": not self._recording,
            "paged_parameters": sum(1 for p in self.params if id(p) in self.session.param_pages),
            "paged_gradients": self.page_grads,
            "op_level_faults": {f"{'train' if tr else 'eval'}{'' if g else ' no_grad'}":
                                ("needed: a paged tensor was used outside its module" if n < 0 else
                                 f"not needed so far ({n} forwards; the handler stays on)")
                                for (tr, g), n in sorted(self.clean_forwards.items())},
        }

    def resident_state(self) -> dict:
        states = {}
        for p in self.params:
            page = self.session.param_pages.get(id(p))
            states[self.names[id(p)]] = page.state.value if page else State.RESIDENT.value
        return states


def _recomputed_aliases(model: nn.Module) -> dict[int, int]:
    """``{id(parameter): n}``: aliases of a parameter's storage that are safe to page under,
    because nothing reads them before they are replaced. The classic
    ``torch.nn.utils.spectral_norm`` leaves ``module.weight = weight_orig.data`` (a plain
    attribute) until its forward pre-hook first sets it to the normalized weight, computed from
    ``weight_orig`` alone; counted as another holder, it kept every spectrally normalized weight
    resident (a probe's SNGAN discriminator was not paged at all)."""
    from torch.nn.utils.spectral_norm import SpectralNorm

    found: dict[int, int] = {}
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if not isinstance(hook, SpectralNorm):
                continue
            orig = module._parameters.get(hook.name + "_orig")
            alias = module.__dict__.get(hook.name)
            if (orig is not None and isinstance(alias, torch.Tensor)
                    and alias.untyped_storage().data_ptr() == orig.untyped_storage().data_ptr()):
                found[id(orig)] = found.get(id(orig), 0) + 1
    return found
