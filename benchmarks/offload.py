#!/usr/bin/env python
"""Out-of-core training: a GPT whose training state is >= 4x the budget, paged below it.

CPU mode (the default, ``--device cpu``): a GPT whose training state is >= 4x the host budget,
paged to NVMe. Two worker processes train the same GPT on the same stdlib text: one in memory (the
switch off), one with the switch paging its parameters, gradients and AdamW states under
``--budget``. After warm-up they take turns (never at the same time), alternating who goes first,
for ``--rounds`` rounds of ``--steps-per-round`` steps. Reported per side: median step time; for
the paged side also the bytes read and written per step (from the pager's counters), the disk
bandwidth measured in the same run, the I/O floor (read bytes / read GB/s + written bytes / write
GB/s: the time the disk alone needs), the ratio of the step time to that floor (target <= 1.5),
and ``ratio_to_bound``: the paged step over max(in-memory step, I/O floor) — the floor alone is
no bound when the compute takes longer than the disk.

    python benchmarks/offload.py --threads 2 --json bench-results/offload.json

The loop clips gradients (``--clip 1.0``), so the optimizer step cannot run inside backward. With
``--clip 0`` it can: the paged worker then runs with ``paging_step_in_backward=on`` (no timed trial)
and a third worker with ``off``: the step inside backward against the step after it, side by side
in the same run (what ``auto``'s own trial compares, over more iterations).

    python benchmarks/offload.py --threads 2 --clip 0 --json bench-results/offload-noclip.json

With ``--compare-reuse-memory`` another paged worker runs with ``paging_reuse_memory=off`` (evicted
pages' memory freed at once rather than kept for the next load of the same size), taking turns with
the others; every worker's minor page faults per step are reported.

GPU mode (``--device cuda``, code in ``offload_gpu.py``): one run compares in-memory training with
torchao's ``CPUOffloadOptimizer`` (with and without ``offload_gradients``), FSDP2's
``CPUOffloadPolicy`` on one rank, and this project's paging with the parameters kept on the device
and with everything paged — each in its own worker process, taking turns; step times, peak HBM,
bytes moved over the host link and the link floor, and a comparison with the issue's targets.
Default model: 12 blocks of width 2048 (SDPA), batch 8 x 512 tokens, fp32 AdamW.

    python benchmarks/offload.py --device cuda --json bench-results/offload-gpu.json
    python benchmarks/offload.py --device cuda --variants in_memory,vb_all_paged --budget-paged 1GB

Without CUDA, ``--device cuda`` exits with status 2 and a one-line message.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import WorkerDied, cpu_and_minor_faults, from_worker, machine_info, summarize, train_step, write_json  # noqa: E402
from offload_gpu import EXTRA, VARIANTS, cuda_missing, run_gpu  # noqa: E402

#: The phases level 0's stall is split into (``vb.get_stats()["levels"][0]["stall_s_by_phase"]``).
PHASES = ("forward", "backward", "optimizer", "other")


def worker(conn, paged: bool, args, step_in_backward: str = "auto", reuse_memory: bool = True) -> None:
    import torch

    torch.set_num_threads(args.threads)
    import apt_model.optimization.vb_global as vb
    from apt_model.core.system import set_seed
    from apt_model.data.text import ByteCorpus, load_text_bytes
    from apt_model.memory.placement import model_state_sizes
    from apt_model.models.gpt import GPT, GPTConfig

    set_seed(0)
    if paged:
        vb.enable("balanced", paging=args.paging, device_budget=args.budget, swap_dir=args.swap_dir,
                  mixed_precision="off", banner=False, paging_step_in_backward=step_in_backward,
                  paging_reuse_memory=reuse_memory)
    corpus = ByteCorpus(load_text_bytes(None, 2_000_000))
    model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                          attn_implementation="sdpa")).to("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    p_bytes, t_bytes = model_state_sizes(model)

    def io_counters():
        usage = cpu_and_minor_faults()  # the last two: CPU seconds (all threads), minor page faults
        if not paged:
            return (0, 0, 0.0, *(0.0 for _ in PHASES), *usage)
        lv = vb.get_stats()["levels"]
        phases = lv[0].get("stall_s_by_phase") or {}
        return (lv[-1]["bytes_out"], lv[-1]["bytes_in"], lv[0]["stall_s"],  # read, written, stall
                *(phases.get(k, 0.0) for k in PHASES), *usage)

    def step() -> float:
        return train_step(model, opt, corpus, gen, args.batch_size, args.seq_len, clip=args.clip or None)

    for _ in range(args.warmup):
        step()
    info = {"params_bytes": p_bytes, "state_bytes": p_bytes + t_bytes + 2 * t_bytes}
    if paged:
        rep = vb.get_report()
        info["plan"] = rep["models"][0]["features"]["paging"]
        info["step_in_backward"] = rep["memory"]["paging"]["step_in_backward"]
        info["bandwidths"] = rep["memory"]["stack"]["bandwidths"]
        info["levels"] = [f"Level {lv['index']}: {lv['device']} - {lv['capacity'] / 1e6:.0f}MB @ {lv['gbps']}GB/s"
                          for lv in rep["memory"]["stack"]["levels"]]
    conn.send(("ready", info))
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        before = io_counters()
        times = [step() for _ in range(msg)]
        after = io_counters()
        conn.send((times, [a - b for a, b in zip(after, before)]))
    if paged:
        from apt_model.memory.bandwidth import measure_bandwidths
        from apt_model.switch.controller import session as vb_session

        conn.send({"disk_after": measure_bandwidths(torch.device("cpu"), vb_session().stack.swap.folder, refresh=True)["disk"],
                   "levels": vb.get_stats()["levels"]})
        vb.disable()
    else:
        conn.send({})


#: Model and loop defaults per ``--device`` (flags given on the command line win).
DEFAULTS = {
    "cpu": dict(d_model=512, layers=8, heads=8, seq_len=128, batch_size=4, threads=2),
    "cuda": dict(d_model=2048, layers=12, heads=16, seq_len=512, batch_size=8, threads=None),  # threads: all cores
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: in memory vs paged to NVMe; cuda: in memory vs torchao, FSDP2 and the switch's paging")
    p.add_argument("--d-model", type=int, default=None, help="default 512 (cpu) / 2048 (cuda)")
    p.add_argument("--layers", type=int, default=None, help="default 8 (cpu) / 12 (cuda)")
    p.add_argument("--heads", type=int, default=None, help="default 8 (cpu) / 16 (cuda)")
    p.add_argument("--seq-len", type=int, default=None, help="default 128 (cpu) / 512 (cuda)")
    p.add_argument("--batch-size", type=int, default=None, help="default 4 (cpu) / 8 (cuda)")
    p.add_argument("--budget", default="100MB", help="cpu: level-0 (host) budget for training state")
    p.add_argument("--paging", default="over_budget", choices=("over_budget", "always", "tight"))
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads; default 2 (cpu) / all cores (cuda)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--compare-reuse-memory", action="store_true",
                   help="cpu: a third worker pages with paging_reuse_memory=off, side by side")
    p.add_argument("--clip", type=float, default=1.0,
                   help="cpu: clip_grad_norm_ max norm in the loop (0: no clipping; then the paged worker steps "
                        "inside backward, paging_step_in_backward=on, and a third worker after it, =off)")
    g = p.add_argument_group("GPU mode (--device cuda)")
    g.add_argument("--variants", default=None, help="comma-separated subset of: " + ", ".join(VARIANTS + EXTRA))
    g.add_argument("--budget-kept", default=None,
                   help="vb_params_kept's device budget (default: the parameters / 0.75 + one block)")
    g.add_argument("--budget-host-step", default=None,
                   help="vb_host_step's device budget (default: twice the parameters + one block, the parameters "
                        "and gradients that torchao's CPUOffloadOptimizer keeps on the device)")
    g.add_argument("--budget-paged", default=None,
                   help="vb_all_paged's device budget (default: a quarter of the parameters, at least the working set)")
    g.add_argument("--keep-cuda-cache", action="store_true",
                   help="workers keep their cached HBM between turns (default: each empties its cache after its "
                        "turn and starts the next with one untimed step, so that six idle workers fit in HBM)")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed turns each worker profiles one more step and writes DIR/profile-<variant>.txt")
    g.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds to wait for a worker's answer")
    g.add_argument("--gpu-code-on-cpu", action="store_true",
                   help="run the GPU mode's code on the CPU (tests of the benchmark itself; the times mean nothing)")
    args = p.parse_args(argv)
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.swap_dir is None:
        args.swap_dir = tempfile.gettempdir()
    if args.device == "cuda":
        missing = cuda_missing(args)
        if missing:
            print(f"offload.py: {missing}", file=sys.stderr)
            raise SystemExit(2)
        return run_gpu(args)

    procs = []
    try:
        return run_cpu(args, procs)
    except WorkerDied as err:  # the worker's own traceback is above, on stderr
        for proc in procs:  # the others would wait for their next turn forever
            proc.terminate()
        print(f"offload.py: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def run_cpu(args, procs: list) -> dict:
    """CPU mode (see the module docstring); each worker process started is appended to ``procs``.
    Raises WorkerDied when a worker ends before answering."""
    ctx = mp.get_context("spawn")
    sides, infos = {}, {}
    workers = [("in_memory", False, "auto"), ("paged", True, "auto")]
    if not args.clip:  # the step inside backward applies: measured against the step after backward
        workers = [("in_memory", False, "auto"), ("paged", True, "on"), ("paged_after_backward", True, "off")]
    if args.compare_reuse_memory:  # the same paged run with evicted pages' memory freed, not kept
        workers.append(("paged_no_reuse", True, workers[1][2], False))
    for name, paged, in_backward, *reuse in workers:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(child, paged, args, in_backward, *reuse), daemon=True)
        proc.start()
        procs.append(proc)
        child.close()  # the worker holds the only other end: its death ends the pipe
        tag, info = from_worker(parent, proc, f"{name}: starting and warming up")
        assert tag == "ready"
        sides[name], infos[name] = (parent, proc), info
    times = {n: [] for n in sides}
    faults = {n: 0 for n in sides}
    cpu = {n: 0.0 for n in sides}
    io, io_after = [], []
    order = list(sides)
    for r in range(args.rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            parent, proc = sides[name]
            parent.send(args.steps_per_round)
            t, delta = from_worker(parent, proc, f"{name}: timing round {r + 1}")
            times[name].extend(t)
            faults[name] += delta[-1]
            cpu[name] += delta[-2]
            if name == "paged":
                io.append(delta)
            elif name == "paged_after_backward":
                io_after.append(delta)
    finals = {}
    for name, (parent, proc) in sides.items():
        parent.send("stop")
        finals[name] = from_worker(parent, proc, f"{name}: stopping")
        proc.join(timeout=60)

    steps = args.rounds * args.steps_per_round
    read_b = sum(d[0] for d in io) / steps
    write_b = sum(d[1] for d in io) / steps
    stall = sum(d[2] for d in io) / steps
    by_phase = {k: sum(d[3 + i] for d in io) / steps for i, k in enumerate(PHASES)} if io and len(io[0]) > 3 else {}
    disk = infos["paged"]["bandwidths"]["disk"]
    disk_after = finals["paged"]["disk_after"]
    floor = read_b / (disk["read"] * 1e9) + write_b / (disk["write"] * 1e9)
    mem, pag = summarize(times["in_memory"]), summarize(times["paged"])
    result = {
        "benchmark": "offload",
        "machine": machine_info(args.threads, "cpu"),
        "config": vars(args),
        "state_bytes": infos["paged"]["state_bytes"],
        "state_over_budget": None,
        "levels": infos["paged"]["levels"],
        "plan": infos["paged"]["plan"],
        "in_memory": mem,
        "paged": pag,
        "read_bytes_per_step": read_b,
        "write_bytes_per_step": write_b,
        "stall_s_per_step": stall,
        "stall_s_per_step_by_phase": by_phase,
        "disk_gbps_before": disk,
        "disk_gbps_after": disk_after,
        "io_floor_s": floor,
        "ratio_to_io_floor": pag["median"] / floor if floor else None,
        "ratio_to_bound": pag["median"] / max(mem["median"], floor),  # the floor is no bound when compute is longer
        "slowdown_vs_in_memory": pag["median"] / mem["median"],
        "step_in_backward": infos["paged"]["step_in_backward"],
        "minor_faults_per_step": {n: f / steps for n, f in faults.items()},
        "cpu_s_per_step": {n: c / steps for n, c in cpu.items()},  # all threads of the worker
    }
    if "paged_no_reuse" in times:
        nr = summarize(times["paged_no_reuse"])
        result["paged_no_reuse"] = nr
        result["reuse_over_no_reuse"] = pag["median"] / nr["median"]
    if "paged_after_backward" in times:
        aft = summarize(times["paged_after_backward"])
        result["paged_after_backward"] = aft
        result["paged_after_backward_stall_s_per_step_by_phase"] = {
            k: sum(d[3 + i] for d in io_after) / steps for i, k in enumerate(PHASES)} if io_after else {}
        result["paged_after_backward_read_bytes_per_step"] = sum(d[0] for d in io_after) / steps
        result["paged_after_backward_write_bytes_per_step"] = sum(d[1] for d in io_after) / steps
        result["in_backward_over_after_backward"] = pag["median"] / aft["median"]
    from apt_model.base.sizes import parse_size

    result["state_over_budget"] = result["state_bytes"] / parse_size(args.budget)
    print(f"offload — GPT d={args.d_model} x{args.layers}, batch {args.batch_size}x{args.seq_len}, {args.threads} threads; "
          f"training state {result['state_bytes'] / 1e6:.0f}MB = {result['state_over_budget']:.1f}x the {args.budget} budget")
    for line in infos["paged"]["levels"]:
        print("  " + line)
    print(f"  plan: {result['plan']['reason']}")
    print(f"  in-memory step  {1e3 * mem['median']:8.1f} ms (p25 {1e3 * mem['p25']:.1f}, p75 {1e3 * mem['p75']:.1f})")
    print(f"  paged step      {1e3 * pag['median']:8.1f} ms (p25 {1e3 * pag['p25']:.1f}, p75 {1e3 * pag['p75']:.1f}); "
          f"stalled {1e3 * stall:.0f} ms/step waiting for I/O ("
          + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in by_phase.items()) + ")")
    print(f"  per step: read {read_b / 1e6:.1f}MB, wrote {write_b / 1e6:.1f}MB; disk read {disk['read']:.2f} GB/s, "
          f"write {disk['write']:.2f} GB/s (re-measured after: {disk_after['read']:.2f} / {disk_after['write']:.2f})")
    print(f"  I/O floor {1e3 * floor:.1f} ms; paged / floor = {result['ratio_to_io_floor']:.2f} (target <= 1.5); "
          f"paged / in-memory = {result['slowdown_vs_in_memory']:.2f}")
    print(f"  paged / max(in-memory, I/O floor) = {result['ratio_to_bound']:.2f} (ratio_to_bound)")
    sib = result["step_in_backward"]
    print(f"  optimizer step inside backward: {sib['state']} ({sib['reason']})")
    if "paged_after_backward" in result:
        aft = result["paged_after_backward"]
        print(f"  paged, step after backward {1e3 * aft['median']:8.1f} ms (p25 {1e3 * aft['p25']:.1f}, "
              f"p75 {1e3 * aft['p75']:.1f}); read {result['paged_after_backward_read_bytes_per_step'] / 1e6:.1f}MB, "
              f"wrote {result['paged_after_backward_write_bytes_per_step'] / 1e6:.1f}MB per step; stalled ("
              + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in result["paged_after_backward_stall_s_per_step_by_phase"].items())
              + f"); in backward / after = {result['in_backward_over_after_backward']:.2f}")
    print("  per step, all threads: minor page faults " + ", ".join(
        f"{n} {f:,.0f}" for n, f in result["minor_faults_per_step"].items()) + "; CPU seconds " + ", ".join(
        f"{n} {c:.2f}" for n, c in result["cpu_s_per_step"].items()))
    if "paged_no_reuse" in result:
        nr = result["paged_no_reuse"]
        print(f"  paged, evicted pages' memory freed (paging_reuse_memory=off) {1e3 * nr['median']:8.1f} ms "
              f"(p25 {1e3 * nr['p25']:.1f}, p75 {1e3 * nr['p75']:.1f}); paged / this = {result['reuse_over_no_reuse']:.3f}")
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
