"""``apt-vb test``: a functional self-test of a device. Each check passes or fails with its reason.

Checks (``--check NAME`` runs a subset):

* ``round_trip`` — tensors of every dtype the device stores (float32, float64, bfloat16, float16,
  int64, int32, uint8, bool), contiguous, strided, empty and 16 MiB, moved to the device with
  :meth:`DeviceBackend.to_device` (blocking and non-blocking) and back: bit-identical.
* ``matmul`` — ``a @ b`` on the device vs a float64 CPU reference of the same (dtype-rounded)
  inputs, in each dtype that computes there: relative error within the dtype's tolerance.
* ``sdpa`` — ``scaled_dot_product_attention`` (causal, and with a boolean mask) through the
  default dispatch and each SDPA backend the probe found running, vs float64 math on the CPU.
* ``training`` — 3 AdamW steps of a small GPT with the switch off, then on with every
  numerics-changing feature off (attention routing, mixed precision, FP4, paging): the losses and
  final parameters must be identical (bitwise on the CPU; within 1e-5 relative on accelerators,
  whose kernels may be non-deterministic).
* ``training_paged`` — the same with the training state paged through the VGPU stack
  (``paging="always"``, a 64 KB level-0 budget, swap files in the configured swap folder): paging
  moves bytes, never changes them, so the same identity holds.

Exit status: 0 when every check passed, 1 when any failed (each failure's reason is printed),
2 for a bad argument (an unknown device or check).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

ROUND_TRIP_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32", "uint8", "bool")
MATMUL_TOL = {"float32": 1e-4, "float64": 1e-10, "bfloat16": 1e-2, "float16": 2e-3}
SDPA_TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}


@dataclass
class CheckResult:
    """One check: ``passed`` and the ``reason`` (what was compared and the numbers; the error on failure)."""

    name: str
    passed: bool
    reason: str
    seconds: float = 0.0


class CheckFailed(AssertionError):
    """Raised inside a check with the reason it failed."""


def _backend(device: torch.device):
    from apt_model.devices.device_backend import DeviceBackend

    return DeviceBackend(device)


def _sample(dtype: torch.dtype, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    hi = 256 if dtype == torch.uint8 else 2**31 - 1
    return torch.randint(0, hi, shape, generator=gen).to(dtype)


def check_round_trip(device: torch.device) -> str:
    """Host -> device -> host for every stored dtype and several layouts: bit-identical."""
    from apt_model.devices.capabilities import get_support

    backend = _backend(device)
    support = get_support(device)
    gen = torch.Generator().manual_seed(0)
    dtypes = [d for d in ROUND_TRIP_DTYPES if support.dtypes.get(d, {}).get("storage", d in ("int64", "int32", "uint8", "bool"))]
    n = 0
    for dname in dtypes:
        dt = getattr(torch, dname)
        layouts = {"contiguous": _sample(dt, (1000,), gen), "strided": _sample(dt, (64, 48), gen).t(),
                   "empty": _sample(dt, (0, 3), gen)}
        if dname == "float32":
            layouts["16 MiB"] = _sample(dt, (4 << 20,), gen)
        for layout, x in layouts.items():
            for non_blocking in (False, True):
                y = backend.to_device(x, non_blocking=non_blocking)
                backend.synchronize()
                if y.device.type != device.type:
                    raise CheckFailed(f"{dname} {layout}: to_device put the tensor on {y.device}, not {device}")
                back = y.to("cpu")
                if back.dtype != x.dtype or back.shape != x.shape or not torch.equal(back, x):
                    diff = "shape/dtype differ" if back.shape != x.shape or back.dtype != x.dtype else \
                        f"{int((back != x).sum())} of {x.numel()} elements differ"
                    raise CheckFailed(f"{dname} {layout} (non_blocking={non_blocking}): {diff} after cpu -> {device} -> cpu")
                n += 1
    return f"{n} tensors ({len(dtypes)} dtypes: {', '.join(dtypes)}; contiguous, strided, empty, 16 MiB) bit-identical after cpu -> {device} -> cpu"


def check_matmul(device: torch.device) -> str:
    """``a @ b`` on the device vs float64 on the CPU, per computing dtype."""
    from apt_model.devices.capabilities import get_support

    support = get_support(device)
    backend = _backend(device)
    gen = torch.Generator().manual_seed(1)
    parts = []
    for dname, tol in MATMUL_TOL.items():
        if not support.dtype_computes(dname):
            continue
        dt = getattr(torch, dname)
        a = torch.randn(128, 96, generator=gen).to(dt)
        b = torch.randn(96, 64, generator=gen).to(dt)
        ref = a.double() @ b.double()
        out = (backend.to_device(a) @ backend.to_device(b)).to("cpu").double()
        err = float((out - ref).norm() / ref.norm())
        if not err <= tol:  # NaN fails too
            hint = ""
            if dname == "float32" and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
                hint = " (torch.backends.cuda.matmul.allow_tf32 is on: TF32 rounds inputs to 10 bits)"
            raise CheckFailed(f"{dname}: relative error {err:.2e} vs the float64 CPU reference, over {tol:.0e}{hint}")
        parts.append(f"{dname} {err:.1e}")
    return "relative error vs float64 on the CPU (128x96 @ 96x64): " + ", ".join(parts)


def _attention_reference(q, k, v, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    att = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        att = att.masked_fill(~torch.ones(att.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    return att.softmax(-1) @ v


def check_sdpa(device: torch.device) -> str:
    """SDPA on the device vs float64 math on the CPU: causal and boolean-masked, per running backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from apt_model.devices.capabilities import get_support

    support = get_support(device)
    backend = _backend(device)
    gen = torch.Generator().manual_seed(2)
    parts = []
    for dname, tol in SDPA_TOL.items():
        if dname != "float32" and not support.dtype_computes(dname):
            continue
        dt = getattr(torch, dname)
        q, k, v = (torch.randn(2, 4, 64, 32, generator=gen).to(dt) for _ in range(3))
        mask = torch.rand(64, 64, generator=gen) > 0.3
        mask[:, 0] = True  # every query sees at least one key
        args = [backend.to_device(t) for t in (q, k, v)]
        cases = {"causal": (None, True), "masked": (backend.to_device(mask), False)}
        refs = {"causal": _attention_reference(q, k, v, None, True), "masked": _attention_reference(q, k, v, mask, False)}
        backends = {"default": None}
        for name in support.sdpa_backends_for(dname):
            backends[name] = getattr(SDPBackend, name)
        worst = 0.0
        for bname, sdp in backends.items():
            for cname, (dm, causal) in cases.items():
                ref = refs[cname]
                try:
                    if sdp is None:
                        out = F.scaled_dot_product_attention(*args, attn_mask=dm, is_causal=causal)
                    else:
                        with sdpa_kernel([sdp]):
                            out = F.scaled_dot_product_attention(*args, attn_mask=dm, is_causal=causal)
                except RuntimeError as err:
                    if sdp is not None and cname == "masked":
                        continue  # a backend without arbitrary masks (flash) is fine; the probe tested causal
                    raise CheckFailed(f"{dname} {bname} {cname}: {err}") from None
                err = float((out.to("cpu").double() - ref).abs().max())
                if not err <= tol:
                    raise CheckFailed(f"{dname} backend {bname}, {cname}: max abs error {err:.2e} vs float64 math "
                                      f"on the CPU, over {tol:.0e}")
                worst = max(worst, err)
        parts.append(f"{dname} [{', '.join(backends)}] max abs error {worst:.1e}")
    return "SDPA vs float64 math on the CPU (causal and masked): " + "; ".join(parts)


