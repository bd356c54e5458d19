"""The optimizer step on the host, over host-resident states (placement ``host``; see
:mod:`~apt_model.memory.paging.step_placement` for when it is chosen).

For each user optimizer whose parameters are host-stepped, a *shadow* optimizer of the same class
and hyperparameters steps host copies of those parameters:

1. **Hyperparameters** are copied from the user's parameter groups before every step (a learning
   rate scheduler changes the user's ``lr``; the shadow follows).
2. **Gradients down.** Each gradient is paged down as it is produced (the gradient pages of
   :mod:`~apt_model.memory.paging.model`, written behind into the host level during backward).
   For Adam and AdamW (:data:`SHARES_GRADIENTS`: their steps only read a gradient) the step reads
   the host copy where it lies in pinned memory, no copy made; otherwise — a deferred
   ``clip_grad_norm_`` scaling still owed, a copy spilled to disk, another optimizer class — the
   current value is read into a reused host buffer. A gradient whose copy down is still under way
   is waited for by that copy's event; if the wait fails, it is read from device memory. A
   gradient the plan keeps on the device is copied down here.
3. **The step** runs on the host copies (in the parameter's own dtype): the states (Adam's m and v...) are created there and
   never reach the device. With ``exact=False`` the shadow uses the CPU's fused kernel where the
   class has one (probed), else the per-tensor loop.
4. **Parameters up.** Each updated host copy is copied into the device parameter in place
   (``copy_``; non-blocking from pinned memory on an accelerator, ordered on the compute stream
   before the next forward). An event recorded after the copies is waited for (that event only,
   never the whole device) before the next step writes the host copies again.

**Chunks, in the order the gradients landed.** For the built-in optimizers whose update of a
parameter reads nothing of another (:data:`~apt_model.memory.paging.optimizer.PER_PARAMETER`: SGD,
Adam, AdamW...; here the exact class, not a subclass, which may couple them) the parameters are stepped in chunks of about
:data:`CHUNK_BYTES`, in the order their gradients landed in the last backward (the last layers
first), each chunk's parameters copied up as soon as it is stepped. Where every gradient's host
copy is in host memory, each chunk reads its own gradients just before its step, waiting for
those copies only: on an accelerator the host steps the first chunks while later gradients are
still on their way down (the scheme of torchao's ``CPUOffloadOptimizer``, which steps each
parameter once its gradient's copy event completed), and the uploads overlap the later chunks'
steps. Each parameter's update is the same whichever chunk it is in (its own state, its own
``step`` count), so the result is bitwise the one whole step. Other optimizer classes are stepped
whole, once.

The host copy of a parameter is refreshed from the device whenever the parameter changed since
the last upload — ``p._version`` or its storage moved (``p.data.mul_()``, ``p.data = ...``,
``load_state_dict`` on the model) — so code that edits weights between steps is followed.

The user's optimizer holds no state for host-stepped parameters: ``optimizer.state_dict()``
returns the shadow's states (host tensors, in the user's parameter order) and
``load_state_dict()`` replaces the shadow's states with the loaded ones (a parameter the loaded
dict has no state for starts afresh, as in plain PyTorch); a state dict saved from plain training
loads here and vice versa. Parameters added to the optimizer after its first host step
(``add_param_group``) are refused with an error naming them.

A step is all or nothing up to the upload where a read can fail: when some gradient's host copy
was spilled to disk (or is being loaded), every gradient is read (and every copy refreshed) before
anything is modified, so a read error (a corrupt swap file) leaves parameters and states as they
were. A read from host memory, or from device memory where a copy down failed, cannot fail that
way. The shadow's own step raising in a later chunk (the host running out of memory for the states a first step
creates) leaves the chunks before it stepped (and uploaded) and the rest as they were — plain
PyTorch would have raised before any update; the exception then carries a note (``add_note``)
naming the parameters already updated.

The shadow optimizer is stepped through its class's own ``step`` beneath torch's hook wrapper, so
optimizer step hooks registered globally (``register_optimizer_step_pre_hook``) see the user's
``optimizer.step()`` once per step, as in plain PyTorch, and never the shadow's chunks.
"""
from __future__ import annotations

