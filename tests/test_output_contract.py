"""Output as a contract: the enable banner (short and long, once per job, rank 0 only), the
``print_stats`` columns, the main job's last lines (tokens/s per rank, why no PNG, shared cores),
the bench footer's noise marks, and no stale swap folders after a two-rank run."""
import json
import re
import subprocess
import sys

import pytest

import apt_model.optimization.vb_global as vb
from apt_model.switch.modes import FEATURES
from conftest import ROOT, clean_env, run_python

FEATURE_NAMES = list(FEATURES)


def banner_of(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def feature_line(lines: list[str], name: str) -> str:
    found = [line for line in lines if line.split()[:1] == [name]]
    assert len(found) == 1, lines
    return found[0]


@pytest.mark.parametrize("mode", ["performance", "balanced", "memory", "full"])
def test_short_banner_is_a_header_and_one_line_per_feature(mode, capsys, cpu_device):
    vb.enable(mode)
    lines = banner_of(capsys)
    assert len(lines) == 1 + len(FEATURE_NAMES), lines
    assert lines[0].startswith("Virtual Blackwell ") and f"mode={mode}, device=cpu" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == FEATURE_NAMES
    text = "\n".join(lines)
    # the long form's material stays out: no candidate list of absent device kinds, no descriptions
    assert "not_installed" not in text and "ranked higher" not in text and "(from mode:" not in text
    # no feature claims a bare "on": every requested one says what decides it
    assert "decided per model on the device's probes" not in text
    paging = feature_line(lines, "paging")
    assert "by budget" in paging and "(level 0)" in paging  # paging is decided by the level-0 budget
    fp4 = feature_line(lines, "fp4")
    if mode == "balanced":
        assert fp4.split()[1:] == ["off", "off"]
    elif mode == "memory":  # storage: only frozen layers, so the main job's model (all trainable) is unchanged
        assert "frozen nn.Linear" in fp4 and "no frozen layer is unchanged" in fp4
    elif mode == "performance":  # native only, and the CPU has no FP4 matmul: nothing converts
        assert "cpu has no FP4 matmul: no layer changes" in fp4
    else:
        assert "frozen nn.Linear" in fp4 and "cpu has no FP4 matmul" in fp4
    offload = feature_line(lines, "activation_offload")
    assert ("go to host/swap" in offload) == (mode in ("memory", "full"))


def test_long_banner_with_verbose(capsys, cpu_device):
    vb.enable("balanced", verbose=True, device_budget="256MB")
    out = capsys.readouterr().out
    assert "device: VB_DEVICE asked for the CPU" in out  # the device choice in full
    assert "(from mode:balanced)" in out and "setting device_budget = '256MB' (from argument)" in out
    assert "configuration files: none" in out and "vb.print_stats()" in out
    assert "training state paged only if over 244.1MiB (level 0)" in out  # the budget given, in the paging line


@pytest.mark.slow  # a subprocess; the default suite's 15-minute budget on 2 cores
def test_long_banner_with_vb_log_level_info():
    """VB_LOG_LEVEL=INFO at import gives the long banner; the default (WARNING) the short one."""
    code = "import apt_model"
    env = clean_env(ENABLE_VIRTUAL_BLACKWELL="1", VB_MODE="memory", VB_DEVICE="cpu")
    short = run_python(code, env=env)
    long = run_python(code, env={**env, "VB_LOG_LEVEL": "INFO"})
    assert short.returncode == 0 and long.returncode == 0, short.stderr + long.stderr
    assert len(short.stdout.strip().splitlines()) == 1 + len(FEATURE_NAMES)
    assert len(long.stdout.strip().splitlines()) > 2 * len(FEATURE_NAMES)
    assert "(from environment:VB_MODE)" not in long.stdout and "mode from: environment:VB_MODE" in long.stdout


def test_banner_once_per_process_and_reconfiguration_shows_what_changed(capsys, cpu_device, monkeypatch):
    # the paging line shows the level-0 budget, by default a share of the memory available at that
    # moment: a fixed one keeps the host's other activity out of what "changed" means here
    monkeypatch.setenv("VB_DEVICE_BUDGET", "8GB")
    vb.enable("balanced")
    assert len(banner_of(capsys)) == 1 + len(FEATURE_NAMES)
    vb.enable("balanced")  # the same again (as the main job after ENABLE_VIRTUAL_BLACKWELL=1): silent
    assert banner_of(capsys) == []
    vb.enable("balanced", activation_offload=True)
    lines = banner_of(capsys)
    assert lines[0].startswith("Virtual Blackwell ") and " reconfigured: mode=balanced" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["activation_offload"]
    vb.disable()  # a user's disable(): the next enable() prints the whole banner again
    vb.enable("balanced")
    assert len(banner_of(capsys)) == 1 + len(FEATURE_NAMES)
    vb.enable("balanced", banner=False, mixed_precision="off")
    assert banner_of(capsys) == []


def test_banner_is_left_to_rank_0(monkeypatch, capsys, cpu_device):
    launch = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for k, v in launch.items():
        monkeypatch.setenv(k, v)
    vb.enable("balanced", distributed="off")
    assert banner_of(capsys) == []
    vb.disable()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    vb.enable("balanced", distributed="off")
    lines = banner_of(capsys)
    assert len(lines) == 1 + len(FEATURE_NAMES) and "2 ranks sharing the CPU" in lines[0]


def test_banner_is_left_to_the_parent_in_a_spawned_worker_reimporting_the_script(capsys, cpu_device):
    """A ``spawn`` DataLoader worker imports the parent's script again as ``__mp_main__``; its
    top-level ``vb.enable()`` (or ``import apt_model`` under ENABLE_VIRTUAL_BLACKWELL=1) printed the
    banner once per worker (five banners for two epochs of two workers). Built here as the worker
    does it: the script's module code run as ``__mp_main__``. A function called later in such a
    child (a ``torch.multiprocessing.spawn`` rank) still prints it."""
    import types

    script = types.ModuleType("__mp_main__")  # run under that name (sys.modules gets it only afterwards)
    code = "import apt_model.optimization.vb_global as vb\nvb.enable('balanced', banner=True)\n"
    exec(compile(code, "train.py", "exec"), script.__dict__)
    assert vb.is_enabled() and "Virtual Blackwell" not in capsys.readouterr().out
    vb.disable()
    exec(compile("def rank_fn():\n    vb.enable('balanced', banner=True)\n", "train.py", "exec"), script.__dict__)
    script.rank_fn()
    assert "Virtual Blackwell" in capsys.readouterr().out


def test_two_rank_main_job_prints_one_banner_labels_tokens_per_rank_and_leaves_no_swap_folders(tmp_path):
    """torchrun --nproc_per_node=2 training/train.py: one banner (rank 0), the last line's tokens/s
    labelled per rank with the job's total, and nothing left under the swap root."""
    swap = tmp_path / "swap"
    swap.mkdir()
    env = clean_env(VB_DEVICE="cpu", CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                    VB_SWAP_DIR=str(swap))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "training" / "train.py"), "--steps", "3", "--eval-every", "3", "--eval-batches", "1",
           "--batch-size", "2", "--max-bytes", "200000", "--plot", "off", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("Virtual Blackwell ") == 1, proc.stdout
    last = [line for line in proc.stdout.splitlines() if line.startswith("held-out loss")]
    assert len(last) == 1 and "tokens/s per rank (rank 0 of 2)" in last[0] and "tokens/s for the job" in last[0]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["world_size"] == 2 and rep["throughput"]["tokens_per_s_job"] > rep["throughput"]["tokens_per_s_median"]
    assert list(swap.iterdir()) == []  # neither the rank folders nor the swap folders inside them remain


