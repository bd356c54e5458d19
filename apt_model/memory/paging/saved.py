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
    """A saved tensor whose page is pinned until this holder is freed."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedPins(saved_tensors_hooks):
    """Saved-tensor hooks that pin the pages of the tensors autograd saves.

    Args:
        pager: the session's :class:`~apt_model.memory.pager.Pager` (``acquire``, ``defer_release``,
            ``by_tensor``).
        pages: the pages the op may save (the fault handler's); None: any page, found through
            ``pager.by_tensor`` by the saved tensor or its base (a backward with ``create_graph``).

    A tensor is a page's when it shares the page's storage (same data pointer); only a resident,
    non-empty page can match. Outer hooks (``torch._C._autograd._top_saved_tensors_default_hooks``)
    receive every tensor that is not a page's, so a pack/unpack pair set by the user keeps working.
    """

    def __init__(self, pager, pages=None):
        self.pager = pager
        self.pages = pages
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        super().__init__(self._pack, self._unpack)

    @staticmethod
    def available() -> bool:
        """Whether saved-tensor hooks may be pushed now (torch disables them in some contexts)."""
        return bool(torch._C._autograd._saved_tensors_hooks_is_enabled())

    def _page_of(self, t: torch.Tensor):
        if self.pages is not None:
            candidates = self.pages
        else:
            lookup = self.pager.by_tensor
            candidates = [pg for pg in (lookup.get(id(t)), lookup.get(id(t._base)) if t._base is not None else None)
                          if pg is not None]
        if not candidates:
            return None
        with torch._C.DisableTorchFunction():
            ptr = t.untyped_storage().data_ptr()
            if not ptr:
                return None
            for page in candidates:
                st = page.storage()
                if st is not None and st.nbytes() and st.data_ptr() == ptr:
                    return page
        return None

    def _pack(self, t: torch.Tensor):
        page = self._page_of(t) if isinstance(t, torch.Tensor) else None
        if page is None:
            return (False, self.outer[0](t)) if self.outer is not None else (False, t)
        self.pager.acquire([page])  # resident (the op is using it): a pin, no load
        holder = _Pinned(t)
        weakref.finalize(holder, _release, weakref.ref(self.pager), page)
        return (True, holder)

    def _unpack(self, packed):
        mine, value = packed
        if mine:
            return value.tensor
        return self.outer[1](value) if self.outer is not None else value


def _release(pager_ref, page) -> None:
    # a finalizer: it runs on whatever thread frees the graph (autograd's device thread, the
    # training thread), possibly while another holds the pager lock, so it only queues the release
    pager = pager_ref()
    if pager is not None and not pager._closed:
        pager.defer_release(page)