import time
import weakref

import torch

from apt_model.base.log import get_logger
from apt_model.memory.pages import State
from apt_model.memory.stores import pinned_bytes
from apt_model.memory.paging.optimizer import PER_PARAMETER

log = get_logger(__name__)

#: Group keys not copied from the user's groups to the shadow's: the kernel choice is the shadow's
#: own (host tensors), and ``params`` are the host copies.
_OWN_KEYS = ("params", "foreach", "fused", "capturable")

#: Optimizer classes (exact types) whose steps — single-tensor, foreach and fused — only read a
#: gradient, so the shadow may read a gradient page's host copy in place. Not SGD: its foreach
#: path with Nesterov momentum adds into the gradients.
SHARES_GRADIENTS = (torch.optim.Adam, torch.optim.AdamW)

#: Bytes of parameters per chunk of the host step (64 MiB: a few tens of chunks for a model of
#: gigabytes, each long enough that the optimizer's per-call cost stays small beside it).
CHUNK_BYTES = 64 * 2**20


class _Shadow:
    """The host side of one user optimizer: host copies of its parameters, gradient buffers, and
    the shadow optimizer stepping them."""

    def __init__(self, opt: torch.optim.Optimizer, params: set[int], pin: bool, fused: bool):
        self.opt_ref = weakref.ref(opt)
        self.pin = pin
        self.masters: dict[int, torch.Tensor] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.marks: dict[int, tuple[int, int]] = {}  # id(p) -> (p._version, p.data_ptr()) after the last upload
        self.refreshes = 0
        groups = []
        for g in opt.param_groups:
            hosted = [self._master(p) for p in g["params"] if id(p) in params]
            opts = {k: v for k, v in g.items() if k not in _OWN_KEYS}
            opts.update(self._kernel(g, fused))
            groups.append({"params": hosted, **opts})
        self.fused = fused
        try:
            self.host = type(opt)(groups)
        except (RuntimeError, TypeError, ValueError) as err:  # fused not supported for this class on the CPU
            if not fused:
                raise
            log.info("%s(fused=True) on the host failed (%s); the host step uses the per-tensor loop",
                     type(opt).__name__, err)
            for grp, g in zip(groups, opt.param_groups):  # the user's own kernel choice again
                grp.pop("fused", None)
                grp.pop("foreach", None)
                grp.update(self._kernel(g, False))
            self.fused = False
            self.host = type(opt)(groups)
        self.event = None

    @staticmethod
    def _kernel(group: dict, fused: bool) -> dict:
        if fused:
            return {"fused": True, "foreach": False}
        return {k: group[k] for k in ("foreach", "fused") if k in group and group[k] is not None}

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch._C.DisableTorchFunction():
            m = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.pin)
            m.copy_(p.detach())
        self.masters[id(p)] = m
        self.marks[id(p)] = (p._version, p.data_ptr())
        return m

    def refresh(self, p: torch.Tensor) -> None:
        """Copy ``p`` into its host copy again if it changed since the last upload."""
        if self.marks.get(id(p)) != (p._version, p.data_ptr()):
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self.masters[id(p)].copy_(p.detach())
            self.marks[id(p)] = (p._version, p.data_ptr())
            self.refreshes += 1

    def grad_buffer(self, p: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        buf = self.grads.get(id(p))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.grads[id(p)] = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)
        return buf


