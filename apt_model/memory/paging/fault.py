"""The page-fault handler: a paged-out tensor touched outside the paging hooks is loaded first.

The hooks (module forward/backward, the streamed optimizer step, the streamed gradient clipping,
state_dict) move pages in the common paths. Anything else — user code that logs a gradient norm,
an EMA update, ``torch.save(model)``, ``copy.deepcopy`` — goes through torch's Python dispatch,
where this ``TorchFunctionMode`` sees it: each argument that is a paged-out tensor is brought
back (counted as a fault) and pinned while the op runs. Without it such code would read a
storage of size 0 and crash the process. Rules that keep it safe:

* an access from outside the hooks may write (directly or through an alias, ``p.data.mul_()``),
  so such a page is marked dirty and the change is written before the page is freed again;
* an op whose result aliases a page (``p.data``, ``p.detach()``, a view) keeps that page pinned
  until the result is garbage-collected — freeing the storage under a live alias would crash —
  also when the page was already pinned by someone else, whose pin may go first;
* an op that builds a graph keeps the pages autograd saves from it resident for as long as the
  graph holds them (``paging/saved.py``): every page it used except those of a module whose
  forward is under way, which that module's backward hook brings back (so a regularizer over the
  parameters, a parameter used outside its module, a block called directly are covered);
* an in-place op returns the paged tensor itself: that is the page's own tensor, not an alias, and
  pins nothing (``zero_grad(set_to_none=False)`` used to pin every gradient for good);
* zeroing a paged-out tensor (``t.zero_()``, ``torch._foreach_zero_``) reads nothing: the page is
  marked to load as zeros;
* where TorchDynamo traces the handler (``torch.compile`` of code run while paging is on) it steps
  aside and Dynamo records the op itself; paged models and the streamed optimizer step run eagerly
  there (:mod:`~apt_model.memory.paging.compiled`).

It also serves the optimizer step taken inside backward (``paging/backward_step.py``): each op
tells the handler whether it may write its arguments (:func:`may_write`), and tensors that are no
pages but must not be used or written before the pending step is committed (resident parameters
and states the step changed, resident gradients, aliases of gradients) are ``watched``: an op on
one is reported (``handler.watched_access``). Resident parameters whose pre-step copy began in
backward are watched too (``"early"``): a write to one before the step drops those copies
(``paging/optimizer.py``).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from apt_model.memory.pages import live_page, storage_ptr
from apt_model.base.errors import DistributedError
from apt_model.base.post_import import when_imported
from apt_model.memory.paging.compiled import compiling

_TB = torch._C.TensorBase
#: Accesses that read or set metadata only (never the data): no fault for these. ``.data`` is
#: deliberately absent: it returns an alias through which the data can be changed.
METADATA_ONLY = frozenset(
    [getattr(_TB, name).__get__ for name in (
        "grad", "requires_grad", "shape", "dtype", "device", "is_leaf", "grad_fn", "layout", "ndim",
        "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "nbytes", "itemsize",
        "_version", "output_nr", "_base", "is_nested",
    ) if hasattr(_TB, name)]
    + [_TB.grad.__set__, _TB.requires_grad.__set__]
    + [getattr(_TB, name) for name in (
        "size", "dim", "numel", "stride", "is_contiguous", "element_size", "untyped_storage", "data_ptr",
        "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "get_device",
        "storage_offset", "is_floating_point", "is_complex", "nelement", "ndimension", "__len__",
    ) if hasattr(_TB, name)]
    + [getattr(torch.Tensor, name) for name in ("register_hook", "register_post_accumulate_grad_hook", "__hash__")
       if hasattr(torch.Tensor, name)]
    # Module._apply (model.to(), .float()...) asks it of every parameter and gradient: types only
    + [f for f in (getattr(torch, "_has_compatible_shallow_copy_type", None),) if f is not None]
)


#: In-place zeroing: a paged-out tensor is marked to load as zeros instead of being read first.
ZEROING = frozenset([_TB.zero_, torch._foreach_zero_])

_DATA_GET = _TB.data.__get__
_DATA_SET = _TB.data.__set__
_IN_PLACE_DUNDER = frozenset(["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"])


def writes_by_name(name: str) -> bool:
    """Whether an op named ``name`` writes its first argument: in place by name (``mul_``,
    ``_foreach_div_``) or an in-place operator method (``__iadd__``, ``__setitem__``)."""
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDER


#: Functions that write their ``weight`` argument when given ``max_norm`` (the mode sees the
#: function itself, not the ``torch.embedding_renorm_`` it calls): position of ``max_norm``.
_MAX_NORM_AT = {torch.nn.functional.embedding: 3, torch.nn.functional.embedding_bag: 3}


def may_write(func, kwargs, args=()) -> bool:
    """Whether ``func`` may write its tensor arguments: in place by name (``mul_``, ``_foreach_div_``,
    ``torch._amp_foreach_non_finite_check_and_unscale_``, ``__setitem__``, ``__iadd__``...), into an
    ``out=`` argument, through ``.data`` (read: an alias whose writes no version counter follows;
    set: new bytes under the same tensor), or ``F.embedding`` / ``F.embedding_bag`` with
    ``max_norm`` (they renormalize the weight's rows in place)."""
    if func == _DATA_GET or func == _DATA_SET or (kwargs and "out" in kwargs):  # new method-wrappers: ==
        return True
    at = _MAX_NORM_AT.get(func)
    if at is not None:
        return (kwargs or {}).get("max_norm") is not None or (len(args) > at and args[at] is not None)
    return writes_by_name(getattr(func, "__name__", ""))




_SHARE_MEMORY = torch.Tensor.share_memory_

#: Conversions that return the tensor itself when it already has their dtype.
_DTYPE_CONVERSIONS = {_TB.float: torch.float32, _TB.double: torch.float64, _TB.half: torch.float16,
                      _TB.bfloat16: torch.bfloat16}
_MAYBE_SELF = frozenset([_TB.to, _TB.cpu, *_DTYPE_CONVERSIONS])


def _same_device(target: torch.device, have: torch.device) -> bool:
    if target.type != have.type:
        return False
    if target.index is None and have.index is not None:  # "cuda" means the current device of its type
        try:
            return torch.accelerator.current_device_index() == have.index
        except Exception:  # noqa: BLE001 - unknown: not the same, the op runs as usual
            return False
    return target.index == have.index


def returns_self(func, args, kwargs) -> bool:
    """Whether ``func`` (``Tensor.to``, ``.cpu()``, ``.float()``, ``.double()``, ``.half()``,
    ``.bfloat16()``) returns its tensor itself, unchanged: the device, dtype and layout asked for
    are the ones it has (``Module.to(device)`` on a model already there, ``model.float()`` of an
    fp32 model). Such a call reads no byte, so a paged-out tensor is not loaded for it (each one
    was loaded and written back, until 2026-11-28: a no-op ``model.to(device)`` cost a third of a
    paged step, a probe's finding)."""
    t = args[0] if args else None
    if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return False
    fmt = kwargs.get("memory_format")
    if fmt is not None and fmt is not torch.preserve_format:
        return False
    if func in _DTYPE_CONVERSIONS:
        return len(args) == 1 and set(kwargs) <= {"memory_format"} and t.dtype == _DTYPE_CONVERSIONS[func]
    if func is _TB.cpu:
        return len(args) == 1 and set(kwargs) <= {"memory_format"} and t.device.type == "cpu"
    if kwargs.get("copy"):
        return False
    try:
        device, dtype, _, fmt = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
    except Exception:  # noqa: BLE001 - a form _parse_to does not take: the op runs as usual
        return False
    return ((device is None or _same_device(device, t.device)) and (dtype is None or dtype == t.dtype)
            and fmt in (None, torch.preserve_format))


def _converts_to_itself(func, args, kwargs) -> bool:
    """:func:`returns_self` for a replacement of ``Tensor.to`` / ``Tensor.cuda`` that says what it
    converts to (``func.to_arguments(args, kwargs) -> (to_args, to_kwargs)``: the switch's CUDA
    redirect, which torch hands modes as the op itself)."""
    as_to = getattr(func, "to_arguments", None)
    if as_to is None or not args:
        return False
    try:
        to_args, to_kwargs = as_to(args[1:], kwargs)
    except Exception:  # noqa: BLE001 - not understood: the op runs as usual
        return False
    return returns_self(_TB.to, (args[0], *to_args), to_kwargs)


def _storage_key(t) -> int | None:
    """Identity of ``t``'s storage object (None for a tensor without one)."""
    try:
        with torch._C.DisableTorchFunction():
            return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class PageFaultMode(TorchFunctionMode):
    """Loads paged-out tensors on access. ``handler.enter(pages) -> held`` loads and pins them for
    the op; ``handler.exit(held, output)`` lets them go (keeping pages that ``output`` aliases)."""

    def __init__(self, lookup: dict, handler):
        super().__init__()
        self.lookup = lookup  # id(tensor) -> page (the pager's live map)
        self.handler = handler
        self.active = True
        self.watched: dict[int, str] = {}  # id(tensor) -> "grad" | "value" | "early" (see the module docstring)
        self.passthrough: set = set()  # functions that read no page themselves (backward, grad): not faulted
        #: storage data pointer -> [page, count] for the aliases of pages the handler keeps pinned
        #: (``handler.exit``): an op on an alias counts as one on its page, so an alias of an alias
        #: (``state["exp_avg"].view(-1)[:4]``) pins it too. Before 2026-11-28 only the first alias
        #: did, and once it died its page was evicted under the second: a segfault (a probe's finding)
        self.aliases: dict[int, list] = {}

    def detach(self) -> None:
        """Let go of the session (paging closed): the mode stays on the stacks of threads started
        while paging was on (:mod:`~apt_model.memory.paging.threads`), as a pass-through that keeps
        nothing of the closed session alive."""
        self.active = False
        self.lookup, self.watched, self.handler, self.aliases = {}, {}, None, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if compiling():  # Dynamo is tracing: it records the op itself (paging/compiled.py)
            return func(*args, **kwargs)
        if func in self.passthrough:
            return func(*args, **kwargs)
        if self.active and self.watched and func not in METADATA_ONLY:
            kinds = set()
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, torch.Tensor) and id(t) in self.watched:
                        kinds.add(self.watched[id(t)])
            if kinds:
                self.handler.watched_access(kinds, may_write(func, kwargs, args))
        if self.active and self.lookup and func in ZEROING and not kwargs:
            handled, out = self._zero(func, args)
            if handled:
                return out
        if self.active and self.lookup and func not in METADATA_ONLY:
            hit = []
            for a in args:
                self._collect(a, hit)
            for a in kwargs.values():
                self._collect(a, hit)
            if hit:  # the op touches paged tensors: the few that need no page, or must not have one, first
                if ((func in _MAYBE_SELF and returns_self(func, args, kwargs))
                        or (func == _DATA_SET and len(args) == 2 and args[1] is args[0])
                        or _converts_to_itself(func, args, kwargs)):
                    # a conversion to what the tensor is already, or ``p.data = p`` (Module.to() sets
                    # it when nothing changed): no byte is read or written
                    return func(*args, **kwargs)
                if func is _SHARE_MEMORY and live_page(self.lookup, args[0]) is not None:
                    raise DistributedError(
                        "share_memory_() of a paged tensor (model.share_memory() for Hogwild-style workers): its bytes "
                        "live in this process's swap files and pages, which other processes cannot share; their updates "
                        "would never reach it (until 2026-11-28 the model silently stayed untrained). Keep the model "
                        "unpaged: paging='off', or a device budget that holds it")
                writes = may_write(func, kwargs, args)
                held = self.handler.enter(hit, writes, self._written(func, args, kwargs) if writes else None)
                out = None
                before = _storage_key(args[0]) if func == _DATA_SET else None
                try:
                    saving = self.handler.graph_saves(hit, args, kwargs)
                    if saving is None:
                        out = func(*args, **kwargs)
                    else:
                        with saving:
                            out = func(*args, **kwargs)
                    if func == _DATA_SET and (page := live_page(self.lookup, args[0])) is not None \
                            and _storage_key(args[0]) != before:  # Module.to() sets p.data = p when nothing changes
                        self.handler.storage_replaced(page)  # p.data = x: the page follows the new storage
                finally:
                    self.handler.exit(held, out, hit)
                if func == _DATA_GET:
                    self.handler.data_alias(hit)
                return out
        return func(*args, **kwargs)

    def _zero(self, func, args) -> tuple[bool, object]:
        """``t.zero_()`` / ``torch._foreach_zero_(ts)`` on paged-out tensors: marked to load as zeros,
        no read (``handler.zero_lower(page) -> bool``). Returns (handled, the op's result)."""
        if func is _TB.zero_:
            page = live_page(self.lookup, args[0]) if args else None
            return (True, args[0]) if page is not None and self.handler.zero_lower(page) else (False, None)
        tensors = list(args[0]) if args else []
        rest = [t for t in tensors if (page := live_page(self.lookup, t)) is None or not self.handler.zero_lower(page)]
        if len(rest) == len(tensors):
            return False, None
        if rest:
            self.__torch_function__(func, (), (rest,))
        return True, None

    def _written(self, func, args, kwargs) -> list:
        """The pages among the arguments a writing op writes: its first argument (in place by
        name, ``.data``; a list for ``_foreach_*_``), ``out=``, and ``F.embedding``'s weight under
        ``max_norm``. Its other arguments are only read."""
        at = _MAX_NORM_AT.get(func)
        if at is not None:
            targets = [kwargs.get("weight", args[1] if len(args) > 1 else None)]
        else:
            targets = [args[0] if args else None, kwargs.get("out")]
        found: list = []
        for t in targets:
            self._collect(t, found)
        return found

    def _collect(self, a, hit: list) -> None:
        if isinstance(a, torch.Tensor):
            page = live_page(self.lookup, a)
            if page is None and self.aliases:
                page = self._alias_page(a)
            if page is not None:
                hit.append(page)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    page = live_page(self.lookup, b)
                    if page is None and self.aliases:
                        page = self._alias_page(b)
                    if page is not None:
                        hit.append(page)

    def _alias_page(self, t: torch.Tensor):
        """The page whose pinned alias shares ``t``'s storage, or None."""
        with torch._C.DisableTorchFunction():
            ptr = storage_ptr(t)
        entry = self.aliases.get(ptr) if ptr else None
        return entry[0] if entry is not None else None


def _never_a_frame_of_its_own(eval_frame) -> None:
    """Dynamo may trace the handler inline (it then records the user's op, see ``compiling()``
    above) but must never compile it as a frame of its own: called from an eagerly run stretch of
    a compiled function, the frame was compiled with ``compiling()`` true — the op alone, no fault
    handling — and recompiled per op until Dynamo's limit (a probe's compiled training step).
    ``torch._dynamo.eval_frame.skip_code`` (where this torch has it) runs the frame as written.
    Applied when Dynamo is imported, by whoever imports it: importing it here, on a thread that
    adopts a model while another builds its first optimizer, made the two imports race (an
    ImportError in the script's thread: a probe's finding, 2026-11-29); and it costs 2 s."""
    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is not None:
        skip_code(PageFaultMode.__torch_function__.__code__)


when_imported("torch._dynamo.eval_frame", _never_a_frame_of_its_own)
