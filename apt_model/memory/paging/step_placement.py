"""Where a paged model's optimizer step runs: on the device (states travel) or on the host.

Two ways to step a model whose parameters stay on an accelerator while its gradients and
optimizer states do not fit beside them:

``device`` (the default path of :mod:`~apt_model.memory.paging.optimizer`)
    The states live in pages; each step brings every state page up over the host<->device link,
    steps it on the device and writes it down again. Per step the link carries the states twice
    and the gradients twice (written as produced, read by the step); the step itself runs at the
    device's memory bandwidth.

``host`` (:mod:`~apt_model.memory.paging.host_step`; the scheme of torchao's ``CPUOffloadOptimizer``)
    The states never leave host memory; the host keeps a copy of each parameter. Per step
    the link carries the gradients down once (as they are produced) and the updated parameters up
    once; the step runs on the host's cores (over host copies of the parameters, in their
    own dtype) at the rate probed for this optimizer.

The cost model (:func:`plan_optimizer_step`) predicts both per step, in seconds, from measured
figures only — the link's GB/s (the stack's host level), the device memory's GB/s (level 0) and
the host step's rate (:func:`probe_host_step_rate`, bytes of parameters stepped per second) — and
picks the cheaper, unless the request names one. The prediction is reported beside what was
measured (``vb.get_report()["models"][i]["features"]["paging"]["optimizer_step"]``).

**Exactness.** On the device, the paged step is bitwise the in-memory step (the same kernels on
the same tensors). On the host, the arithmetic is the host's: for a model on an accelerator the
last bits of the update differ from the device's kernels, so the host step is chosen only where
``paging_exact=False`` (``VB_PAGING_EXACT=0``). Where the compute device *is* the CPU (the tests'
stand-in for an accelerator), the host runs the same kernels and the host step stays exact.

Considered only when the plan keeps the parameters resident and pages the optimizer states: with
the parameters paged too, every parameter already crosses the link for the forward and the
backward, and the device step is used.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from apt_model.base.log import get_logger

log = get_logger(__name__)

#: ``paging_step`` values: let the cost model choose, or force one placement.
STEP_CHOICES = ("auto", "device", "host")

#: Bytes an Adam-style step reads and writes per byte of parameter on the device (parameter,
#: gradient, m and v read; parameter, m and v written).
_DEVICE_STEP_TRAFFIC = 7.0

_RATES: dict[tuple, float] = {}  # (optimizer class, fused, threads) -> bytes of parameters per second


@dataclass(frozen=True)
class StepPlacement:
    """Where the optimizer step of one paged model runs, and why.

    Attributes:
        where: ``"device"`` or ``"host"``.
        reason: one sentence naming the figures or the rule that decided.
        exact: whether the step is bitwise the in-memory step (False only for a host step of a
            model on an accelerator).
        predicted_s: predicted seconds per step for each placement considered
            (``{"device": s, "host": s}``; a placement that was not possible is absent).
        inputs: the figures the prediction used (GB/s, bytes, bytes/s).
    """

    where: str
    reason: str
    exact: bool = True
    predicted_s: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.where not in ("device", "host"):
            raise ValueError(f"StepPlacement.where={self.where!r}; valid values: device, host")

    def to_dict(self) -> dict:
        return asdict(self)


def probe_host_step_rate(opt_cls: type = torch.optim.AdamW, fused: bool = False, nbytes: int = 16 * 2**20) -> float:
    """Bytes of fp32 parameters ``opt_cls`` steps per second on the host (CPU), measured once per
    (class, fused, thread count) per process: median of 5 steps over one ``nbytes`` parameter
    after a warm-up step. The probe's optimizer is stepped beneath torch's hook wrapper, so the
    global optimizer hooks (the switch's first-step adoption check, the report's step recorder,
    paging's step hooks) never see it as a step of the user's.

    Raises:
        TypeError / RuntimeError: ``opt_cls`` cannot be built or stepped that way (e.g. ``fused``
            unsupported on the CPU for this class); callers fall back to ``fused=False``.
    """
    key = (opt_cls, bool(fused), torch.get_num_threads())
    if key not in _RATES:
        p = torch.zeros(nbytes // 4, requires_grad=True)
        p.grad = torch.full_like(p, 1e-3)
        opt = opt_cls([p], lr=1e-3, **({"fused": True} if fused else {}))
        raw = getattr(opt_cls.step, "__wrapped__", opt_cls.step)  # beneath the hook wrapper
        raw(opt)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            raw(opt)
            times.append(time.perf_counter() - t0)
        _RATES[key] = nbytes / sorted(times)[2]
    return _RATES[key]


def plan_optimizer_step(request: str, exact: bool, device: torch.device | str, params_bytes: int,
                        grads_bytes: int, states_bytes: int, page_params: bool, page_states: bool,
                        link_gbps: float | None, device_gbps: float | None, host_rate: float | Callable[[], float] | None,
                        host_room: int | None) -> StepPlacement:
    """Decide where the optimizer step runs (see the module docstring).

    Args:
        request: ``"auto"``, ``"device"`` or ``"host"`` (the ``paging_step`` setting).
        exact: the ``paging_exact`` setting.
        device: the device the model trains on.
        params_bytes / grads_bytes / states_bytes: the model's training state (bytes).
        page_params / page_states: what the placement plan pages.
        link_gbps: host<->device GB/s (the slower direction; None when not measured).
        device_gbps: the device memory's GB/s (None when not measured).
        host_rate: bytes of parameters the host steps per second, or a callable returning it
            (called only when the prediction needs it: probing costs a few steps), or None.
        host_room: bytes the host level can give the host step (its parameter copies, states
            and gradient copies); None for no limit.

    Returns:
        The :class:`StepPlacement`; never raises for a placement that is impossible — it falls
        back to ``device`` and says why.

    Raises:
        ValueError: ``request`` is not one of :data:`STEP_CHOICES`.
    """
    if request not in STEP_CHOICES:
        raise ValueError(f"paging_step={request!r} is not valid; valid values: {', '.join(STEP_CHOICES)}")
    device = torch.device(device)
    # a callable rate is probed only where the prediction needs it; until then the report says None
    inputs = {"link_gbps": link_gbps, "device_gbps": device_gbps,
              "host_step_bytes_per_s": None if callable(host_rate) else host_rate,
              "params_bytes": params_bytes, "grads_bytes": grads_bytes, "states_bytes": states_bytes,
              "host_room": host_room}
    if request == "device":
        return StepPlacement("device", "paging_step=device", inputs=inputs)
    if page_params:
        return StepPlacement("device", "the parameters are paged: they cross the link for the forward and "
                             "backward anyway, so the step runs where they are", inputs=inputs)
    if not page_states:
        return StepPlacement("device", "the optimizer states stay resident on the device: nothing to save by "
                             "stepping on the host", inputs=inputs)
    need = params_bytes + states_bytes + grads_bytes
    if host_room is not None and need > host_room:
        return StepPlacement("device", f"the host step needs {need} bytes of host memory (parameter copies, "
                             f"states, gradient copies) and the host level has {host_room}", inputs=inputs)
    same_kernels = device.type == "cpu"
    if exact and not same_kernels:
        return StepPlacement("device", f"paging_exact=True: a host step would round differently from {device.type}'s "
                             "kernels (set VB_PAGING_EXACT=0 to allow it)", inputs=inputs)
    predicted = {}
    if link_gbps and device_gbps:
        link = link_gbps * 1e9
        predicted["device"] = round((2 * states_bytes + 2 * grads_bytes) / link
                                    + _DEVICE_STEP_TRAFFIC * params_bytes / (device_gbps * 1e9), 4)
    if callable(host_rate):
        host_rate = host_rate()
        inputs["host_step_bytes_per_s"] = host_rate
    if link_gbps and host_rate:
        predicted["host"] = round((grads_bytes + params_bytes) / (link_gbps * 1e9) + params_bytes / host_rate, 4)
    if request == "host":
        return StepPlacement("host", "paging_step=host", exact=same_kernels, predicted_s=predicted, inputs=inputs)
    if "device" not in predicted or "host" not in predicted:
        return StepPlacement("device", "the link, device-memory or host-step rate was not measured: no basis to "
                             "move the step", predicted_s=predicted, inputs=inputs)
    if predicted["host"] < predicted["device"]:
        return StepPlacement("host", f"predicted {predicted['host']:.3f} s per step on the host vs "
                             f"{predicted['device']:.3f} s with the states travelling to the device",
                             exact=same_kernels, predicted_s=predicted, inputs=inputs)
    return StepPlacement("device", f"predicted {predicted['device']:.3f} s per step on the device vs "
                         f"{predicted['host']:.3f} s on the host", predicted_s=predicted, inputs=inputs)
