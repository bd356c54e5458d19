"""Probe results cached on disk: keyed per device model + torch + apt_model version, atomic,
corruption-proof, switchable, never written to the real home folder, and used by the switch."""
import json
import logging
import os

import pytest
import torch
from conftest import clean_env, run_python

from apt_model.devices import capabilities, probe_cache, probes
from apt_model.errors import ConfigError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """VB_CACHE_DIR in tmp_path, HOME and XDG_CACHE_HOME in tmp_path too (a write that ignored
    VB_CACHE_DIR would land there, and the test checks it did not), empty in-memory caches."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("APT_MODEL_CACHE", raising=False)
    monkeypatch.delenv("VB_PROBE_CACHE", raising=False)
    monkeypatch.setenv("VB_CACHE_DIR", str(tmp_path / "cache"))
    capabilities.clear_capability_cache()
    yield tmp_path / "cache" / "probes"
    capabilities.clear_capability_cache()  # no fake result may outlive the test
    assert not (home / ".cache" / "apt_model").exists(), "a probe result was written under HOME"


@pytest.fixture
def fake_probes(monkeypatch):
    """Support and speed probes replaced by instant fakes that count their calls."""
    calls = {"support": 0, "speed": 0}

    def dtypes(dev, notes=None):
        calls["support"] += 1
        return {"float32": {"present": True, "storage": True, "cast": True, "matmul": True, "add": True, "errors": {}}}

    def attention(dev, width, seq, batch, reps=5, **kw):
        calls["speed"] += 1
        return {"eager_ms": 2.0, "sdpa_ms": 1.0, "speedup": 2.0, "samples": {"eager": reps, "sdpa": reps}}

    def autocast(dev, width, seq, batch, dtypes=("bfloat16",), reps=5, **kw):
        return {d: {"fp32_ms": 1.0, "autocast_ms": 4.0, "speedup": 0.25, "samples": 2, "aborted": True} for d in dtypes}

    monkeypatch.setattr(probes, "probe_dtypes", dtypes)
    monkeypatch.setattr(probes, "probe_sdpa_backends", lambda dev, notes=None: {"MATH": {"float32": "ok"}})
    monkeypatch.setattr(probes, "probe_fp8_matmul", lambda dev, notes=None: {"supported": False, "reason": "fake"})
    monkeypatch.setattr(probes, "probe_fp4_matmul", lambda dev, p, notes=None: {"hardware": False, "supported": False,
                                                                               "reason": "fake"})
    monkeypatch.setattr(probes, "probe_attention_speed", attention)
    monkeypatch.setattr(probes, "probe_autocast_speed", autocast)
    return calls


def files(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_second_process_reads_the_result_instead_of_probing(cache, fake_probes):
    first = capabilities.get_support("cpu")
    assert not first.cached and fake_probes["support"] == 1 and "written to" in first.cache
    assert files(cache) == [p.name for p in [probe_cache.entry_path(probe_cache.device_identity(torch.device("cpu"), {}),
                                                                    "support")]]
    capabilities.clear_capability_cache()  # what a new process starts with
    again = capabilities.get_support("cpu")
    assert again.cached and fake_probes["support"] == 1 and again.cache.startswith("read from")
    assert again.dtypes == first.dtypes and again.sdpa_backends == first.sdpa_backends
    assert again.probed_seconds == first.probed_seconds and again.device == "cpu"

    sp = capabilities.get_speed("cpu", width=64)
    capabilities.clear_capability_cache()
    sp2 = capabilities.get_speed("cpu", width=64)
    assert fake_probes["speed"] == 1 and sp2.cached and sp2.attention == sp.attention and sp2.autocast == sp.autocast
    capabilities.get_speed("cpu", width=128)  # another width: another entry, probed
    assert fake_probes["speed"] == 2 and len(files(cache)) == 3
    assert not [n for n in files(cache) if n.startswith(".tmp")]  # no temporary file left behind


def test_cache_folder_order(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("VB_CACHE_DIR", "APT_MODEL_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    assert probe_cache.cache_dir() == tmp_path / "home" / ".cache" / "apt_model" / "probes"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert probe_cache.cache_dir() == tmp_path / "xdg" / "apt_model" / "probes"
    monkeypatch.setenv("APT_MODEL_CACHE", str(tmp_path / "apt"))
    assert probe_cache.cache_dir() == tmp_path / "apt" / "probes"
    monkeypatch.setenv("VB_CACHE_DIR", str(tmp_path / "vb"))
    assert probe_cache.cache_dir() == tmp_path / "vb" / "probes"


@pytest.mark.parametrize("change", ["torch", "apt_model"])
def test_a_new_torch_or_apt_model_version_invalidates_the_result(cache, fake_probes, monkeypatch, change):
    capabilities.get_support("cpu")
    (path,) = [cache / n for n in files(cache)]
    capabilities.clear_capability_cache()
    if change == "torch":
        monkeypatch.setattr(torch, "__version__", "99.0.0")
    else:
        from apt_model.base import version

        monkeypatch.setattr(version, "__version__", "99.0.0")
    sup = capabilities.get_support("cpu")
    assert not sup.cached and fake_probes["support"] == 2 and "stale" in sup.cache
    assert files(cache) == [path.name]  # overwritten in place, not piled up
    assert json.loads(path.read_text())["software"][change] == "99.0.0"


def test_another_device_model_has_its_own_entry(cache, fake_probes, monkeypatch):
    capabilities.get_support("cpu")
    ident = probe_cache.device_identity(torch.device("cpu"), {})
    monkeypatch.setattr(probe_cache, "_cpu_identity", lambda: dict(ident, name="Another CPU", isa="0" * 16))
    capabilities.clear_capability_cache()
    assert not capabilities.get_support("cpu").cached and fake_probes["support"] == 2
    assert len(files(cache)) == 2


def test_accelerator_identity_ignores_the_index_and_needs_a_name():
    props = {"name": "NVIDIA H100 80GB HBM3", "major": 9, "minor": 0, "total_memory": 85e9,
             "multi_processor_count": 132, "uuid": "GPU-1234"}
    a = probe_cache.device_identity(torch.device("cuda", 0), props)
    b = probe_cache.device_identity(torch.device("cuda", 3), props)
    assert a == b and a["capability"] == "9.0" and "uuid" not in a
    assert probe_cache.device_identity(torch.device("cuda", 0), dict(props, major=10)) != a
    assert probe_cache.device_identity(torch.device("meta"), {}) is None


@pytest.mark.parametrize("content", ["{not json", "[]", '{"format": "something else", "data": {}}', "wrong-shape"])
def test_a_corrupt_file_is_ignored_logged_and_rewritten(cache, fake_probes, caplog, content):
    ident = probe_cache.device_identity(torch.device("cpu"), {})
    path = probe_cache.entry_path(ident, "support")
    path.parent.mkdir(parents=True)
    if content == "wrong-shape":  # a well-formed record for this machine whose data does not fit Support
        probe_cache.store(ident, "support", {"dtypes": "not a dict"})
    else:
        path.write_text(content)
    with caplog.at_level(logging.DEBUG, logger="apt_model.devices"):
        sup = capabilities.get_support("cpu")
    assert not sup.cached and fake_probes["support"] == 1 and "float32" in sup.dtypes
    assert any(r.levelno == logging.DEBUG and ("corrupt" in r.getMessage() or "wrong shape" in r.getMessage())
               for r in caplog.records)
    data, why = probe_cache.load(ident, "support")
    assert data is not None and data["dtypes"] == sup.dtypes  # rewritten with the fresh result


def test_the_cache_can_be_turned_off_or_refreshed(cache, fake_probes, monkeypatch):
    monkeypatch.setenv("VB_PROBE_CACHE", "0")
    sup = capabilities.get_support("cpu")
    assert sup.cache.startswith("off") and files(cache) == []
    monkeypatch.setenv("VB_PROBE_CACHE", "1")
    capabilities.clear_capability_cache()
    capabilities.get_support("cpu")
    assert fake_probes["support"] == 2 and len(files(cache)) == 1
    monkeypatch.setenv("VB_PROBE_CACHE", "refresh")
    capabilities.clear_capability_cache()
    sup = capabilities.get_support("cpu")
    assert not sup.cached and fake_probes["support"] == 3 and "written to" in sup.cache
    monkeypatch.setenv("VB_PROBE_CACHE", "sometimes")
    capabilities.clear_capability_cache()
    with pytest.raises(ConfigError, match="VB_PROBE_CACHE"):
        capabilities.get_support("cpu")


def test_a_failed_write_leaves_no_file_and_no_crash(cache, fake_probes, monkeypatch):
    def no_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(probe_cache.os, "replace", no_replace)
    sup = capabilities.get_support("cpu")
    assert "not written" in sup.cache and "No space left" in sup.cache and "float32" in sup.dtypes
    assert files(cache) == []  # neither the entry nor the temporary file


def test_an_unusable_cache_folder_is_no_crash(cache, fake_probes, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("VB_CACHE_DIR", str(blocker))
    sup = capabilities.get_support("cpu")
    assert "not written" in sup.cache and fake_probes["support"] == 1
    capabilities.clear_capability_cache()
    assert not capabilities.get_support("cpu").cached and fake_probes["support"] == 2


SWITCH_SCRIPT = r"""
import json, os
import torch
import apt_model.optimization.vb_global as vb
from apt_model.devices import probes
from apt_model.models.gpt import GPT, GPTConfig

