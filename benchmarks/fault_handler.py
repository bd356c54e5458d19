#!/usr/bin/env python
"""What the op-level page-fault handler costs a paged training step, and what paging at module
boundaries saves (docs/tiers.md, "Module boundaries, not ops, inside a forward").

One process, one paged GPT whose whole training state fits the budget (``paging="always"`` with a
roomy budget: after the first step nothing moves, so the steps time the hooks and the handler, not
I/O). Two variants of the same model and loop, interleaved step by step (ABAB...) after warm-up:

* ``handler``: the model's forwards keep the op-level handler (its learned state forced to "on");
* ``boundaries``: the forwards run without it, as learned (the default after two forwards).

Reported: median step time of each (p25-p75), the ratio, and the ops the handler saw per step.

    python benchmarks/fault_handler.py --threads 2 --json bench-results/fault_handler.json
    python benchmarks/fault_handler.py --device cuda   # on a GPU: the per-op Python matters more there
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import StepClock, machine_info, summarize, write_json  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    import apt_model.optimization.vb_global as vb
    from apt_model.memory.paging.fault import PageFaultMode
    from apt_model.memory.paging.model import LEARN_FORWARDS
    from apt_model.models.gpt import GPT, GPTConfig

    dev = torch.device(args.device)
    calls = [0]
    real = PageFaultMode.__torch_function__

    def counting(self, func, types, a=(), kw=None):
        calls[0] += 1
        return real(self, func, types, a, kw)

    PageFaultMode.__torch_function__ = counting
    torch.manual_seed(0)
    vb.enable("balanced", paging="always", device_budget="4GB", swap_dir=tempfile.gettempdir(), attention="off",
              mixed_precision="off", compile="off", banner=False, device=args.device)
    try:
        model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=4,
                              dropout=0.0, attn_implementation="sdpa")).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        paged = vb.session().paging.models[0]
        x = torch.randint(0, 256, (args.batch_size, args.seq_len), device=dev)
        clock = StepClock(dev)

        def step() -> tuple[float, int]:
            before = calls[0]
            clock.start()
            loss = F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return clock.stop(), calls[0] - before

        kind = (True, True)
        for _ in range(max(args.warmup, LEARN_FORWARDS + 1)):
            step()
        times = {"handler": [], "boundaries": []}
        ops = {"handler": [], "boundaries": []}
        for i in range(2 * args.steps):
            name = ("handler", "boundaries")[i % 2]
            paged.clean_forwards[kind] = -1 if name == "handler" else LEARN_FORWARDS
            t, n = step()
            times[name].append(t)
            ops[name].append(n)
        paged.clean_forwards[kind] = LEARN_FORWARDS
    finally:
        vb.disable()
        PageFaultMode.__torch_function__ = real
    a, b = summarize(times["handler"]), summarize(times["boundaries"])
    result = {"benchmark": "fault_handler", "machine": machine_info(args.threads, args.device), "config": vars(args),
              "handler": a, "boundaries": b, "ratio_boundaries_over_handler": b["median"] / a["median"],
              "handler_ops_per_step": {k: sorted(v)[len(v) // 2] for k, v in ops.items()}}
    print(f"fault handler — GPT d={args.d_model} x{args.layers}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.device}, {args.threads} threads, everything resident (no I/O)")
    for name, s in (("op-level handler", a), ("module boundaries", b)):
        print(f"  {name:18s} {1e3 * s['median']:8.2f} ms/step (p25 {1e3 * s['p25']:.2f}, p75 {1e3 * s['p75']:.2f}); "
              f"ops through the handler per step: {result['handler_ops_per_step']['handler' if 'op' in name else 'boundaries']}")
    print(f"  boundaries / handler = {result['ratio_boundaries_over_handler']:.3f}")
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
