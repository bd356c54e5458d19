#!/usr/bin/env python
"""Activation memory: off vs offload vs checkpoint vs both, at several sequence lengths.

Four worker processes (one per variant) train the same GPT (SDPA attention, fp32) with the same
seed and inputs. For each sequence length they take turns — one at a time, alternating the order
each round — running one training step each; a sampler thread in each worker reads the process's
RSS and the C heap's bytes in use (glibc ``mallinfo2``) every 0.5 ms. The step's activation
peak is the highest value above the one just before the step (freed heap memory returned to the
OS first, so the baseline is honest): "heap" counts live bytes, "RSS" also the freed memory the
allocator keeps during the step. Reported per variant and length: median peaks (MB) and their
ratios to "off", median step time and its ratio.

    python benchmarks/activations.py --threads 2 --json bench-results/activations.json
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

VARIANTS = {
    "off": {},
    "offload": {"activation_offload": True, "activation_checkpointing": False},
    "checkpoint": {"activation_offload": False, "activation_checkpointing": True},
    "both": {"activation_offload": True, "activation_checkpointing": True},
}


def worker(conn, variant: str, args) -> None:
    import threading

    import psutil
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    import apt_model.optimization.vb_global as vb
    from apt_model.memory.host import heap_in_use, release_free_memory
    from apt_model.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=max(args.seq), d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                          attn_implementation="sdpa"))
    if variant != "off":
        vb.enable("balanced", attention="off", mixed_precision="off", compile="off", paging="off", swap_dir=args.swap_dir,
                  activation_budget=args.offload_budget, banner=False, **VARIANTS[variant])
    model.to("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    proc = psutil.Process()

    def step(seq: int) -> tuple[float, int, int]:
        x = torch.randint(0, 256, (args.batch_size, seq), generator=torch.Generator().manual_seed(seq))
        release_free_memory()
        base, hbase = proc.memory_info().rss, heap_in_use() or 0
        peak, hpeak, stop = [base], [hbase], [False]

        def sample():
            while not stop[0]:
                peak[0] = max(peak[0], proc.memory_info().rss)
                hpeak[0] = max(hpeak[0], heap_in_use() or 0)
                time.sleep(0.0005)

        th = threading.Thread(target=sample)
        th.start()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        stop[0] = True
        th.join()
        return dt, peak[0] - base, hpeak[0] - hbase

    serve(conn, step)
    report = vb.get_report()["activations"] if vb.is_enabled() else None
    conn.send(report)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--offload-budget", default="32MB", help="activation_budget for the offload variants")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.swap_dir is None:
        args.swap_dir = tempfile.gettempdir()

    workers = {name: start_worker(worker, name, args, what=f"{name}: starting") for name in VARIANTS}
    results = {}
    names = list(VARIANTS)
    for seq in args.seq:
        for name in names:  # warm-up at this length (allocator, kernels)
            workers[name][0].send(seq)
            from_worker(*workers[name], f"{name}: warming up at {seq} tokens")
        times = {n: [] for n in names}
        peaks = {n: [] for n in names}
        heaps = {n: [] for n in names}
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                workers[name][0].send(seq)
                dt, peak, heap = from_worker(*workers[name], f"{name}: round {r + 1} at {seq} tokens")
                times[name].append(dt)
                peaks[name].append(peak)
                heaps[name].append(heap)
        results[seq] = {n: {"step_s": statistics.median(times[n]), "peak_bytes": statistics.median(peaks[n]),
                            "heap_peak_bytes": statistics.median(heaps[n]), "steps": times[n], "peaks": peaks[n],
                            "heap_peaks": heaps[n]} for n in names}
    finals = stop_workers(workers)

    print(f"activation memory — GPT d={args.d_model} x{args.layers} (SDPA), batch {args.batch_size}, {args.threads} threads, "
          f"offload budget {args.offload_budget}, median of {args.rounds} interleaved steps")
    print(f"  {'seq':>5} {'variant':<11} {'heap MB':>8} {'vs off':>7} {'RSS MB':>8} {'vs off':>7} {'step s':>7} {'vs off':>7}")
    for seq, per in results.items():
        off = per["off"]
        for name in names:
            r = per[name]
            r["peak_vs_off"] = r["peak_bytes"] / off["peak_bytes"] if off["peak_bytes"] > 0 else None
            r["heap_vs_off"] = r["heap_peak_bytes"] / off["heap_peak_bytes"] if off["heap_peak_bytes"] > 0 else None
            r["time_vs_off"] = r["step_s"] / off["step_s"]
            print(f"  {seq:>5} {name:<11} {r['heap_peak_bytes'] / 2**20:>8.1f} {r['heap_vs_off']:>7.2f} "
                  f"{r['peak_bytes'] / 2**20:>8.1f} {r['peak_vs_off']:>7.2f} {r['step_s']:>7.2f} {r['time_vs_off']:>7.2f}")
    result = {"benchmark": "activations", "machine": machine_info(args.threads, "cpu"), "config": vars(args),
              "results": {str(k): v for k, v in results.items()}, "reports": finals}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