calls = []
for name in ("probe_dtypes", "probe_sdpa_backends", "probe_fp8_matmul", "probe_fp4_matmul",
             "probe_attention_speed", "probe_autocast_speed"):
    real = getattr(probes, name)
    def counted(*a, _real=real, _name=name, **k):
        calls.append(_name)
        return _real(*a, **k)
    setattr(probes, name, counted)
vb.enable("balanced", banner=False)
torch.manual_seed(0)
model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=1, n_heads=2, attn_implementation="eager")).to(vb.device())
rep = vb.get_report()
caps = rep["capabilities"]
feats = rep["models"][0]["features"]
print(json.dumps({
    "calls": calls,
    "cached": [r["cached"] for r in caps["support"].values()] + [r["cached"] for r in caps["speed"].values()],
    "speed": [{k: r[k] for k in ("attention", "autocast", "probed_seconds")} for r in caps["speed"].values()],
    "chosen": [feats["attention"]["chosen"], feats["mixed_precision"]["chosen"]],
    "probe_seconds": rep["stats"]["probe_seconds"],
}))
"""


@pytest.mark.slow  # 11 s: two fresh interpreters running the switch
def test_the_switch_in_a_fresh_process_uses_the_cached_result(tmp_path):
    """Two processes, one cache folder: the first probes and writes, the second probes nothing
    (no probe function is called) and decides the same way from the cached figures."""
    env = clean_env(VB_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    env.pop("VB_PROBE_CACHE", None)
    env.pop("XDG_CACHE_HOME", None)
    env.pop("APT_MODEL_CACHE", None)
    runs = []
    for _ in range(2):
        proc = run_python(SWITCH_SCRIPT, env=env)
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["cached"] == [False, False] and "probe_attention_speed" in first["calls"]
    assert second["calls"] == [] and second["cached"] == [True, True]
    assert second["speed"] == first["speed"] and second["chosen"] == first["chosen"]
    assert len(os.listdir(tmp_path / "cache" / "probes")) == 2
    assert not (tmp_path / "home" / ".cache" / "apt_model").exists()


def test_a_failed_speed_probe_is_not_written_for_later_processes(cache, fake_probes, monkeypatch):
    """A timing that failed is this moment's: the next process probes again."""
    monkeypatch.setattr(probes, "probe_attention_speed", lambda *a, **k: {"error": "RuntimeError: out of memory"})
    sp = capabilities.get_speed("cpu", width=64)
    assert "not cached: attention: RuntimeError: out of memory" in sp.cache, sp.cache
    assert not [n for n in files(cache) if "speed" in n]
    capabilities.clear_capability_cache()
    monkeypatch.setattr(probes, "probe_attention_speed", lambda *a, **k: fake_probes.__setitem__("speed", 9) or
                        {"eager_ms": 2.0, "sdpa_ms": 1.0, "speedup": 2.0, "samples": {"eager": 3, "sdpa": 3}})
    assert capabilities.get_speed("cpu", width=64).attention["speedup"] == 2.0 and fake_probes["speed"] == 9


