#!/usr/bin/env python
"""The main job: train a GPT-style decoder on real text, with the Virtual Blackwell switch on.

    python training/train.py                              # stdlib corpus, tiny model, balanced mode
    python training/train.py --data ../shared/data/kjv.txt
    python training/train.py --vb-mode off                # plain PyTorch, same everything else
    python training/train.py --hf-model gpt2              # a transformers GPT-2 built from a config

Writes ``checkpoint.pt`` (model, optimizer, scheduler, config, step), ``report.json`` (config,
device, switch decisions, throughput, losses, per-step time and memory) and, with matplotlib
installed (``pip install 'apt_model[plot]'``), ``report.png`` (memory per level, the per-step peak
RSS, step time, training and held-out loss over the steps) to ``--out``; without matplotlib the
last lines say why there is no PNG. The report's fields: docs/reports.md.

Output: the switch's short banner, a progress bar (stderr), and one closing line (held-out loss,
time, tokens/s — under torchrun per rank and for the job), plus ``no report.png: ...`` when the
PNG could not be drawn and ``note: the CPU cores look shared ...`` when the CPU time the job got
(on an accelerator: the load average) says other processes were using its cores
(:mod:`apt_model.bench.contention`). A mistake in a flag, a ``VB_*``
variable or a ``.vbrc`` is one line naming it, exit status 2.

Under ``torchrun --nproc_per_node=N`` it runs unchanged: the switch initializes the process
group and trains the model with DDP; each rank draws its own batches (``--batch-size`` is per
rank), rank 0 writes ``checkpoint.pt``, ``report.json`` and ``report.png``, rank r > 0 writes
``report.rank<r>.json``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.bench.contention import CoreShare
from apt_model.core.system import get_device, set_seed
from apt_model.data.text import ByteCorpus, load_text_bytes
from apt_model.devices.device_backend import DeviceBackend
from apt_model.devices.ranking import select_device
from apt_model.distributed import process_rank
from apt_model.base.errors import USAGE_EXIT, USER_ERRORS, ConfigError, report_user_error
from apt_model.models.gpt import GPT, PRESETS, GPTConfig

VB_MODES = ("off", "performance", "speed", "balanced", "memory", "full")
SEQ_DEFAULT = {"tiny": 128, "small": 256, "medium": 512}


def build_parser() -> argparse.ArgumentParser:
    from apt_model.cli.errors import OneLineArgumentParser  # usage errors as one line, exit status 2

    p = OneLineArgumentParser(prog="train.py", description="Train a GPT-style model on real text with Virtual Blackwell.")
    p.add_argument("--vb-mode", default=None, choices=VB_MODES,
                   help="switch mode, or 'off' for plain PyTorch (default: VB_MODE, else the .vbrc mode, else balanced)")
    p.add_argument("--data", default=None, help="text file or folder of text files (default: the Python stdlib source)")
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this many corpus bytes")
    p.add_argument("--model-size", default="tiny", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--hf-model", default=None, choices=("gpt2", "llama"), help="train a transformers model built from a config instead")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None, help="context length (default: 128/256/512 by preset)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps before cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--device", default=None, help="device (e.g. cpu, cuda:0, npu:1); default: the ranking policy's choice")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); on cores shared with other jobs, fewer is faster")
    p.add_argument("--device-budget", default=None, help="level-0 budget for training state, e.g. 256MB (paging beyond it)")
    p.add_argument("--host-budget", default=None, help="host-level budget, e.g. 8GiB")
    p.add_argument("--swap-dir", default=None, help="folder for swap files (default: VB_SWAP_DIR or the temp folder)")
    p.add_argument("--paging", default=None, choices=("off", "over_budget", "tight", "always"),
                   help="override the mode's paging request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/train", help="folder for checkpoint.pt and report.json")
    p.add_argument("--plot", default="auto", choices=("auto", "on", "off"),
                   help="report.png: auto = when matplotlib is installed; on = required; off = never")
    p.add_argument("--quiet", action="store_true", help="no banner or progress bar")
    return p


def build_model(args, seq_len: int) -> torch.nn.Module:
    """Our GPT preset, or a transformers GPT-2 / Llama of the same size built from a config."""
    shape = PRESETS[args.model_size]
    if args.hf_model is None:
        return GPT(GPTConfig(vocab_size=256, seq_len=seq_len, **shape))
    try:
        hide_unused_torchao()
        import transformers
    except ImportError:
        raise ConfigError(f"--hf-model {args.hf_model} needs transformers: pip install 'apt_model[hf]'") from None
    d, layers, heads = shape["d_model"], shape["n_layers"], shape["n_heads"]
    if args.hf_model == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=d, n_layer=layers, n_head=heads,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq_len,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def logits_of(out) -> torch.Tensor:
    """Logits from our GPT (a tensor) or a transformers model (an output with ``.logits``)."""
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def evaluate(model, corpus: ByteCorpus, args, seq_len: int, device) -> float:
    """Mean cross-entropy (nats/byte) on ``eval_batches`` fixed held-out batches."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(args.eval_batches):
        x, y = corpus.batch("val", args.batch_size, seq_len, gen, device)
        logits = logits_of(model(x))
        losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def lr_lambda(args):
    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def hide_unused_torchao() -> None:
    """Keep an installed torchao out of transformers' sight in this job (it is only the FP4 interop
    tests' reference): transformers imports it when present, which prints "Failed to load
    ..._C_mxfp8.so" and two torch ``_pytree`` deprecation warnings on a CPU build. Nothing in the
    job uses it; a process that already imported torchao is left alone."""
    if "torchao" not in sys.modules:
        sys.modules["torchao"] = None  # importlib.util.find_spec("torchao") is None; import torchao raises ImportError


