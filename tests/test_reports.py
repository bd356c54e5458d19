"""Run reports: the per-step recorder, the report's JSON schema, and the PNG."""
import json
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.models.gpt import GPT, GPTConfig
from apt_model.switch.steps import StepRecorder
from conftest import best_device

REPORT_KEYS = {"version", "torch", "config", "device", "capabilities", "models", "memory", "decisions", "stats", "steps"}
STEPS_KEYS = {"count", "optimizers", "kept", "stride", "max_records", "device", "memory_fields", "levels", "step_time",
              "optimizer_time_total_s", "memory_peak", "records"}
STEP_TIME_KEYS = {"n", "total_s", "mean_s", "min_s", "max_s", "window", "median_s", "p25_s", "p75_s"}
RECORD_KEYS = {"step", "optimizer", "t", "step_s", "optimizer_s", "memory"}


def train(steps: int, device: str | None = None):
    """A few AdamW steps of a small GPT: left on the CPU, or moved by the script to ``device``."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2))
    x = torch.randint(0, 256, (2, 32))
    if device is not None:
        model, x = model.to(device), x.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def accelerator() -> str:
    dev = best_device()
    if dev == "cpu":
        pytest.skip("needs an accelerator: the ranking chose the CPU on this machine")
    return dev


def test_report_schema_and_steps(tmp_path, cpu_device):
    """On the CPU (VB_DEVICE=cpu): process RSS is the one memory figure, no paging levels."""
    vb.enable("balanced", banner=False, mixed_precision="off")
    _, opt = train(5)
    rep = json.loads(json.dumps(vb.get_report()))  # JSON-safe
    assert REPORT_KEYS <= set(rep)
    assert {"mode", "mode_source", "features", "settings", "config_files"} <= set(rep["config"])
    s = rep["steps"]
    assert STEPS_KEYS <= set(s) and STEP_TIME_KEYS <= set(s["step_time"])
    assert s["device"] == "cpu" and rep["device"]["selection"]["device"] == "cpu"
    assert s["count"] == 5 and s["optimizers"] == 1 and s["kept"] == 5 and s["stride"] == 1
    assert s["levels"] == [] and s["memory_fields"] == ["process_rss", "process_rss_peak"]
    assert [r["step"] for r in s["records"]] == [1, 2, 3, 4, 5]
    assert all(RECORD_KEYS <= set(r) and set(r["memory"]) == {"process_rss", "process_rss_peak"} for r in s["records"])
    assert all(r["memory"]["process_rss_peak"] >= r["memory"]["process_rss"] for r in s["records"])
    assert s["records"][0]["step_s"] is None and all(r["step_s"] > 0 for r in s["records"][1:])
    assert all(r["optimizer_s"] > 0 and r["memory"]["process_rss"] > 0 for r in s["records"])
    assert s["step_time"]["n"] == 4 and s["step_time"]["p25_s"] <= s["step_time"]["median_s"] <= s["step_time"]["p75_s"]
    assert s["memory_peak"]["process_rss"] >= max(r["memory"]["process_rss"] for r in s["records"])
    vb.disable()  # the hooks leave with the switch; the last session's steps stay in the report
    x = torch.zeros(1, requires_grad=True)
    torch.optim.SGD([x], lr=0.1).step()
    assert vb.get_report()["steps"]["count"] == 5


@pytest.mark.gpu
def test_report_steps_record_the_accelerators_memory():
    """On an accelerator the records carry the device's allocated bytes as well as the RSS."""
    dev = accelerator()
    vb.enable("balanced", banner=False, mixed_precision="off")
    train(5, dev)
    rep = json.loads(json.dumps(vb.get_report()))
    s = rep["steps"]
    assert s["device"] == dev == rep["device"]["selection"]["device"] and s["count"] == 5
    assert s["memory_fields"] == ["process_rss", "process_rss_peak", "device_allocated"] and s["levels"] == []
    assert all(set(r["memory"]) == {"process_rss", "process_rss_peak", "device_allocated"} for r in s["records"])
    assert all(r["memory"]["device_allocated"] > 0 for r in s["records"])  # the model and its AdamW state
    assert s["memory_peak"]["device_allocated"] >= max(r["memory"]["device_allocated"] for r in s["records"])


def test_paging_records_memory_per_level(cpu_device):
    """On the CPU (VB_DEVICE=cpu) the stack is host RAM (level 0) and the swap files (level 1)."""
    vb.enable("balanced", banner=False, mixed_precision="off", attention="off", paging="always", device_budget="64KB")
    train(3)
    s = vb.get_report()["steps"]
    assert s["levels"] == ["level0:host", "level1:nvme"]
    assert all(set(r["levels"]) == {"level0:host", "level1:nvme"} for r in s["records"])
    assert s["memory_peak"]["level1:nvme"] > 0  # the state went down to the swap files


