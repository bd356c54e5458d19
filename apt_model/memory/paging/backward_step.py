"""The optimizer step inside backward: each paged parameter is stepped as its gradient lands.

Without it, a paged optimizer step starts after backward: it reads every parameter, gradient and
optimizer state back from the level below while the compute sits idle (the "optimizer" part of
level 0's stall). Stepped inside backward, each parameter's update runs from its post-accumulate
gradient hook, while autograd computes the earlier layers' gradients: the step's reads and writes
overlap backward compute, its parameter and gradient are still resident (no read), and the
next parameters' states are prefetched in the order their gradients arrived on the first step.
PyTorch documents the same pattern for plain training ("optimizer step in backward" with
``Tensor.register_post_accumulate_grad_hook``); here it is chosen from the user's own loop, and
kept exact.

It is valid only for a loop that steps once per backward with the gradients as backward left
them. That is learned from the first ``optimizer.step()``, which runs as usual: one backward
since the start, no paged module building a graph twice before a backward, no backward keeping its
graph (``torch.autograd.backward`` is wrapped), no ``clip_grad_norm_``/``clip_grad_value_`` or
``GradScaler.unscale_`` call, no op that may write a gradient or an alias of one (in place by
name, ``out=``, ``.data``: :func:`~apt_model.memory.paging.fault.may_write`), no gradient
replaced, no parameter stepped on the host. The same conditions, met later, turn it off.

**Exact by construction: a speculative step with a commit.** The steps run in backward form one
step transaction (the pager keeps every touched page's pre-step copy, ``_StepUndo`` the rest,
exactly as for a failed streamed step). The user's ``optimizer.step()`` *commits* it — and does
nothing more — only when nothing the step depended on changed since: the same gradients (tensor,
version counter, deferred scales, no in-place op seen), the same hyperparameters (tensors by
value), every parameter that has a gradient stepped. Otherwise, and when anything else comes
between backward and step — another optimizer's step, a forward of a paged model (accumulation, an
evaluation), another backward, a clip call, an op on a stepped parameter or state (a page in the
transaction, or a resident tensor the fault handler watches while the step is pending), a
``state_dict()`` or ``load_state_dict()``, a failure anywhere in backward — the transaction is
rolled back (parameters and states are their pre-step selves again, the gradients were never
touched) and the ordinary streamed step runs from the same state; the step in backward is turned
off for good, with the reason in the report. A loop that changes after the first step is
therefore still trained bitwise as in memory; it only loses the overlap.

**Kept only within the budget.** While a parameter is stepped inside backward, the backward under
way still pins its module's parameters (and any page a forward faulted in outside the module
hooks, such as a tied weight the root module uses), on top of the step's own pages. Before a
parameter's first step inside backward the pager checks that the two fit together within the
budget plus the largest page (the bound the plan promises); where they do not, the step is rolled
back and stays after backward, with the reason. A plan forced past its working set
(``paging="always"`` under a too small budget) promises no bound, and is not checked.

**Kept only where it is faster** (``"auto"``, the default). Stepping inside backward moves the
step's work into backward; where the compute cores are the bottleneck (a CPU-only run on few
cores, whose paging I/O threads compete with the compute threads) that buys nothing and can cost.
So after learning, six training iterations are a trial — the step inside backward and after it,
taking turns (in, after, after, in, in, after), timed from the end of one ``optimizer.step()`` to
the end of the next (no device synchronization: the iteration's own waits pace it) — and the step
inside backward is kept only if its median iteration is at least :data:`TRIAL_MARGIN` shorter.
Both ways are exact, so the trial changes no result. ``"on"`` arms it without a trial.

State machine (one per paging session; ``vb.get_report()["memory"]["paging"]["step_in_backward"]``)::

    learning --first step: the loop allows it--> trial (auto) | armed (on)   --else--> off (reason)
    trial    --six iterations, timed-->           armed (faster)  | off (not faster)
    armed    --a gradient lands in backward-->    pending    (that parameter stepped now)
    pending  --optimizer.step(), nothing changed--> armed    (committed)
    pending  --anything else-->                   off        (rolled back: the usual step runs)
    trial | armed --a gradient lands, the optimizer is gone--> learning (again, for the next one)

What it cannot catch: a forward that reads a parameter through ``.data`` or ``.detach()`` and
whose backward needs that value *after* the parameter's own gradient was accumulated. Autograd
raises for ``.detach()`` (the version counter is shared); ``.data`` is not tracked by autograd at
all. ``paging_step_in_backward="off"`` (``VB_PAGING_STEP_IN_BACKWARD=off``) keeps the step after
backward.
"""
from __future__ import annotations