def check_flags(args) -> None:
    """Check the flags before anything runs, so a mistake is reported as the flag the user typed.

    Raises:
        ConfigError: a non-positive count, a negative, zero (``--lr``) or non-finite ``--lr`` /
            ``--grad-clip`` / ``--weight-decay``, an ``--out`` that is a file or cannot be created,
            a malformed size, a missing ``--swap-dir`` or ``--data``,
            a malformed device or unknown device kind (naming the flag and the valid forms).
        DeviceSelectionError: ``--device`` names a device that is not usable here.
    """
    from apt_model.base.sizes import parse_size

    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--eval-every", args.eval_every),
                        ("--eval-batches", args.eval_batches), ("--threads", args.threads),
                        ("--max-bytes", args.max_bytes), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer")
    if args.warmup < 0:
        raise ConfigError(f"--warmup {args.warmup} must be 0 or more")
    for flag, value, least in (("--lr", args.lr, "> 0"), ("--grad-clip", args.grad_clip, ">= 0 (0: no clipping)"),
                               ("--weight-decay", args.weight_decay, ">= 0")):
        bad = not math.isfinite(value) or value < 0 or (value == 0 and flag == "--lr")
        if bad:  # a negative clip norm scaled every gradient by a negative factor: gradient ascent
            raise ConfigError(f"{flag} {value} must be a finite number {least}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {args.out!r} is a file; give a folder for checkpoint.pt and report.json")
    try:  # checked before training, not after it: a folder that cannot be made lost the whole run
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {args.out!r} cannot be created ({err.strerror or err}); give a writable folder") from None
    for flag, value in (("--device-budget", args.device_budget), ("--host-budget", args.host_budget)):
        if value is not None:
            parse_size(value, flag)
    if args.swap_dir is not None and not Path(args.swap_dir).is_dir():
        raise ConfigError(f"--swap-dir {args.swap_dir!r} is not an existing folder; create it, or leave the flag out "
                          "to use VB_SWAP_DIR or the system temp folder")
    if args.data is not None and not Path(args.data).exists():
        raise ConfigError(f"--data {args.data!r} does not exist; give a text file or a folder of text files")
    if args.device is not None:
        select_device(device=args.device, label="--device")