@pytest.mark.gpu
def test_paging_on_the_accelerator_records_device_host_and_swap_levels():
    """On an accelerator the stack is device memory, pinned host RAM, then the swap files; with a
    64 KB device budget the training state leaves the device."""
    dev = accelerator()
    vb.enable("balanced", banner=False, mixed_precision="off", attention="off", paging="always", device_budget="64KB")
    train(3, dev)
    s = vb.get_report()["steps"]
    levels = ["level0:device", "level1:host", "level2:nvme"]
    assert s["device"] == dev and s["count"] == 3 and s["levels"] == levels
    assert all(set(r["levels"]) == set(levels) for r in s["records"])
    assert s["memory_peak"]["level1:host"] + s["memory_peak"]["level2:nvme"] > 0  # below the device


def test_recorder_stays_bounded_and_evenly_spaced():
    rec = StepRecorder("cpu", max_records=4, window=3)
    for _ in range(10):
        rec.record_step()
    d = rec.to_dict()
    assert d["count"] == 10 and d["kept"] <= 4 and d["stride"] == 4
    assert [r["step"] for r in d["records"]] == [1, 5, 9]
    assert d["step_time"]["n"] == 9 and d["step_time"]["window"] == 3
    with pytest.raises(ValueError, match="max_records=1"):
        StepRecorder("cpu", max_records=1)
    for name in ("sample_interval", "peak_interval"):
        with pytest.raises(ValueError, match=f"{name}=0 must be > 0 seconds"):
            StepRecorder("cpu", **{name: 0})


@pytest.mark.parametrize("interval, reads", [(3600.0, 1), (1e-9, 20)])
def test_recorder_reads_memory_at_most_once_per_interval(monkeypatch, interval, reads):
    """A memory reading costs as much as the rest of a step's recording: it is taken at most once
    per ``sample_interval`` (every step when the interval is shorter than a step); records kept
    sooner (steps 1, 9, 17 of 20 here) carry the last reading."""
    import apt_model.switch.steps as steps

    n = []
    monkeypatch.setattr(steps, "rss_now", lambda: n.append(1) or 1000 + len(n))
    rec = StepRecorder("cpu", max_records=4, sample_interval=interval)
    for _ in range(20):
        rec.record_step()
    d = rec.to_dict()
    assert len(n) == reads and d["count"] == 20 and [r["step"] for r in d["records"]] == [1, 9, 17]
    assert d["memory_peak"]["process_rss"] == 1000 + reads
    expected = [1001] * 3 if reads == 1 else [1001, 1009, 1017]
    assert [r["memory"]["process_rss"] for r in d["records"]] == expected


def _calls_of_steps(rec: StepRecorder, steps: int, unprofiled: int = 0) -> list[str]:
    """Install ``rec``, take ``unprofiled`` SGD steps and then ``steps`` more under a profiler;
    returns the names of the apt_model functions the profiled steps called (this thread only)."""
    rec.install()
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    calls = []

    def profile(frame, event, arg):
        if event == "call" and "apt_model" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    try:
        p.grad = torch.ones(1)
        for _ in range(unprofiled):
            opt.step()
        sys.setprofile(profile)
        for _ in range(steps):
            opt.step()
        sys.setprofile(None)
    finally:
        sys.setprofile(None)
        rec.remove()
    return calls


def test_a_step_between_memory_readings_costs_the_hook_only_a_note():
    """On a model whose step takes a few hundred microseconds every microsecond of the recorder's
    counts: between two memory readings the post-hook only notes the step (no call into the
    recording code); the figures still count every step, each recorded as at its own step."""
    rec = StepRecorder("cpu", max_records=8, sample_interval=3600.0)
    calls = _calls_of_steps(rec, 5, unprofiled=1)  # the first step reads the memory
    assert set(calls) == {"_pre", "_post"}, calls
    d = rec.to_dict()
    assert d["count"] == 6 and [r["step"] for r in d["records"]] == [1, 2, 3, 4, 5, 6]
    assert d["step_time"]["n"] == 5 and all(r["step_s"] > 0 for r in d["records"][1:])


def test_a_memory_reading_does_not_make_the_hook_record_the_waiting_steps(monkeypatch):
    """A memory reading is due every ``sample_interval`` (5 ms: every dozen steps of a small
    model); the hook takes it and notes it with the step, and the steps are recorded only in
    batches of DRAIN_AT or when the figures are asked for, each with the reading of its own step
    (until 2026-11-28 each reading recorded the batch: ~9 us a step in a cold cache)."""
    import apt_model.switch.steps as steps

    n = []
    monkeypatch.setattr(steps, "rss_now", lambda: n.append(1) or 1000 + len(n))
    rec = StepRecorder("cpu", max_records=8, sample_interval=1e-9)
    calls = _calls_of_steps(rec, 5)
    assert "_drain" not in calls and "_record" not in calls, calls
    d = rec.to_dict()
    rss = [r["memory"]["process_rss"] for r in d["records"]]  # the sampler thread reads too: not 1001, 1002...
    assert d["count"] == 5 and len(rss) == 5 and rss == sorted(set(rss)), rss  # each step its own reading