class HostStep:
    """Steps the optimizers of host-stepped parameters on the host (see the module docstring).

    Args:
        session: the :class:`~apt_model.memory.paging.session.PagingSession`.
        fused: use the CPU's fused kernel where the optimizer class has one (only when the step
            need not be exact).
    """

    def __init__(self, session, fused: bool = False):
        self.session = session
        self.fused = fused
        self.params: set[int] = set()  # id(p) of the parameters stepped on the host
        self.shadows: dict[int, _Shadow] = {}  # id(user optimizer) -> its host side
        self.steps = 0
        self.seconds = 0.0  # wall seconds in host steps (gradients down, step, parameters up)
        self.step_seconds = 0.0  # of which the shadow optimizer's step
        self.grad_bytes = 0  # gradients read on the host
        self.shared_bytes = 0  # of which read where their page's host copy lies (not copied)
        self.param_bytes = 0  # parameters copied up
        self.chunks = 0  # shadow-optimizer steps, over all steps (one per chunk)
        self.interleaved = 0  # steps whose chunks read their own gradients (all host copies in memory)
        self._landed: dict[int, None] = {}  # id(p), in the order the gradients landed in the last backward
        self._stepped = False  # a step ran since the last gradient landed: the next landing starts a new order
        self.ordered = 0  # optimizer steps whose chunks followed a landing order

    def add(self, params) -> None:
        """Step these parameters (resident on the compute device) on the host from now on."""
        self.params.update(id(p) for p in params)

    def retire_dead(self) -> None:
        """Drop the host side of optimizers that were garbage-collected (their parameter copies,
        gradient buffers and states: a model's size in host memory each) and the landing order of
        parameters no longer stepped here (the session calls it; see ``PagingSession.retire_dead``)."""
        if any(sh.opt_ref() is None for sh in self.shadows.values()):
            self.shadows = {k: sh for k, sh in self.shadows.items() if sh.opt_ref() is not None}
        if any(k not in self.params for k in self._landed):
            self._landed = {k: None for k in self._landed if k in self.params}

    def landed(self, p: torch.Tensor) -> None:
        """``p``'s gradient is complete (called by the session as each one lands in backward)."""
        if id(p) in self.params:
            if self._stepped:  # the first gradient after a step: every optimizer stepped from the old order
                self._landed.clear()
                self._stepped = False
            self._landed.pop(id(p), None)
            self._landed[id(p)] = None

    def _order(self, hosted: list[torch.Tensor]) -> list[torch.Tensor]:
        """``hosted`` in the order their gradients landed last, then those that did not land."""
        rank = {k: i for i, k in enumerate(self._landed)}
        n = len(rank)
        return sorted(hosted, key=lambda p: rank.get(id(p), n))

    def hosts(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        """``opt``'s parameters that are stepped on the host."""
        return [p for g in opt.param_groups for p in g["params"] if id(p) in self.params]

    def _shadow(self, opt: torch.optim.Optimizer) -> _Shadow:
        sh = self.shadows.get(id(opt))
        if sh is None or sh.opt_ref() is not opt:
            pin = self.session.pager.device.type != "cpu"
            sh = self.shadows[id(opt)] = _Shadow(opt, self.params, pin, self.fused)
            self.session.patches.add_handle(opt.register_state_dict_post_hook(self._state_dict_hook),
                                            f"{type(opt).__name__} host-step state_dict hook")
            self.session.patches.add_handle(opt.register_load_state_dict_post_hook(self._loaded_hook),
                                            f"{type(opt).__name__} host-step load_state_dict hook")
            self._take_states(opt, sh)  # states loaded (or made) before the first host step
        return sh

    def _grad_to_host(self, sh: _Shadow, p: torch.Tensor, share: bool) -> torch.Tensor | None:
        """``p``'s current gradient on the host (None when it has none): with ``share``, its page's
        host copy itself where that is the current value (no copy; the step only reads it), else
        a copy in a reused host buffer."""
        session = self.session
        page = session.grad_page(p)
        if page is not None:
            with torch._C.DisableTorchFunction():
                g = page.bound()
                if g is None:
                    return None
                if share:
                    view = session.pager.host_copy(page)
                    if view is not None:
                        self.shared_bytes += view.numel() * view.element_size()
                        return view
                buf = sh.grad_buffer(p, g)
            session.pager.materialize(page, out=buf, settle=not share)  # host_copy settled it already
            return buf
        with torch._C.DisableTorchFunction():
            g = p.grad
            if g is None:
                return None
            buf = sh.grad_buffer(p, g)
            buf.copy_(g.detach())
        return buf

    def step(self, opt: torch.optim.Optimizer) -> None:
        """Step ``opt``'s host-stepped parameters on the host.

        Raises:
            SwapError and its kinds: a gradient's host copy could not be read from disk (nothing was
                modified).
            RuntimeError: a parameter was added to ``opt`` after its first host step.
            whatever the shadow optimizer raises (as plain PyTorch would); raised from a chunk after
                the first, with a note naming the parameters already updated.
        """
        t0 = time.perf_counter()
        sh = self._shadow(opt)
        if sh.event is not None:  # the last upload must have left the host copies before they change
            sh.event.synchronize()
            sh.event = None
        for ug, hg in zip(opt.param_groups, sh.host.param_groups):
            for k, v in ug.items():
                if k not in _OWN_KEYS:
                    hg[k] = v
        hosted = self.hosts(opt)
        if any(id(p) in self._landed for p in hosted):
            hosted = self._order(hosted)
            self.ordered += 1
        self._stepped = True  # kept for this step's other optimizers; a new backward starts afresh
        for p in hosted:
            if id(p) not in sh.masters:  # added to the group after the shadow was built
                raise RuntimeError(f"{self.session.param_label(p)} was added to {type(opt).__name__} after its "
                                   "first host step; create the optimizer with all its parameters")
        chunks = self._chunks(opt, hosted)
        interleave = len(chunks) > 1 and self._all_in_memory(hosted)
        share = type(opt) in SHARES_GRADIENTS
        raw = getattr(type(sh.host).step, "__wrapped__", type(sh.host).step)  # beneath the hook wrapper
        grads = {} if interleave else self._read(sh, hosted, share)  # all first: a disk read error modifies nothing
        stepped = []
        try:
            for chunk in chunks:
                if interleave:
                    grads = self._read(sh, chunk, share)
                done = [p for p in chunk if grads.get(id(p)) is not None]
                t1 = time.perf_counter()
                try:
                    for p in done:
                        sh.masters[id(p)].grad = grads[id(p)]
                    if done:
                        raw(sh.host)
                        self.chunks += 1
                finally:
                    self.step_seconds += time.perf_counter() - t1
                    for p in done:
                        sh.masters[id(p)].grad = None
                self._upload(sh, done)
                stepped.extend(done)
        except BaseException as err:
            if stepped:  # the raising chunk and those after it are as they were; say which were updated
                names = ", ".join(self.session.param_label(p) for p in stepped[:8])
                more = f" and {len(stepped) - 8} more" if len(stepped) > 8 else ""
                err.add_note(f"apt_model host step: {len(stepped)} of {len(hosted)} parameters of this "
                             f"{type(opt).__name__}.step() were already updated (with their states) before it raised: "
                             f"{names}{more}; the others were not")
            raise
        finally:
            if sh.pin and stepped:
                sh.event = torch.Event(device=stepped[0].device)
                sh.event.record()
        self.interleaved += interleave
        self.steps += 1
        self.seconds += time.perf_counter() - t0

    def _chunks(self, opt: torch.optim.Optimizer, hosted: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``hosted`` cut into chunks of about :data:`CHUNK_BYTES` (one chunk for a class that is not
        exactly one of :data:`~apt_model.memory.paging.optimizer.PER_PARAMETER`)."""
        if type(opt) not in PER_PARAMETER:
            return [hosted] if hosted else []
        chunks, cur, size = [], [], 0
        for p in hosted:
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= CHUNK_BYTES:
                chunks.append(cur)
                cur, size = [], 0
        if cur:
            chunks.append(cur)
        return chunks

    def _all_in_memory(self, hosted: list[torch.Tensor]) -> bool:
        """Every gradient page of ``hosted`` has its lower copy in host memory (or none is paged)."""
        store = self.session.pager.store
        for p in hosted:
            page = self.session.grad_page(p)
            if page is None:
                continue
            if page.state is State.LOADING or (page.state is State.LOWER and not store.in_memory(page)):
                return False  # a read from disk (or a load under way, which may be one) can fail
        return True

    def _read(self, sh: _Shadow, params: list[torch.Tensor], share: bool) -> dict[int, torch.Tensor | None]:
        """Refresh the host copies of ``params`` and get their gradients on the host."""
        out = {}
        for p in params:
            sh.refresh(p)
            g = out[id(p)] = self._grad_to_host(sh, p, share)
            if g is not None:
                self.grad_bytes += g.numel() * g.element_size()
        return out

    def _upload(self, sh: _Shadow, params: list[torch.Tensor]) -> None:
        """Copy the stepped host copies of ``params`` into the device parameters."""
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for p in params:
                m = sh.masters[id(p)]
                p.copy_(m, non_blocking=sh.pin)
                sh.marks[id(p)] = (p._version, p.data_ptr())
                self.param_bytes += m.numel() * m.element_size()

    # ------------------------------------------------------------------ state_dict
    def _state_dict_hook(self, opt, state_dict):
        sh = self.shadows.get(id(opt))
        if sh is None:
            return state_dict
        order = self.session.optimizers.param_order(opt)
        for idx, p in enumerate(order):
            m = sh.masters.get(id(p))
            st = sh.host.state.get(m) if m is not None else None
            if st:
                state_dict["state"][idx] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        return state_dict

    def _loaded_hook(self, opt):
        sh = self._shadow(opt)
        for m in sh.masters.values():  # a load replaces the whole state, as in plain PyTorch
            sh.host.state.pop(m, None)
        self._take_states(opt, sh)
        return None

    def _take_states(self, opt, sh: _Shadow) -> None:
        """Move the states ``opt`` holds for host-stepped parameters into the shadow (host tensors)."""
        for p in [p for g in opt.param_groups for p in g["params"] if id(p) in self.params]:
            m = sh.masters.get(id(p))
            if m is None:
                continue  # not hosted by this shadow: its state stays where torch put it
            st = opt.state.pop(p, None)
            if st is None:
                continue
            sh.host.state[m] = {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) and v.dim() > 0
                                    else (v.detach().cpu() if isinstance(v, torch.Tensor) else v))
                                for k, v in st.items()}

    # ------------------------------------------------------------------ report
    def host_bytes(self) -> int:
        """Host bytes the host step holds: parameter copies and gradient buffers (pinned ones as
        pinned, rounded up to a power of two each: :func:`~apt_model.memory.stores.pinned_bytes`)
        and states."""
        n = 0
        for sh in self.shadows.values():
            n += sum(pinned_bytes(t.numel() * t.element_size(), sh.pin) for t in sh.masters.values())
            n += sum(pinned_bytes(t.numel() * t.element_size(), sh.pin) for t in sh.grads.values())
            for st in sh.host.state.values():
                n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        return n

    def report(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "parameters": len(self.params),
                "seconds_per_step": round(self.seconds / n, 4), "step_seconds_per_step": round(self.step_seconds / n, 4),
                "grad_bytes_down_per_step": self.grad_bytes // n, "param_bytes_up_per_step": self.param_bytes // n,
                "host_bytes": self.host_bytes(), "fused": any(sh.fused for sh in self.shadows.values()),
                "copies_refreshed": sum(sh.refreshes for sh in self.shadows.values()),
                "chunks_per_step": round(self.chunks / n, 2), "interleaved_steps": self.interleaved,
                "landing_ordered_steps": self.ordered,
                "grad_bytes_shared_per_step": self.shared_bytes // n}
