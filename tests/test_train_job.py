"""The main job, run for real on short schedules."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from apt_model.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


def load_train():
    spec = importlib.util.spec_from_file_location("apt_train", ROOT / "training" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_short_run_learns_and_writes_checkpoint_and_report(tmp_path):
    train = load_train()
    rep = train.main(["--steps", "30", "--eval-every", "15", "--max-bytes", "1000000", "--quiet",
                      "--threads", "2", "--out", str(tmp_path)])
    assert rep["eval"][0][0] == 0 and rep["eval"][-1][0] == 30
    assert rep["eval_drop"] >= 0.30, rep["eval"]  # held-out loss falls by at least 30% (0.49 seen at 30 steps)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["vb"]["config"]["mode"] == "balanced"
    assert saved["vb"]["models"][0]["features"]["attention"]["chosen"] in ("sdpa", "as written")
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    model = GPT(GPTConfig(**ckpt["model_config"]["config"]))
    model.load_state_dict(ckpt["model"])
    assert ckpt["step"] == 30 and len(ckpt["optimizer"]["state"]) > 0


@pytest.mark.slow  # two subprocess runs of the main job; the default suite's 15-minute budget on 2 cores
def test_off_and_balanced_start_from_the_same_place(tmp_path):
    train = load_train()
    common = ["--steps", "3", "--eval-every", "3", "--max-bytes", "500000", "--quiet"]
    off = train.main(common + ["--vb-mode", "off", "--out", str(tmp_path / "off")])
    on = train.main(common + ["--vb-mode", "balanced", "--out", str(tmp_path / "on")])
    assert off["vb"] is None and on["vb"] is not None
    for rep, sub in ((off, "off"), (on, "on")):  # per-step time and memory, with the switch or without
        assert rep["steps"]["count"] == 3 and len(rep["steps"]["records"]) == 3
        if importlib.util.find_spec("matplotlib"):
            assert (tmp_path / sub / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert abs(off["eval"][0][1] - on["eval"][0][1]) < 1e-3  # same init, same held-out batches
    assert abs(off["losses"][0][1] - on["losses"][0][1]) < 5e-2


@pytest.mark.slow  # the main job on the KJV corpus; the default suite's 15-minute budget on 2 cores
def test_kjv_corpus(shared_data, tmp_path):
    rep = load_train().main(["--data", str(shared_data / "kjv.txt"), "--steps", "20", "--eval-every", "20",
                             "--quiet", "--out", str(tmp_path)])
    assert rep["corpus"]["source"].endswith("kjv.txt") and rep["eval"][-1][1] < rep["eval"][0][1]


@pytest.mark.slow
def test_default_run_meets_the_acceptance_target(tmp_path):
    rep = load_train().main(["--quiet", "--out", str(tmp_path)])
    assert rep["eval_drop"] >= 0.30


@pytest.mark.parametrize("preset,budget,steps", [
    ("tiny", "1MB", 4),  # the smallest working set (AdamW's step of a 256 KiB weight) is 1 MiB
    pytest.param("medium", "256MB", 3, marks=pytest.mark.slow),
])
def test_out_of_core_training_has_the_in_memory_losses(preset, budget, steps, tmp_path, monkeypatch):
    """The main job with a level-0 budget far below its training state: same losses as in memory,
    and the state really left level 0 for the level below it — the swap files on a CPU-only run,
    the (pinned) host level on an accelerator, where host RAM can hold it all and no byte needs
    to reach the disk."""
    monkeypatch.setenv("VB_MIXED_PRECISION", "off")  # autocast's trial is timing-dependent; keep numerics fixed
    train = load_train()
    common = ["--model-size", preset, "--steps", str(steps), "--eval-every", str(steps), "--batch-size", "4",
              "--seq-len", "64", "--max-bytes", "300000", "--quiet", "--swap-dir", str(tmp_path)]
    mem = train.main(common + ["--paging", "off", "--out", str(tmp_path / "mem")])
    paged = train.main(common + ["--device-budget", budget, "--out", str(tmp_path / "paged")])
    assert paged["vb"]["models"][0]["features"]["paging"]["chosen"] == "paged"
    assert paged["losses"] == mem["losses"] and paged["eval"] == mem["eval"]
    levels = paged["vb"]["stats"]["levels"]
    below = levels[1]
    assert below["kind"] == ("nvme" if levels[0]["kind"] == "host" else "host")
    assert below["bytes_in"] > 0 and levels[0]["misses"] > 0
    largest = paged["vb"]["memory"]["paging"]["pager"]["largest_page"]
    assert levels[0]["peak_resident"] <= levels[0]["capacity"] + largest  # the budget is held