import statistics
import time
import weakref

import torch

from apt_model.base.log import get_logger
from apt_model.base.sizes import format_size
from apt_model.memory.pages import Category

log = get_logger(__name__)

#: Values of the ``paging_step_in_backward`` setting.
MODES = ("auto", "on", "off")
#: The trial after learning: the step inside backward (``in``) and after it (``after``), taking
#: turns, one training iteration each (ABBAAB: a drift of the machine's speed cancels out).
TRIAL = ("in", "after", "after", "in", "in", "after")
#: The step inside backward is kept when its median iteration is at least this much shorter.
TRIAL_MARGIN = 0.02


def trial_verdict(inside: list[float], after: list[float], margin: float = TRIAL_MARGIN) -> tuple[bool, str]:
    """Whether the trial's iterations with the step inside backward were faster than those with the
    step after it (seconds per training iteration, end of one ``optimizer.step()`` to the next).

    Returns:
        (keep it, the reason with both medians).
    """
    a, b = statistics.median(inside), statistics.median(after)
    told = (f"measured {a:.3f} s per iteration with the step inside backward against {b:.3f} s after it "
            f"(medians of {len(inside)} and {len(after)})")
    if a <= b * (1 - margin):
        return True, told + ": kept"
    return False, told + f": not {margin:.0%} faster, the step stays after backward"


