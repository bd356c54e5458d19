"""``clip_grad_norm_`` / ``clip_grad_value_`` that stream paged gradients through memory.

Torch's ``clip_grad_norm_`` needs every gradient at once; with paged gradients that would pull
the whole gradient set into memory. These replacements visit one gradient at a time and are
bit-for-bit the same computation as torch 2.x's: per-gradient norms from ``torch._foreach_norm``
(or ``torch.linalg.vector_norm`` where torch would use it), grouped by device and dtype in
torch's order, stacked and reduced with ``torch.linalg.vector_norm``, then each gradient
multiplied by ``clamp(max_norm / (total + 1e-6), max=1)``. Gradients that are not paged go the
same way, so mixed lists are handled. A list with no paged gradient is handed to torch itself.

Two shortcuts keep clipping off the disk entirely in the usual case, without changing a bit:

* the 2-norm of a paged gradient is computed (with the same ``_foreach_norm`` call) when the
  gradient is written out after backward, and reused if the data has not changed since;
* the scaling of a paged-out gradient is deferred: the factor is queued on the page and applied
  with the same ``_foreach_mul_`` / ``mul_`` when the gradient is next loaded (by the optimizer
  step, typically), so the gradient is not read and rewritten just to be scaled.
"""
from __future__ import annotations

import types
from typing import Callable, Iterable

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)


def _use_foreach(foreach, tensors, device) -> bool:
    if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


def make_clip_grad_norm(original: Callable, page_of: Callable, acquire: Callable, release: Callable,
                        defer_scale: Callable) -> Callable:
    """Build a drop-in ``clip_grad_norm_``.

    Args:
        original: torch's function (used when no gradient in the call is paged).
        page_of: ``param -> Page | None`` for a parameter's gradient page.
        acquire / release: ``(page, for_write) -> None`` / ``(page) -> None`` bring a page in and let it go.
        defer_scale: ``(page, factor, foreach) -> bool`` queues a scaling on a paged-out page.
    """

    @torch.no_grad()
    def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        if isinstance(parameters, torch.Tensor):
            params = [parameters]
        else:
            gen = isinstance(parameters, types.GeneratorType)
            params = list(parameters)
            if gen and not params:
                return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        with_grad = [p for p in params if p.grad is not None]
        pages = {id(p): page_of(p) for p in with_grad}
        if not any(pages.values()):
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        norm_type = float(norm_type)
        grads = [p.grad for p in with_grad]
        owner = {id(g): p for g, p in zip(grads, with_grad)}
        first_device = grads[0].device
        groups = _group_tensors_by_device_and_dtype([grads])
        norms: list[torch.Tensor] = []
        for (device, _), ([device_grads], _) in groups.items():
            fe = _use_foreach(foreach, device_grads, device)
            for g in device_grads:
                page = pages[id(owner[id(g)])]
                if page is not None and fe and norm_type == 2.0 and page.cached_norm is not None:
                    norms.append(page.cached_norm)  # computed by the same call when the gradient was written
                    continue
                if page is not None:
                    acquire(page, False)
                try:
                    norms.append(torch._foreach_norm([g], norm_type)[0] if fe else torch.linalg.vector_norm(g, norm_type))
                finally:
                    if page is not None:
                        release(page)
        total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm "
                "anyway, set `error_if_nonfinite=False`"
            )
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for (device, _), ([device_grads], _) in groups.items():
            fe = _use_foreach(foreach, device_grads, device)
            c = coef.to(device)
            for g in device_grads:
                p = owner[id(g)]
                page = pages[id(p)]
                if page is not None and defer_scale(page, c, fe):
                    continue  # applied when the gradient is next loaded
                if page is not None:
                    acquire(page, True)
                try:
                    if fe:
                        torch._foreach_mul_([p.grad], c)
                    else:
                        p.grad.mul_(c)
                finally:
                    if page is not None:
                        release(page)
        return total

    clip_grad_norm_.__doc__ = original.__doc__
    return clip_grad_norm_


def make_clip_grad_value(original: Callable, page_of: Callable, acquire: Callable, release: Callable) -> Callable:
    """Build a drop-in ``clip_grad_value_`` (elementwise clamp, one gradient at a time)."""

    @torch.no_grad()
    def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        with_grad = [p for p in params if p.grad is not None]
        pages = [page_of(p) for p in with_grad]
        if not any(pages):
            return original(params, clip_value, foreach)
        clip_value = float(clip_value)
        for p, page in zip(with_grad, pages):
            if page is not None:
                acquire(page, True)
            try:
                original([p], clip_value, foreach)  # elementwise: one tensor at a time is identical
            finally:
                if page is not None:
                    release(page)
        return None

    clip_grad_value_.__doc__ = original.__doc__
    return clip_grad_value_


def unique_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` without repeats (tied weights appear once), in first-seen order."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
