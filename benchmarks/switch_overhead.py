#!/usr/bin/env python
"""Does the switch make the main job slower? ``--vb-mode off`` vs a mode, interleaved.

Two worker processes train the same GPT preset on the same real text (the stdlib corpus, same
seed, same batches): one plain PyTorch, one with the switch enabled before the model is built
(as a user would). Both warm up, then the coordinator has them run ``--steps-per-round`` steps
in turn — never at the same time, so they do not compete for cores — alternating which goes
first, for ``--rounds`` rounds. Reported: median step time per side, the speed-up
(off / mode, from the medians) and the median of per-round ratios, and the switch's decisions.

    python benchmarks/switch_overhead.py --threads 2 --json bench-results/switch_overhead.json
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import machine_info, summarize, train_step, write_json  # noqa: E402


def worker(conn, mode: str, args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import apt_model.optimization.vb_global as vb
    from apt_model.core.system import set_seed
    from apt_model.data.text import ByteCorpus, load_text_bytes
    from apt_model.models.gpt import GPT, PRESETS, GPTConfig

    set_seed(0)
    if mode != "off":
        vb.enable(mode, device=args.device, banner=False)
        device = vb.device()
    else:
        device = torch.device(args.device or "cpu")
    corpus = ByteCorpus(load_text_bytes(None, args.max_bytes))
    model = GPT(GPTConfig(seq_len=args.seq_len, **PRESETS[args.model_size])).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        return train_step(model, opt, corpus, gen, args.batch_size, args.seq_len, device)

    for _ in range(args.warmup):
        step()
    hooks = getattr(model, "_vb_autocast", None)
    trial_steps = 0
    while hooks is not None and hooks.trial is not None and hooks.trial.running and trial_steps < 500:
        step()  # the switch's autocast trial is a one-time cost: finish it before timing
        trial_steps += 1
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        conn.send([step() for _ in range(msg)])
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

    ctx = mp.get_context("spawn")
    sides = {}
    for mode in ("off", args.mode):  # one at a time: the switch's probes must not share the cores
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(child, mode, args), daemon=True)
        proc.start()
        assert parent.recv() == "ready"
        sides[mode] = (parent, proc)
    times = {m: [] for m in sides}
    round_ratios = []
    order = list(sides)
    for r in range(args.rounds):
        per_round = {}
        for mode in (order if r % 2 == 0 else order[::-1]):
            parent, _ = sides[mode]
            parent.send(args.steps_per_round)
            per_round[mode] = parent.recv()
            times[mode].extend(per_round[mode])
        round_ratios.append(statistics.median(per_round["off"]) / statistics.median(per_round[args.mode]))
    finals = {}
    for mode, (parent, proc) in sides.items():
        parent.send("stop")
        finals[mode] = parent.recv()
        proc.join(timeout=30)

    off, on = summarize(times["off"]), summarize(times[args.mode])
    result = {
        "benchmark": "switch_overhead",
        "machine": machine_info(args.threads, finals["off"]["device"]),
        "config": vars(args),
        "off": off,
        args.mode: on,
        "speedup": off["median"] / on["median"],
        "ratio_mode_over_off": on["median"] / off["median"],
        "round_speedups": {"median": statistics.median(round_ratios), "min": min(round_ratios), "max": max(round_ratios)},
        "decisions": finals[args.mode]["decisions"],
        "probe_seconds": finals[args.mode]["probe_seconds"],
        "speed_probe": finals[args.mode]["speed_probe"],
    }
    tok = args.batch_size * args.seq_len
    print(f"switch overhead — {args.model_size} GPT, batch {args.batch_size}x{args.seq_len}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.steps_per_round} steps, device {finals['off']['device']}")
    print(f"  {'side':<12} {'median ms':>10} {'p25':>8} {'p75':>8} {'tokens/s':>10}")
    for name, s in (("off", off), (args.mode, on)):
        print(f"  {name:<12} {1e3 * s['median']:>10.1f} {1e3 * s['p25']:>8.1f} {1e3 * s['p75']:>8.1f} {tok / s['median']:>10,.0f}")
    print(f"  {args.mode} / off step time: {result['ratio_mode_over_off']:.3f} (speed-up {result['speedup']:.2f}x; "
          f"per-round speed-ups {result['round_speedups']['min']:.2f}-{result['round_speedups']['max']:.2f})")
    print(f"  one-time probe cost: {result['probe_seconds']:.2f} s (the autocast trial ran inside the warm-up)")
    for name, feats in (result["decisions"] or {}).items():
        for feat, d in feats.items():
            print(f"  decision {name}.{feat}: {d['chosen']} — {d['reason']}")
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
