"""GPU mode of ``benchmarks/offload.py``: training-state offload on one GPU, six ways in one run.

    python benchmarks/offload.py --device cuda --json bench-results/offload-gpu.json

Every variant trains the same GPT (:mod:`apt_model.models.gpt`, SDPA attention; default 12 blocks
of width 2048, batch 8 x 512 tokens) with fp32 AdamW (lr 1e-4) through the same loop
(:func:`measure.train_step`: batch, forward, loss, backward, optimizer step; no gradient clipping,
which torchao's offloaded gradients would not see):

* ``in_memory`` — everything on the device, the switch off;
* ``torchao_offload`` — ``torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW)``: states
  and the step on the CPU, gradients copied down and parameters back up every step;
* ``torchao_offload_grads`` — the same with ``offload_gradients=True``;
* ``fsdp2_cpu_offload`` — ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` per block, then
  on the root, in a one-rank process group (NCCL, a ``file://`` store);
* ``vb_params_kept`` — the switch paging under a device budget that keeps the parameters resident
  (``--budget-kept``, default the parameters / 0.75 + one block: the plan keeps a category when it
  fits three quarters of the budget), so gradients and AdamW states page to pinned host memory;
* ``vb_host_step`` — ``paging_exact=False``: the cost model may move the optimizer step to the host
  (the states stay in host memory; see docs/tiers.md, "Where the optimizer step runs"); the row
  records where it ran. Its device budget (``--budget-host-step``) defaults to twice the parameters
  plus one block: the parameters and gradients that torchao's ``CPUOffloadOptimizer`` keeps on the
  device, which issue 15's target allows ("at <= its peak HBM"). The plan still keeps only the
  parameters; the rest is room for gradients on their way down, so backward need not wait for
  their copies (with the ``vb_params_kept`` budget it waited: 155 ms per step of hook time on an
  H200, and the host step could start only once backward was nearly done on the device);
* ``vb_all_paged`` — a budget under which everything pages (``--budget-paged``, default a quarter
  of the parameters, at least the working set);
* ``vb_all_paged_one_stream`` (only when named in ``--variants``) — the same with the host level's
  copies in both directions on one side stream, as before 2026-11-27: the A/B of the change to one
  stream per direction.

Each variant runs in its own spawned worker; after its warm-up (the switch's variants go on, untimed,
until the step inside backward is decided: learned from the first step, then a six-step trial in
its ``auto`` mode; the row records the outcome) the workers take turns (never at the
same time, order reversed every round). Each empties its CUDA cache after its turn and begins the
next with one untimed step, so that the idle workers fit in HBM together (``--keep-cuda-cache``:
keep the caches). The switch runs with TF32 and the compiler off, so every variant runs the same
fp32 kernels. A step is timed on the host from its start to a ``torch.cuda.synchronize()`` at its
end. Reported per variant: median step (p25-p75), step / in-memory step, peak HBM
(``torch.cuda.max_memory_allocated``, reset at the start of each turn); for the switch's variants
also the bytes moved up to the device and down from it per step (the pager's level counters: level
0's ``bytes_in``, the host level's ``bytes_in``), the link floor (up / H2D + down / D2H, pinned
copies measured in this run before and after the turns by
:func:`apt_model.memory.bandwidth.measure_link`), and the step over that floor and over
max(in-memory step, floor). A variant whose package or feature is missing is skipped with the
reason; one that fails is reported as failed; neither stops the others.

``--gpu-code-on-cpu`` runs this code on the CPU (the tests do; FSDP2 unpinned on gloo, torchao
skipped, no link and no HBM figures): it checks the benchmark, not the offload.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

VARIANTS = ("in_memory", "torchao_offload", "torchao_offload_grads", "fsdp2_cpu_offload", "vb_params_kept",
            "vb_host_step", "vb_all_paged")
#: Run only when named in ``--variants``: ``vb_all_paged`` with the host level's copies up and down on one
#: side stream, as before 2026-11-27 (the A/B of the two-stream change, side by side in one run).
EXTRA = ("vb_all_paged_one_stream",)
TORCHAO = ("torchao_offload", "torchao_offload_grads")
VB = ("vb_params_kept", "vb_host_step", "vb_all_paged", "vb_all_paged_one_stream")
LR = 1e-4
#: Untimed steps a vb variant may add to its warm-up until the step inside backward is decided
#: (one step learning the loop, six of trial; see Variant.settle).
SETTLE_STEPS = 10


def cuda_missing(args) -> str | None:
    """Why ``--device cuda`` cannot run here (one line), or None."""
    if args.gpu_code_on_cpu or torch.cuda.is_available():
        return None
    return (f"--device cuda needs a CUDA GPU, and this machine has none (torch {torch.__version__}: "
            "torch.cuda.is_available() is False)")


def skip_reason(variant: str, device_type: str = "cuda", importer=importlib.import_module) -> str | None:
    """Why ``variant`` cannot run on ``device_type`` here, or None. ``importer`` imports a module by
    name (tests replace it to pretend a package or feature is missing)."""
    if variant not in VARIANTS + EXTRA:
        return f"unknown variant {variant!r}; valid: {', '.join(VARIANTS + EXTRA)}"
    try:
        if variant in TORCHAO:
            if device_type not in ("cuda", "xpu"):
                return f"torchao's CPUOffloadOptimizer runs on CUDA or XPU only, not {device_type}"
            try:
                mod = importer("torchao.optim")
            except ImportError as err:
                return f"torchao is not installed ({err})"
            if not hasattr(mod, "CPUOffloadOptimizer"):
                ver = getattr(importer("torchao"), "__version__", "?")
                return f"torchao {ver} has no torchao.optim.CPUOffloadOptimizer"
        elif variant == "fsdp2_cpu_offload":
            dist = importer("torch.distributed")
            if not dist.is_available():
                return "torch.distributed is not available in this build of torch"
            try:
                fsdp = importer("torch.distributed.fsdp")
            except ImportError as err:
                return f"torch.distributed.fsdp cannot be imported ({err})"
            absent = [n for n in ("fully_shard", "CPUOffloadPolicy") if not hasattr(fsdp, n)]
            if absent:
                return f"FSDP2 is absent: torch {torch.__version__} has no torch.distributed.fsdp.{' / '.join(absent)}"
            backend = "nccl" if device_type == "cuda" else "gloo"
            if not getattr(dist, f"is_{backend}_available")():
                return f"the {backend.upper()} backend is not available in this build of torch"
        elif variant in VB:
            importer("apt_model.optimization.vb_global")
    except Exception as err:  # a package that is there but does not import: skip, never crash the run
        return f"{variant} cannot be set up: {type(err).__name__}: {err}"
    return None


def _one_copy_stream() -> None:
    """This worker's host level copies up and down on one side stream (the measurement of
    ``vb_all_paged_one_stream`` only: the worker is a process of its own)."""
    from apt_model.memory import stores

    init = stores.HostStore.__init__

    def one_stream(self, *a, **k):
        init(self, *a, **k)
        self.up = self.down

    stores.HostStore.__init__ = one_stream


def gpt_config(args):
    from apt_model.models.gpt import GPTConfig

    return GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                     attn_implementation="sdpa")


def model_sizes(args) -> dict:
    """Sizes of the model (built on the meta device: no memory) and the plans of the two budgets."""
    from apt_model.base.sizes import parse_size
    from apt_model.memory.placement import PagingBudgetError, model_state_sizes, plan_placement, working_set
    from apt_model.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(gpt_config(args))
    p_bytes, t_bytes = model_state_sizes(model)
    block = model_state_sizes(model.blocks[0])[0]
    ws = working_set(model, True, True, True)[0]
    kept_budget = parse_size(args.budget_kept) if args.budget_kept else -(-p_bytes * 4 // 3) + block
    host_budget = parse_size(args.budget_host_step) if args.budget_host_step else 2 * p_bytes + block
    budgets = {"vb_params_kept": kept_budget, "vb_host_step": host_budget,
               "vb_all_paged": parse_size(args.budget_paged) if args.budget_paged else max(p_bytes // 4, ws)}
    budgets["vb_all_paged_one_stream"] = budgets["vb_all_paged"]
    plans = {}
    for name, budget in budgets.items():
        try:
            plan = plan_placement(model, budget, None)
            plans[name] = {"budget": budget, "kept": plan.kept, "paged": plan.paged_categories}
        except PagingBudgetError as err:
            plans[name] = {"budget": budget, "error": str(err)}
    return {"n_params": sum(p.numel() for p in model.parameters()), "params_bytes": p_bytes,
            "state_bytes": p_bytes + t_bytes + 2 * t_bytes, "block_bytes": block, "plans": plans}


def _merged(spans) -> list[tuple[float, float]]:
    """``spans`` ((start, end) pairs, any order) as disjoint sorted intervals."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _common(x, y) -> list[tuple[float, float]]:
    """The intersection of two lists of disjoint sorted intervals."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def timeline_overlap(events) -> dict:
    """How a profiled step's device work overlapped: ``events`` are ``(kind, start, end)`` with kind
    ``"kernel"``, ``"h2d"`` or ``"d2h"`` (other kinds are ignored) and times in microseconds.

    Returns milliseconds: ``span`` (first start to last end), ``kernel`` / ``h2d`` / ``d2h`` (time
    each kind was busy, overlapping events of a kind counted once), ``h2d_under_kernel`` and
    ``d2h_under_kernel`` (copy time hidden under kernels), ``h2d_with_d2h`` (both directions at
    once), ``copy_exposed`` (time a copy ran and no kernel did) and ``idle`` (time nothing ran).
    All zero for no events."""
    by = {k: _merged((a, b) for kind, a, b in events if kind == k) for k in ("kernel", "h2d", "d2h")}
    every = _merged(iv for ivs in by.values() for iv in ivs)
    copies = _merged(by["h2d"] + by["d2h"])
    span = (every[-1][1] - every[0][0]) if every else 0.0
    out = {"span": span, **{k: _length(v) for k, v in by.items()},
           "h2d_under_kernel": _length(_common(by["h2d"], by["kernel"])),
           "d2h_under_kernel": _length(_common(by["d2h"], by["kernel"])),
           "h2d_with_d2h": _length(_common(by["h2d"], by["d2h"])),
           "copy_exposed": _length(copies) - _length(_common(copies, by["kernel"])),
           "idle": span - _length(every)}
    return {k: v / 1e3 for k, v in out.items()}


def _device_events(prof) -> list[tuple[str, float, float]]:
    """The CUDA events of a ``torch.profiler`` run as ``(kind, start_us, end_us)``: copies between
    host and device by direction, every other device event a kernel (memsets and device-to-device
    copies left out)."""
    from torch.autograd import DeviceType

    out = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) != DeviceType.CUDA:
            continue
        name = ev.name
        kind = ("h2d" if "HtoD" in name else "d2h" if "DtoH" in name
                else None if ("DtoD" in name or "Memset" in name or "Memcpy" in name) else "kernel")
        if kind is not None:
            out.append((kind, float(ev.time_range.start), float(ev.time_range.end)))
    return out


class Variant:
    """One variant's model, optimizer and loop, in its worker process."""

    def __init__(self, name: str, args, budget: int | None):
        torch.set_num_threads(args.threads)
        from apt_model.core.system import set_seed
        from apt_model.data.text import ByteCorpus, load_text_bytes
        from apt_model.models.gpt import GPT
        from measure import train_step

        self.train_step = train_step
        self.name, self.args = name, args
        self.dev = torch.device("cpu" if args.gpu_code_on_cpu else "cuda")
        self.cuda = self.dev.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.dev.index or 0)
        self.vb = self.pg_dir = None
        self.timeline: dict | None = None  # the profiled step's device overlap (profile(), on CUDA)
        self.corpus = ByteCorpus(load_text_bytes(None, 2_000_000))
        self.gen = torch.Generator().manual_seed(0)
        if name == "vb_all_paged_one_stream":
            _one_copy_stream()
        if name in VB:
            import apt_model.optimization.vb_global as vb

            vb.enable("balanced", paging="over_budget", device_budget=budget, swap_dir=args.swap_dir,
                      mixed_precision="off", tf32="off", compile="off", banner=False, device=self.dev.type,
                      paging_exact=name != "vb_host_step")
            self.vb = vb
        set_seed(0)
        model = GPT(gpt_config(args))
        if name == "fsdp2_cpu_offload":
            self._shard(model)
        else:
            model = model.to(self.dev)  # the switch adopts the model here (vb variants)
        if name in TORCHAO:
            from torchao.optim import CPUOffloadOptimizer

            opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=name.endswith("grads"),
                                      lr=LR)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model, self.opt = model, opt
        self.info = {"budget": budget}

    def _shard(self, model) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        self.pg_dir = tempfile.mkdtemp(prefix="offload-fsdp2-")
        atexit.register(shutil.rmtree, self.pg_dir, True)  # also when the worker fails
        dist.init_process_group("nccl" if self.cuda else "gloo", init_method=f"file://{self.pg_dir}/store",
                                rank=0, world_size=1)
        mesh = init_device_mesh(self.dev.type, (1,))
        policy = CPUOffloadPolicy(pin_memory=self.cuda)  # pinning needs an accelerator (--gpu-code-on-cpu)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.train_step(self.model, self.opt, self.corpus, self.gen, self.args.batch_size, self.args.seq_len,
                   device=self.dev, clip=None)
        if self.cuda:
            torch.cuda.synchronize(self.dev)  # the step's one synchronization, at its end
        return time.perf_counter() - t0

    def counters(self) -> list:
        """[bytes up into level 0, bytes down to the level below, stall s, disk read, disk written] so far."""
        if self.vb is None:
            return [0, 0, 0.0, 0, 0]
        lv = self.vb.get_stats()["levels"] or []
        below = lv[1] if len(lv) > 1 else {}
        disk = lv[2] if len(lv) > 2 and lv[2].get("kind") == "nvme" else {}  # spills below the host level
        return [lv[0].get("bytes_in") or 0 if lv else 0, below.get("bytes_in") or 0,
                lv[0].get("stall_s") or 0.0 if lv else 0.0, disk.get("bytes_out") or 0, disk.get("bytes_in") or 0]

    def step_in_backward(self) -> dict | None:
        """The switch's report of the optimizer step inside backward (None: not a vb variant)."""
        if self.vb is None:
            return None
        return ((self.vb.get_report().get("memory") or {}).get("paging") or {}).get("step_in_backward")

    def settle(self) -> None:
        """More untimed steps until the switch has decided where the paged step runs: one step
        learns the loop, then six are the trial of the step inside backward (its ``auto`` mode) —
        timed turns taken before that would mix both ways of stepping. At most :data:`SETTLE_STEPS`."""
        for _ in range(SETTLE_STEPS):
            state = (self.step_in_backward() or {}).get("state")
            if state not in ("learning", "trial", "pending"):
                return
            self.step()

    def ready_info(self) -> dict:
        info = dict(self.info)
        if self.vb is not None:
            rep = self.vb.get_report()
            models = rep.get("models") or []
            info["plan"] = models[0]["features"].get("paging") if models else None
            info["optimizer_step"] = (info["plan"] or {}).get("optimizer_step")  # where it ran, predicted costs
            info["host_step"] = ((rep.get("memory") or {}).get("paging") or {}).get("host_step")
            info["step_in_backward"] = self.step_in_backward()
            stack = (rep.get("memory") or {}).get("stack") or {}
            info["bandwidths"] = stack.get("bandwidths")
            info["levels"] = [f"Level {lv['index']}: {lv['device']} - {lv['capacity'] / 1e6:.0f}MB @ {lv['gbps']}GB/s"
                              for lv in stack.get("levels") or []]
        if self.cuda:
            info["allocated_after_warmup"] = torch.cuda.memory_allocated(self.dev)
        return info

    def turn(self, n: int) -> tuple:
        release = self.cuda and not self.args.keep_cuda_cache
        if release:
            self.step()  # untimed: re-fills the allocator's cache emptied after the last turn
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.dev)
        before = self.counters()
        times = [self.step() for _ in range(n)]
        delta = [a - b for a, b in zip(self.counters(), before)]
        peak = (torch.cuda.max_memory_allocated(self.dev), torch.cuda.max_memory_reserved(self.dev)) if self.cuda \
            else (None, None)
        if release:
            torch.cuda.empty_cache()  # the idle workers' caches would not all fit in HBM at once
        return times, delta, peak

    def profile(self, folder: str) -> str:
        """One more step under ``torch.profiler`` (host ops; device kernels and copies on CUDA), after
        the timed turns so that it changes none of them; writes ``profile-<variant>.txt`` in
        ``folder``: the ops by self host time and by self device time (the counts show the copies
        and synchronizations per step). Returns the file's path."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.step()  # untimed: the allocator's cache, as in a turn
        with profile(activities=acts) as prof:
            seconds = self.step()
        avg = prof.key_averages()
        path = os.path.join(folder, f"profile-{self.name}.txt")
        with open(path, "w") as f:
            f.write(f"{self.name}: one profiled step, {seconds * 1e3:.1f} ms (the profiler's overhead included)\n\n")
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
            if self.cuda:
                f.write(avg.table(sort_by="self_device_time_total", row_limit=30) + "\n")
            if self.cuda:  # how the device's kernels and copies overlapped in that step
                try:
                    self.timeline = timeline_overlap(_device_events(prof))
                except Exception as err:  # noqa: BLE001 - a profiler without these fields: the tables stand
                    self.timeline = {"error": f"{type(err).__name__}: {err}"}
                f.write(f"device timeline, ms: {self.timeline}\n")
        return path

    def close(self) -> dict:
        out = {}
        if self.vb is not None:
            out["levels"] = self.vb.get_stats()["levels"]
            self.vb.disable()
        if self.pg_dir is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
            shutil.rmtree(self.pg_dir, ignore_errors=True)
        return out


def gpu_worker(conn, name: str, args, budget: int | None) -> None:
    """A worker's protocol: ("skip", reason) | ("error", message, traceback) | ("ready", info), then
    per turn ("times", times, deltas, peaks) until "stop", then ("final", info)."""
    try:
        reason = skip_reason(name, "cpu" if args.gpu_code_on_cpu else "cuda")
        if reason:
            conn.send(("skip", reason))
            return
        t0 = time.perf_counter()
        run = Variant(name, args, budget)
        t1 = time.perf_counter()
        for _ in range(args.warmup):
            run.step()
        t2 = time.perf_counter()
        run.settle()
        print(f"  {name}: built in {t1 - t0:.1f} s, warm-up {t2 - t1:.1f} s, settled in {time.perf_counter() - t2:.1f} s",
              file=sys.stderr, flush=True)
        info = run.ready_info()
        if run.cuda and not args.keep_cuda_cache:
            torch.cuda.empty_cache()  # the next worker warms up on the same GPU
        conn.send(("ready", info))
        while (msg := conn.recv()) != "stop":
            conn.send(("times", *run.turn(msg)))
        profiled = run.profile(args.profile) if args.profile else None
        conn.send(("final", {**run.close(), "profile": profiled, "timeline": run.timeline}))
    except Exception as err:
        conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))


def _recv(conn, proc, timeout: float) -> tuple:
    """The worker's next message, or ``("error", why, "")`` if it died or went silent."""
    from measure import WorkerDied, from_worker

    try:
        return from_worker(conn, proc, "answering", timeout)
    except WorkerDied as err:
        return ("error", str(err), "")


