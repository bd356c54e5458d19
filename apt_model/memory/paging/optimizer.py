"""The user's own ``torch.optim`` optimizer, stepped in chunks through fast memory.

A global optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
catches every ``optimizer.step()`` — optimizers created before or after enabling. For one that
holds paged parameters, gradients or states, the hook runs the step itself, chunk by chunk: it
acquires a chunk's parameters, gradients and states, prefetches the next chunk, and calls the
optimizer's own (unhooked) step with each parameter group's ``params`` temporarily narrowed to
the chunk. Then it narrows every group to nothing for the call that is already under way, and a
post-hook puts the lists back. New optimizer states (created on the first step) are paged.

Why this is exact: the supported optimizers update each parameter from its own gradient and
state only (SGD, Adam, AdamW, RMSprop, Adagrad, Adamax, NAdam, RAdam, Adadelta); a chunk runs
the same per-tensor arithmetic — the single-tensor loop on CPU, the same ``_foreach`` kernels
on accelerators — as the full step would. An optimizer outside that list, or a ``step(closure)``
call, is refused with a clear error rather than stepped differently.

``optimizer.state_dict()`` materializes paged states (copies) so it can be saved;
``optimizer.load_state_dict()`` pages the loaded states again.

The budget holds through the first step too, when the optimizer creates its states: a chunk's
size counts the states its step will create (:func:`expected_state_bytes`: Adam's m and v, SGD's
momentum buffer...), room for them is made before the chunk runs, and the next chunk's prefetch
leaves that room free.
"""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from apt_model.errors import VBError
from apt_model.memory.pages import Category, Page, State

#: Optimizers whose update of one parameter depends on that parameter's gradient and state only.
PER_PARAMETER = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
)


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
    if isinstance(opt, torch.optim.Adagrad):
        return 1
    return 2  # Adamax (exp_avg, exp_inf), NAdam, RAdam, Adadelta (square_avg, acc_delta)


