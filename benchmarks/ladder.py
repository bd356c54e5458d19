#!/usr/bin/env python
"""The switch's modes against the scripts a user would write, per model shape, interleaved.

Each variant trains the same model (same seed, same real text: the stdlib corpus, same timed
batches) in its OWN worker process:

* ``plain``          — the fp32 script, nothing else;
* ``balanced``       — ``vb.enable("balanced")`` before the model is built;
* ``performance``    — ``vb.enable("performance")`` (with the compile ladder, where it has landed:
  ``torch.compile`` -> a registered override -> eager, decided per model);
* ``manual``         — the script a user tunes by hand: TF32 on where CUDA has it and
  ``torch.autocast(device_type, torch.bfloat16)`` written around forward and loss;
* ``manual-compile`` — ``manual`` plus ``model = torch.compile(model)``.

Model shapes (``--arch``): ``encoder``, an ``nn.TransformerEncoder`` LM (the one of
``switch_overhead.py``); ``gpt-textbook``, a nanoGPT-style GPT whose attention is the textbook
``softmax(q @ k^T / sqrt(d) + mask) @ v``; ``hf-gpt2``, ``transformers.GPT2LMHeadModel`` built from
a config with ``attn_implementation="eager"`` (skipped, with the reason, without transformers).
``--size cpu`` is sized for a few CPU cores; ``--size gpu`` is the accelerator issue's (encoder
d 1024 x 8 layers, GPT-2 124M shapes; seq 1024, batch 8).

Each worker warms up (``--warmup`` steps; the first step's wall time — where compilation
happens — and the whole warm-up are recorded; the switch variants warm up to
``--switch-warmup`` steps, stopping once the autocast trial and the compile decision are final).
Each worker compiles into an empty inductor cache of its own (``--compile-cache shared`` uses
the user's, warm on re-runs), so ``first_step_s`` is a first run's compile time. Then the
coordinator has the workers take turns running ``--steps-per-round`` timed steps — never two at
once, the order rotated each round — for ``--rounds`` rounds (on CUDA each worker hands its
cached memory back after warm-up and after each turn, so all fit on one GPU; ``--keep-cuda-cache``
keeps it). Reported per variant: median step time with p25/p75, tokens/s, first-step and warm-up
seconds; speed ratios from the medians of the same run (``performance`` vs ``plain``, vs
``manual-compile``; ``balanced`` vs ``manual``); and the switch's decisions per model (attention,
mixed precision, compile with its timeline).

    python benchmarks/ladder.py --quick --arch encoder               # smoke run of the harness
    python benchmarks/ladder.py --threads 2 --json bench-results/ladder.json
    python benchmarks/ladder.py --size gpu --json bench-results/ladder-gpu.json   # on a GPU: the issue's check
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import psutil
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import StepClock, WorkerDied, from_worker, machine_info, summarize, write_json  # noqa: E402
from switch_overhead import EncoderLM  # noqa: E402

from apt_model.bench.measure import load_average  # noqa: E402

ARCHS = ("encoder", "gpt-textbook", "hf-gpt2")
VARIANTS = ("plain", "balanced", "performance", "manual", "manual-compile")
SWITCH_VARIANTS = ("balanced", "performance")

#: Model shape per ``--size`` and arch: width, depth, heads, sequence length, batch size.
SHAPES = {
    "quick": {a: dict(d_model=64, n_layers=2, n_heads=2, seq_len=64, batch_size=4) for a in ARCHS},
    "cpu": {a: dict(d_model=256, n_layers=2, n_heads=4, seq_len=128, batch_size=8) for a in ARCHS},
    "gpu": {
        "encoder": dict(d_model=1024, n_layers=8, n_heads=16, seq_len=1024, batch_size=8),
        "gpt-textbook": dict(d_model=768, n_layers=12, n_heads=12, seq_len=1024, batch_size=8),
        "hf-gpt2": dict(d_model=768, n_layers=12, n_heads=12, seq_len=1024, batch_size=8),
    },
}
#: Timing defaults per size: rounds, steps per round, warm-up steps, switch warm-up cap.
TIMING = {
    "quick": dict(rounds=1, steps_per_round=3, warmup=2, switch_warmup=200),
    "cpu": dict(rounds=6, steps_per_round=5, warmup=5, switch_warmup=200),
    "gpu": dict(rounds=8, steps_per_round=10, warmup=10, switch_warmup=200),
}
#: The speed ratios reported: (a, b) -> speed of a relative to b = median_ms(b) / median_ms(a).
RATIOS = (("performance", "plain"), ("performance", "manual-compile"), ("balanced", "manual"))
#: Words in a compile decision's ``chosen`` that mean it is not final yet.
PENDING_WORDS = ("trial", "compiling", "pending", "deciding", "warming")


# ----------------------------------------------------------------------------- models


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention without the flash branch: the textbook form."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = dropout
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float = 0.0):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, ``x + mlp(ln(x))``."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TextbookGPT(nn.Module):
    """A nanoGPT-style byte-level GPT (vocabulary 256) with :class:`CausalSelfAttention`; the head
    is tied to the token embedding unless ``tied=False``."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, dropout: float = 0.0,
                 tied: bool = True, vocab_size: int = 256):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, d_model),
            wpe=nn.Embedding(seq_len, d_model),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(d_model, n_heads, seq_len, dropout) for _ in range(n_layers)]),
            ln_f=nn.LayerNorm(d_model),
        ))
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def build_hf_gpt2(d_model: int, n_layers: int, n_heads: int, seq_len: int, dropout: float = 0.0):
    """``GPT2LMHeadModel`` from a config (byte vocabulary, eager attention, no KV cache), in train mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layers, n_embd=d_model, n_head=n_heads, n_positions=seq_len, vocab_size=256,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                     use_cache=False, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg)
    if getattr(model.config, "_attn_implementation", "eager") != "eager" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    return model.train()


def build_model(arch: str, shape: dict, args) -> nn.Module:
    d, n, h, t = shape["d_model"], shape["n_layers"], shape["n_heads"], shape["seq_len"]
    if arch == "encoder":
        return EncoderLM.build(d, n, h, t)
    if arch == "gpt-textbook":
        return TextbookGPT(d, n, h, t, dropout=args.dropout, tied=not args.untied)
    return build_hf_gpt2(d, n, h, t, dropout=args.dropout)


# ----------------------------------------------------------------------------- worker


def _tf32_on() -> None:
    """TF32 matmuls and convolutions, as a user tuning the script by hand would turn them on."""
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    except (AttributeError, RuntimeError):  # an older torch: the legacy switches
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def compile_pending(report: dict) -> bool:
    """Whether any adopted model's compile decision is still open (absent key: not pending)."""
    for m in report.get("models", []):
        c = (m.get("features") or {}).get("compile")
        if not isinstance(c, dict):
            continue
        if c.get("final") is False:
            return True
        chosen = c.get("chosen")
        if chosen is None or any(w in str(chosen).lower() for w in PENDING_WORDS):
            return True
    return False