def _link(device: torch.device) -> dict | None:
    if device.type != "cuda":
        return None
    from apt_model.memory.bandwidth import measure_link

    link = {k: round(v, 2) for k, v in measure_link(device, mb=256).items()}
    torch.cuda.empty_cache()  # the parent keeps no HBM while the workers run
    return link


def run_gpu(args) -> dict:
    """The GPU-mode benchmark (see the module docstring); prints a table and returns the result."""
    from measure import machine_info, summarize, write_json

    names = [v.strip() for v in args.variants.split(",")] if args.variants else list(VARIANTS)
    bad = [v for v in names if v not in VARIANTS + EXTRA]
    if bad:
        raise SystemExit(f"offload.py: unknown variant(s) {', '.join(bad)}; valid: {', '.join(VARIANTS + EXTRA)}")
    if args.rounds < 1 or args.steps_per_round < 1:
        raise SystemExit("offload.py: --rounds and --steps-per-round must be at least 1")
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    device = torch.device("cpu" if args.gpu_code_on_cpu else "cuda")
    sizes = model_sizes(args)
    link_before = _link(device)
    rows: dict[str, dict] = {}
    live: dict[str, tuple] = {}
    ctx = mp.get_context("spawn")
    for name in names:  # started (and warmed up) one after the other
        budget = sizes["plans"].get(name, {}).get("budget")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=gpu_worker, args=(child, name, args, budget), daemon=True)
        started = time.perf_counter()
        proc.start()
        child.close()
        msg = _recv(parent, proc, args.worker_timeout)
        if msg[0] == "ready":
            rows[name] = {"status": "ok", "info": msg[1]}
            live[name] = (parent, proc)
        else:
            rows[name] = _not_run(msg)
            proc.join(30)
        rows[name]["start_s"] = round(time.perf_counter() - started, 1)  # start, build, warm-up, settle
        print(f"  {name}: {rows[name]['status']} ({rows[name]['start_s']:.0f} s to start)", file=sys.stderr, flush=True)
    times = {n: [] for n in live}
    moved = {n: [0, 0, 0.0, 0, 0] for n in live}
    peaks = {n: [0, 0] for n in live}
    order = list(live)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            if name not in live:
                continue
            parent, proc = live[name]
            parent.send(args.steps_per_round)
            msg = _recv(parent, proc, args.worker_timeout)
            if msg[0] != "times":
                rows[name] = _not_run(msg)
                del live[name]
                continue
            times[name].extend(msg[1])
            moved[name] = [a + b for a, b in zip(moved[name], msg[2])]
            peaks[name] = [max(a, b or 0) for a, b in zip(peaks[name], msg[3])]
    for name, (parent, proc) in live.items():
        parent.send("stop")
        msg = _recv(parent, proc, args.worker_timeout)
        rows[name]["final"] = msg[1] if msg[0] == "final" else {"error": msg[1]}
        proc.join(60)
    link_after = _link(device)

    mem = summarize(times["in_memory"])["median"] if "in_memory" in live else None
    for name in live:
        row, n = rows[name], len(times[name])
        row["step"] = s = summarize(times[name])
        row["ratio_vs_in_memory"] = s["median"] / mem if mem else None
        row["peak_hbm_bytes"], row["peak_reserved_bytes"] = peaks[name] if device.type == "cuda" else (None, None)
        if name in VB:
            up, down, stall, disk_r, disk_w = (x / n for x in moved[name])
            floor = (up / (link_before["h2d"] * 1e9) + down / (link_before["d2h"] * 1e9)) if link_before else None
            row.update(up_bytes_per_step=up, down_bytes_per_step=down, stall_s_per_step=stall,
                       disk_read_bytes_per_step=disk_r, disk_write_bytes_per_step=disk_w, link_floor_s=floor,
                       ratio_to_link_floor=s["median"] / floor if floor else None,
                       ratio_to_bound=s["median"] / max(mem or 0.0, floor or 0.0) if (mem or floor) else None)
    result = {
        "benchmark": "offload_gpu",
        "machine": machine_info(args.threads, device.type),
        "config": vars(args),
        "model": {k: v for k, v in sizes.items() if k != "plans"},
        "budgets": sizes["plans"],
        "link_gbps_before": link_before,
        "link_gbps_after": link_after,
        "variants": rows,
        "skipped": {n: r["reason"] for n, r in rows.items() if r["status"] == "skipped"},
        "failed": {n: r["reason"] for n, r in rows.items() if r["status"] == "failed"},
    }
    result["comparison"] = compare(rows)
    print_result(result, args)
    write_json(result, args.json)
    return result


