"""Measurement helpers for the scripts in this folder. The statistics and the machine description
have one implementation, in the package (:mod:`apt_model.bench.measure`), shared with
``apt-vb bench``; :func:`train_step` is the training step the benchmarks time.

Rules every benchmark follows (DESIGN.md section 9): warm-up first, A and B interleaved in one
run, medians with spread, the thread count fixed and recorded, results written as JSON with the
machine description and printed as a short table.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from apt_model.bench.measure import machine_info, summarize, write_json  # noqa: F401 (the scripts import them here)


def train_step(model, opt, corpus, gen, batch_size: int, seq_len: int, device="cpu", clip: float | None = 1.0,
               autocast_dtype: torch.dtype | None = None) -> float:
    """One full training step of a byte-level LM on ``corpus`` (batch, forward, loss, backward,
    clipping, optimizer step); returns its wall time in seconds (``loss.item()`` included, so the
    device has finished). ``autocast_dtype``: forward and loss under ``torch.autocast`` written by
    hand, as a user tuning the script would."""
    t0 = time.perf_counter()
    x, y = corpus.batch("train", batch_size, seq_len, gen, device)
    dev_type = torch.device(device).type
    with torch.autocast(dev_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    loss.item()
    return time.perf_counter() - t0
