#!/usr/bin/env python
"""Out-of-core RSS: does a CPU-only paged run hold its host budget in the process's RSS?

On a CPU-only machine the compute level *is* host RAM and pages go to swap files on disk, so the
budget (``--budget``) should show in the process's resident size, not only in the pager's books.
Two spawned worker processes, one after the other, train the same GPT on the same stdlib text:
``plain`` (the switch off: everything in memory) and ``paged`` (the switch on, paging parameters,
gradients and AdamW states under the budget). Each records its RSS before the model is built
(after importing torch and apt_model, and for ``paged`` after ``vb.enable``), then trains
``--steps`` steps while a sampler thread reads the RSS every millisecond. Reported per side: the
peak RSS growth over that starting point and what it is made of at the peak:

* ``pages``: the pager's resident pages then (paged only; at most the budget plus one page);
* ``heap (live)``: other bytes the C heap had handed out (activations, autograd's saved tensors,
  temporaries; on the plain side also the weights, gradients and AdamW states): ``mallinfo2``;
* ``staging``: the page-aligned O_DIRECT buffers of the swap I/O threads (paged only);
* ``lib code``: file-backed RSS (shared-library code faulted in by new kernels; the same on both
  sides); the page cache of the swap files is not RSS and is not counted anywhere here;
* ``other``: the rest: free heap memory the allocator still held, Python objects, thread stacks.

The peak while the model is built and adopted (in memory first, then paged out; the paging
session's bandwidth probes run then, ~200 MB for a moment) is reported apart (``adoption peak``).

The target is a paged growth under half the plain one. ``torch.optim`` imports ``torch._dynamo``
(~800 modules, ~70 MB of RSS) when the first optimizer is built, and ``vb.enable`` does too: both
workers import it before their starting point, so neither side's growth counts it (the enable
figures below show what ``enable`` itself added).

    python benchmarks/out_of_core_rss.py --threads 2 --json bench-results/out_of_core_rss.json
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import cpu_and_minor_faults, machine_info, summarize, train_step, write_json  # noqa: E402

MB = 1e6


def _rss_anon_file() -> tuple[int, int]:
    """(RssAnon, RssFile) of this process in bytes, from /proc/self/status ((0, 0) without it)."""
    anon = file = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, file


def worker(conn, paged: bool, args) -> None:
    import threading
    import time

    import torch

    torch.set_num_threads(args.threads)
    import torch._dynamo  # noqa: F401 - what the first torch.optim optimizer imports anyway (see the docstring)

    import apt_model.optimization.vb_global as vb
    from apt_model.core.system import set_seed
    from apt_model.data.text import ByteCorpus, load_text_bytes
    from apt_model.memory.host import heap_in_use, release_free_memory, rss_now
    from apt_model.memory.placement import model_state_sizes
    from apt_model.models.gpt import GPT, GPTConfig
    from apt_model.switch.controller import session as vb_session

    set_seed(0)
    corpus = ByteCorpus(load_text_bytes(None, 2_000_000))
    gen = torch.Generator().manual_seed(0)
    release_free_memory()
    out: dict = {"side": "paged" if paged else "plain"}
    if paged:
        mods, before_enable = len(sys.modules), rss_now()
        vb.enable("balanced", paging=args.paging, device_budget=args.budget, swap_dir=args.swap_dir,
                  mixed_precision="off", banner=False)
        out["enable"] = {"rss_added": rss_now() - before_enable, "modules_added": len(sys.modules) - mods}
    release_free_memory()
    before, heap0, (anon0, file0) = rss_now(), heap_in_use(), _rss_anon_file()
    out["rss_before"] = before

    peak = {"rss": before, "heap": heap0, "pages": 0, "anon": anon0, "file": file0}
    stop = threading.Event()

    def pages_now() -> int:
        s = vb_session() if paged else None
        pg = s.paging if s is not None else None
        return int(pg.pager.resident_bytes + pg.pager.kept_bytes) if pg is not None else 0

    def sample() -> None:
        while not stop.is_set():
            r = rss_now()
            if r > peak["rss"]:  # a new peak: note what it is made of (cheap enough at new peaks only)
                anon, file = _rss_anon_file()
                peak.update(rss=r, heap=heap_in_use(), pages=pages_now(), anon=anon, file=file)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                          attn_implementation="sdpa")).to("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    p_bytes, t_bytes = model_state_sizes(model)
    out["state_bytes"] = p_bytes + t_bytes + 2 * t_bytes
    out["rss_after_adoption"] = rss_now()
    # the model was built in memory and (paged) moved out, with the adoption's bandwidth probes: a
    # transient of its own, reported apart; the training peak starts from here
    out["adoption_peak_growth"] = peak["rss"] - before
    peak["rss"] = 0
    times, cpu, after_step, faults = [], [], [], []
    for _ in range(args.steps):
        c0, f0 = cpu_and_minor_faults()
        times.append(train_step(model, opt, corpus, gen, args.batch_size, args.seq_len))
        c1, f1 = cpu_and_minor_faults()
        cpu.append(c1 - c0)
        faults.append(f1 - f0)
        after_step.append(rss_now() - before)
    stop.set()
    sampler.join()
    out["step_s"] = summarize(times)
    out["step_cpu_s"] = summarize(cpu[1:] or cpu)  # CPU seconds of the process (all threads) per step
    out["minor_faults_per_step"] = sorted(faults[1:] or faults)[len(faults[1:] or faults) // 2]  # median
    out["rss_growth_after_each_step"] = after_step
    growth = peak["rss"] - before
    heap_live = (peak["heap"] - heap0) if heap0 is not None and peak["heap"] is not None else None
    staging = 0
    if paged:
        s = vb_session()
        staging = int(getattr(s.stack.swap, "staging_bytes", 0))
        rep = vb.get_report()["memory"]["paging"]
        out["host_rss_report"] = rep.get("host_rss")
        out["pager"] = {k: rep["pager"][k] for k in ("budget", "peak_resident", "over_budget_bytes")}
        out["plan"] = vb.get_report()["models"][0]["features"]["paging"].get("reason")
    parts = {"pages": peak["pages"]}
    parts["heap_live"] = heap_live - peak["pages"] if heap_live is not None else None
    parts["staging"] = staging
    parts["lib_code"] = peak["file"] - file0
    parts["other"] = growth - sum(v for v in parts.values() if v is not None)
    out["peak_growth"] = growth
    out["anon_growth_at_peak"] = peak["anon"] - anon0
    out["breakdown_at_peak"] = parts
    if paged:
        vb.disable()
    conn.send(out)


def _run(ctx, paged: bool, args) -> dict:
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(child, paged, args), daemon=True)
    proc.start()
    out = parent.recv()
    proc.join(timeout=120)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--budget", default="96MB", help="level-0 (host) budget for training state")
    p.add_argument("--paging", default="over_budget", choices=("over_budget", "always", "tight"))
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.swap_dir is None:
        args.swap_dir = tempfile.gettempdir()
    from apt_model.base.sizes import parse_size

    ctx = mp.get_context("spawn")
    plain = _run(ctx, False, args)  # one at a time: neither competes with the other for memory or cores
    paged = _run(ctx, True, args)
    budget = parse_size(args.budget)
    ratio = paged["peak_growth"] / plain["peak_growth"] if plain["peak_growth"] > 0 else None
    result = {"benchmark": "out_of_core_rss", "machine": machine_info(args.threads, "cpu"), "config": vars(args),
              "budget": budget, "state_bytes": paged["state_bytes"], "plain": plain, "paged": paged,
              "growth_ratio": ratio, "target_ratio": 0.5, "passed": ratio is not None and ratio < 0.5}

    def mb(x) -> str:
        return "   n/a" if x is None else f"{x / MB:6.0f}"

    print(f"out-of-core RSS — GPT d={args.d_model} x{args.layers}, batch {args.batch_size}x{args.seq_len}, "
          f"{args.threads} threads, {args.steps} steps; training state {paged['state_bytes'] / MB:.0f}MB = "
          f"{paged['state_bytes'] / budget:.1f}x the {args.budget} budget")
    print("  MB     | RSS before | adoption peak | peak growth |  pages | heap (live) | staging | lib code | other "
          "| step median")
    for name, side in (("plain", plain), ("paged", paged)):
        b = side["breakdown_at_peak"]
        print(f"  {name:6s} | {mb(side['rss_before'])}     | {mb(side['adoption_peak_growth'])}        | "
              f"{mb(side['peak_growth'])}      | {mb(b['pages'])} | {mb(b['heap_live'])}      | {mb(b['staging'])}  | "
              f"{mb(b['lib_code'])}   | {mb(b['other'])}| {side['step_s']['median']:.2f} s")
    en = paged.get("enable", {})
    print(f"  per step (median): CPU {plain['step_cpu_s']['median']:.2f} s plain, {paged['step_cpu_s']['median']:.2f} s "
          f"paged; minor page faults {plain['minor_faults_per_step']} plain, {paged['minor_faults_per_step']} paged")
    print(f"  paged / plain growth = {ratio:.2f} (target < 0.5); enable() added {en.get('rss_added', 0) / MB:.0f}MB "
          f"and {en.get('modules_added', 0)} modules before the starting point")
    hr = paged.get("host_rss_report")
    if hr:
        print(f"  report host_rss: peak growth {hr['peak_rss_growth'] / MB:.0f}MB (sampled) = pages "
              f"{hr['pages_resident_peak'] / MB:.0f} + staging {hr['staging_buffers'] / MB:.0f} + other "
              f"{hr['other'] / MB:.0f}")
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