def _not_run(msg: tuple) -> dict:
    if msg[0] == "skip":
        return {"status": "skipped", "reason": msg[1]}
    return {"status": "failed", "reason": msg[1], "traceback": msg[2] if len(msg) > 2 else ""}


def _ok(rows: dict, name: str) -> dict | None:
    row = rows.get(name)
    return row if row and row.get("status") == "ok" and "step" in row else None


def _why_not(rows: dict, *names: str) -> str:
    return "; ".join(f"{n} {rows[n]['status']}" if n in rows and rows[n]["status"] != "ok" else f"{n} not run"
                     for n in names if not _ok(rows, n))


def compare(rows: dict) -> list[dict]:
    """The issue's targets, each ``{"what", "target", "value", "applicable", "met", "note"}`` (``met``
    None where not measured or not applicable). Speed ratios are other step / vb step (> 1: vb faster)."""
    out = []
    mem, kept, paged, fsdp = (_ok(rows, n) for n in ("in_memory", "vb_params_kept", "vb_all_paged",
                                                     "fsdp2_cpu_offload"))
    kept_name = "vb_params_kept"
    host = _ok(rows, "vb_host_step")
    if host and (not kept or host["step"]["median"] < kept["step"]["median"]):
        kept, kept_name = host, "vb_host_step"  # the faster of the two ways to step with the parameters kept
    tao = [r for r in (_ok(rows, n) for n in TORCHAO) if r]
    med = lambda r: r["step"]["median"]  # noqa: E731
    if kept and tao:
        best_name = min((n for n in TORCHAO if _ok(rows, n)), key=lambda n: med(rows[n]))
        best = rows[best_name]
        speed = med(best) / med(kept)
        hbm_ok = None if best["peak_hbm_bytes"] is None else kept["peak_hbm_bytes"] <= best["peak_hbm_bytes"]
        out.append({"what": f"{kept_name} vs {best_name} (the faster torchao variant)",
                    "target": ">= 0.95x its speed at <= its peak HBM", "value": speed, "applicable": True,
                    "met": None if hbm_ok is None else speed >= 0.95 and hbm_ok,
                    "note": f"peak HBM {_gb(kept['peak_hbm_bytes'])} vs {_gb(best['peak_hbm_bytes'])}"})
    else:
        out.append({"what": "vb_params_kept vs the faster torchao variant", "target": ">= 0.95x its speed at <= its "
                    "peak HBM", "value": None, "applicable": False, "met": None,
                    "note": "not measured: " + _why_not(rows, "vb_params_kept", *TORCHAO)})
    if paged and mem:
        floor = paged.get("link_floor_s")
        applies = floor is not None and med(mem) > floor
        speed = med(mem) / med(paged)
        why = "no link figure (not a GPU run)" if floor is None else "the link dominates"
        out.append({"what": "vb_all_paged vs in_memory", "target": ">= 0.8x its speed where compute exceeds link time",
                    "value": speed, "applicable": applies, "met": speed >= 0.8 if applies else None,
                    "note": f"in-memory step {_ms(med(mem))} vs link floor {_ms(floor)}"
                    + ("" if applies else f": {why}, target not applicable")})
    else:
        out.append({"what": "vb_all_paged vs in_memory", "target": ">= 0.8x its speed where compute exceeds link time",
                    "value": None, "applicable": False, "met": None,
                    "note": "not measured: " + _why_not(rows, "vb_all_paged", "in_memory")})
    if paged and fsdp:
        speed = med(fsdp) / med(paged)
        out.append({"what": "vb_all_paged vs fsdp2_cpu_offload", "target": ">= 2x its speed", "value": speed,
                    "applicable": True, "met": speed >= 2.0, "note": ""})
    else:
        out.append({"what": "vb_all_paged vs fsdp2_cpu_offload", "target": ">= 2x its speed", "value": None,
                    "applicable": False, "met": None, "note": "not measured: " + _why_not(rows, "vb_all_paged",
                                                                                          "fsdp2_cpu_offload")})
    for name, row in ((kept_name, kept), ("vb_all_paged", paged)):
        floor = row.get("link_floor_s") if row else None
        if not row or not floor:
            out.append({"what": f"{name} vs the link floor", "target": "<= 1.2x where the link dominates",
                        "value": None, "applicable": False, "met": None,
                        "note": "not measured: " + (_why_not(rows, name) if not row else "no link (not a GPU run)")})
            continue
        applies = mem is not None and floor >= med(mem)
        ratio = med(row) / floor
        out.append({"what": f"{name} vs the link floor", "target": "<= 1.2x where the link dominates", "value": ratio,
                    "applicable": applies, "met": ratio <= 1.2 if applies else None,
                    "note": f"link floor {_ms(floor)} vs in-memory step {_ms(med(mem) if mem else None)}"
                    + ("" if applies else ": compute dominates, target not applicable")})
    one = _ok(rows, "vb_all_paged_one_stream")
    if paged and one:  # the A/B of one copy stream per direction (no target of the issue's)
        out.append({"what": "vb_all_paged vs vb_all_paged_one_stream", "target": "> 1x (no target of the issue's)",
                    "value": med(one) / med(paged), "applicable": False, "met": None,
                    "note": f"{_ms(med(paged))} with a copy stream per direction vs {_ms(med(one))} with one"})
    return out


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{1e3 * s:.1f} ms"