def test_rank_swap_folder_is_removed_at_disable(monkeypatch, tmp_path, cpu_device):
    from apt_model.distributed.session import rank_folder_name

    for k, v in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    vb.enable("balanced", banner=False, distributed="off", swap_dir=str(tmp_path))
    folder = tmp_path / rank_folder_name(1)
    assert folder.is_dir() and len(list(folder.iterdir())) == 1  # the stack's own folder inside
    vb.disable()
    assert not folder.exists()
    folder.mkdir()  # a folder that was there before (another job's) is left alone
    (folder / "other").mkdir()
    vb.enable("balanced", banner=False, distributed="off", swap_dir=str(tmp_path))
    vb.disable()
    assert [p.name for p in folder.iterdir()] == ["other"]


def test_print_stats_columns_fit_and_do_not_repeat_the_choice(capsys, cpu_device):
    import torch

    vb.enable("balanced", banner=False, mixed_precision="off")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).to("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    capsys.readouterr()
    vb.print_stats()
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.split()[:1] == ["distributed"])
    assert "single process single process" not in line and re.search(r"single process +no launcher", line)
    rows = [line for line in out.splitlines() if line.startswith("    ")]
    starts = {line.index(line.split()[1], len(line.split()[0]) + 4) for line in rows}
    assert len(starts) == 1  # every chosen value starts in the same column


