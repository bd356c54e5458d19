#!/usr/bin/env python
"""What paging costs per layer when the budget is not short: a deep stack of small layers.

Two worker processes train the same model (``--layers`` blocks of ``Linear(width, width)`` and
``tanh``, AdamW, gradient clipping) on the same random batches: one plain, one with the switch on,
paging forced and a level-0 budget larger than the training state, so parameters and optimizer
states stay resident after the first step. What remains is what a paged model pays on every step
whatever its budget: the unit hooks around each layer's forward and backward (acquire, release,
the forward-scope frames), the gradient hooks, the page-fault handler on every tensor op, the
streamed optimizer step, and the writes of the gradients, states and updated parameters, which
are written behind as they are produced (kept in memory too while the budget has room, so after
the first step nothing is read back; the swap disk's write speed is in it; the bytes are printed).
The layers are small so that this, not the arithmetic, shows. After a warm-up the workers take turns — never at the same time — running
``--steps-per-round`` steps each, alternating which goes first, for ``--rounds`` rounds.

Reported: median step time per side, the difference, and the difference per layer (each layer
is one unit, called once forward and once backward per step): an upper bound on the per-unit
cost, since the handler's per-op cost and the optimizer's are in it too.

    python benchmarks/hook_overhead.py --threads 2 --json bench-results/hook_overhead.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import from_worker, machine_info, serve, start_worker, stop_workers, write_json  # noqa: E402

VARIANTS = ("off", "paged")


def worker(conn, variant: str, args) -> None:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    import apt_model.optimization.vb_global as vb

    if variant == "paged":
        vb.enable("balanced", paging="always", device_budget="1GB", compile="off", attention="off",
                  mixed_precision="off", swap_dir=args.swap_dir, banner=False)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 1)).to("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)

    def step() -> float:
        x = torch.randn(args.batch_size, args.width, generator=gen)
        t0 = time.perf_counter()
        loss = F.mse_loss(model(x), x[:, :1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    serve(conn, lambda n: [step() for _ in range(n)])
    pager = vb.get_report()["memory"]["paging"]["pager"] if vb.is_enabled() else None
    conn.send(pager and {k: pager.get(k) for k in ("bytes_in", "bytes_out", "faults", "misses")})


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps-per-round", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.swap_dir is None:
        args.swap_dir = tempfile.gettempdir()

    workers = {name: start_worker(worker, name, args, what=f"{name}: starting") for name in VARIANTS}
    steps = {n: [] for n in VARIANTS}
    for r in range(args.rounds):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            workers[name][0].send(args.steps_per_round)
            steps[name] += from_worker(*workers[name], f"{name}: round {r + 1}")
    finals = stop_workers(workers)

    med = {n: statistics.median(steps[n]) for n in VARIANTS}
    extra = med["paged"] - med["off"]
    result = {"benchmark": "hook_overhead", "machine": machine_info(args.threads, "cpu"), "config": vars(args),
              "results": {n: {"step_s": med[n], "p25_s": statistics.quantiles(steps[n], n=4)[0],
                              "p75_s": statistics.quantiles(steps[n], n=4)[2], "steps": steps[n]} for n in VARIANTS},
              "extra_s_per_step": extra, "extra_s_per_layer": extra / args.layers, "paged_pager": finals["paged"]}
    print(f"paging bookkeeping — {args.layers} x Linear({args.width}, {args.width}), batch {args.batch_size}, "
          f"{args.threads} threads, median of {args.rounds} x {args.steps_per_round} interleaved steps")
    for n in VARIANTS:
        r = result["results"][n]
        print(f"  {n:<6} {r['step_s'] * 1e3:8.2f} ms/step (p25-p75 {r['p25_s'] * 1e3:.2f}-{r['p75_s'] * 1e3:.2f})")
    print(f"  paged - off: {extra * 1e3:.2f} ms/step, {extra / args.layers * 1e6:.0f} µs per layer "
          f"(forward + backward + its optimizer step); pager after the run: {finals['paged']}")
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
