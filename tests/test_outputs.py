"""Model outputs the switch walks (apt_model/base/outputs.py): pytree containers and dataclass
fields, for the trials' backward timing and autocast's fp32 outputs."""
import collections
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from apt_model.base.outputs import output_tensors, to_fp32
from apt_model.base.patches import PatchSet
from apt_model.devices.trial import SpeedTrial
from apt_model.precision.autocast import attach_autocast


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: dict
    note: str = "x"


@dataclasses.dataclass(frozen=True)
class Frozen:
    hidden: torch.Tensor


def test_dataclass_fields_are_walked_and_converted_in_a_copy():
    a, b, c = torch.ones(2, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float16), torch.ones(1, dtype=torch.int64)
    out = (Out(a, {"b": b, "deep": Frozen(c)}), [a])
    assert [t.shape[0] for t in output_tensors(out)] == [2, 3, 1, 2]
    conv = to_fp32(out)
    assert conv[0].logits.dtype == torch.float32 and conv[0].aux["b"].dtype == torch.float32
    assert conv[0].aux["deep"].hidden.dtype == torch.int64 and conv[1][0].dtype == torch.float32
    assert conv[0].note == "x" and out[0].logits is a  # the model's own object is unchanged
    assert to_fp32(Frozen(a)).hidden.dtype == torch.float32


class DataclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        return Out(self.body(x), {})


def test_autocast_returns_fp32_fields_and_its_trial_decides_on_a_dataclass_output():
    """Before, ``out.logits`` came back bf16 and the trial found no tensor to time: it never ended."""
    torch.manual_seed(0)
    m = DataclassNet()
    patches = PatchSet()
    hooks = attach_autocast(m, "cpu", torch.bfloat16, patches, trial=SpeedTrial(calls=4, settle_max=8))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    x = torch.randn(8, 32)
    budget = hooks.trial.settle_max + 2 * hooks.trial.calls + hooks.max_lag
    steps = 0
    try:
        while hooks.trial.running:
            out = m(x)
            assert out.logits.dtype == torch.float32
            F.mse_loss(out.logits, x).backward()
            opt.step()
            opt.zero_grad()
            steps += 1
            assert steps <= budget, f"no verdict within the trial's call budget ({budget} calls)"
    finally:
        patches.restore_all()
    assert hooks.trial.index == steps


class Interruptible(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x, interrupt=False):
        y = self.lin(x)
        if interrupt:
            raise KeyboardInterrupt  # Ctrl-C in a notebook, mid-forward
        return y


def test_an_interrupted_forward_leaves_no_autocast_behind():
    """A ``KeyboardInterrupt`` skips PyTorch's always-called forward hooks: the autocast context
    stayed entered for the rest of the process (later ops, other models, after ``disable()``). Now
    the model's next call leaves it first, and restoring the patches leaves any still entered."""
    torch.manual_seed(0)
    m = Interruptible()
    patches = PatchSet()
    attach_autocast(m, "cpu", torch.bfloat16, patches)
    x = torch.randn(4, 32)
    try:
        for _ in range(2):
            try:
                m(x, interrupt=True)
            except KeyboardInterrupt:
                pass
        out = m(x)
        assert out.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        try:
            m(x, interrupt=True)
        except KeyboardInterrupt:
            pass
    finally:
        patches.restore_all()
    assert not torch.is_autocast_enabled("cpu")


def test_copies_of_an_autocast_model_run_as_written():
    """``copy.deepcopy`` (an EMA) and ``torch.save`` / ``torch.load`` of a model under autocast give
    plain fp32 models (before, they kept autocast, also after ``disable()`` and without the switch)."""
    import copy
    import io

    torch.manual_seed(0)
    m = DataclassNet()
    patches = PatchSet()
    attach_autocast(m, "cpu", torch.bfloat16, patches)
    x = torch.randn(4, 32)
    try:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        copies = [copy.deepcopy(m), torch.load(buf, weights_only=False)]
        assert not torch.equal(m(x).logits, m.body(x))  # the original runs under bf16 autocast
        for c in copies:
            assert torch.equal(c(x).logits, c.body(x))  # the copies run as written, in fp32
    finally:
        patches.restore_all()


class KwOut(dict):
    """A mapping whose ``__init__`` takes no positional argument."""

    def __init__(self, *, logits=None):
        super().__init__(logits=logits)