def _same(a, b) -> bool:
    """Whether two hyperparameter values are the same (tensors by value, on their device)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        with torch._C.DisableTorchFunction():
            return a is b or (a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _frozen(v):
    """A copy of a hyperparameter value that later in-place edits cannot reach (tensors cloned)."""
    if isinstance(v, torch.Tensor):
        with torch._C.DisableTorchFunction():
            return v.detach().clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_frozen(x) for x in v)
    return v


def _hyper(opt) -> list[dict]:
    """Every group's hyperparameters (all but ``params``), copied (a tensor learning rate edited in
    place, as ``LRScheduler`` does with ``fill_``, must not change the copy)."""
    return [{k: _frozen(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


class BackwardStep:
    """Runs a paged optimizer's step inside backward where the user's loop allows it (see the
    module docstring for the policy and the state machine).

    Args:
        session: the :class:`~apt_model.memory.paging.session.PagingSession`.
        mode: ``"auto"`` (learn from the first step, then keep it only if a trial measures it
            faster), ``"on"`` (learn, no trial) or ``"off"``.

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """

    def __init__(self, session, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"paging_step_in_backward={mode!r} is not valid; use one of {', '.join(MODES)}")
        self.session = session
        self.mode = mode
        self.state = "off" if mode == "off" else "learning"
        self.reason = "paging_step_in_backward=off" if mode == "off" else "learning from the first optimizer step"
        self._opt = None  # weakref to the armed optimizer
        self._group_of: dict[int, int] = {}  # id(param) -> its group index in the armed optimizer
        self._mapped_task: int | None = None  # the backward (graph task) _group_of was read at
        self.order: list[int] = []  # id(param) in the order their gradients landed on the first step
        self._rank: dict[int, int] = {}
        self._tasks: set[int] = set()  # graph tasks that produced gradients since the last step
        self._grads: dict[int, tuple] = {}  # id(param) -> gradient fingerprint when it landed
        self._clipped = False
        self._modified: str | None = None  # why the learning step's gradients were modified
        self._keeps_graph = False  # a backward with retain_graph/create_graph was seen while learning
        self._nested = False  # a backward inside a backward (reentrant checkpointing) was seen while learning
        self._landed_pages: set[int] = set()  # id() of the gradient pages that landed since the last step
        self._units: set[int] = set()  # id() of the paged units that built a graph since the last backward
        self._unit_reused = False  # one of them twice: two graphs (or one) may hold its parameters
        self._learn_reused = False
        self._aliases: list[int] = []  # id() of gradient aliases the fault handler watches
        #: the placement plans promise level 0's bound (a plan forced past its working set does not)
        self.bound_promised = True
        self._fits: set[int] = set()  # id(param) whose step in backward was checked against the level-0 bound
        self.pending: _Pending | None = None
        self._stepping = False  # inside our own step of a parameter
        self.steps_in_backward = 0
        self.rolled_back = 0
        self.relearned = 0  # times it learned again for a new optimizer (the armed one was gone)
        self.clock = time.perf_counter
        self._plan: list[str] = []  # the trial's modes for the coming iterations
        self._current = "in"  # the mode of the iteration under way (trial)
        self._last_end: float | None = None  # when the last optimizer.step() ended
        self.trial: dict[str, list[float]] = {"in": [], "after": []}
        session.optimizers.after_step.append(self._step_ended)

    # ------------------------------------------------------------------ observations
    def _fingerprint(self, p: torch.Tensor) -> tuple:
        """What must not change between a gradient's landing and the step: the tensor (by weak
        reference: an ``id`` could be reused by a replacement), its version counter, the scales and
        zeroing deferred on its page."""
        g = p.grad
        page = self.session.grad_pages.get(id(p))
        scales = len(page.scales) if page is not None else 0
        zero = bool(page.zero_on_load) if page is not None else False
        return (None, 0, 0, False) if g is None else (_Ref(g), g._version, scales, zero)

    def grad_landed(self, p: torch.Tensor) -> None:
        """``p``'s gradient is complete for this backward (post-accumulate hook, before the
        gradient is written behind): learn, or step ``p`` now when armed."""
        if self.state == "off":
            return
        task = torch._C._current_graph_task_id()
        page = self.session.grad_pages.get(id(p))
        if page is not None:
            self._landed_pages.add(id(page))  # writes to it before the step are modifications
        if self.state == "learning":
            self._tasks.add(task)
            if id(p) not in self._rank:
                self._rank[id(p)] = len(self.order)
                self.order.append(id(p))
            self._grads[id(p)] = self._fingerprint(p)
            return
        opt = self._opt() if self._opt is not None else None
        if opt is None:
            self._relearn("the optimizer it was armed for is gone (a new one made mid-run)")
            self.grad_landed(p)  # learned: this is the new iteration's first gradient
            return
        if self.state == "trial" and self._current == "after":
            return  # this iteration of the trial measures the step after backward
        pending = self.pending
        if pending is not None and pending.task != task:
            self.abandon("a second backward ran before optimizer.step() (gradient accumulation)")
            return
        if pending is None and task != self._mapped_task:
            # the groups as they are at this backward: a parameter moved to another group, or taken
            # out of the optimizer, since the last step is stepped with its group's settings, or not
            self._group_of = {id(q): gi for gi, g in enumerate(opt.param_groups) for q in g["params"]}
            self._mapped_task = task
        if id(p) not in self._group_of:
            return  # not a parameter of that optimizer
        if pending is None:
            pending = self._open(opt, task)
        if id(p) in pending.stepped:
            self.abandon(f"{self.session.param_label(p)}'s gradient landed twice in one backward")
            return
        if self.bound_promised and id(p) not in self._fits:
            over = self._overshoot(opt, p)
            if over:
                self.abandon(over)
                return
            self._fits.add(id(p))
        self._step_one(opt, p, pending)

    def _overshoot(self, opt, p: torch.Tensor) -> str | None:
        """Why stepping ``p`` now would break the level-0 bound (budget plus the largest page), or
        None: the backward under way still pins its module's parameters (and any a forward faulted
        in outside the module hooks), which the plan's working set — a module's parameters, or one
        parameter's step — does not count together with the step's pages."""
        pages, creates = self.session.optimizers.step_pages(opt, self._group_of[id(p)], p)
        pager = self.session.pager
        over = pager.overshoot(pages, creates)
        if not over:
            return None
        return (f"stepping {self.session.param_label(p)} inside backward would take level 0 {format_size(over)} "
                f"past its page budget ({format_size(pager.budget)}) plus the largest page "
                f"({format_size(pager.largest_page)}): the pages the backward under way pins and the step's own "
                f"({format_size(sum(pg.nbytes for pg in pages) + creates)}) do not fit together")

    def clip_called(self) -> None:
        """``clip_grad_norm_`` or ``clip_grad_value_`` was called."""
        if self.state == "learning":
            self._clipped = True
        elif self.pending is not None:
            self.pending.invalid = "the loop clips gradients now (clip_grad_norm_/clip_grad_value_)"

    def grads_modified(self, why: str) -> None:
        """Something rescales or edits the gradients before the step (``GradScaler.unscale_``, an
        in-place op on a gradient)."""
        if self.state == "learning":
            self._modified = self._modified or why  # the first one seen names the cause
        elif self.pending is not None and not self._stepping:
            self.pending.invalid = self.pending.invalid or why

    def forward_starts(self) -> None:
        """A paged model's forward begins (outside backward): a pending step is rolled back first."""
        if self.pending is not None:
            self.abandon("a forward ran between backward and optimizer.step() (gradient accumulation or an "
                         "evaluation)")

    def unit_forward(self, unit_id: int) -> None:
        """A paged unit (module) built a graph in a forward (root or submodule call). Twice since the
        last backward: the parameters may be saved by a graph that another backward, after the
        step, still needs (two forwards then two backwards), so the step inside backward is ruled
        out at the next backward (also for one graph using a unit twice: conservative)."""
        if unit_id in self._units:
            self._unit_reused = True
        self._units.add(unit_id)

    def grad_alias(self, page, alias: torch.Tensor) -> None:
        """An op returned an alias of a gradient page (``p.grad.detach()``, a view): if that
        gradient landed in this iteration, writes through the alias are modifications of it."""
        if self.state != "off" and id(page) in self._landed_pages:
            self.session.mode.watched[id(alias)] = "grad"
            self._aliases.append(id(alias))
            weakref.finalize(alias, self.session.mode.watched.pop, id(alias), None)  # its id may be reused

    def data_alias(self, pages) -> None:
        """``.data`` was read from a gradient page: writes through that alias bump no version
        counter and, made later, pass no check here. The step inside backward turns off for good
        (a pending one is rolled back at ``optimizer.step()``)."""
        if self.state == "off" or not any(pg.category is Category.GRAD for pg in pages):
            return
        why = "a .data alias of a gradient was taken: writes through it are invisible to the checks"
        self.grads_modified(why)
        if self.state in ("armed", "trial") and self.pending is None:
            self._turn_off(why)

    def backward_call(self, keeps_graph: bool, nested: bool = False) -> None:
        """``Tensor.backward`` (or ``torch.autograd.grad``) is called. A step still pending from an
        earlier backward is rolled back first (this backward may need the values it changed); a
        graph kept for another backward, a backward run inside a backward (``nested``: reentrant
        activation checkpointing, whose inner backwards each accumulate into the gradients), or a
        second forward since the last step (another graph may have saved the parameters), rules
        the step inside backward out."""
        inner = ("a backward ran inside a backward (reentrant activation checkpointing): each inner backward "
                 "accumulates into the gradients")
        if self.pending is not None:
            self.abandon(inner if nested else "a second backward ran before optimizer.step() (gradient accumulation)")
        reused, self._unit_reused = self._unit_reused, False
        if not nested:  # the units an inner backward recomputes belong to the outer one's graph
            self._units.clear()
        if self.state == "learning":
            self._keeps_graph |= keeps_graph
            self._nested |= nested
            self._learn_reused |= reused
        elif self.state in ("armed", "trial"):
            if keeps_graph:
                self._turn_off("a backward keeps its graph (retain_graph/create_graph): a later backward would "
                               "need the parameters this step changes")
            elif nested:
                self._turn_off(inner)
            elif reused:
                self._turn_off("a module built a graph twice before a backward (two forwards, or one module "
                               "used twice): another graph may have saved the parameters this step changes")

    def touched(self, pages, writes: bool = False) -> None:
        """An op outside the step reads or writes ``pages`` (the fault handler). If one of them was
        stepped by the pending step (a parameter or state logged, edited or saved between backward
        and ``optimizer.step()``), the step is rolled back first, so the op sees the pre-step value;
        an op that may write a gradient that landed is a modification of it."""
        if self._stepping:
            return
        if self.pending is not None and any(self.session.pager.in_transaction(pg) for pg in pages):
            self.abandon("a parameter or optimizer state was used between backward and optimizer.step()")
        if writes and any(id(pg) in self._landed_pages for pg in pages):
            self.grads_modified("an in-place op wrote a gradient between backward and optimizer.step()")

    def watched_access(self, kinds: set, writes: bool) -> None:
        """An op on a tensor the pending step changed that is no page (a resident parameter or
        state: rolled back first), or that may write a resident gradient it used (a modification)."""
        if self._stepping:
            return
        if "value" in kinds and self.pending is not None:
            self.abandon("a parameter or optimizer state was used between backward and optimizer.step()")
        elif "grad" in kinds and writes:
            self.grads_modified("an in-place op wrote a gradient between backward and optimizer.step()")

    def settle(self, why: str) -> None:
        """Something is about to read the whole training state (``state_dict()``): a pending step
        is rolled back first (``why`` goes in the report)."""
        if self.pending is not None:
            self.abandon(why)

    def backward_failed(self, err: BaseException) -> None:
        """A paging hook raised inside backward (the backward is abandoned by autograd): a pending
        step is rolled back."""
        if self.pending is not None:
            self.abandon(f"backward failed ({type(err).__name__}: {err})")

    # ------------------------------------------------------------------ the step in backward
    def _open(self, opt, task: int) -> "_Pending":
        undo = self.session.optimizers.begin_transaction(opt)
        self.pending = _Pending(opt, task, undo, _hyper(opt))
        return self.pending

    def _step_one(self, opt, p: torch.Tensor, pending: "_Pending") -> None:
        # the step acquires its own pages: its ops need no fault handler (which would take them
        # for uses of stepped values and roll the step back)
        handler_off = self.session.suspend_fault_handler()
        self._stepping = True  # defensive: our own ops are no uses of stepped values, whatever sees them
        gi = self._group_of[id(p)]
        try:
            self.session.optimizers.step_alone(opt, gi, p, pending.undo)
            pending.stepped[id(p)] = self._fingerprint(p)
            pending.group[id(p)] = gi
            self._watch(p, pending)
            self.session.pager.prefetch(self._ahead(p))
        except Exception as err:  # noqa: BLE001 - the step after backward meets it, where the user expects it
            # the optimizer's own error (a dtype the states do not match after model.half(), an
            # optimizer the loop no longer steps) belongs to optimizer.step(), not to backward: roll
            # back, and let the usual step raise it there, with the backward complete
            self.abandon(f"stepping {self.session.param_label(p)} in backward failed ({type(err).__name__}: {err})")
        except BaseException as err:  # an interrupt: rolled back, and it goes on
            self.abandon(f"stepping {self.session.param_label(p)} in backward was interrupted ({type(err).__name__})")
            raise
        finally:
            self._stepping = False
            if handler_off:
                self.session.restore_fault_handler(handler_off)

    def _watch(self, p: torch.Tensor, pending: "_Pending") -> None:
        """Have the fault handler report uses of what the step of ``p`` changed or used that is no
        page: resident parameters and states (Adam's ``step`` too), a resident gradient."""
        watched = self.session.mode.watched
        for t, _ in pending.undo.resident_tensors(p):
            watched[id(t)] = "value"
            pending.watched.append(id(t))
        if id(p) not in self.session.grad_pages and p.grad is not None:  # a page's writes are seen as landed
            watched[id(p.grad)] = "grad"
            pending.watched.append(id(p.grad))

    def _unwatch(self, pending: "_Pending") -> None:
        watched = self.session.mode.watched
        for i in pending.watched:
            watched.pop(i, None)

    def forget(self, pid: int) -> None:
        """The parameter with id ``pid`` was garbage-collected (a finalizer calls this): its id
        leaves the learned order's maps at once, so a new parameter given the id is learned anew
        (``order`` itself is compacted by :meth:`retire_dead`)."""
        self._rank.pop(pid, None)
        self._grads.pop(pid, None)
        self._fits.discard(pid)

    def retire_dead(self) -> None:
        """Drop forgotten parameters from the learned order (see :meth:`forget`)."""
        if len(self._rank) != len(self.order):
            self.order = [pid for pid in self.order if pid in self._rank]
            self._rank = {pid: i for i, pid in enumerate(self.order)}

    def _ahead(self, p: torch.Tensor) -> list:
        """The state pages of the parameters whose gradients came after ``p``'s on the first step
        (up to four parameters, and a sixth of the page budget)."""
        paging = self.session.optimizers
        ahead, room = [], self.session.pager.budget // 6
        i = self._rank.get(id(p))
        if i is None:
            return ahead
        opt = self._opt() if self._opt is not None else None
        for pid in self.order[i + 1:i + 5]:
            pages = list(paging.state_pages.get((id(opt), pid), {}).values())
            if sum(pg.nbytes for pg in pages) > room:
                break
            room -= sum(pg.nbytes for pg in pages)
            ahead += pages
        return ahead

    # ------------------------------------------------------------------ the user's step
    def claim(self, opt) -> bool:
        """The user calls ``opt.step()``. Returns True when the step already ran inside backward
        and is committed now (the call has nothing left to do); False when the ordinary step must
        run (after a roll-back, while learning, or for another optimizer).

        Raises:
            PagingRecoveryError: a roll-back could not restore some tensors (named).
        """
        if self.state == "learning":
            self._learn(opt)
            return False
        pending = self.pending
        if pending is None:
            return False
        if pending.opt is not opt:  # its step would also open (and so commit) a transaction
            self.abandon(f"another optimizer ({type(opt).__name__}) stepped between backward and the step of "
                         f"the one stepped inside backward")
            return False
        why = pending.invalid or self._changed(opt, pending)
        if why:
            self.abandon(why)
            return False
        self._unwatch(pending)
        self.session.pager.commit()
        pending.undo.commit()
        self.pending = None
        self.steps_in_backward += 1
        return True

    def _changed(self, opt, pending: "_Pending") -> str | None:
        """Why the step in backward is not the step the user asks for now (None: it is)."""
        now = _hyper(opt)
        if len(now) != len(pending.hyper):
            return "a parameter group was added (add_param_group) between backward and optimizer.step()"
        if any(
                a.keys() != b.keys() or not all(_same(a[k], b[k]) for k in a) for a, b in zip(now, pending.hyper)):
            return "hyperparameters changed between backward and optimizer.step()"
        in_opt = set()
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                in_opt.add(id(p))
                seen = pending.stepped.get(id(p))
                if seen is not None and pending.group[id(p)] != gi:
                    return (f"{self.session.param_label(p)} moved to another parameter group between backward and "
                            "optimizer.step()")
                if seen is None:
                    if p.grad is not None and id(p) not in self._group_of:
                        return (f"{self.session.param_label(p)} is in a parameter group added (add_param_group) after "
                                "the step inside backward was armed")
                    if p.grad is not None:
                        return f"{self.session.param_label(p)} has a gradient that did not come from the last backward"
                elif seen != self._fingerprint(p):
                    return f"{self.session.param_label(p)}'s gradient was modified or replaced before optimizer.step()"
        if len(in_opt) < len(pending.stepped) or not in_opt.issuperset(pending.stepped):
            return "a parameter stepped inside backward was taken out of the optimizer before optimizer.step()"
        return None

    def _learn(self, opt) -> None:
        """The first step: arm for ``opt`` if the loop allows it, else turn off with the reason."""
        host = self.session.host_step
        why = None
        if host is not None and host.hosts(opt):
            why = "the optimizer steps on the host (paging_step=host)"
        elif self._keeps_graph:  # before the count: a kept graph's second backward is no accumulation
            why = "a backward keeps its graph (retain_graph/create_graph)"
        elif self._nested:  # nor are a reentrant checkpoint's inner backwards
            why = ("a backward ran inside a backward (reentrant activation checkpointing): each inner backward "
                   "accumulates into the gradients")
        elif len(self._tasks) > 1:
            why = f"gradient accumulation: {len(self._tasks)} backward passes before the first optimizer.step()"
        elif not self._tasks:
            why = "no paged gradient came from a backward before the first optimizer.step()"
        elif self._clipped:
            why = "the loop clips gradients between backward and optimizer.step()"
        elif self._modified:
            why = self._modified
        elif self._learn_reused:
            why = ("a module built a graph twice before a backward (two forwards, or one module used twice) in "
                   "the first iteration")
        else:
            for g in opt.param_groups:
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    if id(p) not in self._grads:
                        why = (f"the optimizer holds {self.session.param_label(p)}, whose gradient the switch "
                               "did not see arrive in backward (a model that is not paged, or a gradient the "
                               "loop set itself): its step cannot run as the gradients land")
                    elif self._grads[id(p)] != self._fingerprint(p):
                        why = "the loop modifies gradients between backward and optimizer.step()"
                    if why:
                        break
                if why:
                    break
        self._tasks.clear()
        self._grads.clear()
        if why:
            self._turn_off(why)
            return
        self._opt = weakref.ref(opt)
        self._group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
        allowed = ("one backward per optimizer.step() and the gradients untouched in between: each parameter "
                   "is stepped as its gradient lands")
        if self.mode == "on":
            self.state, self.reason = "armed", allowed + " (paging_step_in_backward=on: no trial)"
            log.info("paging: the optimizer step runs inside backward from now on (%s)", self.reason)
        else:
            self.state, self.reason = "trial", allowed + "; on trial against the step after backward"
            self._plan = list(TRIAL)
            self._current = self._plan.pop(0)

    def _relearn(self, why: str) -> None:
        """The armed optimizer was garbage-collected (a script that makes a new optimizer after
        unfreezing, or after an LR finder): learn again from the iteration under way, for whichever
        optimizer steps next. Called at this iteration's first landed gradient: its backward began
        while armed, so what :meth:`backward_call` rules out (a kept graph, a nested backward, a
        module used twice) would have turned the feature off already. Until 2026-11-29 it turned
        off for good. Only a dead optimizer: one alive that another's step came between (a GAN's
        two) still turns it off, or the two would roll each other back at every step."""
        log.info("paging: the step inside backward learns again: %s", why)
        self.state, self.reason = "learning", f"learning again from the next optimizer step: {why}"
        self.relearned += 1
        self._opt, self._group_of, self._mapped_task = None, {}, None
        self._fits.clear()  # checked against the bound for the old optimizer's states, not the new one's
        self._tasks.clear()
        self._grads.clear()
        self._clipped, self._modified = False, None
        self._keeps_graph = self._nested = self._learn_reused = False
        self._plan, self._current, self._last_end = [], "in", None
        self.trial = {"in": [], "after": []}

    def _step_ended(self, step: int) -> None:
        """After every paged ``optimizer.step()``: time the iteration that ended, and during the
        trial choose the next one's mode, or decide (the armed optimizer's steps only)."""
        self._landed_pages.clear()
        for i in self._aliases:
            self.session.mode.watched.pop(i, None)
        self._aliases.clear()
        armed = self._opt() if self._opt is not None else None
        if armed is not None and self.session.optimizers.last_stepped is not armed:
            return
        now = self.clock()
        last, self._last_end = self._last_end, now
        if self.state != "trial" or last is None:
            return
        self.trial[self._current].append(now - last)
        if self._plan:
            self._current = self._plan.pop(0)
            return
        keep, why = trial_verdict(self.trial["in"], self.trial["after"])
        if keep:
            self.state, self.reason = "armed", why
            log.info("paging: the optimizer step runs inside backward from now on (%s)", why)
        else:
            self._turn_off(why)

    # ------------------------------------------------------------------ leaving
    def abandon(self, why: str) -> None:
        """Roll back a pending step in backward and turn the feature off, saying why.

        Raises:
            PagingRecoveryError: some tensors could not be restored (named).
        """
        pending, self.pending = self.pending, None
        self._turn_off(why)
        if pending is None:
            return
        self._unwatch(pending)
        self.rolled_back += 1
        lost = pending.undo.rollback()
        log.info("paging: the optimizer step taken inside backward was rolled back (%s); the usual step runs", why)
        if lost:
            from apt_model.memory.swap import PagingRecoveryError

            raise PagingRecoveryError(
                f"rolling back the optimizer step taken inside backward ({why}) could not restore "
                + "; ".join(f"{k}: {v}" for k, v in lost.items()), lost=lost)

    def _turn_off(self, why: str) -> None:
        if self.state != "off":
            log.info("paging: the optimizer step stays after backward: %s", why)
        self.state, self.reason = "off", why
        self._opt = None

    def close(self) -> None:
        """The session closes: a step never claimed by ``optimizer.step()`` is rolled back."""
        if self.pending is not None:
            self.abandon("the paging session closed before optimizer.step()")

    def report(self) -> dict:
        """``{"state", "reason", "steps_in_backward", "rolled_back", "relearned", "trial"}`` (see the
        module docstring); ``relearned``: times it learned again for a new optimizer; ``trial``: the
        trial's seconds per iteration, ``{"in": [...], "after": [...]}``."""
        return {"state": "pending" if self.pending is not None else self.state, "reason": self.reason,
                "steps_in_backward": self.steps_in_backward, "rolled_back": self.rolled_back,
                "relearned": self.relearned,
                "trial": {k: [round(t, 4) for t in v] for k, v in self.trial.items()}}


class _Ref:
    """A weak reference to a tensor that compares by the identity of what it refers to."""

    __slots__ = ("ref",)

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)

    def __eq__(self, other) -> bool:
        if not isinstance(other, _Ref):
            return NotImplemented
        a = self.ref()
        return a is not None and a is other.ref()

    __hash__ = None


class _Pending:
    """A step taken inside backward, not yet claimed by ``optimizer.step()``."""

    def __init__(self, opt, task: int, undo, hyper: list[dict]):
        self.opt = opt
        self.task = task
        self.undo = undo
        self.hyper = hyper
        self.stepped: dict[int, tuple] = {}  # id(param) -> gradient fingerprint after its step
        self.group: dict[int, int] = {}  # id(param) -> index of the group it was stepped with
        self.watched: list[int] = []  # id() of the tensors it has the fault handler watch
        self.invalid: str | None = None
