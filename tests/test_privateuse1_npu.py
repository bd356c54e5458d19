"""The out-of-tree device path, exercised for real on the CPU.

A PrivateUse1 backend is registered in a fresh process under the name ``npu`` (or ``mlu``) with
two devices, exactly the mechanism torch_npu / torch_mlu use. Detection, naming, ranking,
``prefer_npu``, ``VB_DEVICE=npu:1``, the communication backend and the seed-era API must all
see it as a real NPU.
"""
import json

import pytest

from conftest import clean_env, run_python

SCRIPT = r'''
import json, os, sys
import torch
import torch.utils.backend_registration as br

KIND = sys.argv[1] if len(sys.argv) > 1 else "npu"

class FakeModule(br._DummyBackendModule):
    def device_count(self):
        return 2
    def get_device_name(self, index=0):
        return f"FakeAscend-910B#{index}"
    def is_initialized(self):
        return True

br._setup_privateuseone_for_python_backend(KIND, backend_module=FakeModule())

import apt_model.optimization.vb_global as vb
from apt_model.core.system import get_device
from apt_model.devices.detection import detect_devices
from apt_model.devices.ranking import select_device
from apt_model.optimization import npu_backend as nb

out = {}
cands = {c.kind: c for c in detect_devices(refresh=True)}
c = cands[KIND]
out["status"], out["count"], out["names"], out["reason"] = c.status, c.count, list(c.names), c.reason
out["cuda_status"] = cands["cuda"].status
out["dist_backend"] = c.dist_backend
out["parsed"] = str(torch.device(f"{KIND}:1"))
out["best"] = str(select_device().device)
out["prefer"] = str(select_device(prefer=KIND).device)
out["ranking"] = list(select_device().ranking)
if KIND == "npu":
    out["get_device_prefer_npu"] = str(get_device(prefer_npu=True))
    out["manager_best_prefer_npu"] = str(nb.get_device_manager().get_best_device(prefer_npu=True))
    out["is_npu_available"] = nb.is_npu_available()
    out["accelerator_type"] = nb.get_accelerator_type()
os.environ["VB_DEVICE"] = f"{KIND}:1"
sel = select_device()
out["env_device"], out["env_dist"] = str(sel.device), sel.to_dict()["dist_backend"]
b = nb.DeviceBackend(f"{KIND}:1")
out["backend_name"] = b.get_device_name()
out["backend_count"] = b.device_count()
out["backend_total"] = b.total_memory()  # the fake has no memory API: None plus a reason, never a raise
out["backend_total_why"] = b.why("total_memory")
b.synchronize(); b.empty_cache()
vb.enable("balanced", banner=False)
out["vb_device"] = str(vb.device())
out["vb_dist"] = vb.get_report()["device"]["selection"]["dist_backend"]
print("RESULT" + json.dumps(out))
'''


def _run(kind: str) -> dict:
    """Run SCRIPT with a PrivateUse1 ``kind`` of two devices registered. A real CUDA/ROCm device is
    hidden (``CUDA_VISIBLE_DEVICES=""``): the test is of a machine whose accelerator is the ``kind``,
    and CUDA would rightly outrank it in the ranking policy."""
    env = clean_env(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    proc = run_python(SCRIPT.replace("sys.argv[1] if len(sys.argv) > 1 else \"npu\"", repr(kind)), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_privateuse1_npu_is_detected_named_ranked_and_selected():
    r = _run("npu")
    assert r["status"] == "available" and r["count"] == 2
    assert r["names"] == ["FakeAscend-910B#0", "FakeAscend-910B#1"]
    assert "found 2 device(s)" in r["reason"]
    assert r["parsed"] == "npu:1"
    assert r["best"] == "npu:0"  # NPU outranks the CPU (CUDA hidden)
    assert r["cuda_status"] != "available"
    assert r["ranking"][0] == "npu" and r["ranking"][-1] == "cpu"
    assert r["prefer"] == "npu:0"
    assert r["get_device_prefer_npu"] == "npu:0" and r["manager_best_prefer_npu"] == "npu:0"
    assert r["is_npu_available"] is True and r["accelerator_type"] == "npu"
    assert r["dist_backend"] == "hccl" and r["env_dist"] == "hccl" and r["vb_dist"] == "hccl"
    assert r["env_device"] == "npu:1"
    assert r["backend_name"] == "FakeAscend-910B#1" and r["backend_count"] == 2
    assert r["backend_total"] is None and r["backend_total_why"]
    assert r["vb_device"] == "npu:1"  # VB_DEVICE is honoured by the switch too


@pytest.mark.parametrize("kind,backend", [("mlu", "cncl")])
def test_privateuse1_mlu_uses_cncl(kind, backend):
    r = _run(kind)
    assert r["status"] == "available" and r["count"] == 2
    assert r["best"] == f"{kind}:0" and r["dist_backend"] == backend and r["env_device"] == f"{kind}:1"