def test_containers_accelerate_cannot_rebuild_or_does_not_walk_come_back_fp32():
    """accelerate rebuilds a mapping with ``type(m)(dict)``: a ``defaultdict`` output raised
    ``TypeError: first argument must be callable or None``, and a mapping class with a keyword-only
    ``__init__`` raised too; ``deque`` and ``SimpleNamespace`` outputs came back bf16 (a probe's
    findings). All are converted now, in copies of their own type."""
    import collections
    import types

    a = torch.ones(2, dtype=torch.bfloat16)
    dd = collections.defaultdict(list, {"logits": a})
    got = to_fp32(dd)
    assert type(got) is collections.defaultdict and got.default_factory is list and got["logits"].dtype == torch.float32
    kw = to_fp32(KwOut(logits=a))
    assert type(kw) is KwOut and kw["logits"].dtype == torch.float32
    ns = to_fp32(types.SimpleNamespace(logits=a, n=3))
    assert type(ns) is types.SimpleNamespace and ns.logits.dtype == torch.float32 and ns.n == 3
    dq = to_fp32(collections.deque([a, 1], maxlen=5))
    assert type(dq) is collections.deque and dq[0].dtype == torch.float32 and dq[1] == 1 and dq.maxlen == 5
    assert dd["logits"] is a and KwOut(logits=a)["logits"].dtype == torch.bfloat16  # the originals unchanged


class _Tagged(dict):
    """A dict subclass output with an attribute of its own."""


class _ReadOnly(dict):
    def __setitem__(self, key, value):
        raise TypeError("read-only")

    def update(self, *args, **kwargs):
        raise TypeError("read-only")


class _Counting(dict):
    sets = 0

    def __setitem__(self, key, value):
        type(self).sets += 1
        super().__setitem__(key, value)


def test_dict_subclass_outputs_keep_their_attributes_and_are_copied_without_their_methods():
    """Under autocast: accelerate's ``type(m)(dict)`` rebuild dropped a dict subclass's own
    attributes (``out.temperature`` raised AttributeError), and the copy that followed called the
    class's ``__setitem__`` (a read-only mapping raised; a counting one counted every key twice)."""
    a = torch.ones(2, dtype=torch.bfloat16)
    tagged = _Tagged(logits=a)
    tagged.temperature = 0.7
    got = to_fp32([tagged, 3])
    assert type(got[0]) is _Tagged and got[0].temperature == 0.7 and got[0]["logits"].dtype == torch.float32
    ro = to_fp32(_ReadOnly(logits=a, aux=a))
    assert type(ro) is _ReadOnly and ro["logits"].dtype == torch.float32 and ro["aux"].dtype == torch.float32
    counting = _Counting()
    dict.update(counting, logits=a)
    out = to_fp32({"out": counting})
    assert out["out"]["logits"].dtype == torch.float32 and _Counting.sets == 0
    assert tagged["logits"] is a  # the model's own object is unchanged


class _OrderedTagged(collections.OrderedDict):
    pass


class _DefaultTagged(collections.defaultdict):
    pass


class _Slotted(dict):
    __slots__ = ("temperature",)


def test_ordered_default_and_slotted_dict_subclasses_come_back_whole():
    """The copy of a dict subclass: an OrderedDict subclass's keys() came back empty (filled with
    dict.update), a defaultdict subclass lost its default_factory, a slotted one its slot (a review
    probe's findings)."""
    a = torch.ones(2, dtype=torch.bfloat16)
    od = _OrderedTagged(z=a, loss=a)
    od.temperature = 0.7
    got = to_fp32(od)
    assert type(got) is _OrderedTagged and list(got.keys()) == ["z", "loss"] and got.temperature == 0.7
    assert [v.dtype for v in got.values()] == [torch.float32] * 2
    dd = _DefaultTagged(list, z=a)
    got = to_fp32(dd)
    assert type(got) is _DefaultTagged and got.default_factory is list and got["z"].dtype == torch.float32
    assert got["missing"] == []
    sl = _Slotted(z=a)
    sl.temperature = 0.7
    got = to_fp32(sl)
    assert type(got) is _Slotted and got.temperature == 0.7 and got["z"].dtype == torch.float32


