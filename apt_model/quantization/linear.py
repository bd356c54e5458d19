"""FP4 linear layers: frozen FP4 weight storage (emulated or native compute) and FP4 QAT.

Three uses:

1. **Frozen weight storage** — :class:`FP4Linear`. The weight lives packed (MXFP4: 4.25 bits per
   weight, NVFP4: 4.5) in buffers; each call dequantizes it to the compute dtype (the input's, or
   autocast's) and multiplies. Gradients flow to the input — adapters stacked on the layer train —
   never to the frozen weight. Backward dequantizes again instead of keeping the dequantized weight
   alive between forward and backward, so the layer's memory stays at its packed size.
2. **Quantization-aware training** — :class:`FP4QATLinear`, an ``nn.Linear`` whose fp32 master
   weight stays a trainable Parameter (the same object, so an optimizer built earlier keeps
   training it); the forward uses the fake-quantized weight ``dequantize(quantize(W))`` and the
   backward passes the gradient straight through to ``W`` (straight-through estimator).
3. **Native FP4 matrix products** — :class:`FP4Linear` with ``compute="native"`` (or ``"auto"``):
   the activation is quantized to the weight's format on the fly and ``torch._scaled_mm`` runs on
   FP4 matrix units — only where the capability probe says they exist (NVIDIA sm_100+, AMD gfx950).
   Its backward uses the dequantized weight. :attr:`FP4Linear.compute_used` says which path ran.

``state_dict()`` of an :class:`FP4Linear` holds ``weight_data`` (uint8 codes), ``weight_scales``
(uint8 scale bits), ``weight_tensor_scale`` (fp32, NVFP4 only), ``bias``, and ``_extra_state``
(format, scale rule, shape, dtype: plain Python values, so ``torch.load(weights_only=True)`` reads
it). Loading it into an :class:`FP4Linear` restores the exact bytes; loading a plain ``nn.Linear``
state dict (a ``weight`` key) quantizes that weight.
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from apt_model.base.log import get_logger
from apt_model.base.patches import current_session
from apt_model.quantization.mxfp4 import check_scale_rule
from apt_model.quantization.native import native_fp4_matmul, native_support, shape_problem
from apt_model.quantization.tensor import FORMATS, FP4Tensor, check_format, quantize

log = get_logger(__name__)

COMPUTE_CHOICES = ("emulated", "native", "auto")
_STATE_VERSION = 1


def _check_compute(compute: str) -> str:
    if compute not in COMPUTE_CHOICES:
        raise ValueError(f"compute={compute!r} is not valid; valid: {', '.join(COMPUTE_CHOICES)}")
    return compute


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in: autocast's where it is on, else the input's."""
    dev = x.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype if x.is_floating_point() else torch.float32


class _FrozenFP4Linear(torch.autograd.Function):
    """``y = x W^T + b`` with a packed, frozen ``W``: no gradient for ``W``; backward re-dequantizes it."""

    @staticmethod
    def forward(ctx, x, bias, weight: FP4Tensor, native: bool):
        if native:
            lead = x.shape[:-1]
            y = native_fp4_matmul(x.reshape(-1, x.shape[-1]), weight, out_dtype=x.dtype)
            y = y.reshape(*lead, -1)
            if bias is not None:
                y = y + bias
        else:
            y = F.linear(x, weight.dequantize(x.dtype), bias)
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ ctx.weight.dequantize(grad_out.dtype)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_bias, None, None