@pytest.mark.parametrize("caller", ["no_grad", "inference_mode"])
def test_probes_run_as_from_a_training_script_whatever_the_callers_mode(cache, monkeypatch, caller):
    """A model's first call under ``no_grad`` / ``inference_mode`` (an evaluation before training):
    the real speed probes still time forward + backward (they failed with "element 0 of tensors
    does not require grad", and the failure was cached)."""
    monkeypatch.setenv("VB_PROBE_CACHE", "off")
    with torch.no_grad() if caller == "no_grad" else torch.inference_mode():
        sp = capabilities.get_speed("cpu", width=64)
        assert not torch.is_grad_enabled()  # the caller's mode is back
    assert "error" not in sp.attention and sp.attention["speedup"] > 0, sp.attention
    assert all("error" not in r for r in sp.autocast.values()), sp.autocast


def test_probes_leave_the_scripts_random_numbers_alone(cache, monkeypatch):
    """The speed probes run at a model's first call, after the script seeded: their inputs and
    block initialization drew from the global generator, so on a machine's first run (empty probe
    cache) every later dropout mask differed from plain PyTorch."""
    monkeypatch.setenv("VB_PROBE_CACHE", "off")
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    capabilities.get_support("cpu")
    sp = capabilities.get_speed("cpu", width=64)
    assert "error" not in sp.attention  # the probes did run
    assert torch.equal(torch.random.get_rng_state(), before)