def test_a_hugging_face_output_keeps_an_attribute_the_model_set_and_its_fields_agree():
    """A ``ModelOutput`` (a dataclass and an OrderedDict, a pytree node of its own) with an
    attribute that is not a field lost it under autocast: accelerate and the pytree rebuild it
    from its fields. Its copy converts each field once: ``out.logits is out["logits"]``."""
    from transformers.modeling_outputs import CausalLMOutput

    a = torch.ones(2, dtype=torch.bfloat16)
    out = CausalLMOutput(logits=a)
    out.extra = 0.5
    for got in (to_fp32(out), to_fp32((out, 1))[0]):
        assert type(got) is CausalLMOutput and got.extra == 0.5 and list(got.keys()) == ["logits"]
        assert got.logits.dtype == torch.float32 and got.logits is got["logits"] and got.to_tuple()[0] is got.logits
    assert out.logits is a and out["logits"] is a  # the model's own object is unchanged
    plain = to_fp32(CausalLMOutput(logits=a))  # no attribute of its own: rebuilt as before
    assert plain.logits.dtype == torch.float32 and plain.logits is plain["logits"] and not hasattr(plain, "extra")


def test_a_distribution_output_comes_back_with_fp32_parameters_in_a_copy():
    """A policy network returning ``Categorical(logits=...)`` or ``Normal(loc, scale)``: under
    the switch's autocast its parameters stayed bf16, so ``log_prob`` and ``entropy`` were bf16 (a
    probe's finding). The distribution comes back as a copy with its tensors (the values it cached
    too) in fp32; the model's own object is unchanged, and its tensors are the output's tensors."""
    logits = torch.randn(3, 4, requires_grad=True)
    made = torch.distributions.Categorical(logits=logits.bfloat16())
    _ = made.probs  # a cached value
    out = to_fp32(made)
    assert isinstance(out, torch.distributions.Categorical) and out is not made
    assert out.logits.dtype == out.probs.dtype == torch.float32 and made.logits.dtype == torch.bfloat16
    actions = torch.tensor([0, 1, 2])
    assert out.log_prob(actions).dtype == torch.float32 and out.entropy().dtype == torch.float32
    out.log_prob(actions).sum().backward()
    assert logits.grad is not None
    assert any(t is made.logits for t in output_tensors(made))
    normal = torch.distributions.Normal(torch.zeros(2, dtype=torch.bfloat16), torch.ones(2))
    assert to_fp32(normal).loc.dtype == torch.float32 and to_fp32(normal).log_prob(torch.zeros(2)).dtype == torch.float32
    plain = torch.distributions.Normal(torch.zeros(2), torch.ones(2))
    assert to_fp32(plain) is plain  # nothing to convert: the same object
    # nested ones too: Independent, SAC's tanh-squashed Normal, a mixture (a review probe's finding)
    D = torch.distributions
    half = D.Normal(torch.zeros(2, 3, dtype=torch.bfloat16), torch.ones(2, 3, dtype=torch.bfloat16))
    squashed = to_fp32(D.TransformedDistribution(half, [D.transforms.TanhTransform()]))
    assert squashed.rsample().dtype == torch.float32 and half.loc.dtype == torch.bfloat16
    assert to_fp32(D.Independent(half, 1)).mean.dtype == torch.float32
    mixture = D.MixtureSameFamily(D.Categorical(logits=torch.zeros(2, 3, dtype=torch.bfloat16)), half)
    assert to_fp32(mixture).mean.dtype == torch.float32


def test_an_action_a_returned_distribution_caches_is_left_as_returned():
    """A SAC policy returns ``(action, dist)`` with ``action = dist.rsample()`` through a
    ``TanhTransform(cache_size=1)``: ``dist.log_prob(action)`` finds the action in the transform's
    cache by identity. The fp32 copy of the action missed it and computed ``atanh`` of a
    bf16-rounded 1.0: infinite, and the policy trained to NaN (a review probe's finding). The cached
    action is returned as it is; the rest is converted."""
    D = torch.distributions
    loc = torch.full((4, 2), 6.0, dtype=torch.bfloat16)  # tanh(6) rounds to 1.0 in bf16
    dist = D.TransformedDistribution(D.Normal(loc, torch.full((4, 2), 0.1, dtype=torch.bfloat16)),
                                     [D.transforms.TanhTransform(cache_size=1)])
    action = dist.rsample()
    other = torch.ones(3, dtype=torch.bfloat16)
    got_action, got_dist, got_other = to_fp32((action, dist, other))
    assert got_action is action and got_other.dtype == torch.float32
    assert torch.isfinite(got_dist.log_prob(got_action)).all()