class PackedWeightView(torch.Tensor):
    """What :attr:`FP4Linear.weight` returns for a packed layer: the dequantized weight, whose
    in-place changes are written back into the layer's FP4 codes.

    Until 2026-11-29 ``layer.weight`` was a fresh copy and a write into it went nowhere: ``with
    torch.no_grad(): layer.weight.copy_(pretrained)``, ``nn.init.zeros_(layer.weight)`` and
    ``layer.weight.data = w`` left the layer unchanged, without a word (a probe's finding). Now an
    in-place operation on the view, on a view of it (``w[0]``, ``w.view_as(q)``, ``w.data``) or a
    ``.data`` assignment re-quantizes the layer from the written values (FP4 rounding applies, as
    for ``load_state_dict``). Other results are plain tensors; pickling or copying the view gives a
    plain tensor. Only reads and writes through ``layer.weight`` pay the check
    (``__torch_function__``), never the layer's forward.
    """

    @staticmethod
    def of(dense: torch.Tensor, owner: "FP4Linear") -> "PackedWeightView":
        view = dense.as_subclass(PackedWeightView)
        view._fp4_owner = weakref.ref(owner)
        view._fp4_base = dense
        return view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        views = [a for a in tree_leaves((args, kwargs)) if isinstance(a, PackedWeightView)]
        with torch._C.DisableTorchFunctionSubclass():
            before = [a._version for a in views]
            if views and args and args[0] is views[0] and _sets_requires_grad(func):
                # layer.weight.requires_grad = True (or requires_grad_()): the layer's, not this copy's
                views[0]._set_requires_grad(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
                return views[0] if func is torch.Tensor.requires_grad_ else None
            if views and args and args[0] is views[0] and _is_setter(func, _DATA):
                # layer.weight.data = w (a method wrapper made at each access: told by its descriptor)
                out = func(*args, **kwargs)
                views[0]._write_back(args[1])
                return out
            out = func(*args, **kwargs)
            changed = [v for v, ver in zip(views, before) if v._version != ver]
            for v in changed:
                v._write_back(v._fp4_base)
            return _keep_views(out, views)

    def _layer(self) -> "FP4Linear | None":
        owner = self.__dict__.get("_fp4_owner")
        return owner() if owner is not None else None

    def _write_back(self, values: torch.Tensor) -> None:
        layer = self._layer()
        if layer is not None:
            with torch._C.DisableTorchFunctionSubclass():
                layer.set_weight(values.detach().reshape(layer.out_features, layer.in_features)
                                 .to(layer.weight_dtype))

    def _set_requires_grad(self, value: bool) -> None:
        layer = self._layer()
        if layer is None:
            return
        held = layer._parameters.get("weight")
        if held is not None:
            held.requires_grad_(bool(value))
            if value:
                layer._unfreeze(held)  # (torch functions are off here: HeldWeight would not see the flag)
        elif value:
            layer._warn_unfrozen()

    def __reduce_ex__(self, proto):
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).clone().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor).clone()

    def __repr__(self, *, tensor_contents=None):
        with torch._C.DisableTorchFunctionSubclass():
            return repr(self.as_subclass(torch.Tensor))  # printed as the tensor it stands for


_DATA = torch._C.TensorBase.data  # the getset descriptor behind Tensor.data


def _keep_views(out, views: list[PackedWeightView]):
    """``out`` with each tensor that shares a view's memory made a view too (same layer, same
    base): writes into it reach the layer; any other tensor is returned plain."""
    if isinstance(out, (list, tuple)):
        return type(out)(_keep_views(o, views) for o in out) if not hasattr(out, "_fields") else out
    if not isinstance(out, torch.Tensor) or isinstance(out, PackedWeightView):
        return out
    try:
        ptr = out.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return out
    for v in views:
        if ptr == v._fp4_base.untyped_storage().data_ptr():
            view = out.as_subclass(PackedWeightView)
            view._fp4_owner, view._fp4_base = v._fp4_owner, v._fp4_base
            return view
    return out


class HeldWeight(nn.Parameter):
    """The class of a converted layer's released weight Parameter while it is held empty
    (:meth:`FP4Linear.hold_released`): made trainable (``p.requires_grad = True``,
    ``p.requires_grad_()``, ``model.requires_grad_()``), it unfreezes its layer at once — the
    values come back, FP4-rounded — and becomes an ``nn.Parameter`` again (the same object). At
    once, not at the layer's next call: an optimizer built right after the unfreezing sorts
    parameters by shape (``p.dim() >= 2`` gets weight decay) or makes its state at construction
    (Adagrad), and read an empty tensor until 2026-11-29 (a probe's finding)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            held = args[0] if args and isinstance(args[0], HeldWeight) else None
            if held is not None and held.requires_grad and _sets_requires_grad(func):
                ref = _HOLDERS.get(held)
                layer = ref() if ref is not None else None
                if layer is not None:
                    layer._unfreeze(held)
        return out


#: Held weight -> a weak reference to its layer (weakly both ways: a copy of the Parameter, by
#: deepcopy or pickling, has no entry, and its layer unfreezes it at its next call or ``weight``
#: read instead).
_HOLDERS = WeakIdKeyDictionary()


def _is_setter(func, descriptor) -> bool:
    """Whether ``func`` (what ``__torch_function__`` gets for ``t.attr = v``: a method wrapper made at
    each access) is ``descriptor``'s ``__set__``."""
    return getattr(func, "__self__", None) is descriptor and getattr(func, "__name__", "") == "__set__"


