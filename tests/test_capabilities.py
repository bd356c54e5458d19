"""Probed capabilities on this CPU, the FP4 hardware rule, early stopping of the speed probes
(on a virtual clock, so it means the same on every machine), and silent probes."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from apt_model.devices import capabilities, probes


@pytest.fixture(autouse=True)
def probe_cache_in_tmp(tmp_path, monkeypatch):
    """Probe results cached on disk go to a temporary folder, never to the user's home."""
    monkeypatch.setenv("VB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("VB_PROBE_CACHE", raising=False)


def test_cpu_support_probe_matches_known_facts():
    sup = capabilities.get_support("cpu")
    assert sup.dtype_computes("float32") and sup.dtype_computes("bfloat16")
    fp4 = sup.dtypes["float4_e2m1fn_x2"]
    assert fp4["storage"] is True and fp4["cast"] is False  # FP4 is storage-only on CPU (DESIGN section 4)
    assert "MATH" in sup.sdpa_backends_for("float32")
    assert sup.sdpa_backends["EFFICIENT_ATTENTION"]["float32"] != "ok"  # not on CPU
    assert sup.fp4_matmul["supported"] is False and sup.fp4_matmul["reason"].startswith("not attempted")
    assert isinstance(sup.fp8_matmul["supported"], bool) and sup.fp8_matmul["reason"]
    assert capabilities.get_support("cpu") is sup  # cached per process


def test_speed_probe_is_cached_per_width_and_reports_medians():
    a = capabilities.get_speed("cpu", width=64)
    assert capabilities.get_speed("cpu", width=64) is a
    assert a.width == 64 and a.threads == torch.get_num_threads()
    assert a.attention["eager_ms"] > 0 and a.attention["sdpa_ms"] > 0
    assert abs(a.attention["speedup"] - a.attention["eager_ms"] / a.attention["sdpa_ms"]) < 0.01
    bf = a.autocast["bfloat16"]
    assert bf["fp32_ms"] > 0 and bf["autocast_ms"] > 0


def test_probe_width_clamps_to_the_device_range():
    assert capabilities.probe_width("cpu", None) == 256
    assert capabilities.probe_width("cpu", 4096) == 512
    assert capabilities.probe_width("cpu", 100) == 64
    assert capabilities.probe_width("cuda:0", None) == 1024


def test_fp4_hardware_rule(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert probes.fp4_hardware(cuda, {"major": 10, "minor": 0})[0] is True
    ok, why = probes.fp4_hardware(cuda, {"major": 9, "minor": 0})
    assert ok is False and "sm_90 lacks FP4" in why
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert probes.fp4_hardware(cuda, {"gcnArchName": "gfx950:sramecc+"})[0] is True
    assert probes.fp4_hardware(cuda, {"gcnArchName": "gfx942"})[0] is False
    assert probes.fp4_hardware(torch.device("cpu"), {})[0] is False


class VirtualClock:
    """A clock that only moves when a fake workload says it ran: timings are exact on any machine."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def work(self, seconds, calls, key):
        def fn():
            calls[key] += 1
            self.now += seconds
        return fn


def test_a_slow_candidate_is_stopped_early():
    """A dtype that cannot win is dropped: at warm-up when hopeless, else after two timed rounds.

    On the H100 run this test timed real ``time.sleep`` calls under 14 parallel workers: a 2 ms
    sleep that overshoots past 5.6 ms makes a 50 ms candidate look under 9x the baseline at
    warm-up (``calls["hopeless"] == 3``). The rule is about ratios, not about a machine's sleep
    accuracy, so the workloads run on a virtual clock.
    """
    clock = VirtualClock()
    calls = {"fast": 0, "hopeless": 0, "slow": 0, "close": 0}
    fns = {"fast": clock.work(0.002, calls, "fast"), "hopeless": clock.work(0.05, calls, "hopeless"),
           "slow": clock.work(0.008, calls, "slow"), "close": clock.work(0.0025, calls, "close")}
    t = probes.time_interleaved(fns, torch.device("cpu"), reps=5, abort_ratio=3.0, baseline="fast", clock=clock)
    assert len(t["fast"]) == 5 and len(t["close"]) == 5  # a close competitor is measured fully
    assert t["close"] == [pytest.approx(0.0025)] * 5 and t.stopped is None
    assert calls["hopeless"] == 2 and len(t["hopeless"]) == 1  # 25x: only the two warm-up runs ran
    assert calls["slow"] == 3 and len(t["slow"]) == 2  # 4x: warm-up + two rounds, then dropped
    assert set(t.dropped) == {"hopeless", "slow"} and "over 9x" in t.dropped["hopeless"]


def test_a_candidate_whose_first_call_pays_a_one_time_cost_is_measured():
    """oneDNN generates its bf16 kernels at their first use in a process: on a CPU with bf16 units
    (AVX-512 BF16) the first bf16 call took 10x the fp32 one, the warm-up screen dropped bf16 as
    hopeless and the probe cache kept "21.7x slower" for a dtype 1.2-1.9x faster there."""
    clock = VirtualClock()
    calls = {"fp32": 0, "bf16": 0}
    fp32, steady = clock.work(0.002, calls, "fp32"), clock.work(0.0015, calls, "bf16")

    def bf16():
        if calls["bf16"] == 0:
            clock.now += 0.05  # kernel generation at the first call
        steady()

    t = probes.time_interleaved({"fp32": fp32, "bf16": bf16}, torch.device("cpu"), reps=5, abort_ratio=3.0,
                                 baseline="fp32", clock=clock)
    assert not t.dropped and t["bf16"] == [pytest.approx(0.0015)] * 5 and calls["bf16"] == 7


def test_timing_ends_when_decided_or_over_budget():
    clock = VirtualClock()
    calls = {"eager": 0, "sdpa": 0}
    fns = {"eager": clock.work(0.010, calls, "eager"), "sdpa": clock.work(0.002, calls, "sdpa")}
    t = probes.time_interleaved(fns, torch.device("cpu"), reps=5, abort_ratio=3.0, baseline="eager", clock=clock)
    assert calls == {"eager": 3, "sdpa": 3} and t.rounds == 2  # 5x faster in every run: decided
    assert "over 3x faster" in t.stopped and not t.dropped

    calls = {"a": 0, "b": 0}
    fns = {"a": clock.work(0.1, calls, "a"), "b": clock.work(0.1, calls, "b")}
    t = probes.time_interleaved(fns, torch.device("cpu"), reps=5, abort_ratio=3.0, baseline="a",
                                 budget_s=0.25, clock=clock)
    assert calls == {"a": 3, "b": 3}  # over budget after warm-up + 2 rounds (two samples at least)
    assert "budget" in t.stopped and len(t["a"]) == len(t["b"]) == 2


def test_a_failing_candidate_is_an_error_not_a_crash():
    clock = VirtualClock()
    calls = {"fp32": 0}

    def broken():
        raise RuntimeError("no kernel for this dtype")

    t = probes.time_interleaved({"fp32": clock.work(0.01, calls, "fp32"), "bf16": broken}, torch.device("cpu"),
                                 reps=3, abort_ratio=3.0, baseline="fp32", clock=clock)
    assert "no kernel for this dtype" in t.errors["bf16"] and "bf16" not in t
    assert len(t["fp32"]) == 2 and "no candidate left" in t.stopped
    with pytest.raises(RuntimeError):
        probes.time_interleaved({"fp32": broken}, torch.device("cpu"), reps=3, abort_ratio=3.0, baseline="fp32")


def test_cpu_probes_are_proportionate():
    """CPU speed probes: fewer tokens and rounds than on accelerators, a time budget, and a pilot."""
    cpu, accel = capabilities.probe_plan("cpu"), capabilities.probe_plan("cuda:0")
    assert cpu.seq * cpu.batch <= 512 < accel.seq * accel.batch and cpu.reps < accel.reps
    assert cpu.attention_budget_s + cpu.autocast_budget_s <= 2.0 and cpu.pilots
    sp = capabilities.get_speed("cpu", width=64)
    assert (sp.seq, sp.batch, sp.reps) == (cpu.seq, cpu.batch, cpu.reps)
    assert sp.attention["samples"]["sdpa"] <= cpu.reps


def test_the_autocast_pilot_decides_when_the_full_size_would_not_fit():
    dev = torch.device("cpu")
    out = probes.probe_autocast_speed(dev, 64, 64, 2, reps=2, budget_s=0.0, pilots=((8, 1),))["bfloat16"]
    assert out["stage"] == "pilot" and (out["seq"], out["batch"]) == (8, 1) and out["samples"] >= 1
    assert "over 3x" in out["stopped"] or "budget" in out["stopped"]
    full = probes.probe_autocast_speed(dev, 64, 32, 1, reps=2)["bfloat16"]
    assert "stage" not in full and full["fp32_ms"] > 0 and full["autocast_ms"] > 0


def test_a_pilot_rules_a_dtype_out_never_in(monkeypatch):
    """bf16 2x faster on the pilot, but the budget stops before the full size: no gain is claimed
    (tiny shapes on a busy CPU are noise, and a wrong 'faster' would put autocast on trial)."""
    clock = VirtualClock()
    calls = {"fp32": 0, "bfloat16": 0}
    real = probes.time_interleaved
    monkeypatch.setattr(probes, "time_interleaved", lambda *a, **k: real(*a, clock=clock, **k))
    monkeypatch.setattr(probes, "_autocast_workloads", lambda block, dev, w, seq, batch, dtypes: {
        "fp32": clock.work(0.010, calls, "fp32"), "bfloat16": clock.work(0.005, calls, "bfloat16")})
    dev = torch.device("cpu")
    out = probes.probe_autocast_speed(dev, 64, 64, 2, reps=3, budget_s=0.0, pilots=((8, 1),))["bfloat16"]
    assert out["stage"] == "pilot" and out["pilot_speedup"] == 2.0 and out["speedup"] == 1.0
    assert "never in" in out["stopped"] and calls == {"fp32": 3, "bfloat16": 3}
    full = probes.probe_autocast_speed(dev, 64, 64, 2, reps=3, pilots=((8, 1),))["bfloat16"]
    assert full["speedup"] == 2.0 and "stage" not in full and full["samples"] == 3  # measured at full size


# ----------------------------------------------------------------------------- silent probes

SDPA_WARNING = "Flash attention has been runtime disabled. (Triggered internally at sdp_utils_cpp.h:540.)"


@pytest.fixture
def warning_sdpa(monkeypatch):
    """SDPA that warns the way PyTorch's CUDA dispatcher does when a backend is off (it does not on CPU)."""
    real = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        warnings.warn(SDPA_WARNING, UserWarning)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return SDPA_WARNING


def test_sdpa_probe_lets_no_warning_escape_and_keeps_its_text(warning_sdpa):
    notes = {}
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        out = probes.probe_sdpa_backends(torch.device("cpu"), notes)
    assert escaped == []
    assert out["MATH"]["float32"] == "ok"  # the record's format is unchanged
    assert notes["MATH/float32"] == ["UserWarning: Flash attention has been runtime disabled."]
    assert set(notes) >= {f"{b}/{d}" for b in ("MATH", "FLASH_ATTENTION") for d in ("float32", "bfloat16")}


def test_support_and_speed_records_keep_probe_warnings_even_under_W_error(warning_sdpa):
    capabilities.clear_capability_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a script run with -W error: a warning escaping would raise
        sup = capabilities.get_support("cpu")
        sp = capabilities.get_speed("cpu", width=64)
    assert not sup.cached and "MATH" in sup.sdpa_backends_for("float32")
    assert "UserWarning: Flash attention has been runtime disabled." in sup.warnings["MATH/float32"]
    assert "error" not in sp.attention and sp.attention["sdpa_ms"] > 0
    assert any("Flash attention has been runtime disabled" in w for w in sp.warnings["attention"])
    capabilities.clear_capability_cache()


def test_quiet_catches_warnings_raised_outside_any_trial():
    notes = {}
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        with probes.quiet(notes, "other") as texts:
            warnings.warn("first", RuntimeWarning)
            warnings.warn("first", RuntimeWarning)
        assert probes.try_run(lambda: warnings.warn("inside", UserWarning), notes, "t") is None
    assert escaped == [] and texts == ["RuntimeWarning: first"]
    assert notes == {"other": ["RuntimeWarning: first"], "t": ["UserWarning: inside"]}


def test_each_autocast_dtype_is_probed_with_its_own_casts():
    """Probes run inside ``isolated()``, whose outer ``autocast(enabled=False)`` keeps autocast's
    cast cache alive across the workloads: the float16 workload reused bf16 weight casts and
    failed ("mat1 and mat2 must have the same dtype, but got Half and BFloat16"), so a forced
    fp16 was refused on the CPU ("fp16 autocast does not run on cpu"); and every timed call but
    the first skipped its weight casts."""
    dev = torch.device("cpu")
    with probes.isolated(dev):
        out = probes.probe_autocast_speed(dev, 64, 16, 1, reps=2, dtypes=("bfloat16", "float16"))
    assert "error" not in out["bfloat16"] and "error" not in out["float16"], out
    assert out["float16"]["autocast_ms"] > 0