def _peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
    except (ImportError, OSError):
        return None


def worker(conn, arch: str, variant: str, shape: dict, args) -> None:
    """One variant's process: build, warm up, then run timed steps when told (see the protocol in
    :func:`run_arch`); any exception is sent back as ``{"error": ...}``."""
    cache = None
    if args.compile_cache == "fresh":  # read lazily by inductor (and Triton, under it): set before any compile
        cache = tempfile.mkdtemp(prefix=f"ladder-inductor-{variant}-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    try:
        _worker(conn, arch, variant, shape, args)
    except BaseException as e:  # noqa: BLE001 - reported to the coordinator, which prints it
        try:
            conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        except (OSError, EOFError):
            pass
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


def _worker(conn, arch: str, variant: str, shape: dict, args) -> None:
    torch.set_num_threads(args.threads)
    import apt_model.optimization.vb_global as vb
    from apt_model.core.system import set_seed
    from apt_model.data.text import ByteCorpus, load_text_bytes

    switch = variant in SWITCH_VARIANTS
    amp = None
    if switch:
        vb.enable(variant, device=args.device, banner=False)
        device = vb.device()
    else:
        from apt_model.devices.ranking import select_device

        device = select_device(device=args.device).device  # the same device the switch would pick
        if variant in ("manual", "manual-compile"):
            amp = torch.bfloat16
            if device.type == "cuda":
                _tf32_on()
    corpus = ByteCorpus(load_text_bytes(None, args.max_bytes))
    set_seed(0)
    model = build_model(arch, shape, args)
    attn_impl = getattr(getattr(model, "config", None), "_attn_implementation", None)  # as built, before adoption
    model = model.to(device)
    net = model  # the module the switch adopted (its autocast hooks live here)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if variant == "manual-compile":
        model = torch.compile(model)
    bs, t = shape["batch_size"], shape["seq_len"]
    warm_gen = torch.Generator().manual_seed(1)  # warm-up lengths differ: the timed batches must not
    gen = torch.Generator().manual_seed(0)
    clock = StepClock(device)
    dev_type = device.type

    def step(g) -> tuple[float, torch.Tensor]:
        clock.start()
        x, y = corpus.batch("train", bs, t, g, device)
        with torch.autocast(dev_type, dtype=amp, enabled=amp is not None):
            out = model(x)
            logits = getattr(out, "logits", out)
            loss = F.cross_entropy(logits.reshape(-1, 256).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return clock.stop(), loss

    def pending() -> list[str]:
        out = []
        hooks = getattr(net, "_vb_autocast", None)
        trial = getattr(hooks, "trial", None)
        if trial is not None and getattr(trial, "running", False):
            out.append("autocast trial")
        if vb.is_enabled() and compile_pending(vb.get_report()):
            out.append("compile decision")
        return out

    cap = max(args.warmup, args.switch_warmup) if switch else args.warmup
    t_warm = time.perf_counter()
    first_step_s, final_at, n, left = None, None, 0, []
    while n < cap:
        t0 = time.perf_counter()
        step(warm_gen)[1].item()
        if first_step_s is None:
            first_step_s = time.perf_counter() - t0
        n += 1
        if not switch:
            continue
        left = pending()
        if not left and final_at is None:
            final_at = n
        if final_at is not None and n >= args.warmup and n >= final_at + args.settle_steps:
            break
    warm = {"first_step_s": first_step_s, "warmup_s": time.perf_counter() - t_warm, "warmup_steps": n,
            "device": str(device), "settled": not left if switch else True, "decision_final_at_step": final_at,
            "pending": left}
    if attn_impl is not None:
        warm["attn_implementation_built"] = attn_impl
        warm["attn_implementation_after_warmup"] = getattr(net.config, "_attn_implementation", None)
    release = device.type == "cuda" and not args.keep_cuda_cache
    if release:
        torch.cuda.empty_cache()  # the next worker warms up on the same GPU
    conn.send(warm)
    trained = n
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        secs, walls, losses = [], [], []
        for _ in range(msg):
            s, loss = step(gen)
            secs.append(s)
            walls.append(clock.wall)
            losses.append(loss.item())
        trained += msg
        if release:
            torch.cuda.empty_cache()  # N workers share one GPU: hand the cache back between turns
        conn.send({"seconds": secs, "wall": walls, "losses": losses})
    final = {"steps_trained": trained, "peak_mem_bytes": _peak_memory(device), "models": None}
    if vb.is_enabled():
        rep = vb.get_report()
        final["models"] = [{"name": m["name"], "id": m["id"], "alive": m.get("alive"), "features": m["features"]}
                           for m in rep["models"]]
        final["probe_seconds"] = rep["stats"].get("probe_seconds")
    conn.send(final)


# ----------------------------------------------------------------------------- coordinator


def _recv(parent, proc, what: str):
    """The worker's next message, or ``{"error": ...}`` if it died without one."""
    try:
        return from_worker(parent, proc, what)
    except WorkerDied as err:
        return {"error": str(err)}


def run_arch(arch: str, shape: dict, args) -> dict:
    """Start one worker per variant (one at a time: warm-ups and the switch's probes must not share
    the cores), run the rounds in turns, stop them. Protocol: the worker sends its warm-up record;
    an int n -> n timed steps' seconds; ``"stop"`` -> its final record (decisions, memory)."""
    res = {"shape": dict(shape), "variants": {}}
    if arch == "hf-gpt2" and importlib.util.find_spec("transformers") is None:
        res["skipped"] = "transformers is not installed (pip install transformers)"
        return res
    ctx = mp.get_context("spawn")
    live = {}
    for v in args.variant_list:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(child, arch, v, shape, args), daemon=True)
        t0 = time.perf_counter()
        proc.start()
        child.close()
        msg = _recv(parent, proc, "warming up")
        rec = res["variants"][v] = {"samples_s": [], "wall_s": [], "losses": [], "start_s": time.perf_counter() - t0}
        if "error" in msg:
            rec.update(msg)
            proc.join(timeout=10)
            print(f"  [{arch}] {v}: FAILED during warm-up: {msg['error']}", flush=True)
            continue
        rec.update(msg)
        unsettled = "" if msg["settled"] else ", NOT settled: " + ", ".join(msg["pending"])
        print(f"  [{arch}] {v}: ready in {rec['start_s']:.1f} s (first step {msg['first_step_s']:.2f} s, "
              f"{msg['warmup_steps']} warm-up steps{unsettled})", flush=True)
        live[v] = (parent, proc)
    order = list(live)
    round_ratios = {f"{a}/{b}": [] for a, b in RATIOS}
    for r in range(args.rounds):
        k = r % len(order) if order else 0
        per_round = {}
        for v in order[k:] + order[:k]:
            if v not in live:
                continue
            parent, proc = live[v]
            parent.send(args.steps_per_round)
            msg = _recv(parent, proc, f"timing round {r + 1}")
            if "error" in msg:
                res["variants"][v].update(msg)
                print(f"  [{arch}] {v}: FAILED in round {r + 1}: {msg['error']}", flush=True)
                live.pop(v)
                continue
            rec = res["variants"][v]
            rec["samples_s"].extend(msg["seconds"])
            rec["wall_s"].extend(msg["wall"])
            rec["losses"].extend(msg["losses"])
            per_round[v] = statistics.median(msg["seconds"])
        for a, b in RATIOS:
            if a in per_round and b in per_round:
                round_ratios[f"{a}/{b}"].append(per_round[b] / per_round[a])
    for v, (parent, proc) in live.items():
        parent.send("stop")
        msg = _recv(parent, proc, "stopping")
        res["variants"][v].update(msg)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.terminate()
    tok = shape["batch_size"] * shape["seq_len"]
    for v, rec in res["variants"].items():
        if rec["samples_s"]:
            rec["summary"] = summarize(rec["samples_s"])
            rec["tokens_per_s"] = tok / rec["summary"]["median"]
            rec["loss_last_round"] = statistics.fmean(rec["losses"][-args.steps_per_round:])
    res["ratios"] = {}
    for a, b in RATIOS:
        sa, sb = res["variants"].get(a, {}).get("summary"), res["variants"].get(b, {}).get("summary")
        if sa and sb:
            rr = round_ratios[f"{a}/{b}"]
            res["ratios"][f"{a}/{b}"] = {
                "speed": sb["median"] / sa["median"],  # > 1: a is faster than b
                "step_time": sa["median"] / sb["median"],
                "per_round": {"median": statistics.median(rr), "min": min(rr), "max": max(rr)} if rr else None,
            }
    return res


def _fmt_entry(e) -> str:
    if isinstance(e, dict):
        return ", ".join(f"{k}={v}" for k, v in e.items() if v is not None)
    return str(e)


def print_arch(arch: str, res: dict, args) -> None:
    sh = res["shape"]
    head = (f"ladder — {arch} ({args.size}: d {sh['d_model']}, {sh['n_layers']} layers, {sh['n_heads']} heads), "
            f"batch {sh['batch_size']}x{sh['seq_len']}, {args.threads} threads, "
            f"{args.rounds} rounds x {args.steps_per_round} steps")
    if res.get("skipped"):
        print(f"{head}\n  skipped: {res['skipped']}")
        return
    devices = sorted({r.get("device") for r in res["variants"].values() if r.get("device")})
    print(f"{head}, device {', '.join(devices) or '?'}")
    print(f"  {'variant':<15} {'median ms':>10} {'p25':>8} {'p75':>8} {'tokens/s':>10} {'first s':>8} "
          f"{'warm-up s':>9} {'steps':>5} {'loss':>6}")
    for v, r in res["variants"].items():
        if "summary" not in r:
            print(f"  {v:<15} FAILED: {r.get('error', 'no samples')}")
            continue
        s = r["summary"]
        print(f"  {v:<15} {1e3 * s['median']:>10.1f} {1e3 * s['p25']:>8.1f} {1e3 * s['p75']:>8.1f} "
              f"{r['tokens_per_s']:>10,.0f} {r['first_step_s']:>8.2f} {r['warmup_s']:>9.2f} {r['warmup_steps']:>5d} "
              f"{r['loss_last_round']:>6.3f}")
        if r.get("error"):
            print(f"  {'':<15} (failed after {s['n']} timed steps: {r['error']})")
    built = {v: r["attn_implementation_built"] for v, r in res["variants"].items()
             if r.get("attn_implementation_built")}
    if built:
        after = ", ".join(f"{v} {r.get('attn_implementation_after_warmup')}" for v, r in res["variants"].items()
                          if r.get("attn_implementation_built"))
        print(f"  attn_implementation as built: {', '.join(sorted(set(built.values())))}; after warm-up: {after}")
    for name, q in res["ratios"].items():
        a, b = name.split("/")
        pr = q["per_round"]
        spread = f"; per-round {pr['min']:.2f}-{pr['max']:.2f}" if pr and len({pr['min'], pr['max']}) > 1 else ""
        print(f"  {a} vs {b}: {q['speed']:.2f}x speed ({b} ms / {a} ms; step-time ratio {q['step_time']:.3f}{spread})")
    for v, r in res["variants"].items():
        for m in r.get("models") or []:
            feats = m["features"]
            print(f"  {v} decisions for {m['name']}#{m['id']}:")
            for f in ("attention", "mixed_precision", "compile"):
                d = feats.get(f)
                if d is None:
                    continue
                print(f"    {f}: {d.get('chosen')} — {d.get('reason')}")
                for e in d.get("timeline") or []:
                    print(f"      · {_fmt_entry(e)}")
            if "compile" not in feats and v == "performance":
                print("    compile: (no compile decision in the report: the switch does not compile here)")
        if r.get("settled") is False:
            print(f"  {v}: warm-up ended before the switch settled ({', '.join(r.get('pending') or [])}): "
                  f"raise --switch-warmup")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="all", choices=ARCHS + ("all",))
    p.add_argument("--variants", default="all", help=f"comma-separated, from {', '.join(VARIANTS)} (default all)")
    p.add_argument("--size", default="cpu", choices=("cpu", "gpu"), help="model shapes and timing defaults")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models, 1 round (checks the harness)")
    p.add_argument("--d-model", type=int, default=None, help="override the size's width")
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--n-heads", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--dropout", type=float, default=0.0, help="gpt-textbook and hf-gpt2 dropout (default 0.0)")
    p.add_argument("--untied", action="store_true", help="gpt-textbook: a head not tied to the embedding")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps-per-round", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps of every variant (cpu 5, gpu 10)")
    p.add_argument("--switch-warmup", type=int, default=None,
                   help="switch variants: at most this many warm-up steps, stopping once the autocast trial and "
                        "the compile decision are final (default 200: the ladder trials each rung against "
                        "eager for 16-48 calls)")
    p.add_argument("--settle-steps", type=int, default=2,
                   help="switch variants: steps run after the decisions are final")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-bytes", type=int, default=None, help="corpus bytes read (default 2 MB; --quick 300 kB)")
    p.add_argument("--device", default=None)
    p.add_argument("--compile-cache", default="fresh", choices=("fresh", "shared"),
                   help="fresh (default): each worker compiles into an empty inductor cache of its own, so "
                        "first_step_s is a first run's compile time; shared: the user's cache (warm on re-runs)")
    p.add_argument("--keep-cuda-cache", action="store_true",
                   help="CUDA: keep each worker's cached memory between turns (by default it is released after "
                        "warm-up and after each turn, so that all the variants fit on one GPU)")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    if args.quick:
        args.size = "quick"
    variants = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        p.error(f"--variants: unknown {', '.join(bad) or '(none given)'}; valid: {', '.join(VARIANTS)}")
    args.variant_list = variants
    for k in ("warmup", "rounds", "steps_per_round", "switch_warmup"):
        if getattr(args, k) is not None and getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    for k, v in TIMING[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_bytes is None:
        args.max_bytes = 300_000 if args.size == "quick" else 2_000_000
    archs = list(ARCHS) if args.arch == "all" else [args.arch]

    t_start = time.perf_counter()
    result = {"benchmark": "ladder", "machine": None, "config": {k: v for k, v in vars(args).items()}, "archs": {}}
    for arch in archs:
        shape = dict(SHAPES[args.size][arch])
        for k in shape:
            if getattr(args, k) is not None:
                shape[k] = getattr(args, k)
        t0, load0 = time.perf_counter(), load_average()
        res = run_arch(arch, shape, args)
        res["seconds"] = time.perf_counter() - t0
        res["load_average"] = {"start": load0, "end": load_average()}
        result["archs"][arch] = res
        print_arch(arch, res, args)
        la = res["load_average"]
        busy = la["end"] and la["end"][0] > (psutil.cpu_count() or 1) + 0.5  # our own worker adds <= threads
        print(f"  ({res['seconds']:.0f} s; load average {la['start'] and la['start'][0]} -> "
              f"{la['end'] and la['end'][0]}"
              f"{': other processes competed for the cores, timings are noisy' if busy else ''})", flush=True)
    devices = [r.get("device") for a in result["archs"].values() for r in a["variants"].values() if r.get("device")]
    result["machine"] = machine_info(args.threads, devices[0] if devices else None)
    result["seconds"] = time.perf_counter() - t_start
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
