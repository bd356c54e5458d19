"""Probed capabilities on this CPU, and the FP4 hardware rule."""
import torch

from apt_model.devices import capabilities, probes


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


def test_a_slow_candidate_is_stopped_early():
    """A dtype that cannot win is dropped: at warm-up when hopeless, else after two timed rounds."""
    import time

    def runner(seconds, calls, key):
        def fn():
            calls[key] += 1
            time.sleep(seconds)
        return fn

    calls = {"fast": 0, "hopeless": 0, "slow": 0, "close": 0}
    fns = {"fast": runner(0.002, calls, "fast"), "hopeless": runner(0.05, calls, "hopeless"),
           "slow": runner(0.008, calls, "slow"), "close": runner(0.0025, calls, "close")}
    t = probes._time_interleaved(fns, torch.device("cpu"), reps=5, abort_ratio=3.0, baseline="fast")
    assert len(t["fast"]) == 5 and len(t["close"]) == 5  # a close competitor is measured fully
    assert calls["hopeless"] == 1 and len(t["hopeless"]) == 1  # 25x: only the warm-up ran
    assert calls["slow"] == 3 and len(t["slow"]) == 2  # 4x: warm-up + two rounds, then dropped
