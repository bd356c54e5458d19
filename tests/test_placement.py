"""The placement rule: the switch never moves a model; a device mismatch inside an adopted model's
forward keeps its exception and gains one line naming the model's device and the fix."""
import traceback

import pytest
import torch
import torch.nn as nn

import apt_model.optimization.vb_global as vb
import apt_model.switch.placement as placement
from apt_model.base.patches import SessionHook
from apt_model.switch.placement import DeviceMismatchHint, mismatch_hint


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.fixture
def accelerator_seen(monkeypatch):
    """An accelerator present (mocked at the boundary the switch asks): the hint is attached to CPU
    models too, and a ``meta`` input stands for a tensor on another device."""
    monkeypatch.setattr(placement, "accelerator_present", lambda: True)


def _hints(model: nn.Module) -> int:
    return sum(isinstance(h, SessionHook) and isinstance(h.fn, DeviceMismatchHint) for h in model._forward_hooks.values())


def test_a_device_mismatch_in_an_adopted_model_names_its_device_and_the_fix(cpu_device, accelerator_seen):
    vb.enable("balanced", banner=False)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).to(vb.device())
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8, device="meta"))  # inputs on another device than the model's
    text = _text(info.value)
    assert "is not on the expected device" in text  # PyTorch's own message is kept
    assert mismatch_hint("cpu") in text and text.count("apt_model: this model") == 1
    assert model(torch.randn(2, 8)).shape == (2, 8)  # the model itself still works
    place = vb.get_report()["models"][0]["features"]["placement"]
    assert place["chosen"] == "cpu" and place["reason"].startswith("moved by the script")


def test_other_errors_are_untouched_and_the_hint_goes_with_disable(cpu_device, accelerator_seen):
    vb.enable("balanced", banner=False)
    model = nn.Linear(8, 8).to(vb.device())
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 7))  # a shape error, not a device error
    assert "apt_model:" not in _text(info.value)
    vb.disable()
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8, device="meta"))
    assert "apt_model:" not in _text(info.value)


def test_an_inner_adopted_model_and_the_outer_one_add_one_line_between_them(cpu_device, accelerator_seen):
    vb.enable("balanced", banner=False)
    inner = nn.Linear(8, 8)
    vb.adopt(inner)
    outer = nn.Sequential(inner, nn.ReLU())
    vb.adopt(outer)
    with pytest.raises(RuntimeError) as info:
        outer(torch.randn(2, 8, device="meta"))
    assert _text(info.value).count("apt_model: this model") == 1


def test_no_hint_hook_for_a_cpu_model_where_no_accelerator_is_present(cpu_device, monkeypatch):
    """With the CPU selected and no accelerator, every tensor a script builds is on the CPU: the hint
    could not help, and its forward hook would cost every call of the model PyTorch's hook path."""
    monkeypatch.setattr(placement, "accelerator_present", lambda: False)
    vb.enable("balanced", banner=False)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model(torch.randn(2, 8))
    assert vb.get_stats()["adopted_models"] == 1 and _hints(model) == 0
    place = vb.get_report()["models"][0]["features"]["placement"]
    assert place["chosen"] == "cpu"  # the placement is still recorded
    monkeypatch.setattr(placement, "accelerator_present", lambda: True)
    other = nn.Linear(8, 8)
    other(torch.randn(2, 8))
    assert _hints(other) == 1


def test_hint_useful_names_where_the_hint_is_attached(monkeypatch):
    cpu, meta = torch.device("cpu"), torch.device("meta")
    monkeypatch.setattr(placement, "accelerator_present", lambda: False)
    assert not placement.hint_useful(cpu, cpu)
    assert placement.hint_useful(meta, cpu) and placement.hint_useful(cpu, meta)
    monkeypatch.setattr(placement, "accelerator_present", lambda: True)
    assert placement.hint_useful(cpu, cpu)


from conftest import needs_accelerator  # noqa: E402


@pytest.mark.gpu
@needs_accelerator
def test_cpu_inputs_to_a_model_on_the_accelerator_get_the_hint():
    vb.enable("balanced", banner=False)
    model = nn.Linear(8, 8).to(vb.device())
    assert vb.device().type != "cpu"
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8))
    assert mismatch_hint(next(model.parameters()).device) in _text(info.value)
