"""Probes that run on the device itself: what works there, and what is faster there.

Each probe is small (tiny tensors for support checks; one transformer block for speed checks),
returns plain dicts that go straight into reports, and never raises: a failure becomes the
exact error text. :mod:`apt_model.devices.capabilities` caches the results per device (in memory
and on disk, see :mod:`apt_model.devices.probe_cache`).

Probes are silent: every trial runs inside ``warnings.catch_warnings(record=True)``, so PyTorch's
warnings about the kernels being tried ("Flash attention has been runtime disabled", "cuDNN
attention kernel not used because: ...") never reach the user's stderr. Their text is kept: each
probe takes an optional ``notes`` dict that receives ``{trial: [warning text, ...]}``, which the
capability records carry as ``warnings`` (why a backend was not used). ``catch_warnings`` is
process-wide in Python before 3.14: a warning another thread raises while a probe runs lands in
the probe's notes instead of on stderr.

Speed probes time forward + backward, interleave the candidates (A, B, A, B, ...), discard a
warm-up, and compare medians, so a burst of noise hits both sides alike. They stop as soon as the
answer is clear (see :func:`time_interleaved`), so a hopeless candidate costs one or two runs.
"""
from __future__ import annotations

import contextlib
import math
import re
import statistics
import time
import warnings
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from apt_model.base.log import get_logger
from apt_model.devices.plugins import describe_exception
from apt_model.devices.timing import synchronize

log = get_logger(__name__)

#: dtypes whose support is probed, by their torch names.
PROBED_DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
LOW_PRECISION = {"float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2"}


def short_error(err: BaseException, limit: int = 300) -> str:
    """The error as one line, cut to ``limit`` characters."""
    text = describe_exception(err).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


_sync = synchronize  # the device layer's one "wait for the device" (devices/timing.py)


_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?\s*$")


def warning_text(w: warnings.WarningMessage, limit: int = 300) -> str:
    """One caught warning as ``"Category: message"``, without PyTorch's "(Triggered internally at
    <file>:<line>)" suffix, cut to ``limit`` characters."""
    msg = _TRIGGERED.sub("", str(w.message).replace("\n", " ")).strip()
    text = f"{w.category.__name__}: {msg}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextlib.contextmanager
def quiet(notes: dict[str, list[str]] | None = None, key: str = "") -> Iterator[list[str]]:
    """Run the block with every warning caught (none reaches the caller, whatever its filters, even
    ``-W error``); their texts, de-duplicated in order, are yielded as a list and, when ``notes``
    is given, stored under ``notes[key]`` (only if there were any).

    Never raises by itself; exceptions of the block propagate unchanged.
    """
    texts: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield texts
        finally:
            for w in caught:
                t = warning_text(w)
                if t not in texts:
                    texts.append(t)
            if notes is not None and texts:
                kept = notes.setdefault(key, [])
                for t in texts:
                    if t not in kept:
                        kept.append(t)


def _forked_rng(device: torch.device):
    """``torch.random.fork_rng`` for the CPU and ``device``: the random numbers the probes draw
    (their inputs, a block's initialization) come from a copy of the generators' states, put back
    afterwards. A device kind ``fork_rng`` does not know keeps the CPU's fork only."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    try:
        index = device.index if device.index is not None else torch.accelerator.current_device_index()
        return torch.random.fork_rng(devices=[index], device_type=device.type)
    except Exception as err:  # noqa: BLE001 - the CPU's generator is the one every script seeds
        log.debug("no generator fork for %s: %s", device, err)
        return torch.random.fork_rng(devices=[])


@contextlib.contextmanager
def isolated(device: torch.device) -> Iterator[None]:
    """Run probes as if from a fresh training script, whatever the caller's state: gradients on
    (``torch.enable_grad()``, outside ``torch.inference_mode``), no autocast on ``device``, and the
    random generators of the CPU and ``device`` as they were (the speed probes run at a model's
    first call, after the script seeded: their draws shifted every later dropout mask on the
    first run on a machine, whose probe cache was empty, until 2026-11-26).

    A model's first call may come under ``torch.no_grad()`` or ``inference_mode`` (an evaluation
    before training, an inference script) or inside the user's own autocast: before 2026-11-26 the
    probes then ran there, their backward failed ("element 0 of tensors does not require grad"),
    and the failure was cached on disk for later processes. Never raises by itself.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(_forked_rng(device))
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        try:
            stack.enter_context(torch.autocast(device_type=device.type, enabled=False))
        except Exception as err:  # noqa: BLE001 - a device type autocast does not know: nothing to turn off
            log.debug("no autocast context for %s: %s", device.type, err)
        yield


