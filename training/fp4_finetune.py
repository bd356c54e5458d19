#!/usr/bin/env python
"""FP4 base + low-rank adapters vs fp32 base + the same adapters: a fine-tune on real text.

1. Pre-train a small GPT (apt_model.models.gpt) on the Python standard library's source.
2. Fine-tune it on another text (default: ../shared/data/kjv.txt) with the base frozen and
   low-rank adapters (rank 8) on every attention and MLP projection — three times from the same
   base weights, batches and adapter initialisation:
   * ``fp32``: the frozen base as it is;
   * ``mxfp4`` / ``nvfp4``: the switch in memory mode (``vb.enable("memory", fp4_policy=...)``)
     stores the frozen base's linear layers in FP4 when the model is moved to the device.
3. Report the held-out loss on the fine-tuning text before and after, per variant, the gap to fp32,
   the base's bytes, and the switch's FP4 decision.

    python training/fp4_finetune.py --data ../shared/data/kjv.txt --json runs/fp4_finetune.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import apt_model.optimization.vb_global as vb  # noqa: E402
from apt_model.core.system import set_seed  # noqa: E402
from apt_model.data.text import ByteCorpus, load_text_bytes  # noqa: E402
from apt_model.models.gpt import GPT, GPTConfig  # noqa: E402
from apt_model.quantization import add_lora, lora_parameters, module_bytes  # noqa: E402

LORA_TARGETS = ("*.attn.qkv", "*.attn.proj", "*.mlp.0", "*.mlp.2")
VARIANTS = ("fp32", "mxfp4", "nvfp4")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "kjv.txt"), help="fine-tuning text")
    p.add_argument("--base-bytes", type=int, default=3_000_000, help="bytes of stdlib source to pre-train on")
    p.add_argument("--ft-bytes", type=int, default=2_000_000, help="bytes of the fine-tuning text")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--ft-steps", type=int, default=200)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quiet", action="store_true")
    return p


def evaluate(model, corpus: ByteCorpus, args, device) -> float:
    """Mean held-out cross-entropy (nats/byte) over fixed windows (same windows for every variant)."""
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(args.eval_batches):
            x, y = corpus.batch("val", args.batch_size, args.seq_len, gen, device)
            total += F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1)).item()
    model.train()
    return total / args.eval_batches


def train(model, params, corpus: ByteCorpus, steps: int, args, device, seed: int) -> list[float]:
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = corpus.batch("train", args.batch_size, args.seq_len, gen, device)
        loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def pretrain_base(args, device) -> dict:
    set_seed(args.seed)
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads)
    model = GPT(cfg).to(device)
    corpus = ByteCorpus(load_text_bytes(None, args.base_bytes))
    t0 = time.perf_counter()
    losses = train(model, list(model.parameters()), corpus, args.base_steps, args, device, args.seed)
    return {"config": cfg, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": [losses[0], losses[-1]] if losses else [], "seconds": round(time.perf_counter() - t0, 2)}


def finetune(variant: str, base: dict, corpus: ByteCorpus, args, device) -> dict:
    set_seed(args.seed + 1)  # the same adapter initialisation for every variant
    model = GPT(base["config"])
    model.load_state_dict(base["state"])
    add_lora(model, targets=LORA_TARGETS, rank=args.rank, freeze=True)
    fp32_bytes = module_bytes(model)
    fp4 = None
    if variant != "fp32":
        vb.enable("memory", device=args.device, mixed_precision="off", attention="off", banner=False,
                  fp4_policy={"format": variant})
    try:
        model.to(device)  # with the switch on, this adopts the model: the frozen base goes to FP4
        model_bytes = module_bytes(model)
        if vb.is_enabled():
            fp4 = vb.get_report()["models"][0]["features"]["fp4"]
        params = lora_parameters(model)
        before = evaluate(model, corpus, args, device)
        t0 = time.perf_counter()
        losses = train(model, params, corpus, args.ft_steps, args, device, args.seed + 2)
        seconds = time.perf_counter() - t0
        after = evaluate(model, corpus, args, device)
    finally:
        vb.disable()
    return {"eval_before": round(before, 4), "eval_after": round(after, 4),
            "eval_drop": round(1 - after / before, 4), "train_loss_first_last": [losses[0], losses[-1]],
            "seconds": round(seconds, 2), "ms_per_step": round(1000 * seconds / max(1, args.ft_steps), 1),
            "model_bytes_fp32": fp32_bytes, "model_bytes": model_bytes,
            "adapter_parameters": sum(p.numel() for p in params),
            "fp4": None if fp4 is None else {k: fp4.get(k) for k in ("chosen", "reason", "bytes_before",
                                                                      "bytes_after", "bytes_saved")}}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise SystemExit(f"--variants {args.variants!r}: valid: {', '.join(VARIANTS)}")
    if not Path(args.data).exists():
        raise SystemExit(f"--data {args.data} does not exist (the KJV text lives in the shared data folder)")
    device = torch.device(args.device)
    threads_before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        base = pretrain_base(args, device)
        corpus = ByteCorpus(load_text_bytes(args.data, args.ft_bytes))
        results = {v: finetune(v, base, corpus, args, device) for v in variants}
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads_before)
    ref = results.get("fp32")
    if ref:
        for v, r in results.items():
            r["gap_to_fp32"] = round(r["eval_after"] - ref["eval_after"], 4)
            r["gap_to_fp32_rel"] = round(r["eval_after"] / ref["eval_after"] - 1, 4)
    out = {"args": vars(args), "threads": threads, "base": {"losses": base["losses"],
           "seconds": base["seconds"]}, "results": results}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str), encoding="utf-8")
    if not args.quiet:
        print(f"base pre-trained on stdlib source: loss {base['losses'][0]:.3f} -> {base['losses'][-1]:.3f} "
              f"in {base['seconds']} s")
        for v, r in results.items():
            gap = f", {100 * r['gap_to_fp32_rel']:+.2f}% vs fp32" if "gap_to_fp32_rel" in r else ""
            print(f"{v:>6}: held-out loss {r['eval_before']:.4f} -> {r['eval_after']:.4f} "
                  f"({100 * r['eval_drop']:.1f}% lower{gap}); base {r['model_bytes'] / 2**20:.2f} MiB; "
                  f"{r['ms_per_step']} ms/step")
    return out


if __name__ == "__main__":
    main()
