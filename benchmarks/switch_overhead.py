#!/usr/bin/env python
"""Does the switch make the main job slower? A baseline script vs a mode, interleaved.

Two worker processes train the same model on the same real text (the stdlib corpus, same seed,
same batches): one the baseline script, one with the switch enabled before the model is built
(as a user would). ``--baseline off`` is the plain fp32 script; ``--baseline manual`` is the
script a user would tune by hand (TF32 matmuls on where CUDA has them, and ``torch.autocast``
in bf16 written around forward and loss) — the switch must not be slower than either.
``--arch gpt`` is the main job's GPT preset; ``--arch encoder`` an ``nn.TransformerEncoder``
language model (causal mask, the library's fused path) of the preset's width and depth; ``--arch mlp``
a deep stack of narrow layers (``--mlp-layers`` blocks of ``--mlp-width``), where the arithmetic is
small and the switch's cost per module call and per step shows; ``--arch tabular`` a 3-layer MLP
classifier (``--seq-len`` byte features -> 64 -> 64 -> 2: is the next byte a space?) trained with
Adam and an ``nn.CrossEntropyLoss`` module, a step of a few hundred microseconds: the switch's fixed
cost per step and per model call. Both warm up, then the coordinator has them run ``--steps-per-round`` steps
in turn — never at the same time, so they do not compete for cores — alternating which goes
first, for ``--rounds`` rounds. Reported: median step time per side, the speed-up
(off / mode, from the medians) and the median of per-round ratios, and the switch's decisions.

    python benchmarks/switch_overhead.py --threads 2 --json bench-results/switch_overhead.json
    python benchmarks/switch_overhead.py --baseline manual --arch encoder --model-size medium \
        --seq-len 1024 --batch-size 8          # on a GPU: the accelerator issue's acceptance check
    python benchmarks/switch_overhead.py --arch mlp --threads 1 --batch-size 4 --seq-len 16 --rounds 10 \
        --steps-per-round 200                  # per-call overhead: 96 small modules per forward
    python benchmarks/switch_overhead.py --arch tabular --threads 1 --batch-size 64 --seq-len 20 \
        --rounds 10 --steps-per-round 1000     # fixed overhead per step: 0.3 ms steps
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import (  # noqa: E402
    from_worker, machine_info, serve, start_worker, stop_workers, summarize, train_step, write_json,
)


class EncoderLM:
    """Factory for a byte-level ``nn.TransformerEncoder`` LM (embedding, causal encoder, head)."""

    @staticmethod
    def build(d_model: int, n_layers: int, n_heads: int, seq_len: int):
        import torch
        import torch.nn as nn

        class _LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(256, d_model)
                self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
                layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True,
                                                   norm_first=True)
                self.enc = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
                self.head = nn.Linear(d_model, 256)

            def forward(self, x):
                t = x.shape[1]
                mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
                return self.head(self.enc(self.emb(x) + self.pos[:t], mask=mask, is_causal=True))

        return _LM()


class Tabular:
    """Factory and step of a 3-layer MLP classifier over ``features`` byte values (a tabular model:
    a step of a few hundred microseconds)."""

    @staticmethod
    def build(features: int):
        import torch.nn as nn

        return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    @staticmethod
    def step(model, opt, loss_fn, corpus, gen, batch_size: int, features: int, device) -> float:
        """One step on ``batch_size`` windows of ``features`` bytes: is the byte after it a space?
        Returns its wall time in seconds (``loss.item()`` included)."""
        import time

        t0 = time.perf_counter()
        x, y = corpus.batch("train", batch_size, features, gen, device)
        loss = loss_fn(model(x.float() / 255.0), (y[:, -1] == 32).long())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        return time.perf_counter() - t0


class DeepMLP:
    """Factory for a byte-level LM of ``layers`` narrow blocks (``Linear(width, width)`` + ``tanh``):
    little arithmetic per module, so what the switch costs per module call and per step shows."""

    @staticmethod
    def build(width: int, layers: int):
        import torch.nn as nn

        blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())]
        return nn.Sequential(nn.Embedding(256, width), *blocks, nn.Linear(width, 256))


def worker(conn, mode: str, args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import apt_model.optimization.vb_global as vb
    from apt_model.core.system import set_seed
    from apt_model.data.text import ByteCorpus, load_text_bytes
    from apt_model.models.gpt import GPT, PRESETS, GPTConfig

    set_seed(0)
    amp = None
    if mode not in ("off", "manual"):
        vb.enable(mode, device=args.device, banner=False)
        device = vb.device()
    else:
        from apt_model.devices.ranking import select_device

        device = select_device(device=args.device).device  # the same device the switch would pick
        if mode == "manual":
            amp = torch.bfloat16
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
    corpus = ByteCorpus(load_text_bytes(None, args.max_bytes))
    preset = PRESETS[args.model_size]
    if args.arch == "gpt":
        model = GPT(GPTConfig(seq_len=args.seq_len, **preset))
    elif args.arch == "mlp":
        model = DeepMLP.build(args.mlp_width, args.mlp_layers)
    elif args.arch == "tabular":
        model = Tabular.build(args.seq_len)
    else:
        model = EncoderLM.build(preset["d_model"], preset["n_layers"], preset["n_heads"], args.seq_len)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    if args.arch == "tabular":  # the tabular loop: Adam, a loss module, no clipping, fp32 as written
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss_fn = torch.nn.CrossEntropyLoss()
        step = functools.partial(Tabular.step, model, opt, loss_fn, corpus, gen, args.batch_size, args.seq_len, device)
    else:
        step = functools.partial(train_step, model, opt, corpus, gen, args.batch_size, args.seq_len, device,
                                 autocast_dtype=amp)

    for _ in range(args.warmup):
        step()
    hooks = getattr(model, "_vb_autocast", None)
    trial_steps = 0
    while hooks is not None and hooks.trial is not None and hooks.trial.running and trial_steps < 500:
        step()  # the switch's autocast trial is a one-time cost: finish it before timing
        trial_steps += 1

    def ladder_pending() -> bool:
        if not vb.is_enabled():
            return False
        models = vb.get_report()["models"]
        return bool(models) and models[0]["features"].get("compile", {}).get("chosen") == "on trial"

    while ladder_pending() and trial_steps < 500:
        step()  # likewise the compile ladder's warm-up and trial (docs/compile.md)
        trial_steps += 1
    serve(conn, lambda n: [step() for _ in range(n)])
    report = vb.get_report() if vb.is_enabled() else None
    decisions = None
    if report:
        decisions = {m["name"]: {k: {"chosen": v["chosen"], "reason": v["reason"]} for k, v in m["features"].items()}
                     for m in report["models"]}
    conn.send({"device": str(device), "decisions": decisions,
               "probe_seconds": report["stats"]["probe_seconds"] if report else 0.0,
               "speed_probe": report["capabilities"]["speed"] if report else None})


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="balanced", help="switch mode compared against off")
    p.add_argument("--baseline", default="off", choices=("off", "manual"),
                   help="off: the plain fp32 script; manual: TF32 + hand-written bf16 autocast")
    p.add_argument("--arch", default="gpt", choices=("gpt", "encoder", "mlp", "tabular"),
                   help="gpt: the main job's model; encoder: an nn.TransformerEncoder LM; mlp: a deep stack of "
                        "narrow layers (--mlp-layers, --mlp-width), where per-call overhead shows")
    p.add_argument("--mlp-layers", type=int, default=48, help="--arch mlp: Linear+tanh blocks")
    p.add_argument("--mlp-width", type=int, default=16, help="--arch mlp: their width")
    p.add_argument("--model-size", default="tiny", choices=("tiny", "small", "medium"))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10, help="steps before timing (the autocast trial, if any, is finished too)")
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    base = args.baseline

    # one at a time: the switch's probes must not share the cores
    sides = {mode: start_worker(worker, mode, args, what=f"{mode}: starting") for mode in (base, args.mode)}
    times = {m: [] for m in sides}
    round_ratios = []
    order = list(sides)
    for r in range(args.rounds):
        per_round = {}
        for mode in (order if r % 2 == 0 else order[::-1]):
            parent, _ = sides[mode]
            parent.send(args.steps_per_round)
            per_round[mode] = from_worker(parent, sides[mode][1], f"{mode}: round {r + 1}")
            times[mode].extend(per_round[mode])
        round_ratios.append(statistics.median(per_round[base]) / statistics.median(per_round[args.mode]))
    finals = stop_workers(sides)

    off, on = summarize(times[base]), summarize(times[args.mode])
    result = {
        "benchmark": "switch_overhead",
        "machine": machine_info(args.threads, finals[base]["device"]),
        "config": vars(args),
        base: off,
        args.mode: on,
        "speedup": off["median"] / on["median"],
        "ratio_mode_over_baseline": on["median"] / off["median"],
        "round_speedups": {"median": statistics.median(round_ratios), "min": min(round_ratios), "max": max(round_ratios)},
        "decisions": finals[args.mode]["decisions"],
        "probe_seconds": finals[args.mode]["probe_seconds"],
        "speed_probe": finals[args.mode]["speed_probe"],
    }
    tok = args.batch_size * args.seq_len
    label = (f"{args.mlp_layers}x{args.mlp_width} mlp" if args.arch == "mlp" else "3-layer tabular mlp"
             if args.arch == "tabular" else f"{args.model_size} {args.arch}")
    print(f"switch overhead — {label}, batch {args.batch_size}x{args.seq_len}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.steps_per_round} steps, device {finals[base]['device']}, baseline {base}")
    print(f"  {'side':<12} {'median ms':>10} {'p25':>8} {'p75':>8} {'tokens/s':>10}")
    for name, s in ((base, off), (args.mode, on)):
        print(f"  {name:<12} {1e3 * s['median']:>10.1f} {1e3 * s['p25']:>8.1f} {1e3 * s['p75']:>8.1f} {tok / s['median']:>10,.0f}")
    print(f"  {args.mode} / {base} step time: {result['ratio_mode_over_baseline']:.3f} (speed-up {result['speedup']:.2f}x; "
          f"per-round speed-ups {result['round_speedups']['min']:.2f}-{result['round_speedups']['max']:.2f})")
    print(f"  one-time probe cost: {result['probe_seconds']:.2f} s (the autocast trial ran inside the warm-up)")
    for name, feats in (result["decisions"] or {}).items():
        for feat, d in feats.items():
            print(f"  decision {name}.{feat}: {d['chosen']} — {d['reason']}")
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