def main(argv: list[str] | None = None) -> dict:
    """Run the job; returns the report (also written to ``--out/report.json``).

    A mistake in a flag, a ``VB_*`` variable or a ``.vbrc`` (:data:`apt_model.base.errors.USER_ERRORS`)
    ends the job with one line on stderr naming it and the valid forms, and ``SystemExit(2)``;
    ``VB_LOG_LEVEL=DEBUG`` adds the traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except USER_ERRORS as err:
        report_user_error(err, "train.py")
        raise SystemExit(USAGE_EXIT) from None


def run(args) -> dict:
    """The job for parsed ``args`` (see :func:`main`)."""
    check_flags(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    set_seed(args.seed)
    rank, world = process_rank()  # (0, 1) unless a launcher such as torchrun started several processes
    args.quiet = args.quiet or rank > 0
    seq_len = args.seq_len or SEQ_DEFAULT[args.model_size]
    recorder = None
    if args.vb_mode != "off":
        mode = "performance" if args.vb_mode == "speed" else args.vb_mode  # None: VB_MODE, .vbrc, balanced
        already = vb.is_enabled() and mode in (None, vb.get_config()["mode"]) and args.device is None
        memory = {k: v for k, v in (("device_budget", args.device_budget), ("host_budget", args.host_budget),
                                     ("swap_dir", args.swap_dir), ("paging", args.paging)) if v is not None}
        already = already and not memory
        if not already:  # the launcher or ENABLE_VIRTUAL_BLACKWELL may have enabled it already
            vb.enable(mode, device=args.device, banner=not args.quiet, **memory)
        device = vb.device()
    else:
        vb.disable()  # plain PyTorch, even if the environment enabled the switch
        device = select_device(device=args.device, label="--device").device if args.device else get_device()
        from apt_model.switch.steps import StepRecorder

        recorder = StepRecorder(device)  # per-step time and memory, as the switch records them
        recorder.install()

    t_load = time.perf_counter()
    corpus = ByteCorpus(load_text_bytes(args.data, args.max_bytes))
    load_s = time.perf_counter() - t_load
    model = build_model(args, seq_len).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    backend = DeviceBackend(device)
    gen = torch.Generator().manual_seed(args.seed + rank)  # each rank its own batches

    evals = [(0, evaluate(model, corpus, args, seq_len, device))]
    losses, step_times = [], []
    tokens_per_step = args.batch_size * seq_len
    from tqdm.auto import tqdm

    bar = tqdm(range(1, args.steps + 1), desc="train", disable=args.quiet, mininterval=1.0, dynamic_ncols=True)
    share = CoreShare(torch.get_num_threads(), on_cpu=device.type == "cpu")  # are the cores shared? (said at the end)
    t_start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        x, y = corpus.batch("train", args.batch_size, seq_len, gen, device)
        logits = logits_of(model(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        sched.step()
        loss_v = loss.item()  # synchronizes the device, so the step time is complete
        step_times.append(time.perf_counter() - t0)
        losses.append((step, loss_v))
        if step % args.eval_every == 0 or step == args.steps:
            evals.append((step, evaluate(model, corpus, args, seq_len, device)))
        peak = backend.max_memory_allocated()
        bar.set_postfix(refresh=False, loss=f"{loss_v:.3f}", val=f"{evals[-1][1]:.3f}",
                        tok_s=f"{tokens_per_step / step_times[-1]:,.0f}",
                        peak=f"{(peak or 0) / 2**20:,.0f}MiB")
    train_s = time.perf_counter() - t_start
    bar.close()
    contention = share.stop()

    steady = step_times[min(5, len(step_times) - 1):] or step_times
    med = statistics.median(steady)
    job_tps = job_tokens_per_s(tokens_per_step / med, world, device)  # under torchrun: summed over the ranks
    vb_report = vb.get_report() if vb.is_enabled() else None
    if recorder is not None:
        recorder.remove()
        steps = recorder.to_dict()
    else:
        steps = vb_report.pop("steps")
    report = {
        "args": vars(args),
        "rank": rank, "world_size": world,
        "model": {"kind": args.hf_model or "apt_model.GPT", "parameters": n_params, "seq_len": seq_len,
                  **({"config": model.cfg.to_dict()} if isinstance(model, GPT) else {})},
        "device": {"device": str(device), "kind": backend.kind, "name": backend.get_device_name(),
                   "threads": torch.get_num_threads()},
        "corpus": {"source": args.data or "python stdlib", "train_bytes": len(corpus.train), "val_bytes": len(corpus.val),
                   "load_seconds": round(load_s, 3)},
        "throughput": {"step_time_median_s": round(med, 5), "tokens_per_s_median": round(tokens_per_step / med, 1),
                       "tokens_per_s_job": None if job_tps is None else round(job_tps, 1),
                       "train_seconds": round(train_s, 2)},
        "contention": contention,
        "memory": {"peak_bytes": backend.max_memory_allocated(), "peak_note": backend.why("max_memory_allocated")},
        "losses": losses,
        "eval": evals,
        "eval_drop": round(1 - evals[-1][1] / evals[0][1], 4),
        "steps": steps,
        "vb": vb_report,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # under DDP every rank holds the same model: one checkpoint
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "model_config": report["model"], "step": args.steps, "args": vars(args)}, out / "checkpoint.pt")
    from apt_model.reports import write_report
    from apt_model.reports.plot import plot_report

    written = write_report(report, out / ("report.json" if rank == 0 else f"report.rank{rank}.json"), png=False)
    plot_input = {"steps": steps, "decisions": (vb_report or {}).get("decisions"),
                  "config": (vb_report or {}).get("config") or {"mode": "off", "device": str(device)}}
    no_png = None  # why there is no report.png, said at the end
    if args.plot != "off" and rank == 0:
        try:
            written["png"] = str(plot_report(plot_input, out / "report.png", losses=losses, evals=evals))
        except ImportError:
            if args.plot == "on":
                raise
            no_png = "matplotlib is not installed (pip install 'apt_model[plot]', or -e '.[plot]' in a checkout)"
    if not args.quiet:
        tps = report["throughput"]["tokens_per_s_median"]
        if world > 1:
            speed = f"{tps:,.0f} tokens/s per rank (rank {rank} of {world})"
            speed += f", {job_tps:,.0f} tokens/s for the job" if job_tps is not None else ""
        else:
            speed = f"{tps:,.0f} tokens/s"
        print(f"held-out loss {evals[0][1]:.3f} -> {evals[-1][1]:.3f} nats/byte ({100 * report['eval_drop']:.1f}% lower) "
              f"in {train_s:.1f} s; {speed} on {device}; "
              f"report: {written['json']}" + (f" and {written['png']}" if written["png"] else ""))
        if no_png:
            print(f"no report.png: {no_png}")
        if contention["note"]:
            print(f"note: {contention['note']}")
    if vb.is_enabled():
        vb.disable()
    return report


def job_tokens_per_s(per_rank: float, world: int, device: torch.device) -> float | None:
    """The job's tokens/s under a multi-process launcher: every rank's median summed (a collective:
    every rank calls it). None for a single process, or when no process group is initialized
    (``--vb-mode off`` under torchrun: each rank trains alone)."""
    if world <= 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    t = torch.tensor([per_rank], dtype=torch.float32, device=device if device.type != "cpu" else "cpu")
    dist.all_reduce(t)
    return float(t.item())


if __name__ == "__main__":
    main(sys.argv[1:])