def try_run(fn: Callable[[], object], notes: dict[str, list[str]] | None = None, key: str = "") -> str | None:
    """Run ``fn`` silently (see :func:`quiet`); return None when it ran, else the error as one line."""
    with quiet(notes, key):
        try:
            fn()
            return None
        except Exception as err:  # noqa: BLE001 - the error text is the probe's answer
            return short_error(err)


# ----------------------------------------------------------------------------- support


def probe_dtypes(device: torch.device, notes: dict[str, list[str]] | None = None) -> dict[str, dict]:
    """Which dtypes can be stored, cast to, and used in a matmul and an add on ``device``.

    Args:
        device: where to try.
        notes: optional; receives the warnings each trial raised, under ``"<dtype>/<op>"``.

    Returns:
        ``{dtype_name: {"storage": bool, "cast": bool, "matmul": bool, "add": bool, "errors": {...}}}``;
        dtypes missing from this torch are reported with ``"present": False``. Never raises.
    """
    out: dict[str, dict] = {}
    for name in PROBED_DTYPES:
        dt = getattr(torch, name, None)
        if dt is None:
            out[name] = {"present": False, "storage": False, "cast": False, "matmul": False, "add": False, "errors": {}}
            continue
        errors: dict[str, str] = {}
        res = {"present": True}

        def trial(op: str, fn: Callable[[], object]) -> None:
            e = try_run(fn, notes, f"{name}/{op}")
            res[op] = e is None
            if e:
                errors[op] = e

        if name == "float4_e2m1fn_x2":  # packed pairs: only a byte view, no arithmetic in torch
            trial("storage", lambda: torch.zeros(8, dtype=torch.uint8, device=device).view(dt))
            trial("cast", lambda: torch.ones(8, device=device).to(dt))
            res["matmul"] = res["add"] = False
            errors["matmul"] = "packed FP4 has no plain matmul; see fp4_matmul"
        else:
            a = torch.randn(16, 16)
            trial("storage", lambda: torch.zeros(8, dtype=dt, device=device))
            trial("cast", lambda: a.to(device=device, dtype=dt))
            trial("matmul", lambda: (a.to(device=device, dtype=dt) @ a.to(device=device, dtype=dt)).float().cpu())
            trial("add", lambda: (a.to(device=device, dtype=dt) + a.to(device=device, dtype=dt)).float().cpu())
        res["errors"] = errors
        out[name] = res
    return out


