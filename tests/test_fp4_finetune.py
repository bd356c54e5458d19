"""The real check: fine-tuning on real text (KJV) with a frozen FP4 base plus low-rank adapters
tracks the same fine-tune with an fp32 base. Stated margin: final held-out loss within 2% of fp32's."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARGIN = 0.02  # relative gap of the final held-out loss to the fp32-base fine-tune


def load_job():
    spec = importlib.util.spec_from_file_location("fp4_finetune", ROOT / "training" / "fp4_finetune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check(out, variants):
    r = out["results"]
    assert set(r) == set(variants)
    for v in variants:
        assert r[v]["eval_after"] < (1 - 0.05) * r[v]["eval_before"], (v, r[v])  # the loss falls
    for v in variants:
        if v == "fp32":
            continue
        assert abs(r[v]["gap_to_fp32_rel"]) <= MARGIN, (v, r[v]["gap_to_fp32_rel"])
        assert r[v]["fp4"]["chosen"] == "storage" and r[v]["fp4"]["bytes_saved"] > 0
        assert r[v]["model_bytes"] < 0.5 * r["fp32"]["model_bytes"]  # the frozen base really shrank


def test_fp4_base_with_adapters_fine_tunes_like_fp32(shared_data):
    job = load_job()
    out = job.main(["--data", str(shared_data / "kjv.txt"), "--base-steps", "60", "--ft-steps", "40",
                    "--layers", "2", "--seq-len", "64", "--batch-size", "8", "--eval-batches", "4",
                    "--base-bytes", "1000000", "--ft-bytes", "500000", "--variants", "fp32,nvfp4", "--threads", "1",
                    "--quiet"])
    check(out, ["fp32", "nvfp4"])


@pytest.mark.slow
def test_fp4_fine_tune_full_size(shared_data):
    job = load_job()
    out = job.main(["--data", str(shared_data / "kjv.txt"), "--threads", "1", "--quiet"])
    check(out, ["fp32", "mxfp4", "nvfp4"])
