"""Tensors autograd saves outside the module hooks stay readable while their graph lives.

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

:class:`SavedPins` is a ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook recognizes a
page's tensor by its storage:

* a **parameter** (no outer hooks) is saved by reference (:class:`_Reload`): its place in the
  storage and its version. Unpacked, the page is loaded, the elements are copied out and the page
  is let go, so the graph pins nothing and level 0 keeps its budget while it lives;
* any **other page** (a gradient), and every page when outer hooks are active, is pinned; a holder
  whose finalizer lets the pin go lives as long as autograd keeps the saved value.

Other tensors go to the hooks that were active before (activation offload, checkpointing) or are
saved detached. Values are bitwise those of unpaged training: a reloaded parameter is a copy of
the same bytes, and one changed in place since it was saved raises autograd's own error.
"""
from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from apt_model.memory.pages import Category


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
        if page is not None and self.outer is None and page.category is Category.PARAM:
            base = page.bound()
            if base is not None and base.dtype == t.dtype and not t.is_conj() and not t.is_neg() \
                    and 0 not in t.stride():  # else pinned below (a copy would lose the bit or the expansion)
                with torch._C.DisableTorchFunction():
                    return (_RELOAD, _Reload(page, base, t))
        value = self.outer[0](t) if self.outer is not None else _detached(t) if isinstance(t, torch.Tensor) else t
        if page is None:
            return (False, value)
        self.pager.acquire([page])  # resident (the op is using it): a pin, no load
        holder = _Pinned(value)
        weakref.finalize(holder, _release, weakref.ref(self.pager), page)
        return (True, holder)

    def _unpack(self, packed):
        mine, value = packed
        if mine is _RELOAD:
            return value.load(self.pager)
        if mine:
            value = value.value
        return self.outer[1](value) if self.outer is not None else value


_RELOAD = "reload"


class _Reload:
    """A parameter's page saved by reference: where the saved tensor lies in the parameter's
    storage, and the parameter's version then. Unpacked, the page is loaded and the same elements
    are copied out (autograd uses the copy, then frees it), so the page is pinned only while it
    is read, not while the graph lives."""

    __slots__ = ("page", "ref", "version", "generation", "size", "stride", "offset")

    def __init__(self, page, base: torch.Tensor, t: torch.Tensor):
        self.page = page
        self.ref = weakref.ref(base)
        self.version = base._version
        self.generation = page.generation  # storages given by user code (not paging's own copies)
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def load(self, pager) -> torch.Tensor:
        """The saved elements, copied out of the (re)loaded page.

        Raises:
            RuntimeError: the parameter was modified in place since it was saved (as autograd
                raises without paging), or its storage was replaced (``p.data = ...``; without
                paging the graph would read the old storage, which paging no longer holds).
        """
        base = self.ref()
        if base is None:
            raise RuntimeError("a parameter saved for backward was freed before its backward (paged model)")
        with torch._C.DisableTorchFunction():
            if base._version != self.version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: the paged parameter {self.page.label!r} is at version {base._version}; expected "
                    f"version {self.version} instead")
            if self.page.generation != self.generation:
                raise RuntimeError(
                    f"the paged parameter {self.page.label!r} got new storage (p.data = ...) between the forward "
                    "that saved it and this backward; paging keeps no copy of the old one")
            if pager._closed or self.page.bound() is not base:  # paging was turned off: all in memory
                return base.detach().as_strided(self.size, self.stride, self.offset).clone()
            pager.acquire([self.page])
            try:
                return base.detach().as_strided(self.size, self.stride, self.offset).clone()
            finally:
                pager.release([self.page])


def _release(pager_ref, page) -> None:
    # a finalizer: it runs on whatever thread frees the graph (autograd's device thread, the
    # training thread), possibly while another holds the pager lock, so it only queues the release
    pager = pager_ref()
    if pager is not None and not pager._closed:
        pager.defer_release(page)
