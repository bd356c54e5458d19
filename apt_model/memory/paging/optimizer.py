"""The user's own ``torch.optim`` optimizer, stepped in chunks through fast memory.

A global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
catches every ``optimizer.step()`` — optimizers created before or after enabling. For one that
holds paged parameters, gradients or states, the hook runs the step itself, chunk by chunk: it
acquires a chunk's parameters, gradients and states, prefetches the next chunk, and calls the
optimizer's own (unhooked) step with each parameter group's ``params`` temporarily narrowed to
the chunk. Then it narrows every group to nothing for the call that is already under way, and a
post-hook puts the lists back. New optimizer states (created on the first step) are paged.

Why this is exact: the supported optimizers update each parameter from its own gradient and
state only (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, and
subclasses that override neither ``step`` nor ``_init_group``: :func:`steps_per_parameter`); a chunk runs
the same per-tensor arithmetic — the single-tensor loop on CPU, the same ``_foreach`` kernels
on accelerators — as the full step would. An optimizer outside that list is refused with a clear
error rather than stepped differently. ``step(closure)`` calls the closure once, first, as those
optimizers' own ``step`` does, then streams the step; it returns the closure's loss. The optimizer's own step
hooks (``register_step_pre_hook`` / ``register_step_post_hook``) run around the streamed step,
with its parameters in place (:meth:`OptimizerPaging._take_own_hooks`).

``optimizer.state_dict()`` materializes paged states (copies) so it can be saved;
``optimizer.load_state_dict()`` pages the loaded states again.

The budget holds through the first step too, when the optimizer creates its states: a chunk's
size counts the states its step will create (:func:`expected_state_bytes`: Adam's m and v, SGD's
momentum buffer...), room for them is made before the chunk runs, and the next chunk's prefetch
leaves that room free.

**A step is all or nothing.** Chunks are applied one after the other, so a fault half-way (a
corrupt or unreadable swap file of a later chunk, a full or read-only swap disk when an updated
chunk is written, a timeout, or any exception from the optimizer itself) would otherwise leave
some parameters stepped and others not, and a retry would step the first ones twice. Before a
chunk runs, what it will modify is kept (:class:`_StepUndo`): paged parameters and states keep
their pre-step copy below (the pager's step transaction: a rename, no I/O), tensors the plan keeps
resident get a pre-step copy that is itself a page (evicted first, so it costs I/O only when the
level is short of room), scalars (Adam's ``step``) a clone, and each parameter's state dict its
entries. A resident parameter the last step copied is copied again as soon as its gradient lands in
backward (:meth:`OptimizerPaging.grad_landed`), so on an accelerator that copy down shares the link
with backward's, not with the step's write-backs. A write to such a parameter before the step (seen
by the fault handler: in place, through ``.data``, ``p.data = x``) drops the early copies, and the
version counter, data pointer and storage size are checked again when its chunk runs: a parameter
changed after its copy began is copied again there. Early copies the next step does not take are
let go at the next backward, and their parameters are not copied early again until a step copies
them. A step that fails is rolled back completely — states it created are removed — and the
error is raised; a retry steps from the state before the failed step. Plain PyTorch does not roll
back: a foreach AdamW that raised part-way (a dtype error after ``model.double()``) has already
counted the step and applied weight decay, so a script that catches the error and goes on differs
from plain PyTorch there (by the step count and ~1e-5 in the parameters; a probe's finding,
documented in docs/tiers.md as the rollback's choice). A step that completes
drops the copies. Costs: the swap files hold two versions of the paged parameters and states
during a step (the old ones are then reused for the next step's writes).
"""
from __future__ import annotations

import functools
import inspect
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from apt_model.base.errors import VBError
from apt_model.base.log import get_logger
from apt_model.memory.interrupts import hold, let_go, shielded
from apt_model.memory.pages import Category, Page, State
from apt_model.memory.swap import PagingRecoveryError

log = get_logger(__name__)

#: Optimizers whose update of one parameter depends on that parameter's gradient and state only.
PER_PARAMETER = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
) + ((torch.optim.Adafactor,) if hasattr(torch.optim, "Adafactor") else ())  # factored moments: per parameter too

#: Methods through which a subclass could make one parameter's update depend on others.
_STEP_METHODS = ("step", "_init_group")


def steps_per_parameter(opt: torch.optim.Optimizer) -> tuple[bool, str]:
    """Whether ``opt`` can be stepped a chunk of parameters at a time with the same result, and
    why not: its class is one of :data:`PER_PARAMETER`, or a subclass of one that overrides none
    of its step methods (``step``, ``_init_group``). A subclass that does (divides gradients by the
    group's total norm, scales the learning rate by ``len(group["params"])``...) may couple the
    parameters: stepped in chunks, it gave other results, silently, until 2026-11-26. A subclass
    whose author knows its step still updates each parameter alone (it counts calls, logs, injects
    a fault) says so with the attribute ``vb_per_parameter = True``; the step then runs once per
    chunk, so side effects in it run once per chunk too. So does any other ``Optimizer`` whose step
    updates each parameter from its own gradient and state alone (a hand-written Adam or Lion, LARS's
    per-parameter trust ratio): until 2026-11-29 the attribute was read only on subclasses of the
    built-ins, and such an optimizer was refused with advice that did not work (a probe's finding)."""
    if getattr(opt, "vb_per_parameter", False) is True:
        return True, ""  # the script says its step updates each parameter alone
    mro = type(opt).__mro__
    base = next((c for c in mro if c in PER_PARAMETER), None)
    if base is None:
        return False, "it is not known to update each parameter independently"
    for cls in mro[:mro.index(base)]:
        # torch wraps a class's ``step`` for its profiler and hooks in the first instance's
        # __init__, setting it on the subclass: a wrapper around the base's own step is no override
        overridden = [name for name in _STEP_METHODS if name in vars(cls)
                      and inspect.unwrap(vars(cls)[name]) is not inspect.unwrap(getattr(base, name))]
        if overridden:
            return False, (f"it subclasses {base.__name__} and overrides {', '.join(overridden)}, "
                           "which may make one parameter's update depend on the others")
    return True, ""