def _train(device: torch.device, steps: int = 3) -> tuple[list[torch.Tensor], dict]:
    from apt_model.core.system import set_seed
    from apt_model.models.gpt import GPT, GPTConfig

    set_seed(0)
    model = GPT(GPTConfig(seq_len=16, d_model=64, n_layers=2, n_heads=2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    inp, tgt = x[:, :-1].to(device), x[:, 1:].to(device)  # one batch, learnt step by step
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(inp).reshape(-1, 256), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach().to("cpu"))
    return losses, {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}


def _compare_training(device: torch.device, label: str, **switch) -> str:
    import apt_model.optimization.vb_global as vb

    vb.disable()
    ref_losses, ref_params = _train(device)
    overrides = dict(attention="off", mixed_precision="off", compile="off", tf32="off", fp4="off", paging="off",
                     activation_checkpointing=False, activation_offload=False, banner=False)
    overrides.update(switch)
    vb.enable(device=str(device), **overrides)
    try:
        losses, params = _train(device)
        stats = vb.get_stats()
    finally:
        vb.disable()
    exact = device.type == "cpu"
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        same = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=0)
        if not same:
            raise CheckFailed(f"{label}: loss at step {i + 1} is {b.item():.9g} with the switch vs "
                              f"{a.item():.9g} without")
    for name, ref in ref_params.items():
        got = params[name]
        same = torch.equal(ref, got) if exact else torch.allclose(ref, got, rtol=1e-5, atol=1e-7)
        if not same:
            raise CheckFailed(f"{label}: parameter {name} differs after {len(losses)} steps "
                              f"(max abs difference {float((ref - got).abs().max()):.3e})")
    how = "bit-identical" if exact else "equal within 1e-5 relative"
    extra = ""
    levels = stats.get("levels")
    if levels:
        moved = sum((lv.get("bytes_in") or 0) + (lv.get("bytes_out") or 0) for lv in levels)
        extra = f"; {moved / 2**20:.1f} MiB moved between levels"
    return (f"{len(losses)} AdamW steps, losses {ref_losses[0].item():.4f} -> {ref_losses[-1].item():.4f}: "
            f"losses and parameters {how} with the switch off and on ({label}){extra}")


