"""The on-line autocast trial: schedule, verdict, and its effect on a real training loop."""
import pytest
import torch
import torch.nn.functional as F

import apt_model.optimization.vb_global as vb
from apt_model.models.gpt import GPT, GPTConfig
from apt_model.precision.trial import SpeedTrial


def test_schedule_skips_warms_up_then_abba():
    t = SpeedTrial(calls=8, skip=3)
    assert t.schedule == [True] * 3 + [True, False] + [True, False, False, True] * 2
    assert SpeedTrial(calls=0).verdict is True and not SpeedTrial(calls=0).running
    for bad in (dict(calls=3), dict(calls=-2), dict(min_speedup=0), dict(skip=-1)):
        with pytest.raises(ValueError):
            SpeedTrial(**bad)


@pytest.mark.parametrize("on_s,off_s,keep", [(1.0, 2.0, True), (1.0, 1.02, False), (2.0, 1.0, False)])
def test_verdict_from_medians(on_s, off_s, keep):
    t = SpeedTrial(calls=8, min_speedup=1.05, skip=2)
    verdict = None
    for i in range(len(t.schedule)):
        setting = t.next_setting()
        # the untimed calls are absurdly slow: they must not count
        seconds = 100.0 if i < t.untimed else (on_s if setting else off_s)
        verdict = t.record(seconds)
        if i < len(t.schedule) - 1:
            assert verdict is None
    assert verdict is keep and t.verdict is keep
    s = t.summary()
    assert s["calls"] == 8 and s["on_ms"] == 1e3 * on_s and s["off_ms"] == 1e3 * off_s


def _train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        loss = F.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=16, d_model=64, n_layers=1, n_heads=2, attn_implementation="sdpa"))


def test_trial_turns_autocast_off_on_a_real_loop_and_the_model_is_fp32_again():
    model = _gpt()
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, autocast_trial_min_speedup=99.0,
              banner=False)
    model.to("cpu")
    hooks = model._vb_autocast
    assert hooks.trial.running
    n = len(hooks.trial.schedule)
    _train(model, n - 1)
    assert hooks.trial.running and hooks.active  # the last call's backward decides
    _train(model, 1)
    assert not hooks.trial.running and hooks.active is False
    feat = vb.get_report()["models"][0]["features"]["mixed_precision"]
    assert feat["chosen"] == "fp32" and feat["reason"].startswith("turned off after the trial")
    assert feat["trial"]["calls"] == 4
    model.eval()
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        out = model(x)
    vb.disable()
    with torch.no_grad():
        assert torch.equal(model(x), out)  # no autocast any more: plain fp32 results
    assert vb.get_stats()["autocast_models"] == 0


def test_trial_keeps_autocast_when_it_wins():
    model = _gpt()
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=4, autocast_trial_min_speedup=0.01,
              banner=False)
    model.to("cpu")
    _train(model, len(model._vb_autocast.trial.schedule))
    feat = vb.get_report()["models"][0]["features"]["mixed_precision"]
    assert feat["chosen"] == "bf16" and feat["reason"].startswith("kept after the trial")
    assert model._vb_autocast.active


def test_eval_calls_do_not_count_and_do_not_block_the_trial():
    model = _gpt()
    vb.enable("balanced", autocast_min_speedup=0.01, autocast_trial_calls=2, banner=False)
    model.to("cpu")
    trial = model._vb_autocast.trial
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 16)))
    assert trial.index == 0
    model(torch.randint(0, 256, (1, 16)))  # a training-mode forward never followed by backward
    assert trial.index == 0
    _train(model, len(trial.schedule))
    assert not trial.running


def test_invalid_trial_settings():
    from apt_model.errors import ConfigError

    with pytest.raises(ConfigError, match="autocast_trial_calls=3 must be an even int"):
        vb.enable(autocast_trial_calls=3)