class CapturableFlags:
    """The ``capturable`` flag of each param group as the user set it, put back around every
    paged step, and the flag Dynamo compiled the emptied step body with, given to that body.

    Dynamo, tracing ``optimizer.step`` (``torch.compile(optimizer.step)``, or a training step
    compiled whole), sets ``capturable=True`` in every param group whose parameters are all on an
    accelerator — or that has none, which is what the streamed step leaves the real step (its
    parameters are taken out: see :meth:`PagedOptimizers._pre`) — and writes that back to the real
    groups after each compiled step. On the CPU torch's optimizers then refuse to step ("If
    capturable=True, params and state_steps must be on supported devices"), the next eager step and
    a checkpoint's ``state_dict()`` included. The value a group had when the paging step first saw
    it (before any traced step body ran) is the user's; it is restored before the streamed step and
    after the body.

    The body itself, with no parameters left, gets the value Dynamo last wrote
    (:meth:`for_empty_body`): its compiled code guards on the flag, and given the user's value back
    each step it recompiled every step up to Dynamo's limit of 8 (until 2026-11-27). An eager body
    with empty parameter lists reads the flag for no tensor.
    """

    def __init__(self):
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> {group index: value}
        self._traced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> {index: Dynamo's}

    def remember(self, opt) -> None:
        """Record the flag of groups not seen before (a group added by ``add_param_group`` too),
        and a flag the script changed since the last step (or a state dict it loaded): a value
        other than the recorded one and other than the one Dynamo writes is the script's. Until
        2026-11-28 such a change was put back at every step (a script turning ``capturable`` off
        after a CPU step refused it kept failing: a probe's finding)."""
        seen = self._seen.setdefault(opt, {})
        traced = self._traced.get(opt, {})
        for i, g in enumerate(opt.param_groups):
            if i not in seen:
                seen[i] = g.get("capturable")
            elif "capturable" in g and g["capturable"] != seen[i] and (i not in traced or g["capturable"] != traced[i]):
                log.debug("param group %d: capturable=%s set by the script", i, g["capturable"])
                seen[i] = g["capturable"]

    def restore(self, opt) -> None:
        """Put back the recorded flags that something (Dynamo) changed since, remembering the
        changed values for :meth:`for_empty_body`."""
        seen = self._seen.get(opt, {})
        for i, g in enumerate(opt.param_groups):
            if i in seen and "capturable" in g and g["capturable"] != seen[i]:
                log.debug("param group %d: capturable=%s (set by torch.compile) put back to %s", i, g["capturable"],
                          seen[i])
                self._traced.setdefault(opt, {})[i] = g["capturable"]
                g["capturable"] = seen[i]

    def for_empty_body(self, opt) -> None:
        """Give the groups, their parameter lists emptied, the flags Dynamo last set in them."""
        for i, value in self._traced.get(opt, {}).items():
            if i < len(opt.param_groups) and not opt.param_groups[i]["params"]:
                opt.param_groups[i]["capturable"] = value


#: Dynamo's graph-break reason at the paged optimizer step.
EAGER_STEP = "apt_model streams this optimizer's step through its pages: it runs eagerly under torch.compile"


class PagedOptimizerError(VBError, RuntimeError):
    """An optimizer that cannot be stepped in chunks holds paged state."""


def _state_copies(opt: torch.optim.Optimizer, group: dict) -> int:
    """How many tensors of a parameter's size ``opt``'s step creates as state for one parameter."""
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2
    if isinstance(opt, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0
    if isinstance(opt, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    if isinstance(opt, (torch.optim.Adagrad, torch.optim.ASGD)):
        return 1  # sum; ASGD's ax (its eta and mu are scalars)
    return 2  # Adamax (exp_avg, exp_inf), NAdam, RAdam, Adadelta (square_avg, acc_delta), Rprop (prev, step_size)


def expected_state_bytes(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> int:
    """Bytes of state ``opt``'s next step will create for ``p`` on its device: 0 when the state
    exists already, else the state tensors of ``p``'s size the optimizer creates (scalars such as
    Adam's ``step`` are not counted)."""
    st = opt.state.get(p)
    if st and any(isinstance(v, torch.Tensor) and v.numel() >= 2 for v in st.values()):
        return 0
    return _state_copies(opt, group) * p.numel() * p.element_size()


def version_mark(t: torch.Tensor) -> tuple[int, int, int]:
    """What says ``t`` changed since a copy of it began: its version counter (in-place ops), its
    data pointer and its storage's size (``t.data = x``, which leaves the version alone)."""
    with torch._C.DisableTorchFunction():
        return t._version, t.data_ptr(), t.untyped_storage().nbytes()


def marked_copy(pager, t: torch.Tensor, label: str) -> Page:
    """Start ``t``'s pre-step copy below (:meth:`Pager.copy_out`, whose errors it raises), marked
    with :func:`version_mark` so that a change made after it began is seen."""
    copy = pager.copy_out(t, label)
    copy.version = version_mark(t)
    return copy


def _state_of(opt_ref, p_ref, key):
    """The optimizer's live state tensor ``key`` of the parameter ``p_ref()`` (None once the
    optimizer or the parameter is gone: a page holds neither, so a dropped model is freed)."""
    opt, p = opt_ref(), p_ref()
    if opt is None or p is None:
        return None
    st = opt.state.get(p)  # not opt.state[p]: a defaultdict would add an entry for a parameter the
    return None if st is None else st.get(key)  # user took out (optimizer.state_dict() then fails)


def _muted_hook(opt, args, kwargs):
    """Stands in, for one step, for a global step hook the paged step ran itself (see
    :meth:`OptimizerPaging._mute`)."""
    return None


def _evaluated(loss):
    """The closure handed to torch's step call after the paged step evaluated the user's: the loss."""
    return loss


class OptimizerPaging:
    """Global step hooks plus per-optimizer state pages for one paging session."""

    def __init__(self, session, page_states: bool):
        self.session = session
        self.page_states = page_states
        # (id(optimizer), id(param)) -> {state key: page}: two optimizers may hold one parameter
        self.state_pages: dict[tuple[int, int], dict[str, Page]] = {}
        self.known: weakref.WeakSet = weakref.WeakSet()
        self._dead: list[int] = []  # id() of adopted optimizers since garbage-collected (a finalizer's queue)
        self._stash: dict[int, list] = {}
        self._own_hooks: dict[int, tuple[dict, dict]] = {}  # id(opt) -> its step hooks, taken out (_take_own_hooks)
        self._hooks: tuple = (None, None)  # the handles of the global step pre- and post-hook (install)
        self._muted: list = []  # (torch's hook dict, key, hook): global hooks this step runs itself (_mute)
        self._in_step = False
        self.steps = 0
        self.after_step: list = []  # callables run after each completed step, given the step count
        self.first_chunk: list[Page] = []  # pages of the last step's first chunk, prefetched after backward
        self._last_stepped = None  # weakref to the optimizer whose step ran last (see last_stepped)
        # pre-step copies started in backward, for the next step transaction:
        # id(p) -> (p, label, copy, self.steps when it began)
        self.early: dict[int, tuple[torch.Tensor, str, Page, int]] = {}
        self._copied = WeakIdKeyDictionary()  # resident parameter -> label: those the last steps copied
        self._swept = 0  # self.steps when the early copies were last swept
        self.capturable = CapturableFlags()

    def install(self, patches) -> None:
        # run eagerly when Dynamo reaches them (torch.compile of optimizer.step or of a training step
        # that calls it): the streamed step's I/O and bookkeeping cannot be traced (paging/compiled.py)
        pre = torch.compiler.disable(self._pre, reason=EAGER_STEP)
        post = torch.compiler.disable(self._post, reason=EAGER_STEP)
        self._hooks = (register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post))
        patches.add_handle(self._hooks[0], "optimizer step pre-hook")
        patches.add_handle(self._hooks[1], "optimizer step post-hook")
        patches.add_undo(self._unmute, "global optimizer step hooks muted for a step")

    def _mute(self, handle, after: bool) -> list:
        """The global step hooks torch would run after (``after``) or before ``handle``'s, in order,
        each replaced by :func:`_muted_hook` in torch's dict for the step under way (a value swap:
        torch may be iterating that dict). Torch runs global hooks in registration order, so a
        global pre-hook registered after paging started ran after the paged step had emptied the
        parameter groups for torch's own call, and a global post-hook registered before it ran
        before :meth:`_post` gave them back: both saw empty groups (a gradient-scaling or EMA hook
        silently did nothing; until 2026-11-27). The paged step runs them itself, in torch's
        order, with the parameters in place; :meth:`_unmute` puts them back."""
        hooks_dict = handle.hooks_dict_ref()
        if hooks_dict is None or handle.id not in hooks_dict:
            return []
        keys = list(hooks_dict)
        at = keys.index(handle.id)
        taken = []
        for key in keys[at + 1:] if after else keys[:at]:
            hook = hooks_dict[key]
            if hook is _muted_hook:
                continue
            self._muted.append((hooks_dict, key, hook))
            hooks_dict[key] = _muted_hook
            taken.append(hook)
        return taken

    def _unmute(self) -> None:
        """Put back the global step hooks :meth:`_mute` stood in for (at :meth:`_post`, or at the next
        step or the session's end where a step ended early)."""
        muted, self._muted = self._muted, []
        for hooks_dict, key, hook in muted:
            if hooks_dict.get(key) is _muted_hook:
                hooks_dict[key] = hook

    # ------------------------------------------------------------------ discovery
    def _involves_paging(self, opt: torch.optim.Optimizer) -> bool:
        s = self.session
        return any(id(p) in s.params for g in opt.param_groups for p in g["params"])

    def _adopt(self, opt: torch.optim.Optimizer, patches) -> None:
        if opt in self.known:
            return
        ok, why = steps_per_parameter(opt)
        if not ok:
            names = ", ".join(f"{c.__module__.split('.')[0]}.optim.{c.__name__}" for c in PER_PARAMETER)
            cls = type(opt)
            raise PagedOptimizerError(
                f"{cls.__module__}.{cls.__qualname__} steps parameters of a paged model (whose parameters, gradients "
                f"or optimizer states are paged) but {why}, so it cannot be stepped in chunks; "
                f"use one of {names} (or a subclass that keeps their step), set the class attribute "
                "vb_per_parameter = True on an optimizer whose step updates each parameter from its own gradient "
                "and state alone (a hand-written Adam or Lion; not SAM or LBFGS, whose step reads every parameter's "
                "gradient), or turn paging off (enable(paging='off'))"
            )
        self.known.add(opt)
        # its pages go when it does (another optimizer may later get its id): see retire_dead
        weakref.finalize(opt, self._dead.append, id(opt))
        patches.add_handle(opt.register_state_dict_pre_hook(self._before_state_dict),
                           f"{type(opt).__name__} state_dict pre-hook")
        patches.add_handle(opt.register_state_dict_post_hook(self._state_dict_hook), f"{type(opt).__name__} state_dict hook")
        patches.add_handle(opt.register_load_state_dict_pre_hook(self._before_load),
                           f"{type(opt).__name__} load_state_dict pre-hook")
        patches.add_handle(opt.register_load_state_dict_post_hook(self._loaded_hook),
                           f"{type(opt).__name__} load_state_dict hook")
        self._page_existing_states(opt)

    def _page_existing_states(self, opt: torch.optim.Optimizer) -> None:
        for g in opt.param_groups:
            for p in g["params"]:
                self._page_new_states(opt, p)

    @property
    def last_stepped(self):
        """The optimizer whose step ran last (for the after_step callbacks), None once it is gone
        (held weakly: a dropped optimizer's pages are retired, see :meth:`retire_dead`)."""
        return self._last_stepped() if self._last_stepped is not None else None

    def retire_dead(self) -> None:
        """Forget the state pages of optimizers that were garbage-collected (their states died
        with them): without this a loop that makes a new optimizer per phase grows the pager and
        the swap space, and a new optimizer could inherit a dead one's id."""
        while self._dead:
            oid = self._dead.pop()
            for key in [k for k in self.state_pages if k[0] == oid]:
                for page in self.state_pages.pop(key).values():
                    self.session.pager.discard(page)

    def _page_new_states(self, opt: torch.optim.Optimizer, p: torch.Tensor) -> list[Page]:
        self.retire_dead()
        host = self.session.host_step
        if not self.page_states or (host is not None and id(p) in host.params):
            return []  # resident, or kept on the host by the host step
        pages = self.state_pages.setdefault((id(opt), id(p)), {})
        new = []
        for k, v in opt.state.get(p, {}).items():
            if not isinstance(v, torch.Tensor) or v.numel() < 2 or v.device != p.device:
                continue  # scalars such as Adam's 'step' (kept on the CPU) stay resident
            page = pages.get(k)
            if page is None or page.bound() is not v:  # new, or replaced (load_state_dict)
                if page is not None:
                    self.session.pager.unregister(page)
                if not v.untyped_storage().resizable():  # e.g. loaded from a checkpoint buffer
                    v = opt.state[p][k] = v.clone()
                label = f"{self.session.param_label(p)}:{k}"
                page = self.session.pager.register(Category.STATE, functools.partial(_state_of, weakref.ref(opt), weakref.ref(p), k),
                                                   label)
                pages[k] = page
                new.append(page)
        return new

    # ------------------------------------------------------------------ the step
    def grad_landed(self, p: torch.Tensor) -> None:
        """``p``'s gradient landed in backward: start the pre-step copy of ``p`` now if the last
        step copied it (a resident parameter of a streamed step), outside any step transaction.

        The copy is for the next step. The first gradient after a step first drops the copies
        that step did not take: their parameters are no longer copied early (until a step copies
        them again). While a copy waits, the fault handler watches its parameter: a write to it
        (an in-place op, ``.data``, ``p.data = x``) drops every early copy (:meth:`early_written`),
        and the step copies afresh. A copy that cannot start is left to the step, which copies
        (and raises) then."""
        if self._swept != self.steps:
            self._swept = self.steps
            stale = [k for k, e in self.early.items() if e[3] != self.steps]
            for key in stale:
                t, _, copy, _ = self.early.pop(key)
                self._copied.pop(t, None)
                self._forget(t, copy)
        label = self._copied.get(p)
        if label is None or id(p) in self.early or self._in_step or self.session.pager.in_step:
            return
        try:
            copy = marked_copy(self.session.pager, p, label)
        except Exception as err:  # noqa: BLE001 - the step makes the copy itself and reports the error
            log.debug("the pre-step copy of %s could not start in backward: %s", label, err)
            return
        self.early[id(p)] = (p, label, copy, self.steps)
        self.session.mode.watched.setdefault(id(p), "early")

    def early_written(self) -> None:
        """The fault handler saw a write to a parameter with an early copy (between backward and
        the step): drop them all (the step copies afresh; not every write shows in ``_version``)."""
        if self.early:
            log.debug("a parameter was written after its pre-step copy began: %d early copies dropped",
                      len(self.early))
            self.drop_early()

    def take_early(self, params) -> dict[int, tuple[torch.Tensor, str, Page]]:
        """The pre-step copies started in backward of ``params`` (``{id(p): (p, label, copy)}``), for
        a step transaction."""
        taken = {}
        for p in params:
            entry = self.early.pop(id(p), None)
            if entry is not None:
                self._unwatch(p)
                taken[id(p)] = entry[:3]
        return taken

    def drop_early(self) -> None:
        """Forget the pre-step copies started in backward that no step took."""
        early, self.early = self.early, {}
        for t, _, copy, _ in early.values():
            self._forget(t, copy)

    def _unwatch(self, t: torch.Tensor) -> None:
        watched = self.session.mode.watched
        if watched.get(id(t)) == "early":
            del watched[id(t)]

    def _forget(self, t: torch.Tensor, copy: Page) -> None:
        """Drop an early copy; never raises (an error is logged: the copy's room is lost at worst)."""
        self._unwatch(t)
        try:
            self.session.pager.copy_drop(copy)
        except Exception as err:  # noqa: BLE001 - a failed drop must not fail the step or the teardown
            log.warning("the pre-step copy %s could not be dropped: %s", copy.label, err)

    def _pre(self, opt, args, kwargs):
        """The global step pre-hook: the whole step of an optimizer holding paged tensors runs here
        (:meth:`_prepare`, the closure if one was given, :meth:`_streamed`); torch's call that
        follows finds every parameter group empty, and a closure that returns the loss already
        computed. Returns the (possibly changed) ``(args, kwargs)`` for that call, or None."""
        if self._in_step or not self._involves_paging(opt):
            return None
        given = (args, kwargs)
        own = self._prepare(opt)
        later = self._mute(self._hooks[0], after=True) if self._hooks[0] is not None else []
        try:
            # the global pre-hooks registered after this one, then the optimizer's own, with its parameters
            # in place (torch's order)
            for hook in [*later, *own[0].values()]:
                changed = hook(opt, args, kwargs)
                if changed is not None:  # torch's rule for a pre-hook's result
                    if not (isinstance(changed, tuple) and len(changed) == 2):
                        raise RuntimeError(f"{hook} must return None or a tuple of (new_args, new_kwargs), "
                                           f"but got {changed!r}")
                    args, kwargs = changed
            # not shielded: an interrupt in the closure's forward or backward lands as without paging
            args, kwargs = self._evaluate_closure(opt, args, kwargs)
        except BaseException:
            self._give_back_own_hooks(opt)
            self._unmute()
            raise
        self._streamed(opt, own, args, kwargs)
        return None if args is given[0] and kwargs is given[1] else (args, kwargs)  # None: torch's call as it was

    @shielded  # the paged step is not cut by a signal: one arriving meanwhile waits (interrupts.py)
    def _prepare(self, opt) -> tuple[dict, dict]:
        """Adopt ``opt`` (refusing what cannot be stepped in chunks) and take its own step hooks
        out; returns them (pre-hooks, post-hooks)."""
        self._put_back_lists(opt)  # a signal (held back too long) landed between this hook and _post
        self._unmute()  # idem: hooks a step muted
        self._adopt(opt, self.session.patches)
        self._refuse_duplicates(opt)
        self.capturable.remember(opt)
        self.capturable.restore(opt)
        return self._take_own_hooks(opt)

    def _evaluate_closure(self, opt, args, kwargs) -> tuple[tuple, dict]:
        """``optimizer.step(closure)``: the closure (which re-evaluates the model: zero_grad, forward,
        backward, and returns the loss) is called here, once, with grad enabled, as every supported
        optimizer's ``step`` calls it first. Torch's call that follows gets a closure returning that
        loss, so ``step`` returns it without evaluating the model again. The step inside backward
        is turned off: the closure's backward runs inside the step call. Returns ``(args, kwargs)``."""
        if "closure" in kwargs:
            closure = kwargs["closure"]
        else:
            closure = args[1] if len(args) > 1 else None
        if closure is None:
            return args, kwargs
        self.session.backward_step.abandon(
            "the loop passes a closure to optimizer.step() (Lightning always does, also with manual optimization): "
            "a closure may run the backward inside the step call, so the step stays after backward")
        with torch.enable_grad():
            loss = closure()
        done = functools.partial(_evaluated, loss)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": done}
        return (args[0], done, *args[2:]), kwargs

    @shielded  # the paged step is not cut by a signal: one arriving meanwhile waits (interrupts.py)
    def _streamed(self, opt, own: tuple[dict, dict], args, kwargs) -> None:
        """The step itself, the optimizer's own post-hooks, then every group emptied for torch's call."""
        try:
            self._step(opt)
            for hook in own[1].values():  # its post-hooks, after the update, before the lists go
                hook(opt, args, kwargs)
            # then the global post-hooks torch would run before _post gives the lists back (torch's order)
            earlier = self._mute(self._hooks[1], after=False) if self._hooks[1] is not None else []
            for hook in earlier:
                hook(opt, args, kwargs)
        except BaseException:
            self._give_back_own_hooks(opt)
            self._unmute()
            raise
        # until _post gives the lists back, across torch's own code, a signal waits (interrupts.py):
        # left empty, zero_grad() would clear no gradient and state_dict() would raise KeyError
        hold(("optimizer step", id(opt)))
        self._stash[id(opt)] = [g["params"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["params"] = []  # the step already under way has nothing left to do
        self.capturable.for_empty_body(opt)  # its compiled code's guard holds: no recompile (CapturableFlags)

    def _refuse_duplicates(self, opt) -> None:
        """Raises PagedOptimizerError when a parameter appears twice in ``opt``'s groups. Plain
        PyTorch warns that this is deprecated and steps it twice per step, sharing one state; the
        streamed step stepped it once per chunk it landed in, with other results (silently, until
        2026-11-26)."""
        seen: set[int] = set()
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) in seen:
                    label = self.session.labels.get(id(p), f"a parameter of shape {tuple(p.shape)}")
                    raise PagedOptimizerError(
                        f"{label} appears more than once in {type(opt).__name__}'s parameter groups (PyTorch "
                        "warns this is deprecated and steps it once per appearance); the paged step cannot repeat "
                        "that: list each parameter once, or turn paging off (enable(paging='off'))")
                seen.add(id(p))

    def _take_own_hooks(self, opt) -> tuple[dict, dict]:
        """The optimizer's own step hooks (``opt.register_step_pre_hook`` / ``..._post_hook``),
        taken out of the dicts torch is about to run them from, until :meth:`_post` (or a failure)
        puts them back. Torch runs them after the global pre-hooks and before the global post-hooks:
        they saw the lists this hook empties, so a pre-hook scaling the gradients ran after the
        update and a post-hook EMA updated nothing (until 2026-11-26). :meth:`_pre` runs them
        itself, around the step, with the parameters in place."""
        self._give_back_own_hooks(opt)  # a step that raised between the hooks left them out
        pre, post = opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks
        own = (dict(pre), dict(post))
        if own[0] or own[1]:
            self._own_hooks[id(opt)] = own
            pre.clear()  # cleared in place: torch iterates views of these very dicts
            post.clear()
        return own

    def _give_back_own_hooks(self, opt) -> None:
        own = self._own_hooks.pop(id(opt), None)
        if own is not None:
            opt._optimizer_step_pre_hooks.update(own[0])
            opt._optimizer_step_post_hooks.update(own[1])

    def _step(self, opt) -> None:
        """The step itself (inside backward already, or streamed now), and the after-step callbacks."""
        if not self.session.backward_step.claim(opt):  # else: it ran inside backward, committed now
            # every page the step touches is acquired by the step itself: its ops (the optimizer's
            # arithmetic, this bookkeeping) need no op-level fault handler
            handler_off = self.session.suspend_fault_handler()
            pager = self.session.pager
            phase, pager.phase = pager.phase, "optimizer"
            try:
                self._run(opt)
            finally:
                pager.phase = phase
                if handler_off:
                    self.session.restore_fault_handler(handler_off)
        self.steps += 1
        self._last_stepped = weakref.ref(opt)
        for fn in self.after_step:
            fn(self.steps)

    def _run(self, opt) -> None:
        """The step: host-stepped parameters on the host, the rest streamed in chunks."""
        host = self.session.host_step
        if host is not None and host.hosts(opt):
            host.step(opt)  # the host-stepped parameters (see paging/host_step.py)
            full = [g["params"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in host.params]
            try:
                if any(g["params"] for g in opt.param_groups):
                    self._stream(opt)
            finally:
                for g, params in zip(opt.param_groups, full):
                    g["params"] = params
        else:
            self._stream(opt)

    def _post(self, opt, args, kwargs):
        self._give_back_own_hooks(opt)
        self._put_back_lists(opt)
        self._unmute()
        return None

    def _put_back_lists(self, opt) -> None:
        """Give ``opt``'s groups back the parameter lists :meth:`_pre` emptied (if it did): done by :meth:`_post`, or — where an interrupt landed between the two hooks — by the next
        step, ``state_dict()`` or ``load_state_dict()``."""
        saved = self._stash.pop(id(opt), None)
        if saved is not None:
            for g, params in zip(opt.param_groups, saved):
                g["params"] = params
            # the user's flag back, after a compiled step's write-back or the empty body's (see
            # CapturableFlags): here, so a checkpoint taken after an interrupt between the hooks has it too
            self.capturable.restore(opt)
        let_go(("optimizer step", id(opt)))

    def _pages_of(self, opt, p: torch.Tensor) -> tuple[list[Page], list[Page]]:
        """(pages written by ``opt``'s step, pages only read) for parameter ``p``."""
        s = self.session
        write = [pg for pg in (s.param_pages.get(id(p)),) if pg is not None]
        write += list(self.state_pages.get((id(opt), id(p)), {}).values())
        g = s.grad_pages.get(id(p))
        read = [g] if g is not None and g.state is not State.ABSENT else []
        return write, read

    def _new_state_bytes(self, opt, group: dict, params) -> int:
        """Bytes of paged state the step will create for ``params`` (0 when states stay resident:
        those are counted as kept by the session)."""
        if not self.page_states:
            return 0
        return sum(expected_state_bytes(opt, group, p) for p in params)

    def _chunks(self, opt, group: dict, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Split ``params`` into chunks of at most a third of the page budget each — pages the step
        reads and writes plus the states it will create — so a chunk, the next one's prefetch and
        the previous one's write-behind fit together."""
        limit = max(self.session.pager.budget // 3, 1)
        chunks, cur, size = [], [], 0
        for p in params:
            w, r = self._pages_of(opt, p)
            nbytes = (sum(pg.nbytes for pg in w + r) or p.untyped_storage().nbytes()) \
                + self._new_state_bytes(opt, group, [p])
            if cur and size + nbytes > limit:
                chunks.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            chunks.append(cur)
        return chunks

    def run_chunk(self, opt, gi: int, chunk: list[torch.Tensor], undo: "_StepUndo", originals: list,
                  raw=None, next_chunk: list[torch.Tensor] | None = None, first: bool = False) -> None:
        """Step ``chunk`` (parameters of ``opt.param_groups[gi]``) alone, inside the open step
        transaction: acquire its pages, keep their pre-step versions (``undo``), prefetch
        ``next_chunk``'s pages, run the optimizer's own step with the groups narrowed to the chunk,
        then release (write behind) what it touched and page the states it created.

        Args:
            originals: every group's full ``params`` list, put back after the call.
            raw: the optimizer class's unwrapped ``step`` (None: a re-entrant ``opt.step()``).
            first: the step's first chunk (prefetched after the next backward).

        Raises:
            whatever acquiring, keeping or the optimizer raised; the chunk's pins are dropped and
                the caller rolls the transaction back.
        """
        pager = self.session.pager
        group = opt.param_groups[gi]
        write, read = [], []
        for p in chunk:
            w, r = self._pages_of(opt, p)
            write += w
            read += r
        if first:
            self.first_chunk = write + read
        pager.acquire(write + read)  # in one call: making room for some never evicts the others
        done = False
        try:
            undo.keep(chunk, write)  # the pre-step versions of what this chunk modifies
            creates = self._new_state_bytes(opt, group, chunk)
            if creates:  # the step allocates these on the device: make their room first
                pager.make_room(creates, protect=write + read)
            if next_chunk:
                nxt = []
                for p in next_chunk:
                    w, r = self._pages_of(opt, p)
                    nxt += w + r
                pager.prefetch(nxt, reserve=creates)
            try:
                for gj, g in enumerate(opt.param_groups):
                    g["params"] = chunk if gj == gi else []
                if raw is not None:
                    raw(opt)
                else:
                    opt.step()  # re-entrant call; our pre-hook sees _in_step and lets it run
            finally:
                for g, params in zip(opt.param_groups, originals):
                    g["params"] = params
            done = True
        finally:
            if not done:
                pager.unpin(read)
                pager.unpin(write)
        new = []
        for p in chunk:
            pages = self._page_new_states(opt, p)
            undo.created += [(p, pg) for pg in pages]
            new += pages
        pager.release(read, evict=True)  # gradients: a clean copy is dropped, no I/O
        pager.release(write)
        if self.page_states:  # written now, their memory kept while level 0 has room for it
            pager.write_behind(write)
        pager.write_behind(new)

    def begin_transaction(self, opt) -> "_StepUndo":
        """Open a step transaction for ``opt`` outside ``optimizer.step()`` (the step inside backward,
        :mod:`~apt_model.memory.paging.backward_step`): returns its undo record, for
        :meth:`step_alone` and then ``undo.commit()`` (with ``pager.commit()``) or ``undo.rollback()``."""
        self.session.pager.begin_step()
        return _StepUndo(self, opt)

    def step_pages(self, opt, gi: int, p: torch.Tensor) -> tuple[list[Page], int]:
        """What stepping ``p`` alone holds on level 0: ``(its pages — parameter, states, gradient —,
        bytes of paged state the step will create)``."""
        w, r = self._pages_of(opt, p)
        return w + r, self._new_state_bytes(opt, opt.param_groups[gi], [p])

    def step_alone(self, opt, gi: int, p: torch.Tensor, undo: "_StepUndo") -> None:
        """Step parameter ``p`` of ``opt.param_groups[gi]`` alone, in the transaction of ``undo``
        (see :meth:`run_chunk`, whose errors it raises)."""
        originals = [g["params"] for g in opt.param_groups]
        self._in_step = True
        try:
            self.run_chunk(opt, gi, [p], undo, originals, getattr(type(opt).step, "__wrapped__", None))
        finally:
            self._in_step = False

    def _stream(self, opt: torch.optim.Optimizer) -> None:
        """Run ``opt``'s step chunk by chunk, as one transaction (see the module docstring).

        Raises:
            whatever a chunk raised (a swap error, a timeout, the optimizer's own error), after
                the step was rolled back: parameters and states are those from before the step.
            PagingRecoveryError: the roll-back itself could not restore some tensors (named; the
                original error is its cause).
        """
        pager = self.session.pager
        raw = getattr(type(opt).step, "__wrapped__", None)
        originals = [g["params"] for g in opt.param_groups]
        self._in_step = True
        undo = _StepUndo(self, opt)
        try:
            pager.begin_step()
            plan = []
            for gi, group_params in enumerate(originals):
                group = opt.param_groups[gi]
                plan.append((gi, group, self._chunks(opt, group, [p for p in group_params if p.grad is not None])))
            for _, _, chunks in plan:  # copies of what the plan keeps resident: written while chunks run
                for chunk in chunks:
                    undo.start(chunk)
            for gi, group, chunks in plan:
                for ci, chunk in enumerate(chunks):
                    nxt = chunks[ci + 1] if ci + 1 < len(chunks) else None
                    self.run_chunk(opt, gi, chunk, undo, originals, raw, nxt, first=gi == 0 and ci == 0)
            pager.commit()
            for p, label in undo.copied_params():
                self._copied[p] = label
            undo.commit()
            pager.trim()  # the step's temporaries and freed chunks go back to the OS
        except BaseException as err:
            lost = undo.rollback()
            if lost:
                raise PagingRecoveryError(
                    f"{type(opt).__name__}.step() failed ({type(err).__name__}: {err}) and could not be rolled back "
                    f"completely: {', '.join(lost)} could not be restored to their pre-step values ("
                    + "; ".join(f"{k}: {v}" for k, v in lost.items()) + ")", lost=lost) from err
            log.info("%s.step() failed (%s: %s); the step was rolled back: parameters and optimizer states are "
                     "those from before it", type(opt).__name__, type(err).__name__, err)
            raise
        finally:
            self._in_step = False

    # ------------------------------------------------------------------ state_dict
    def param_order(self, opt) -> list[torch.Tensor]:
        """``opt``'s parameters in ``state_dict()`` order (its groups' lists, as the user set them)."""
        saved = self._stash.get(id(opt))
        groups = saved if saved is not None else [g["params"] for g in opt.param_groups]
        return [p for params in groups for p in params]

    def _before_state_dict(self, opt):
        self._put_back_lists(opt)
        self.session.backward_step.settle("the optimizer's state_dict() was taken between backward and "
                                          "optimizer.step()")

    def _before_load(self, opt, state_dict):
        self._put_back_lists(opt)
        self.session.backward_step.settle("the optimizer's load_state_dict() was called between backward and "
                                          "optimizer.step()")
        return None

    def _state_dict_hook(self, opt, state_dict):
        for idx, p in enumerate(self.param_order(opt)):
            pages = self.state_pages.get((id(opt), id(p)))
            entry = state_dict["state"].get(idx)
            if not pages or entry is None:
                continue
            entry = dict(entry)  # torch packs the live per-parameter dict: never edit it in place
            for k, page in pages.items():
                if k in entry:  # a copy even when resident: an alias would die with the next eviction
                    entry[k] = self.session.pager.materialize(page)
            state_dict["state"][idx] = entry
        return state_dict

    def _loaded_hook(self, opt):
        self._page_existing_states(opt)
        pages = [pg for p in self.param_order(opt) for pg in self.state_pages.get((id(opt), id(p)), {}).values()]
        self.session.pager.evict_now(pages)
        return None


class _StepUndo:
    """What one streamed optimizer step modifies, kept until the step commits (see the module
    docstring): each parameter's state dict entries, pre-step copies of the tensors that are not
    paged, and the pages the step created. Paged parameters and states keep their pre-step copy
    through the pager's step transaction.

    A tensor the plan keeps resident (a parameter, or a state when states are not paged) is copied
    to the level below straight from its own memory (:meth:`Pager.copy_out`: no second copy on
    level 0, whose budget the step's working set already fills) — all of them started when the
    step starts, each waited for just before its chunk runs — and read back only if the step
    fails. Scalars (Adam's ``step``) are cloned.
    """

    def __init__(self, paging: OptimizerPaging, opt: torch.optim.Optimizer):
        self.paging = paging
        self.opt = opt
        self.pager = paging.session.pager
        self.entries: dict[int, tuple[torch.Tensor, dict | None]] = {}  # id(param) -> (param, state dict copy)
        self.clones: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, pre-step clone)
        self.copies: dict[int, tuple[torch.Tensor, str, Page]] = {}  # id(tensor) -> (tensor, label, copy below)
        self.created: list[tuple[torch.Tensor, Page]] = []  # (param, state page the step created)
        self.confirmed: set[int] = set()  # id() of copied tensors whose chunk was about to run
        self.cloned: set[int] = set()  # id() of the tensors in ``clones``
        if paging.early:  # take over the pre-step copies started in backward of the parameters opt steps
            self.copies.update(paging.take_early(p for g in opt.param_groups for p in g["params"]))

    def copied_params(self) -> list[tuple[torch.Tensor, str]]:
        """(parameter, label) of the resident parameters this step copied (worth copying in the next
        backward)."""
        return [(t, label) for key, (t, label, _) in self.copies.items() if key in self.entries]

    def resident_tensors(self, p: torch.Tensor):
        """(tensor, label) of what the step modifies for ``p`` that is not paged."""
        session = self.paging.session
        label = session.param_label(p)
        pages = self.paging.state_pages.get((id(self.opt), id(p)), {})
        for k, v in self.opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and k not in pages:  # paged states are in the pager's transaction
                yield v, f"{label}:{k}"
        if id(p) not in session.param_pages:
            yield p, label  # a parameter the plan keeps resident

    def _copied_below(self, t: torch.Tensor) -> bool:
        return t.numel() >= 2 and t.device.type == self.pager.device.type

    def start(self, chunk: list[torch.Tensor]) -> None:
        """Start writing the pre-step copies of ``chunk``'s resident tensors in the background (the
        step modifies them only when ``chunk`` runs; :meth:`keep` waits for them then, and copies
        again a tensor whose ``_version`` says it was modified meanwhile)."""
        for p in chunk:
            for t, label in self.resident_tensors(p):
                if self._copied_below(t) and id(t) not in self.copies:
                    self.copies[id(t)] = (t, label, marked_copy(self.pager, t, label))

    def keep(self, chunk: list[torch.Tensor], write_pages: list[Page]) -> None:
        """Keep the pre-step state of ``chunk`` (acquired: its pages are resident and pinned)
        before it runs.

        Raises:
            SwapError: a pre-step copy could not be written (nothing of this chunk was modified).
            SwapTimeoutError: such a write did not finish within ``VB_SWAP_TIMEOUT`` seconds.
        """
        self.start(chunk)
        for p in chunk:
            if id(p) in self.entries:
                continue
            st = self.opt.state.get(p)
            self.entries[id(p)] = (p, None if st is None else dict(st))
            for t, label in self.resident_tensors(p):
                if id(t) in self.copies:
                    copy = self.copies[id(t)][2]
                    self.pager.copy_wait(copy)
                    if copy.version != version_mark(t):  # changed since the copy started: copy it again
                        self.pager.copy_drop(copy)
                        copy = marked_copy(self.pager, t, label)
                        self.copies[id(t)] = (t, label, copy)
                        self.pager.copy_wait(copy)
                    self.confirmed.add(id(t))
                elif id(t) not in self.cloned:
                    self.cloned.add(id(t))
                    with torch.no_grad(), torch._C.DisableTorchFunction():
                        self.clones.append((t, t.detach().clone()))
        self.pager.protect(write_pages)

    def commit(self) -> None:
        """The step completed: drop the pre-step copies."""
        for _, _, copy in self.copies.values():
            self.pager.copy_drop(copy)
        self.copies.clear()
        self.confirmed.clear()
        self.clones.clear()
        self.cloned.clear()
        self.entries.clear()
        self.created.clear()

    def rollback(self) -> dict[str, str]:
        """Put everything the step touched back as it was; returns ``{label: why}`` for tensors that
        could not be (their pre-step copy was unreadable)."""
        lost = self.pager.rollback()
        for p, page in self.created:
            self.pager.discard(page)
            pages = self.paging.state_pages.get((id(self.opt), id(p)), {})
            for k, pg in list(pages.items()):
                if pg is page:
                    del pages[k]
        for p, entry in self.entries.values():
            if entry is None:
                self.opt.state.pop(p, None)
            else:
                cur = self.opt.state.get(p)
                if cur is None:  # the script dropped it since (a step taken inside backward, then the
                    continue  # parameter taken out of the optimizer): it stays out, as in plain PyTorch
                cur.clear()
                cur.update(entry)
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for t, copy in self.clones:
                t.copy_(copy)
        for key, (t, label, copy) in self.copies.items():
            try:
                if key in self.confirmed:  # its chunk ran (or started): it may have been modified
                    self.pager.copy_in(copy, t)
            except Exception as err:  # noqa: BLE001 - every other tensor is still restored
                lost[label] = f"its pre-step copy could not be read back: {err}"
            finally:
                self.pager.copy_drop(copy)
        self.confirmed.clear()
        self.copies.clear()
        self.clones.clear()
        self.cloned.clear()
        self.entries.clear()
        self.created.clear()
        return lost
