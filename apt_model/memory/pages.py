"""Pages: one tensor storage whose bytes can leave the compute device and come back.

A page frees memory the way FSDP does: the tensor object and its metadata (shape, stride, dtype,
and for parameters the ``nn.Parameter`` identity the optimizer holds) stay; only the storage is
resized to 0 bytes. Touching a paged-out tensor therefore fails loudly ("out of bounds for
storage of size 0") instead of computing with stale data. Bringing it back resizes the same
storage and fills it, so autograd's saved references and the optimizer's references see the
restored bytes.
"""
from __future__ import annotations

import ctypes
import enum
import itertools
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch


class Category(str, enum.Enum):
    """What a page holds; decides its access pattern and paging priority."""

    PARAM = "param"
    GRAD = "grad"
    STATE = "state"  # optimizer state (Adam m and v, SGD momentum...)


class State(str, enum.Enum):
    """Where a page's bytes are: on the compute level, moving, or only on the level below."""

    RESIDENT = "resident"  # bytes on the compute device
    LOADING = "loading"  # storage allocated, read in flight
    WRITING = "writing"  # resident, a copy to the lower level in flight; freed when done
    LOWER = "lower"  # only on a lower level
    ABSENT = "absent"  # no data at all (a gradient that was set to None)


_ids = itertools.count()


@dataclass(eq=False)
class Page:
    """One paged tensor.

    Attributes:
        key: unique name of the page (also its swap file's name).
        category: param, grad or state.
        tensor_of: returns the live tensor (a gradient or optimizer state can be replaced by
            torch or by user code between steps, so pages look the tensor up instead of holding it).
        ref: weak reference to the tensor whose storage the page manages now (its *binding*).
            When ``tensor_of()`` returns another object (``p.grad = p.grad * 0.5``) or None
            (``zero_grad(set_to_none=True)``), the pager settles the old binding first — its bytes
            go back to the old tensor if anything still holds it — and binds the new tensor.
        nbytes: size of the tensor's storage in bytes.
        label: human name (``blocks.0.mlp.0.weight:grad``).
        state: where the bytes are.
        dirty: the resident bytes differ from the lower copy (or there is none).
        pins: users that need the bytes resident right now.
        keep: never evicted (the placement plan keeps this category resident).
        retain: its write in flight was started by :meth:`Pager.write_behind`: once it lands the
            page stays resident and clean (a cached copy) instead of being freed.
        cached: resident and clean after such a write, not used since: eviction drops these
            first (no I/O), before the least recently used pages in use.
        pre_step_copy: a copy of a tensor the plan keeps resident, written before an optimizer
            step so that the step can be rolled back (:meth:`Pager.copy_out`), not a managed page.
    """

    category: Category
    tensor_of: Callable[[], torch.Tensor | None]
    nbytes: int
    label: str
    key: str = field(default_factory=lambda: f"pg{next(_ids)}")
    state: State = State.RESIDENT
    dirty: bool = True
    pins: int = 0
    keep: bool = False
    retain: bool = False
    cached: bool = False
    pre_step_copy: bool = False
    last_use: int = 0
    future: Future | None = None
    zero_on_load: bool = False  # a gradient zeroed in place while paged: load as zeros
    tensor_id: int = 0  # id() of the live tensor, for the fault handler's lookup
    #: Multiplications still owed by the lower copy, applied in order on load: ``(factor, foreach)``.
    #: Gradient clipping defers its scaling of paged gradients this way (see paging/clip.py).
    scales: list = field(default_factory=list)
    #: ``torch._foreach_norm([t], 2.0)[0]`` of the current data, or None when unknown/stale.
    cached_norm: torch.Tensor | None = None
    ref: weakref.ref | None = None
    #: Counts the new storages user code gave the tensor (``p.data = x``; see ``Pager.restorage``);
    #: a copy paging makes itself (a storage exported to NumPy) does not count.
    generation: int = 0

    @property
    def kind(self) -> str:
        """What the bytes are, for traffic figures: ``"param"``, ``"grad"``, ``"state"`` or
        ``"pre-step copy"``."""
        return "pre-step copy" if self.pre_step_copy else self.category.value

    def bound(self) -> torch.Tensor | None:
        """The tensor whose storage this page manages (None once it was garbage-collected)."""
        return None if self.ref is None else self.ref()

    def bind(self, t: torch.Tensor | None) -> None:
        """Manage ``t``'s storage from now on (None: no tensor)."""
        self.ref = None if t is None else weakref.ref(t)
        self.tensor_id = 0 if t is None else id(t)

    def storage(self) -> torch.UntypedStorage | None:
        """The bound tensor's storage (the bytes this page moves), or None."""
        t = self.bound()
        return None if t is None else t.untyped_storage()

    @property
    def occupies(self) -> int:
        """Bytes this page holds on the compute device now."""
        return self.nbytes if self.state in (State.RESIDENT, State.LOADING, State.WRITING) else 0


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (what paging frees)."""
    return int(t.untyped_storage().nbytes())


def other_holders(t: torch.Tensor) -> int:
    """How many other tensors hold ``t``'s storage now: views of it, ``.data`` / ``.detach()``
    aliases the script keeps, the other parameters of one flat buffer, a state dict's tensors kept
    after ``load_state_dict(assign=True)``. A page frees its storage in place, so every one of them
    would read freed memory (a segfault). Counted from the storage's C++ reference count (less
    ``t`` and the one Python storage object); 0 where this torch does not expose that count."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return 0
    with torch._C.DisableTorchFunction():
        storage = t.untyped_storage()  # one Python object per storage: it counts once, kept or not
        return max(0, int(use_count(storage._cdata)) - 2)