def test_bench_footer_counts_only_marked_results():
    from apt_model.bench.suite import NOISY, format_table

    def rate(noisy):
        return {"group": "gemm", "unit": "GFLOP/s", "median": 100.0, "p25": 60.0 if noisy else 99.0, "p75": 120.0,
                "n": 5, "spread": 0.6 if noisy else 0.02, "noisy": noisy}

    att = {"group": "attention", "unit": "ms", "sdpa": {"median": 1.0, "p25": 0.5, "p75": 2.0, "n": 5},
           "plain": {"median": 2.0, "p25": 1.9, "p75": 2.1, "n": 5}, "speedup": 2.0, "spread": 1.5, "noisy": True}
    disk = {"group": "disk", "unit": "GB/s", "folder": "/tmp", "write": {"median": 1.0, "p25": 0.5, "p75": 1.5, "n": 3},
            "read": {"median": 1.0, "p25": 0.9, "p75": 1.1, "n": 3}, "spread": 1.0, "noisy": True}
    result = {"machine": {"cpu": "test CPU", "torch": "x"}, "elapsed_s": 1.0,
              "settings": {"threads": 1, "duration_s": 1.0},
              "devices": {"cpu": {"name": "test CPU", "cases": {"gemm a": rate(True), "gemm b": rate(False),
                                                              "attention": att}}},
              "disk": disk, "noise": {"note": f"3 result(s) with an interquartile range over {int(NOISY * 100)}% of the median"}}
    table = format_table(result).splitlines()
    marked = [line for line in table[2:-1] if line.rstrip().endswith(" ~")]
    assert len(marked) == 3, table  # gemm a, attention and disk: as many as the footer counts


def run_main_job(capsys, tmp_path, *extra):
    sys.path.insert(0, str(ROOT / "training"))
    try:
        import train
    finally:
        sys.path.pop(0)
    report = train.main(["--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "2",
                         "--max-bytes", "200000", "--threads", "1", "--vb-mode", "off", "--out", str(tmp_path), *extra])
    return report, capsys.readouterr().out


def test_main_job_says_why_there_is_no_png(capsys, tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg",
                 "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)  # as if the plot extra were not installed
    _, out = run_main_job(capsys, tmp_path)
    lines = out.strip().splitlines()
    why = [line for line in lines if line.startswith("no report.png")]
    assert len(why) == 1 and why[0].startswith("no report.png: matplotlib is not installed") and "apt_model[plot]" in why[0]
    assert lines.index(why[0]) == lines.index(next(line for line in lines if line.startswith("held-out loss"))) + 1
    assert not (tmp_path / "report.png").exists()


def test_main_job_says_when_the_cores_look_shared(capsys, tmp_path, monkeypatch):
    from apt_model.bench import contention

    monkeypatch.setattr(contention, "_load", lambda: 8.0)  # a busy machine, as os.getloadavg would say
    monkeypatch.setattr(contention, "usable_cores", lambda: 2)  # on 2 cores (8.0 on 16 is room enough)
    monkeypatch.setattr(contention, "MIN_CPU_SHARE", 2.0)  # and a CPU share below it, as a shared core gives
    rep, out = run_main_job(capsys, tmp_path, "--plot", "off")
    notes = [line for line in out.splitlines() if line.startswith("note: the CPU cores look shared")]
    assert len(notes) == 1 and "load average 8.0" in notes[0] and "--threads 1" in notes[0]
    assert rep["contention"]["note"] and rep["contention"]["load_before"] == 8.0
    monkeypatch.setattr(contention, "_load", lambda: 0.0)
    monkeypatch.setattr(contention, "MIN_CPU_SHARE", 0.0)  # this machine's real sharing must not decide the test
    rep, out = run_main_job(capsys, tmp_path, "--plot", "off")
    assert "note:" not in out and rep["contention"]["note"] is None


def test_contention_note_rules():
    from apt_model.bench.contention import contention_note

    assert contention_note(2, 2, 0.1, 2.0, None) is None  # our own two threads in the load at the end
    assert contention_note(1, 2, 1.2, 1.9, None) is None  # one thread, one other busy core: room enough
    assert "before the run" in contention_note(2, 2, 2.0, None, None)
    assert "at the end" in contention_note(2, 2, 0.0, 4.5, None)
    note = contention_note(2, 2, 0.0, 2.0, 0.52)
    assert "got 52% of the CPU time its 2 thread(s) asked for" in note and "load average" not in note
    assert "load average 4.3" in contention_note(2, 2, 4.3, 4.4, 0.51)  # the load as context
    # measured CPU time decides: a load left by a job that just ended (the average lags) says nothing
    assert contention_note(2, 2, 1.3, 1.9, 0.99) is None
    assert contention_note(2, 2, None, None, None) is None  # nothing known: nothing said


@pytest.mark.slow  # a subprocess run of the HF main job; the default suite's 15-minute budget on 2 cores
def test_hf_main_job_prints_no_third_party_warnings(tmp_path):
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(ROOT / "training" / "train.py"), "--hf-model", "gpt2", "--steps", "1",
                           "--eval-every", "1", "--eval-batches", "1", "--batch-size", "2", "--max-bytes", "100000",
                           "--threads", "1", "--plot", "off", "--quiet", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=clean_env(VB_DEVICE="cpu"), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert noise == [], noise  # --quiet: no banner, no bar, no last line; and nothing from torchao or torch