def check_training(device: torch.device) -> str:
    """A few training steps, switch off vs on with the numerics-changing features off: identical."""
    return _compare_training(device, "no numerics-changing feature")


def check_training_paged(device: torch.device) -> str:
    """The same, with the whole training state paged through the VGPU stack."""
    return _compare_training(device, "paging='always', 64 KB level-0 budget", paging="always", device_budget="64KB")


#: The checks, in the order they run.
CHECKS: dict[str, Callable[[torch.device], str]] = {
    "round_trip": check_round_trip,
    "matmul": check_matmul,
    "sdpa": check_sdpa,
    "training": check_training,
    "training_paged": check_training_paged,
}


def run_checks(device: str | torch.device | None = None, only: list[str] | None = None,
               progress: Callable[[str], None] | None = None) -> list[CheckResult]:
    """Run the checks on ``device`` (default: the ranking's choice); the switch is left off.

    Args:
        device: the device to test.
        only: names from :data:`CHECKS` (default: all).
        progress: called with each check's name as it starts.

    Returns:
        One :class:`CheckResult` per check; a check that raises fails with the error text.

    Raises:
        ConfigError: an unknown check name, or a malformed device.
        DeviceSelectionError: a device that is not usable here.
    """
    from apt_model.devices.probes import short_error
    from apt_model.devices.ranking import select_device
    from apt_model.base.errors import ConfigError

    names = list(only or CHECKS)
    bad = [n for n in names if n not in CHECKS]
    if bad:
        raise ConfigError(f"unknown check(s) {', '.join(map(repr, bad))}; valid checks: {', '.join(CHECKS)}")
    dev = select_device(device=device).device
    results = []
    for name in names:
        if progress:
            progress(name)
        t0 = time.perf_counter()
        try:
            reason, passed = CHECKS[name](dev), True
        except CheckFailed as err:
            reason, passed = str(err), False
        except Exception as err:  # noqa: BLE001 - an error is a failed check with its reason
            reason, passed = short_error(err), False
        results.append(CheckResult(name, passed, reason, round(time.perf_counter() - t0, 3)))
    return results


def add_parser(sub) -> None:
    """Add ``test`` to the ``apt-vb`` sub-parsers."""
    t = sub.add_parser("test", help="functional self-test of a device (exit status 1 if a check fails)",
                       description="Round trip, matmul and SDPA vs CPU references, and training with the switch "
                                   "on vs off giving identical results.")
    t.add_argument("devices", nargs="*", default=[], metavar="DEVICE",
                   help="device(s) to test, e.g. 'apt-vb test cpu' (same as --device)")
    t.add_argument("--device", action="append", default=None, metavar="DEVICE",
                   help="device to test (repeatable, or comma-separated; default: the ranking's choice)")
    t.add_argument("--check", action="append", default=None, metavar="NAME",
                   help=f"run only this check (repeatable): {', '.join(CHECKS)}")
    t.add_argument("--json", action="store_true", help="print JSON")


def run_selftest(args) -> int:
    """Run ``apt-vb test``; returns 0 when every check passed, else 1."""
    from tqdm.auto import tqdm

    from apt_model.devices.device_backend import DeviceBackend
    from apt_model.devices.ranking import select_device

    given = [*getattr(args, "devices", []), *(args.device or [])]  # positional (apt-vb test cpu) and --device
    devices = list(dict.fromkeys(d.strip() for item in given for d in item.split(",") if d.strip())) or [None]
    names = list(args.check or CHECKS)
    bar = tqdm(total=len(devices) * len(names), desc="test", unit="check", file=sys.stderr, disable=None)
    out = []
    try:
        for d in devices:
            def step(name, d=d):
                bar.set_postfix_str(f"{d or 'default'} {name}", refresh=False)
                bar.update(1)

            dev = select_device(device=d).device
            results = run_checks(dev, args.check, step)
            out.append({"device": str(dev), "name": DeviceBackend(dev).get_device_name(),
                        "passed": all(r.passed for r in results), "checks": [asdict(r) for r in results]})
    finally:
        bar.close()
    ok = all(d["passed"] for d in out)
    if args.json:
        print(json.dumps({"passed": ok, "devices": out}, indent=2))
    else:
        for d in out:
            print(f"apt-vb test {d['device']} ({d['name']}):")
            for c in d["checks"]:
                print(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']:<15} {c['reason']}  ({c['seconds']:.2f} s)")
            failed = [c["name"] for c in d["checks"] if not c["passed"]]
            print(f"  {len(d['checks']) - len(failed)} of {len(d['checks'])} checks passed"
                  + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 0 if ok else 1