def storage_ptr(t: torch.Tensor) -> int | None:
    """The data pointer of ``t``'s storage — of the tensor inside, for a ``torch.func`` wrapper
    (``vmap``'s batched tensors, ``grad``'s wrapped ones have no storage of their own) — or None
    for a tensor without storage."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t) or functorch.is_batchedtensor(t):
        t = functorch.get_unwrapped(t)
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def cpu_byte_view(storage: torch.UntypedStorage) -> memoryview:
    """A writable memoryview of a CPU storage's bytes (shares memory; valid while the storage
    keeps this allocation). Built with ctypes, not ``Tensor.numpy()``: exporting to NumPy marks
    a storage non-resizable, which would make it impossible to page out afterwards."""
    n = storage.nbytes()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(storage.data_ptr())).cast("B")


def live_page(lookup: dict, t) -> "Page | None":
    """The page of ``lookup`` (the pager's ``id(tensor) -> page`` map) that manages ``t`` itself, or
    None. The map is keyed by ``id()`` and a page holds its tensor weakly, so a tensor that died
    (a gradient set to None by ``zero_grad()``) can leave its ``id()`` to a new, unrelated tensor
    before its entry is settled: that tensor must not be taken for the page's. (It was, inside
    the side-stream copies of the host level on the H200: the fault handler took a fresh byte view
    for a dead gradient and evicted pages from inside the copy.)"""
    page = lookup.get(id(t))
    return page if page is not None and page.bound() is t else None


def frees_in_place(storage: torch.UntypedStorage) -> bool:
    """Whether resizing ``storage`` to 0 bytes frees its memory in place, as paging does to evict a
    page: False for a storage exported to NumPy (``Tensor.numpy()`` fixes its size for good) or in
    the CPU's shared memory (``share_memory_()``, as ``torch.multiprocessing`` does to a tensor it
    sends to spawn workers: resizing it crashes the process). An accelerator's storage is never
    shared memory in that sense, although ``UntypedStorage.is_shared()`` answers True for CUDA
    storages (PyTorch: "always True for CUDA tensors"; newer releases: for every device but the CPU
    and meta). Never raises."""
    if not storage.resizable():
        return False
    return storage.device.type != "cpu" or not storage.is_shared()


def free_storage(storage: torch.UntypedStorage) -> None:
    """Release ``storage``'s bytes (resize to 0); tensors that view it stay valid objects."""
    storage.resize_(0)


def alloc_storage(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give ``storage`` back ``nbytes`` bytes of (uninitialized) memory, in place."""
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