def probe_sdpa_backends(device: torch.device, notes: dict[str, list[str]] | None = None) -> dict[str, dict[str, str]]:
    """Which SDPA backends run on ``device`` for fp32, bf16 and fp16 (causal, small shapes).

    Each trial is silent: PyTorch's warnings about a backend it cannot use ("Flash attention has
    been runtime disabled", "... kernel not used because: ...") go to ``notes``, not to stderr.

    Args:
        device: where to try.
        notes: optional; receives each trial's warnings under ``"<BACKEND>/<dtype>"``.

    Returns:
        ``{backend_name: {dtype_name: "ok" | error_text}}`` for every ``SDPBackend`` except ERROR.
        Never raises.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out: dict[str, dict[str, str]] = {}
    for bname, backend in SDPBackend.__members__.items():
        if bname == "ERROR":
            continue
        per_dtype: dict[str, str] = {}
        for dname in ("float32", "bfloat16", "float16"):
            dt = getattr(torch, dname)

            def run():
                q = torch.randn(1, 2, 16, 64, device=device, dtype=dt)
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True)
                _sync(device)

            err = try_run(run, notes, f"{bname}/{dname}")
            per_dtype[dname] = "ok" if err is None else err
        out[bname] = per_dtype
    return out


def probe_fp8_matmul(device: torch.device, notes: dict[str, list[str]] | None = None) -> dict:
    """Whether ``torch._scaled_mm`` runs with float8_e4m3fn inputs on ``device``.

    Returns:
        ``{"supported": bool, "reason": str}``; the trial's warnings go to ``notes["fp8_matmul"]``.
        Never raises.
    """
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return {"supported": False, "reason": "this torch has no float8_e4m3fn / _scaled_mm"}

    def run():
        a = torch.randn(32, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(32, 32, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        _sync(device)

    err = try_run(run, notes, "fp8_matmul")
    return {"supported": err is None, "reason": "torch._scaled_mm ran with float8_e4m3fn" if err is None else err}


def fp4_hardware(device: torch.device, properties: dict) -> tuple[bool, str]:
    """Whether the device has native FP4 matrix units: NVIDIA sm_100+ (Blackwell) or AMD gfx950."""
    if device.type != "cuda":
        return False, f"{device.type} has no native FP4 matmul; FP4 is a storage format there"
    if torch.version.hip:
        arch = str(properties.get("gcnArchName", ""))
        if arch.startswith("gfx950"):
            return True, f"AMD {arch} has FP4 matrix instructions"
        return False, f"AMD {arch or 'GPU'} lacks FP4 matrix instructions (gfx950 has them)"
    major = int(properties.get("major", 0))
    minor = int(properties.get("minor", 0))
    if major >= 10:
        return True, f"sm_{major}{minor} (Blackwell) has FP4 tensor cores"
    return False, f"sm_{major}{minor} lacks FP4 tensor cores (Blackwell sm_100+ has them)"


def probe_fp4_matmul(device: torch.device, properties: dict, notes: dict[str, list[str]] | None = None) -> dict:
    """Native FP4 (MXFP4) matmul: tried only where the hardware has it, never elsewhere.

    Returns:
        ``{"hardware": bool, "supported": bool, "reason": str}``; the trial's warnings go to
        ``notes["fp4_matmul"]``. Never raises.
    """
    hw, why = fp4_hardware(device, properties)
    if not hw:
        return {"hardware": False, "supported": False, "reason": f"not attempted: {why}"}
    if not hasattr(torch, "float4_e2m1fn_x2") or not hasattr(torch, "float8_e8m0fnu"):
        return {"hardware": True, "supported": False, "reason": "this torch lacks float4_e2m1fn_x2 / float8_e8m0fnu"}

    def run():
        m = n = k = 128
        a = torch.zeros(m, k // 2, dtype=torch.uint8, device=device).view(torch.float4_e2m1fn_x2)
        b = torch.zeros(n, k // 2, dtype=torch.uint8, device=device).view(torch.float4_e2m1fn_x2).t()
        # blocked (swizzled) E8M0 scales: one per 32 elements, padded to 128 x 4 tiles; 127 = 2^0
        sa = torch.full((m * (k // 32),), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
        sb = torch.full((n * (k // 32),), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
        torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        _sync(device)

    err = try_run(run, notes, "fp4_matmul")
    return {"hardware": True, "supported": err is None, "reason": why if err is None else f"{why}, but the call failed: {err}"}


# ----------------------------------------------------------------------------- speed


class Timings(dict):
    """What :func:`time_interleaved` measured: ``{name: [seconds of each timed run]}`` in the order
    of the candidates (a candidate that raised is absent), plus how the measurement ended.

    Attributes:
        dropped: ``{name: reason}`` for candidates stopped early as clearly slower than the baseline.
        errors: ``{name: error text}`` for candidates that raised (the baseline's error propagates).
        stopped: why the rounds ended before ``reps`` (None when every round ran).
        rounds: timed rounds run.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dropped: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.stopped: str | None = None
        self.rounds = 0


def time_interleaved(fns: dict[str, Callable[[], None]], device: torch.device, reps: int,
                     abort_ratio: float | None = None, baseline: str | None = None, *,
                     budget_s: float | None = None, clock: Callable[[], float] = time.perf_counter) -> Timings:
    """Warm each fn up once, then run up to ``reps`` interleaved rounds; return seconds per timed run.

    The measurement stops as soon as its answer is clear, so a hopeless candidate costs one or two
    runs, not ``reps + 1`` (bf16 on a CPU without bf16 units is 20-50x slower than fp32). With
    ``abort_ratio`` and a ``baseline``:

    * after warm-up, a candidate whose warm-up took over ``3 * abort_ratio`` times the baseline's
      is run once more, and dropped if that run too is over it (its one sample is then that run).
      A first call may pay one-time costs: oneDNN generates its bf16 kernels at their first use in
      a process, which made the first bf16 call on a CPU *with* bf16 units (AVX-512 BF16) 10x the
      fp32 one, and the probe cached bf16 as 21.7x slower where it is 1.2-1.9x faster (until
      2026-11-28);
    * from the second round on, a candidate whose *fastest* run is over ``abort_ratio`` times the
      baseline's median is dropped (two samples at least, so one noisy run cannot turn an
      optimization off);
    * from the second round on, the rounds end when no candidate is left beside the baseline, or
      when every candidate left is over ``abort_ratio`` times faster than the baseline in every run.

    With ``budget_s``, the rounds also end once ``budget_s`` seconds (warm-up included) have passed
    and at least two rounds ran. A candidate other than the baseline that raises is recorded in
    ``errors`` and left out.

    Args:
        fns: candidates by name; each call runs the work once.
        device: synchronized after each call (accelerators run asynchronously).
        reps: the most timed rounds.
        abort_ratio: how much slower (or faster) than the baseline counts as clearly decided.
        baseline: the name in ``fns`` the others are compared with.
        budget_s: time budget in seconds, or None.
        clock: seconds as a float (``time.perf_counter``; tests pass a virtual clock).

    Returns:
        :class:`Timings`.

    Raises:
        Exception: whatever a fn raises when it is the baseline, or any fn when there is no baseline.
    """
    t = Timings((k, []) for k in fns)
    start = clock()

    def run(name: str) -> float | None:
        t0 = clock()
        try:
            fns[name]()
            _sync(device)
        except Exception as err:  # noqa: BLE001 - a failing candidate is an answer, not a crash
            if baseline is None or name == baseline:
                raise
            t.errors[name] = short_error(err)
            del t[name]
            return None
        return clock() - t0

    warm: dict[str, float] = {}
    active: list[str] = []
    for name in fns:
        took = run(name)
        if took is not None:
            warm[name] = took
            active.append(name)
    screen = bool(abort_ratio and baseline)
    if screen:
        limit = 3 * abort_ratio * warm[baseline]
        for name in list(active):
            if name != baseline and warm[name] > limit:
                again = run(name)  # the first call may have paid one-time costs (kernel generation)
                if again is None:
                    active.remove(name)
                elif again > limit:
                    t[name] = [again]
                    t.dropped[name] = (f"its two warm-up runs took {warm[name] / warm[baseline]:.1f}x and "
                                       f"{again / warm[baseline]:.1f}x the {baseline} one (over {3 * abort_ratio:g}x)")
                    active.remove(name)
    for r in range(reps):
        for name in list(active):
            took = run(name)
            if took is None:
                active.remove(name)
            else:
                t[name].append(took)
        t.rounds = r + 1
        if r < 1:
            continue
        if screen:
            base = statistics.median(t[baseline])
            for name in list(active):
                if name != baseline and min(t[name]) > abort_ratio * base:
                    t.dropped[name] = (f"its fastest of {len(t[name])} runs took {min(t[name]) / base:.1f}x the "
                                       f"{baseline} median (over {abort_ratio:g}x)")
                    active.remove(name)
            if r + 1 == reps:
                break
            others = [n for n in active if n != baseline]
            if not others:
                t.stopped = f"no candidate left beside {baseline} after {r + 1} rounds"
                break
            if all(max(t[n]) * abort_ratio < min(t[baseline]) for n in others):
                t.stopped = f"every candidate over {abort_ratio:g}x faster than {baseline} in {r + 1} rounds"
                break
        if budget_s is not None and r + 1 < reps and clock() - start > budget_s:
            t.stopped = f"time budget of {budget_s:g} s used after {r + 1} rounds"
            break
    return t


def attention_workloads(device: torch.device, batch: int, heads: int, seq: int, head_dim: int) -> dict:
    """The attention A/B pair the probes and ``apt-vb bench`` time: causal attention, forward +
    backward, fp32, on (batch, heads, seq, head_dim) inputs.

    Returns:
        ``{"eager": fn, "sdpa": fn}``: hand-written masked softmax, and
        ``F.scaled_dot_product_attention(is_causal=True)``; each call runs one forward + backward.
    """
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()

    def eager():
        att = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        (att @ v).sum().backward()

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return {"eager": eager, "sdpa": sdpa}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def probe_attention_speed(device: torch.device, width: int, seq: int, batch: int, reps: int = 5, *,
                          budget_s: float | None = None, notes: dict[str, list[str]] | None = None) -> dict:
    """Causal attention, forward + backward, fp32: hand-written masked softmax vs SDPA.

    Args:
        device: where to time.
        width: model width (heads of 64; head_dim = width // heads).
        seq, batch: input shape.
        reps: the most timed rounds (fewer when the answer is clear or ``budget_s`` is used up).
        budget_s: time budget in seconds (see :func:`time_interleaved`), or None.
        notes: optional; receives the warnings the runs raised under ``"attention"``.

    Returns:
        ``{"eager_ms", "sdpa_ms", "speedup", "samples"}`` (milliseconds; speedup = eager / sdpa,
        medians; ``samples`` = timed runs each), with ``"aborted": True`` when SDPA was stopped as
        over 3x slower and ``"stopped"`` saying why timing ended early; or ``{"error"}``. Never raises.
    """
    heads = max(1, width // 64)
    with quiet(notes, "attention"):
        try:
            t = time_interleaved(attention_workloads(device, batch, heads, seq, width // heads), device, reps,
                                  abort_ratio=3.0, baseline="eager", budget_s=budget_s)
        except Exception as err:  # noqa: BLE001
            return {"error": short_error(err)}
    if "sdpa" in t.errors:
        return {"error": t.errors["sdpa"]}
    e, s = statistics.median(t["eager"]), statistics.median(t["sdpa"])
    res = {"eager_ms": _ms(e), "sdpa_ms": _ms(s), "speedup": round(e / s, 3),
           "samples": {"eager": len(t["eager"]), "sdpa": len(t["sdpa"])}}
    if "sdpa" in t.dropped:
        res["aborted"] = True
    if t.dropped or t.stopped:
        res["stopped"] = t.dropped.get("sdpa") or t.stopped
    return res


def representative_block(width: int, device: torch.device) -> nn.Module:
    """A pre-norm transformer block (attention through SDPA, GELU MLP 4x) of the given width."""
    heads = max(1, width // 64)
    block = nn.TransformerEncoderLayer(
        width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True, device=device
    )
    block._vb_internal = True  # a probe, not a user model: the switch must not adopt it
    return block


def _autocast_workloads(block: nn.Module, device: torch.device, width: int, seq: int, batch: int,
                        dtypes: list[str]) -> dict[str, Callable[[], None]]:
    """``{"fp32": fn, dtype_name: fn, ...}``: one forward + backward of ``block`` on (batch, seq, width)."""
    x = torch.randn(batch, seq, width, device=device, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(seq, device=device)

    def fp32():
        block(x, src_mask=mask, is_causal=True).sum().backward()

    fns: dict[str, Callable[[], None]] = {"fp32": fp32}
    for dname in dtypes:
        def amp(dt=getattr(torch, dname)):
            try:
                with torch.autocast(device.type, dtype=dt):
                    y = block(x, src_mask=mask, is_causal=True)
            finally:
                # autocast empties its cache of weight casts only when the outermost autocast exits,
                # and isolated() holds one open: every call must pay its own casts (as a training
                # step does), and one dtype must never find another's casts
                torch.clear_autocast_cache()
            y.float().sum().backward()

        fns[dname] = amp
    return fns


def _autocast_record(t: Timings, dname: str) -> dict:
    base, amp_t = statistics.median(t["fp32"]), statistics.median(t[dname])
    res = {"fp32_ms": _ms(base), "autocast_ms": _ms(amp_t), "speedup": round(base / amp_t, 3), "samples": len(t[dname])}
    if dname in t.dropped:
        res["aborted"] = True
        res["stopped"] = t.dropped[dname]
    elif t.stopped:
        res["stopped"] = t.stopped
    return res


def probe_autocast_speed(device: torch.device, width: int, seq: int, batch: int,
                         dtypes: tuple[str, ...] = ("bfloat16",), reps: int = 5, *,
                         budget_s: float | None = None, pilots: tuple[tuple[int, int], ...] = (),
                         notes: dict[str, list[str]] | None = None) -> dict[str, dict]:
    """Forward + backward of :func:`representative_block`: fp32 vs autocast to each dtype.

    With ``pilots`` (``(seq, batch)`` shapes, smallest first), the same block is first timed on
    that few tokens (warm-up and two rounds per pilot): a dtype already over 3x slower than fp32
    there is reported from the pilot and never run at a larger size (on a CPU without bf16 units
    one full-size bf16 run can take seconds). With ``budget_s`` as well, a larger stage is only
    started when its predicted cost (three runs of every remaining candidate, scaled by tokens
    from the previous stage's medians) fits in what is left of the budget; otherwise the
    remaining dtypes are decided on the last stage that ran, conservatively: a pilot can rule a
    dtype out, never in (tiny shapes on a busy machine are mostly noise), so a pilot ratio above
    1 is reported as ``pilot_speedup`` and ``speedup`` is counted as 1.0 (no gain shown).

    Args:
        device: where to time.
        width: block width.
        seq, batch: full-size input shape.
        dtypes: autocast dtype names.
        reps: the most timed rounds at full size.
        budget_s: time budget in seconds for the whole probe, or None (no budget).
        pilots: pilot shapes, or () for none.
        notes: optional; receives the warnings the runs raised under ``"autocast"``.

    Returns:
        ``{dtype_name: {"fp32_ms", "autocast_ms", "speedup", "samples"} | {"error"}}`` in
        milliseconds, speedup = fp32 / autocast (medians). A dtype stopped as over 3x slower also
        has ``"aborted": True``; ``"stopped"`` says why timing ended early; a dtype decided on a
        pilot has ``"stage": "pilot"``, that pilot's ``"seq"`` and ``"batch"``, and
        ``"pilot_speedup"`` where its ratio was capped at 1.0. Never raises.
    """
    out: dict[str, dict] = {}
    t_start = time.perf_counter()
    with quiet(notes, "autocast"):
        try:
            block = representative_block(width, device)
        except Exception as err:  # noqa: BLE001
            return {d: {"error": short_error(err)} for d in dtypes}
        remaining = list(dtypes)
        stages = [(int(s), int(b), 2, True) for s, b in pilots] + [(seq, batch, reps, False)]
        last: tuple[int, int, Timings] | None = None
        for s_seq, s_batch, s_reps, is_pilot in stages:
            if not remaining:
                break
            left = None if budget_s is None else budget_s - (time.perf_counter() - t_start)
            if last is not None and left is not None:
                l_seq, l_batch, l_t = last
                scale = (s_seq * s_batch) / (l_seq * l_batch)
                predicted = 3 * scale * sum(statistics.median(l_t[n]) for n in ["fp32", *remaining])
                if predicted > left:
                    why = (f"{s_batch}x{s_seq} tokens would take about {predicted:.2f} s, over the "
                           f"{max(left, 0.0):.2f} s left of the {budget_s:g} s budget")
                    for dname in remaining:
                        res = _autocast_record(l_t, dname)
                        res["stopped"] = f"{res['stopped']}; {why}" if "stopped" in res else why
                        if res["speedup"] > 1.0:  # a pilot rules a dtype out, never in
                            res["pilot_speedup"], res["speedup"] = res["speedup"], 1.0
                            res["stopped"] += "; a pilot can rule a dtype out, never in: speed-up counted as 1.0"
                        out[dname] = res | {"stage": "pilot", "seq": l_seq, "batch": l_batch}
                    remaining = []
                    break
            try:
                fns = _autocast_workloads(block, device, width, s_seq, s_batch, remaining)
                t = time_interleaved(fns, device, s_reps, abort_ratio=3.0, baseline="fp32",
                                      budget_s=None if is_pilot else left)
            except Exception as err:  # noqa: BLE001 - fp32 itself failed
                out.update({d: {"error": short_error(err)} for d in remaining})
                break
            for dname in list(remaining):
                if dname in t.errors:
                    out[dname] = {"error": t.errors[dname]}
                elif not is_pilot:
                    out[dname] = _autocast_record(t, dname)
                elif dname in t.dropped:
                    res = _autocast_record(t, dname)
                    res["stopped"] = f"pilot on {s_batch}x{s_seq} tokens: {res['stopped']}"
                    out[dname] = res | {"stage": "pilot", "seq": s_seq, "batch": s_batch}
                else:
                    continue  # not ruled out: timed at the next size
                remaining.remove(dname)
            last = (s_seq, s_batch, t)
    return {d: out[d] for d in dtypes if d in out}