def _gb(b: float | None) -> str:
    from apt_model.base.sizes import format_size

    return format_size(b)


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def print_result(result: dict, args) -> None:
    m, rows, lb, la = result["model"], result["variants"], result["link_gbps_before"], result["link_gbps_after"]
    dev = result["machine"].get("device_name") or result["machine"].get("device")
    print(f"offload (GPU mode) on {dev} — GPT d={args.d_model} x{args.layers} (SDPA), batch {args.batch_size}x"
          f"{args.seq_len}, fp32 AdamW, {args.threads} CPU threads; {m['n_params'] / 1e6:.1f}M parameters "
          f"({_gb(m['params_bytes'])}), training state {_gb(m['state_bytes'])}")
    if lb:
        print(f"  pinned link: H2D {lb['h2d']:.1f} GB/s, D2H {lb['d2h']:.1f} GB/s (re-measured after: "
              f"{la['h2d']:.1f} / {la['d2h']:.1f})")
    for name, plan in result["budgets"].items():
        what = plan.get("error") or f"kept {', '.join(plan['kept']) or 'nothing'}; paged {', '.join(plan['paged'])}"
        print(f"  {name}: device budget {_gb(plan['budget'])} -> {what}")
    print(f"  {'variant':<22} {'ms/step (p25-p75)':>24} {'/in-mem':>8} {'peak HBM':>9} {'up/down per step':>19} "
          f"{'link floor':>11} {'/floor':>7} {'/bound':>7}")
    for name, row in rows.items():
        if row["status"] != "ok":
            print(f"  {name:<22} {row['status'].upper()}: {row['reason']}")
            continue
        s = row["step"]
        ratio = f"{row['ratio_vs_in_memory']:.2f}" if row["ratio_vs_in_memory"] else "-"
        line = (f"  {name:<22} {1e3 * s['median']:>9.1f} ({1e3 * s['p25']:.1f}-{1e3 * s['p75']:.1f}) {ratio:>8} "
                f"{_gb(row['peak_hbm_bytes']):>9}")
        if name in VB:
            fl = row["link_floor_s"]
            line += (f" {_gb(row['up_bytes_per_step']):>9}/{_gb(row['down_bytes_per_step']):<9} {_ms(fl):>11} "
                     f"{_x(row['ratio_to_link_floor']):>7} {_x(row['ratio_to_bound']):>7}")
        print(line)
    for name, row in rows.items():
        info = row.get("info") or {} if row["status"] == "ok" else {}
        where, sib = info.get("optimizer_step") or {}, info.get("step_in_backward") or {}
        if name in VB and (where or sib):
            print(f"  {name}: optimizer step on the {where.get('where', '?')}; step inside backward "
                  f"{sib.get('state', '?')} ({sib.get('reason', '')})")
        levels = (row.get("final") or {}).get("levels") or []
        host = next((lv for lv in levels if lv.get("kind") == "host"), {})
        if name in VB and host:
            print(f"  {name}: host level copies on {host.get('copy_streams')} side stream(s); "
                  f"{host.get('copy_waits')} host waits for a copy's event; {host.get('spills_to_disk')} spills to disk")
        tl = (row.get("final") or {}).get("timeline")
        if tl and "error" in tl:
            print(f"  {name}: no device timeline ({tl['error']})")
        elif tl:
            print(f"  {name}: profiled step on the device, ms: kernels {tl['kernel']:.1f}, up {tl['h2d']:.1f} "
                  f"({tl['h2d_under_kernel']:.1f} under kernels), down {tl['d2h']:.1f} ({tl['d2h_under_kernel']:.1f} "
                  f"under kernels), both directions at once {tl['h2d_with_d2h']:.1f}, copies alone "
                  f"{tl['copy_exposed']:.1f}, idle {tl['idle']:.1f} of {tl['span']:.1f}")
        kinds = host.get("bytes_in_by_kind")
        if name in VB and kinds:  # all the worker's steps (warm-up, settling, timed, profiled), in parameter bytes
            pb = result["model"]["params_bytes"]
            print(f"  {name}: written to the host level over all its steps, in parameter bytes: "
                  + ", ".join(f"{k} {v / pb:.1f}x" for k, v in sorted(kinds.items())))
    print("  against the issue's targets:")
    for c in result["comparison"]:
        if c["value"] is None:
            print(f"    {c['what']} (target {c['target']}): {c['note']}")
            continue
        verdict = ("met" if c["met"] else "NOT met") if c["met"] is not None else "not applicable"
        print(f"    {c['what']}: {c['value']:.2f}x (target {c['target']}): {verdict}"
              + (f" — {c['note']}" if c["note"] else ""))