def test_the_peak_sampler_thread_wakes_at_most_twenty_times_a_second(monkeypatch):
    """Each wake of the RSS sampler takes the interpreter lock from the training thread; at 200 a
    second (until 2026-11-28) that cost a 0.3 ms step ~3%."""
    import apt_model.switch.steps as steps

    n = []
    monkeypatch.setattr(steps, "rss_now", lambda: n.append(1) or 1000)
    rec = StepRecorder("cpu")
    rec.install()
    try:
        start = len(n)
        time.sleep(0.5)
        woke = len(n) - start
    finally:
        rec.remove()
    assert 3 <= woke <= 12, woke  # 10 at 50 ms (a slow machine may miss a few); 100 at 5 ms


def test_two_optimizers_are_told_apart():
    rec = StepRecorder("cpu")
    rec.install()
    try:
        a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
        oa, ob = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
        for _ in range(3):
            oa.step()
            ob.step()
    finally:
        rec.remove()
    d = rec.to_dict()
    assert d["count"] == 6 and d["optimizers"] == 2
    assert [r["optimizer"] for r in d["records"]] == [0, 1] * 3
    assert d["step_time"]["n"] == 4  # each optimizer's first step has no interval


def is_png(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    img = imread(path)  # decodes the whole image
    return img.shape[1], img.shape[0]


def test_save_report_writes_json_and_a_valid_png(tmp_path):
    pytest.importorskip("matplotlib")
    vb.enable("balanced", banner=False, mixed_precision="off")
    train(4)
    out = vb.save_report(tmp_path / "run" / "report.json")
    assert out == str(tmp_path / "run" / "report.json")
    assert REPORT_KEYS <= set(json.loads((tmp_path / "run" / "report.json").read_text()))
    w, h = is_png(tmp_path / "run" / "report.png")
    assert w >= 600 and h >= 400
    vb.save_report(tmp_path / "nopng.json", png=False)
    assert not (tmp_path / "nopng.png").exists()


def test_png_without_steps_and_without_matplotlib(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from apt_model.reports import write_report

    written = write_report({"steps": None}, tmp_path / "empty.json", png=True)
    is_png(tmp_path / "empty.png")
    assert written["png"] == str(tmp_path / "empty.png")
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the plot extra were not installed
    assert write_report({"steps": None}, tmp_path / "auto.json")["png"] is None
    with pytest.raises(ImportError, match=r"pip install 'apt_model\[plot\]'"):
        write_report({"steps": None}, tmp_path / "forced.json", png=True)
    assert (tmp_path / "forced.json").exists()


def test_png_memory_panel_draws_the_per_step_rss_peak(tmp_path, monkeypatch):
    """A step whose forward holds 256 MiB that is freed before the optimizer step: the RSS at the
    step's end misses it; the panel's data (what is handed to the plot) has the per-step peak."""
    import time

    from apt_model.reports import plot

    rec = StepRecorder("cpu")
    rec.install()
    try:
        p = torch.zeros(4, requires_grad=True)
        opt = torch.optim.SGD([p], lr=0.1)
        for _ in range(3):
            big = torch.ones(64 * 2**20)  # 256 MiB, touched, as activations would be
            time.sleep(0.2)  # the sampler (every 5 ms) sees it even on a busy machine
            del big
            p.grad = torch.ones(4)
            opt.step()
    finally:
        rec.remove()
    steps = rec.to_dict()
    data = plot.plot_data({"steps": steps}, losses=[(1, 3.0), (2, 2.0)], evals=[(0, 3.5), (3, 1.5)])
    peaks = dict(data["memory"]["process_rss_peak"])
    ends = dict(data["memory"]["process_rss"])
    assert sorted(peaks) == [1, 2, 3]
    assert all(peaks[s] - ends[s] > 200 * 2**20 for s in peaks), (peaks, ends)
    assert steps["memory_peak"]["process_rss_peak"] == max(peaks.values())
    assert data["loss"] == {"train": [(1, 3.0), (2, 2.0)], "held-out": [(0, 3.5), (3, 1.5)]}
    pytest.importorskip("matplotlib")
    drawn = []
    real = plot.plot_lines
    monkeypatch.setattr(plot, "plot_lines", lambda ax, series, what: (drawn.append((what, series)), real(ax, series, what)))
    from matplotlib.figure import Figure

    figures = []
    real_save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), real_save(fig, *a, **k))[1])
    plot.plot_report({"steps": steps}, tmp_path / "r.png", losses=[(1, 3.0)], evals=[(0, 3.5), (3, 1.5)])
    memory = dict(drawn)["process memory"]
    assert dict(memory["process_rss_peak"]) == peaks  # the panel plots the per-step peak
    is_png(tmp_path / "r.png")
    ticks = figures[0].axes[-1].get_xticks()
    assert all(float(t).is_integer() for t in ticks)  # optimizer steps: no 2.5, 7.5
    labels = [line.get_label() for line in figures[0].axes[-1].get_lines()]
    assert "held-out loss" in labels and "training loss" in labels
