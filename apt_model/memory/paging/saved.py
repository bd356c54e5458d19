"""Pages that autograd saves stay resident for as long as the graph holding them lives.

Autograd keeps references to some tensors an op used (``p.pow(2)`` saves ``p``; ``x @ w.t()``
saves a view of ``w``) and reads them in backward. A saved tensor that shares a page's storage
reads freed memory (garbage or a crash) once that page is evicted. Two cases are not covered by the
module hooks (which bring a unit's parameters back when backward reaches it):

* **ops outside a module's forward** — a regularizer over the parameters
  (``loss + wd * sum(p.pow(2).sum() for p in model.parameters())``), a penalty on the gradients —
  and ops inside a forward on a page no module hook had pinned (a parameter used outside its
  module). The page-fault handler runs such an op under :class:`SavedPins`;
* **a backward that builds a graph** (``create_graph=True``: ``torch.autograd.grad`` for a gradient
  penalty, or ``backward(create_graph=True)``): the backward formulas save parameters into the
  new graph (the input gradient of ``x @ w.t()`` saves ``w``). The session's wrappers of
  ``torch.autograd.backward`` and ``torch.autograd.grad`` run it under :class:`SavedPins`, which
  the autograd engine carries onto its device threads.

:class:`SavedPins` is a ``torch.autograd.graph.saved_tensors_hooks``: its pack hook checks whether
the saved tensor's storage is a page's and, if so, pins that page and returns a holder whose
finalizer lets the pin go — when autograd frees the saved tensor (after the backward that used
it, without ``retain_graph``) or the graph is dropped. Other tensors go to the hooks that were
active before (activation offload, checkpointing) or are saved as usual. The saved values are the
tensors themselves: nothing is copied, so results are bitwise those of unpaged training.
"""
from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks


class _Pinned:
    """A saved value (the tensor, detached, or what outer hooks packed it into) whose page is
    pinned until this holder is freed."""

    __slots__ = ("value", "__weakref__")

    def __init__(self, value):
        self.value = value


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its autograd history: an op that saves its own output (``exp``, ``tanh``,
    ``norm``) would otherwise hold its node through the saved tensor, a reference cycle across
    C++ that the garbage collector cannot break (torch's own hooks must not return the input as
    is, for the same reason). Autograd re-attaches the saved tensor's history on unpack."""
    with torch._C.DisableTorchFunction():
        return t.detach()


class SavedPins(saved_tensors_hooks):
    """Saved-tensor hooks that pin the pages of the tensors autograd saves.

    Args:
        pager: the session's :class:`~apt_model.memory.pager.Pager` (``acquire``, ``defer_release``,
            ``pages``).
        pages: the pages the op may save (the fault handler's); None: any of the pager's pages (a
            backward with ``create_graph``).

    A tensor is a page's when it is strided and shares the page's storage object (a resident,
    non-empty one): views autograd makes of a saved tensor are no views of the page's tensor
    in Python's eyes, but they share its storage. Hooks that were active before
    (``torch._C._autograd._top_saved_tensors_default_hooks``: the user's, activation offload, a
    non-reentrant checkpoint's) receive every saved tensor, pages' included — a checkpoint counts
    the tensors it sees in the forward and again in the recomputation, where no page is pinned
    by these hooks (torch runs backward without the fault handler's mode) — and the page's pin
    lives as long as what they packed it into; the page then stays resident for the
    recomputation too. Without outer hooks a saved tensor is kept detached (see :func:`_detached`).
    """

    def __init__(self, pager, pages=None):
        self.pager = pager
        self.pages = pages
        self._by_storage = None
        if pages is None:  # a backward: its formulas save views autograd made itself, not views of the page's tensor
            with torch._C.DisableTorchFunction():
                self._by_storage = {st._cdata: pg for pg in list(pager.pages.values())
                                    if (st := pg.storage()) is not None}
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        super().__init__(self._pack, self._unpack)

    @staticmethod
    def available() -> bool:
        """Whether saved-tensor hooks may be pushed now (torch disables them in some contexts)."""
        return bool(torch._C._autograd._saved_tensors_hooks_is_enabled())

    def _page_of(self, t: torch.Tensor):
        """The page whose storage ``t`` shares (the same storage object, resident), or None."""
        if t.layout is not torch.strided:  # sparse and other layouts have no storage to share
            return None
        with torch._C.DisableTorchFunction():
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass, a nested tensor...
                return None
            if not st.nbytes():
                return None
            key = st._cdata
            if self._by_storage is not None:
                page = self._by_storage.get(key)
                return page if page is not None and page.storage() is not None and page.storage()._cdata == key \
                    else None
            for page in self.pages:
                pst = page.storage()
                if pst is not None and pst._cdata == key:
                    return page
        return None

    def _pack(self, t):
        page = self._page_of(t) if isinstance(t, torch.Tensor) else None
        value = self.outer[0](t) if self.outer is not None else _detached(t) if isinstance(t, torch.Tensor) else t
        if page is None:
            return (False, value)
        self.pager.acquire([page])  # resident (the op is using it): a pin, no load
        holder = _Pinned(value)
        weakref.finalize(holder, _release, weakref.ref(self.pager), page)
        return (True, holder)

    def _unpack(self, packed):
        mine, value = packed
        if mine:
            value = value.value
        return self.outer[1](value) if self.outer is not None else value


def _release(pager_ref, page) -> None:
    # a finalizer: it runs on whatever thread frees the graph (autograd's device thread, the
    # training thread), possibly while another holds the pager lock, so it only queues the release
    pager = pager_ref()
    if pager is not None and not pager._closed:
        pager.defer_release(page)