def expected_state_bytes(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> int:
    """Bytes of state ``opt``'s next step will create for ``p`` on its device: 0 when the state
    exists already, else the state tensors of ``p``'s size the optimizer creates (scalars such as
    Adam's ``step`` are not counted)."""
    st = opt.state.get(p)
    if st and any(isinstance(v, torch.Tensor) and v.numel() >= 2 for v in st.values()):
        return 0
    return _state_copies(opt, group) * p.numel() * p.element_size()


class OptimizerPaging:
    """Global step hooks plus per-optimizer state pages for one paging session."""

    def __init__(self, session, page_states: bool):
        self.session = session
        self.page_states = page_states
        self.state_pages: dict[int, dict[str, Page]] = {}  # id(param) -> {state key: page}
        self.known: weakref.WeakSet = weakref.WeakSet()
        self._stash: dict[int, list] = {}
        self._in_step = False
        self.steps = 0
        self.first_chunk: list[Page] = []  # pages of the last step's first chunk, prefetched after backward

    def install(self, patches) -> None:
        patches.add_handle(register_optimizer_step_pre_hook(self._pre), "optimizer step pre-hook")
        patches.add_handle(register_optimizer_step_post_hook(self._post), "optimizer step post-hook")

    # ------------------------------------------------------------------ discovery
    def _involves_paging(self, opt: torch.optim.Optimizer) -> bool:
        s = self.session
        return any(id(p) in s.params for g in opt.param_groups for p in g["params"])

    def _adopt(self, opt: torch.optim.Optimizer, patches) -> None:
        if opt in self.known:
            return
        if not isinstance(opt, PER_PARAMETER):
            names = ", ".join(c.__name__ for c in PER_PARAMETER)
            raise PagedOptimizerError(
                f"{type(opt).__name__} holds paged parameters but is not known to update each parameter "
                f"independently, so it cannot be stepped in chunks; use one of {names}, or turn paging off "
                "(enable(paging='off'))"
            )
        self.known.add(opt)
        patches.add_handle(opt.register_state_dict_post_hook(self._state_dict_hook), f"{type(opt).__name__} state_dict hook")
        patches.add_handle(opt.register_load_state_dict_post_hook(self._loaded_hook),
                           f"{type(opt).__name__} load_state_dict hook")
        self._page_existing_states(opt)

    def _page_existing_states(self, opt: torch.optim.Optimizer) -> None:
        for g in opt.param_groups:
            for p in g["params"]:
                self._page_new_states(opt, p)

    def _page_new_states(self, opt: torch.optim.Optimizer, p: torch.Tensor) -> list[Page]:
        if not self.page_states:
            return []
        pages = self.state_pages.setdefault(id(p), {})
        new = []
        for k, v in opt.state.get(p, {}).items():
            if not isinstance(v, torch.Tensor) or v.numel() < 2 or v.device != p.device:
                continue  # scalars such as Adam's 'step' (kept on the CPU) stay resident
            page = pages.get(k)
            if page is None or page.tensor_of() is not v:
                if page is not None:
                    self.session.pager.unregister(page)
                if not v.untyped_storage().resizable():  # e.g. loaded from a checkpoint buffer
                    v = opt.state[p][k] = v.clone()
                label = f"{self.session.param_label(p)}:{k}"
                page = self.session.pager.register(Category.STATE, (lambda opt=opt, p=p, k=k: opt.state[p].get(k)), label)
                pages[k] = page
                new.append(page)
        return new

    # ------------------------------------------------------------------ the step
    def _pre(self, opt, args, kwargs):
        if self._in_step or not self._involves_paging(opt):
            return None
        self._adopt(opt, self.session.patches)
        # torch passes the wrapped call's positional arguments, the optimizer itself first
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:
            raise PagedOptimizerError(
                f"{type(opt).__name__}.step(closure) re-evaluates the model inside the step, which cannot be "
                "streamed in chunks; call loss.backward() yourself and then optimizer.step() without a closure"
            )
        self._stream(opt)
        self._stash[id(opt)] = [g["params"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["params"] = []  # the step already under way has nothing left to do
        return None

    def _post(self, opt, args, kwargs):
        saved = self._stash.pop(id(opt), None)
        if saved is not None:
            for g, params in zip(opt.param_groups, saved):
                g["params"] = params
        return None

    def _pages_of(self, p: torch.Tensor) -> tuple[list[Page], list[Page]]:
        """(pages written by the step, pages only read) for parameter ``p``."""
        s = self.session
        write = [pg for pg in (s.param_pages.get(id(p)),) if pg is not None]
        write += list(self.state_pages.get(id(p), {}).values())
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
            w, r = self._pages_of(p)
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

    def _stream(self, opt: torch.optim.Optimizer) -> None:
        pager = self.session.pager
        raw = getattr(type(opt).step, "__wrapped__", None)
        originals = [g["params"] for g in opt.param_groups]
        self._in_step = True
        try:
            for gi, group_params in enumerate(originals):
                group = opt.param_groups[gi]
                with_grad = [p for p in group_params if p.grad is not None]
                chunks = self._chunks(opt, group, with_grad)
                for ci, chunk in enumerate(chunks):
                    write, read = [], []
                    for p in chunk:
                        w, r = self._pages_of(p)
                        write += w
                        read += r
                    if gi == 0 and ci == 0:
                        self.first_chunk = write + read
                    pager.acquire(write, for_write=True)
                    pager.acquire(read)
                    creates = self._new_state_bytes(opt, group, chunk)
                    if creates:  # the step allocates these on the device: make their room first
                        pager.make_room(creates, protect=write + read)
                    if ci + 1 < len(chunks):
                        nxt = []
                        for p in chunks[ci + 1]:
                            w, r = self._pages_of(p)
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
                    new = []
                    for p in chunk:
                        new += self._page_new_states(opt, p)
                    pager.release(read, evict=True)
                    pager.release(write, evict=bool(self.page_states))
                    pager.evict_now(new)
            self.steps += 1
            pager.trim()  # the step's temporaries and freed chunks go back to the OS
        finally:
            self._in_step = False

    # ------------------------------------------------------------------ state_dict
    def _param_order(self, opt) -> list[torch.Tensor]:
        saved = self._stash.get(id(opt))
        groups = saved if saved is not None else [g["params"] for g in opt.param_groups]
        return [p for params in groups for p in params]

    def _state_dict_hook(self, opt, state_dict):
        for idx, p in enumerate(self._param_order(opt)):
            pages = self.state_pages.get(id(p))
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
        pages = [pg for p in self._param_order(opt) for pg in self.state_pages.get(id(p), {}).values()]
        self.session.pager.evict_now(pages)
        return None