def _sets_requires_grad(func) -> bool:
    return func is torch.Tensor.requires_grad_ or _is_setter(func, _REQUIRES_GRAD)


_REQUIRES_GRAD = torch._C.TensorBase.requires_grad  # the getset descriptor behind Tensor.requires_grad


class FP4Linear(nn.Linear):
    """A linear layer whose frozen weight is stored in FP4 (MXFP4 or NVFP4).

    An ``nn.Linear`` subclass (since 2026-11-29), so that a script's ``isinstance(m, nn.Linear)``
    loops (minGPT's weight-decay groups, re-initialisation, adapter injection) still find the
    layers the switch converted; it does not run ``nn.Linear.__init__`` (no full weight is made).

    Args:
        in_features, out_features: as ``nn.Linear``.
        bias: whether the layer has a bias (kept in full precision).
        format: ``"nvfp4"`` (blocks of 16, 4.5 bits per weight) or ``"mxfp4"`` (blocks of 32, 4.25).
        scale_rule: MXFP4 scale rule, ``"floor"`` or ``"rceil"``.
        compute: ``"emulated"`` (dequantize, then an ordinary matmul), ``"native"`` (FP4 matrix
            units; raises where the capability probe says the device has none) or ``"auto"``
            (native where the probe says yes, else emulated).
        weight_dtype: the dtype the weight had (``weight`` returns this dtype).
        device: where the buffers are created.

    Input ``(..., in_features)``; output ``(..., out_features)`` in the compute dtype (the input's,
    or autocast's).

    The original weight Parameter (:meth:`hold_released`, as the switch does): the released
    ``nn.Linear`` weight (an empty tensor, the same object an optimizer may hold) is this layer's
    ``weight`` entry of ``parameters()``, so the layer lists as many parameters, in the same order,
    as the ``nn.Linear`` it replaced (an optimizer built over ``model.parameters()`` after the
    switch converted the layer loads and saves the same state dicts as without it). Made trainable
    (``requires_grad_(True)`` on the layer, the model or that Parameter), the layer is *unfrozen*
    at its next call: the Parameter gets the dequantized values back (FP4-rounded) and the layer
    computes like ``nn.Linear`` from then on (dense), so progressive unfreezing trains it. A
    Parameter assigned to ``layer.weight`` makes the layer dense too.

    Raises:
        ValueError: bad format, scale rule or compute choice.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, format: str = "nvfp4",
                 scale_rule: str = "floor", compute: str = "emulated", weight_dtype: torch.dtype = torch.float32,
                 device=None):
        nn.Module.__init__(self)
        self.format = check_format(format)
        self.scale_rule = check_scale_rule(scale_rule) if self.format == "mxfp4" else None
        self.compute = _check_compute(compute)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight_dtype = weight_dtype
        block = FORMATS[self.format]
        padded = -(-self.in_features // block) * block
        self.register_buffer("weight_data", torch.zeros(out_features, padded // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scales", torch.zeros(out_features, padded // block, dtype=torch.uint8, device=device))
        ts = torch.zeros((), dtype=torch.float32, device=device) if self.format == "nvfp4" else None
        self.register_buffer("weight_tensor_scale", ts)
        self._parameters["weight"] = None  # the slot of the nn.Linear's weight, before the bias (hold_released)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.compute_used: tuple[str, str] | None = None  # (path, why) of the last call
        self._native_cache: dict[str, tuple[bool, str]] = {}
        self._bias_trainable = False  # at conversion: a bias made trainable later means "unfrozen"
        self._warned_unfrozen = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str = "nvfp4", scale_rule: str = "floor",
                    compute: str = "emulated") -> FP4Linear:
        """An FP4Linear holding ``linear``'s weight in FP4 and the **same** bias Parameter object.

        ``linear`` is left untouched (its weight still holds its memory: see
        :func:`apt_model.quantization.footprint.release_parameter` to free it).
        """
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, bias=False, format=format, scale_rule=scale_rule,
                    compute=compute, weight_dtype=w.dtype, device="meta")
        layer.set_weight(w)
        layer.bias = linear.bias
        layer._bias_trainable = linear.bias is not None and linear.bias.requires_grad
        return layer

    def requires_grad_(self, requires_grad: bool = True):
        """As ``nn.Module.requires_grad_``: the bias, and the held weight Parameter (which unfreezes
        the layer at its next call); without one, unfreezing logs that the FP4 weight stays frozen."""
        if requires_grad and self._parameters.get("weight") is None:
            self._warn_unfrozen()
        return super().requires_grad_(requires_grad)

    def _warn_unfrozen(self) -> None:
        """Say once, through logging, that this layer was unfrozen but its weight cannot train:
        it is packed FP4 and no weight Parameter is held (only the bias trains)."""
        if not getattr(self, "_warned_unfrozen", False):
            self._warned_unfrozen = True
            log.warning("FP4Linear(%d->%d) was unfrozen, but its weight is stored in FP4 and stays frozen: only "
                        "its bias trains (no weight Parameter is held: hold_released()).",
                        self.in_features, self.out_features)

    def hold_released(self, param: nn.Parameter) -> None:
        """List ``param`` — the replaced ``nn.Linear``'s weight, released to an empty tensor
        (:func:`~apt_model.quantization.footprint.release_parameter`) — as this layer's ``weight``
        parameter (see the class docstring).

        Raises:
            ValueError: ``param`` is not an empty, frozen ``nn.Parameter``.
        """
        if not isinstance(param, nn.Parameter) or param.numel() != 0 or param.requires_grad:
            raise ValueError("hold_released: expects the released (empty) frozen nn.Parameter of the replaced layer")
        if type(param) is nn.Parameter:
            param.__class__ = HeldWeight  # the same object: an optimizer holding it keeps it
        _HOLDERS[param] = weakref.ref(self)  # weakly: the layer holds the key (a strong value kept both)
        self._parameters["weight"] = param

    def _dense_param(self) -> nn.Parameter | None:
        """The weight Parameter the layer computes from, None while it computes from its codes; a
        held weight made trainable without passing through ``requires_grad`` (a copy's flag) is
        unfrozen first."""
        w = self._parameters.get("weight")
        if w is None:
            return None
        if w.numel() == 0 and w.requires_grad:
            self._unfreeze(w)
        return w if w.numel() > 0 else None

    @property
    def dense(self) -> bool:
        """Whether the layer computes from a full weight Parameter (unfrozen, or one assigned) rather
        than from its FP4 codes."""
        w = self._parameters.get("weight")
        return w is not None and w.numel() > 0

    def _unfreeze(self, w: nn.Parameter) -> None:
        if w.numel() != 0:
            return
        # not inside the caller's inference_mode: its tensors could never train again (a probe's finding)
        with torch.inference_mode(False), torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            w.data = self.fp4_weight.dequantize(self.weight_dtype).to(self.weight_data.device).clone()
        if type(w) is HeldWeight:
            w.__class__ = nn.Parameter
        _HOLDERS.pop(w, None)
        log.info("FP4Linear(%d->%d) was unfrozen: its weight is a trainable Parameter again, holding the "
                 "FP4-rounded values, and the layer computes as nn.Linear from now on", self.in_features,
                 self.out_features)

    def reset_parameters(self) -> None:
        """As ``nn.Linear.reset_parameters``, with the same random draws (Kaiming-uniform weight, then
        the bias): a packed layer stores the new weight in FP4 (a probe's finding: a re-initialising
        loop raised AttributeError on the layers the switch had converted)."""
        w = self._parameters.get("weight") if self.dense else torch.empty(
            self.out_features, self.in_features, dtype=self.weight_dtype, device=self.weight_data.device)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        if not self.dense:
            self.set_weight(w)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain tensor ``(out_features, in_features)`` in :attr:`weight_dtype`: the
        Parameter where the layer is dense, else its FP4 codes dequantized (a new tensor)."""
        if self.dense:
            return self._parameters["weight"]
        return self.fp4_weight.dequantize(self.weight_dtype)

    def set_weight(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` ``(out_features, in_features)`` into this layer's buffers (replacing them)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match "
                             f"({self.out_features}, {self.in_features})")
        q = quantize(weight.detach(), self.format, self.scale_rule or "floor")
        if not self.weight_data.is_meta:  # a write into a converted layer, not its conversion
            _note_rounding(self, weight, q)
        self.weight_data = q.data
        self.weight_scales = q.scales
        self.weight_tensor_scale = q.tensor_scale
        self.weight_dtype = weight.dtype

    # ------------------------------------------------------------------ views
    @property
    def fp4_weight(self) -> FP4Tensor:
        """The packed weight as an :class:`FP4Tensor` (views of the buffers, no copy)."""
        return FP4Tensor(self.weight_data, self.weight_scales, self.weight_tensor_scale,
                         (self.out_features, self.in_features), self.weight_dtype, self.format, self.scale_rule)

    @property
    def weight(self) -> torch.Tensor:
        """The weight ``(out_features, in_features)``: the Parameter where the layer is dense, else the
        dequantized codes in :attr:`weight_dtype` (a new :class:`PackedWeightView` on every access,
        no gradient; writing into it re-quantizes the layer)."""
        w = self._dense_param()
        if w is not None:
            return w
        return PackedWeightView.of(self.fp4_weight.dequantize(self.weight_dtype), self)

    def weight_nbytes(self) -> int:
        """Bytes of the packed weight (codes, scales, tensor scale)."""
        return self.fp4_weight.nbytes

    def extra_repr(self) -> str:
        rule = f", scale_rule={self.scale_rule}" if self.scale_rule else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.format}{rule}, compute={self.compute}")

    # ------------------------------------------------------------------ compute
    def _native_for(self, device: torch.device) -> tuple[bool, str]:
        key = str(device)
        if key not in self._native_cache:
            self._native_cache[key] = native_support(device)
        return self._native_cache[key]

    def _choose(self, x: torch.Tensor, rows: int) -> tuple[bool, str]:
        if self.compute == "emulated":
            return False, "compute=emulated"
        ok, why = self._native_for(x.device)
        if not ok:
            if self.compute == "native":
                raise RuntimeError(f"FP4Linear(compute='native') on {x.device}: {why}; use compute='auto' or 'emulated'")
            return False, why
        problem = shape_problem(self.format, rows, self.out_features, self.weight_data.shape[1] * 2, x.device)
        if problem:
            return False, problem
        return True, why

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._dense_param()  # progressive unfreezing reached the held weight: it trains from now on
        if w is not None:
            return F.linear(x, w, self.bias)
        if self._parameters.get("weight") is None and self.bias is not None and self.bias.requires_grad \
                and not getattr(self, "_bias_trainable", True):
            self._warn_unfrozen()  # p.requires_grad_() over model.parameters() reached only the bias
        dtype = _compute_dtype(x)
        rows = x.numel() // max(1, x.shape[-1])
        native, why = self._choose(x, rows)
        used = ("native" if native else "emulated", why)
        if used != self.compute_used:
            log.debug("FP4Linear(%d->%d) on %s: %s (%s)", self.in_features, self.out_features, x.device, *used)
        self.compute_used = used
        bias = self.bias.to(dtype) if self.bias is not None else None
        dev = x.device.type
        no_autocast = torch.autocast(dev, enabled=False) if torch.amp.is_autocast_available(dev) \
            else contextlib.nullcontext()
        with no_autocast:  # the dtype is chosen above; the matmul runs in it
            return _FrozenFP4Linear.apply(x.to(dtype), bias, self.fp4_weight, native)

    # ------------------------------------------------------------------ dtype moves and state
    def _apply(self, fn, recurse=True):
        """Keep the NVFP4 tensor scale in fp32 when the module is cast (``model.half()``), and let
        :attr:`weight_dtype` follow the cast, as an ``nn.Linear``'s weight would (until 2026-11-26 it
        stayed, and ``disable()`` gave a model cast to bf16 an fp32 weight beside its bf16 bias)."""
        ts = self.weight_tensor_scale
        probe = fn(torch.empty(0, dtype=self.weight_dtype, device=self.weight_data.device))
        if isinstance(probe, torch.Tensor) and probe.is_floating_point():
            self.weight_dtype = probe.dtype
        out = super()._apply(fn, recurse)
        if ts is not None and self.weight_tensor_scale.dtype != torch.float32:
            self.weight_tensor_scale = ts.to(self.weight_tensor_scale.device)
        return out

    def get_extra_state(self) -> dict:
        return {"version": _STATE_VERSION, "format": self.format, "scale_rule": self.scale_rule,
                "in_features": self.in_features, "out_features": self.out_features,
                "weight_dtype": str(self.weight_dtype).replace("torch.", "")}

    def set_extra_state(self, state: dict) -> None:
        dtype = getattr(torch, state.get("weight_dtype", "float32"), torch.float32)
        self.weight_dtype = dtype

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Packed: the codes, scales, bias and extra state (never the held empty Parameter). Dense:
        ``weight`` and ``bias``, as ``nn.Linear``."""
        if self.dense:
            w = self._parameters["weight"]
            destination[prefix + "weight"] = w if keep_vars else w.detach()
            if self.bias is not None:
                destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()
            return
        held = self._parameters.get("weight")
        self._parameters["weight"] = None
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)
        finally:
            self._parameters["weight"] = held

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self.dense:  # as nn.Linear: the weight into the Parameter; packed entries are not needed
            n = len(missing_keys)
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
            packed = {prefix + k for k in ("weight_data", "weight_scales", "weight_tensor_scale", "_extra_state")}
            missing_keys[n:] = [k for k in missing_keys[n:] if k not in packed]
            return
        held = self._parameters.get("weight")
        self._parameters["weight"] = None
        try:
            self._load_packed(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        finally:
            self._parameters["weight"] = held

    def _load_packed(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, dict):
            theirs = (extra.get("format"), extra.get("scale_rule"), extra.get("in_features"), extra.get("out_features"))
            ours = (self.format, self.scale_rule, self.in_features, self.out_features)
            if theirs != ours:
                error_msgs.append(f"{prefix or 'FP4Linear'}: the state dict holds format/scale_rule/in/out "
                                  f"{theirs}, this layer is {ours}; build the layer with the same settings")
                return
        plain = prefix + "weight"
        if plain in state_dict and prefix + "weight_data" not in state_dict:  # an nn.Linear state dict
            w = state_dict.pop(plain)
            # this layer's own dequantized weight (its state dict in nn.Linear form) keeps its codes
            q = self.fp4_weight if self._holds(w) else quantize(w.to(self.weight_data.device), self.format,
                                                                self.scale_rule or "floor")
            _note_rounding(self, w, q)
            state_dict[prefix + "weight_data"] = q.data
            state_dict[prefix + "weight_scales"] = q.scales
            if q.tensor_scale is not None:
                state_dict[prefix + "weight_tensor_scale"] = q.tensor_scale
            state_dict.setdefault(prefix + "_extra_state", {**self.get_extra_state(),
                                                           "weight_dtype": str(w.dtype).replace("torch.", "")})
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _holds(self, w) -> bool:
        """Whether ``w`` is exactly this layer's dequantized weight (shape, dtype and every value):
        re-quantizing it could pick other scales, so the codes it came from are kept instead."""
        if not isinstance(w, torch.Tensor) or self.weight_data.is_meta or w.dtype != self.weight_dtype:
            return False
        if tuple(w.shape) != (self.out_features, self.in_features):
            return False
        return torch.equal(w.to(self.weight_data.device), self.fp4_weight.dequantize(self.weight_dtype))


_ROUNDED = [0]  # the switch session in which a write rounded to FP4 was said (0: none yet)


def _note_rounding(layer: FP4Linear, w: torch.Tensor, q: FP4Tensor) -> None:
    """Say, once per switch session, that values written into ``layer`` (a state dict loaded, a write
    into its weight) were rounded to FP4. A fine-tuned checkpoint loaded into a model whose layers
    were converted frozen, or a LoRA merge into the base, lost its precision silently (a probe's
    finding); unfrozen before the write, the layer keeps the values exactly."""
    try:
        with torch._C.DisableTorchFunctionSubclass():
            got = q.dequantize(w.dtype).to(w.device)
            changed = not torch.equal(got, w)
            worst = (got - w).abs().max().item() if changed and w.numel() else 0.0
    except Exception as err:  # noqa: BLE001 - a note must not break a load
        log.debug("FP4Linear: rounding check: %s", err)
        return
    if not changed:
        return
    if _ROUNDED[0] != current_session():
        _ROUNDED[0] = current_session()
        log.warning("values written into FP4Linear(%d->%d) (a state dict loaded, or a write into its weight) were "
                    "rounded to FP4: it stores its frozen weight in FP4 (largest change %.3g). To keep such values "
                    "exact, make the layer trainable before writing (it then holds a full-precision weight), or use "
                    "fp4='off'. Said once per session; later layers are logged at DEBUG", layer.in_features, layer.out_features,
                    worst)
    else:
        log.debug("values written into FP4Linear(%d->%d) were rounded to FP4 (largest change %.3g)",
                  layer.in_features, layer.out_features, worst)


def state_dict_as_linear(module: FP4Linear, state_dict: dict, prefix: str, local_metadata) -> None:
    """A ``state_dict`` post-hook that presents an :class:`FP4Linear` as the ``nn.Linear`` it
    replaced: ``weight`` (dequantized, in :attr:`FP4Linear.weight_dtype`) and ``bias``, in that
    order, instead of the packed buffers. The switch puts it on the layers it converts, so a
    checkpoint saved while it is on loads into the model's own class without it; loading one back
    into the FP4 layer keeps its codes when the weight is its own (see ``_load_from_state_dict``)."""
    if module.dense:
        return  # unfrozen: its own entries are nn.Linear's already (the Parameter itself with keep_vars)
    for name in ("weight_data", "weight_scales", "weight_tensor_scale", "_extra_state"):
        state_dict.pop(prefix + name, None)
    state_dict[prefix + "weight"] = module.dense_weight()
    if prefix + "bias" in state_dict and hasattr(state_dict, "move_to_end"):
        state_dict.move_to_end(prefix + "bias")


class _FakeQuantizeSTE(torch.autograd.Function):
    """Forward: the FP4 round trip of ``w``. Backward: the gradient unchanged (straight-through).

    Written with ``setup_context`` (forward without ``ctx``), which ``torch.func`` transforms need:
    in the older style ``torch.func.grad`` of a QAT model raised "must override the setup_context
    staticmethod" (a probe's finding, 2026-11-29)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(w, fmt: str, rule: str):
        return quantize(w, fmt, rule).dequantize(w.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass  # the straight-through backward needs nothing saved

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quantize_ste(w: torch.Tensor, format: str = "nvfp4", scale_rule: str = "floor") -> torch.Tensor:
    """FP4 fake quantization with a straight-through gradient: value ``dequantize(quantize(w))``, d/dw = 1."""
    return _FakeQuantizeSTE.apply(w, check_format(format), check_scale_rule(scale_rule))


class FP4QATLinear(nn.Linear):
    """``nn.Linear`` trained with FP4 fake-quantized weights (quantization-aware training).

    The weight is an ordinary fp32 (master) Parameter; each forward quantizes it to ``format`` and
    back, and the straight-through estimator hands the gradient to the master weight unchanged. Its
    ``state_dict`` is exactly ``nn.Linear``'s, so a QAT checkpoint loads into a plain ``nn.Linear``
    (and, quantized, into an :class:`FP4Linear` for deployment).

    Raises:
        ValueError: bad format or scale rule.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, format: str = "nvfp4",
                 scale_rule: str = "floor", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.format = check_format(format)
        self.scale_rule = check_scale_rule(scale_rule)

    @classmethod
    def from_linear(cls, linear: nn.Linear, format: str = "nvfp4", scale_rule: str = "floor") -> FP4QATLinear:
        """A QAT layer sharing ``linear``'s weight and bias **Parameter objects** (no copy, no detach)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.format = check_format(format)
        layer.scale_rule = check_scale_rule(scale_rule)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quantize_ste(self.weight, self.format, self.scale_rule), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, format={self.format}, scale_rule={self.scale_rule}"
