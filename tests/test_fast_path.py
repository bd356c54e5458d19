"""The forward fast path: inside an adopted model's forward, after its first calls, its submodules
run without the switch's global forward pre-hook (switch/fast_path.py)."""
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.modules.module as module_mod

import apt_model.optimization.vb_global as vb
from apt_model.base.patches import PatchSet
from apt_model.switch.fast_path import WARM_CALLS, ForwardFastPath

GLOBAL_PRE = module_mod._global_forward_pre_hooks  # PyTorch's dictionary of global forward pre-hooks


class Probe(nn.Module):
    """A layer that records how many global forward pre-hooks PyTorch holds while it runs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(len(GLOBAL_PRE))
        return self.lin(x)


class Holder(nn.Module):
    """A model that calls ``side`` (a network kept outside its module tree) from its call ``start`` on."""

    def __init__(self, side: nn.Module | None = None, start: int = 1):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.probe = Probe()
        object.__setattr__(self, "side", side)  # not a submodule: not adopted with this model
        self.start, self.calls = start, 0

    def forward(self, x):
        self.calls += 1
        y = self.probe(self.lin(x))
        if self.side is not None and self.calls >= self.start:
            y = y + self.side(x)
        return y


def is_switch(fn) -> bool:
    return (getattr(fn, "__module__", "") or "").startswith("apt_model")


@pytest.fixture
def on(cpu_device):
    import torch._dynamo

    torch._dynamo.reset()  # no compiled code of earlier tests: the path starts on
    vb.enable("balanced", mixed_precision="off", banner=False)
    yield
    vb.disable()
    torch._dynamo.reset()


@pytest.fixture
def armed(on):
    """A module with state built and never called (a copy kept for later): the switch has not seen
    it, so the hook stays in place between calls, and roots step aside only during their calls."""
    kept = nn.Linear(1, 1)
    yield kept
    assert vb.get_stats()["forward_fast_path"]["pending"] >= 1 or not vb.is_enabled()


def test_after_the_warm_calls_submodules_run_without_the_global_hook(armed):
    m = Holder()
    x = torch.randn(2, 4)
    for _ in range(WARM_CALLS + 3):
        m(x)
    stats = vb.get_stats()["forward_fast_path"]
    assert m.probe.seen == [1] * WARM_CALLS + [0] * 3  # the hook was in place, then stepped aside
    assert len(GLOBAL_PRE) == 1 and is_switch(next(iter(GLOBAL_PRE.values())))  # back after each call
    assert stats["on"] and stats["calls"] == 3 and stats["ready_models"] == 1 and stats["warm_calls"] == WARM_CALLS
    decision = [d for d in vb.get_report()["decisions"] if d["feature"] == "forward_fast_path"]
    assert decision and decision[-1]["chosen"] == "on"


class EncDec(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(Probe(), nn.Linear(4, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.decoder(self.encoder(x)))


def test_parts_the_script_calls_itself_become_roots(armed):
    """``model.encoder(x)`` / ``for layer in layers``: the model itself is never called, so its
    parts (holding two modules or more) become roots after their warm calls."""
    m = EncDec().to("cpu")
    layers = nn.ModuleList([nn.Sequential(Probe(), nn.Tanh()) for _ in range(3)] + [nn.Linear(4, 4)]).to("cpu")
    x = torch.randn(2, 4)
    for _ in range(WARM_CALLS + 3):
        m.head(m.decoder(m.encoder(x)))
        y = x
        for layer in layers:
            y = layer(y)
    assert m.encoder[0].seen == [1] * WARM_CALLS + [0] * 3
    assert all(layer[0].seen == [1] * WARM_CALLS + [0] * 3 for layer in layers[:3])
    stats = vb.get_stats()["forward_fast_path"]
    assert stats["ready_models"] == 5 and stats["calls"] == 5 * 3  # encoder, decoder, 3 layers; not the leaves
    assert len(GLOBAL_PRE) == 1


def test_parts_called_inside_their_models_forward_stay_parts(armed):
    m = EncDec()
    for _ in range(WARM_CALLS + 3):
        m(torch.randn(2, 4))
    stats = vb.get_stats()["forward_fast_path"]
    assert stats["ready_models"] == 1 and stats["calls"] == 3
    assert m.encoder[0].seen == [1] * WARM_CALLS + [0] * 3


class Siamese(nn.Module):
    """Calls its encoder twice; a frozen helper (outside its module tree) is first called inside
    the encoder at the model's second call."""

    def __init__(self, helper: nn.Module):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.calls = 0
        object.__setattr__(self, "helper", helper)

    def forward(self, a, b):
        self.calls += 1
        za, zb = self.enc(a), self.enc(b)
        if self.calls >= 2:
            za = za + self.helper(a)
        return (za - zb).pow(2).sum()


def test_parts_called_twice_inside_the_adoption_call_stay_parts(armed):
    """The adoption call is a root call too: the encoder called twice inside it is not the
    script's direct call, and a helper first called inside the model's second call is adopted."""
    m = Siamese(helper=nn.Linear(4, 4))
    for _ in range(WARM_CALLS + 2):
        m(torch.randn(2, 4), torch.randn(2, 4))
    assert not any(is_switch(fn) for fn in m.enc._forward_hooks.values())
    assert vb.get_stats()["adopted_models"] == 2
    assert vb.get_stats()["forward_fast_path"]["ready_models"] == 1


def test_a_network_first_called_inside_forward_during_the_warm_calls_is_adopted(armed):
    m = Holder(side=nn.Linear(4, 4), start=1)
    for _ in range(WARM_CALLS + 2):
        m(torch.randn(2, 4))
    assert vb.get_stats()["adopted_models"] == 2


def test_a_network_first_called_inside_forward_later_is_adopted_at_its_first_call_elsewhere(armed):
    side = nn.Linear(4, 4)
    m = Holder(side=side, start=WARM_CALLS + 1)
    for _ in range(WARM_CALLS + 2):
        m(torch.randn(2, 4))
    assert vb.get_stats()["adopted_models"] == 1  # what the policy gives up (docs/architecture.md)
    side(torch.randn(2, 4))
    assert vb.get_stats()["adopted_models"] == 2


def test_an_exception_in_forward_puts_the_hook_back(armed):
    m = Holder()
    for _ in range(WARM_CALLS):
        m(torch.randn(2, 4))
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 5))  # a shape error inside the model's forward, with the hook out
    assert len(GLOBAL_PRE) == 1
    other = nn.Linear(4, 4)
    other(torch.randn(2, 4))
    assert vb.get_stats()["adopted_models"] == 2


class Interrupted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.interrupt = False

    def forward(self, x):
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt  # not an Exception: PyTorch runs no always_call hook
        return self.lin(x)


@pytest.mark.parametrize("back_by", ["optimizer step", "the model's next call"])
def test_a_forward_stopped_by_keyboard_interrupt_gets_the_hook_back(armed, back_by):
    m = Interrupted()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(WARM_CALLS):
        m(torch.randn(2, 4))
    m.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        m(torch.randn(2, 4))
    assert len(GLOBAL_PRE) == 0  # left out by the interrupted call
    if back_by == "optimizer step":
        opt.step()
    else:
        m(torch.randn(2, 4))
    assert len(GLOBAL_PRE) == 1
    nn.Linear(4, 4)(torch.randn(2, 4))
    assert vb.get_stats()["adopted_models"] == 2


def test_a_model_freed_after_an_interrupted_call_gives_the_hook_back(armed):
    """A notebook: Ctrl-C inside forward, the cell run again builds a new model (the old one is
    freed), and only evaluates: the new model is adopted at its first call."""
    import gc

    m = Interrupted()
    for _ in range(WARM_CALLS):
        m(torch.randn(2, 4))
    m.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        m(torch.randn(2, 4))
    assert vb.get_stats()["forward_fast_path"]["away"]
    del m
    gc.collect()
    assert len(GLOBAL_PRE) == 1 and not vb.get_stats()["forward_fast_path"]["away"]
    with torch.no_grad():
        Interrupted()(torch.randn(2, 4))
    assert vb.get_stats()["adopted_models"] == 2


def test_a_scripts_global_hook_keeps_the_slow_path_and_runs_at_every_module(armed):
    calls = []
    handle = nn.modules.module.register_module_forward_pre_hook(lambda mod, args: calls.append(type(mod).__name__))
    try:
        m = Holder()
        for _ in range(WARM_CALLS + 2):
            m(torch.randn(2, 4))
    finally:
        handle.remove()
    assert m.probe.seen == [2] * (WARM_CALLS + 2)
    assert calls.count("Probe") == WARM_CALLS + 2 and calls.count("Linear") == 2 * (WARM_CALLS + 2)
    assert vb.get_stats()["forward_fast_path"]["calls"] == 0


class Registers(nn.Module):
    """Registers a global forward pre-hook of the script's at its call ``at`` (inside forward)."""

    def __init__(self, at: int, calls: list):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at, self.n, self.calls, self.handle = at, 0, calls, None

    def forward(self, x):
        self.n += 1
        if self.n == self.at:
            self.handle = nn.modules.module.register_module_forward_pre_hook(
                lambda mod, args: self.calls.append(type(mod).__name__))
        return self.lin(x)


def test_a_global_hook_registered_while_the_hook_is_out_runs_after_the_switchs(armed):
    calls = []
    m = Registers(at=WARM_CALLS + 1, calls=calls)
    for _ in range(WARM_CALLS + 1):
        m(torch.randn(2, 4))
    try:
        assert len(GLOBAL_PRE) == 2
        first, second = GLOBAL_PRE.values()
        assert is_switch(first) and not is_switch(second)  # registration order, as PyTorch keeps it
        m(torch.randn(2, 4))
        # as in plain PyTorch: from the layer after its registration, then at every module
        assert calls == ["Linear", "Registers", "Linear"]
    finally:
        m.handle.remove()


def test_torch_compile_turns_it_off_without_recompiling(armed):
    import torch._dynamo.testing

    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounter()
    m = Holder()
    m.lin = torch.compile(nn.Linear(4, 4), backend=counts)  # compiled before the model's first call
    try:
        for _ in range(WARM_CALLS + 4):
            m(torch.randn(2, 4))
        stats = vb.get_stats()["forward_fast_path"]
        report = vb.get_report()["decisions"]
    finally:
        torch._dynamo.reset()
    # traced once with the hook in place; had it stepped aside after the warm calls, the compiled
    # layer's guards on the global hooks would have traced it again
    assert counts.frame_count == 1
    assert not stats["on"] and "torch.compile()" in stats["off_reason"] and stats["calls"] == 0
    assert m.probe.seen == [1] * (WARM_CALLS + 4)
    assert [d["chosen"] for d in report if d["feature"] == "forward_fast_path"] == ["on", "off"]


def test_code_compiled_before_enable_does_not_recompile(cpu_device):
    """A layer compiled before the switch was enabled (the one line added to a script that compiles
    its blocks), traced at the model's first call: Dynamo's start of compilation turns the path off
    before the trace, so the layer's guards hold (under error_on_recompile it raised)."""
    import torch._dynamo
    import torch._dynamo.testing

    torch._dynamo.reset()
    counts = torch._dynamo.testing.CompileCounter()
    m = Holder()
    m.lin = torch.compile(nn.Linear(4, 4), backend=counts)  # torch's own compile: the switch is off
    vb.enable("balanced", mixed_precision="off", banner=False)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(WARM_CALLS + 4):
                m(torch.randn(2, 4))
            m.lin(torch.randn(2, 4))  # and outside the model's forward
        stats = vb.get_stats()["forward_fast_path"]
    finally:
        vb.disable()
        torch._dynamo.reset()
    assert counts.frame_count == 1
    assert not stats["on"] and stats["off_reason"].startswith("Dynamo began compiling")


def test_a_session_starts_off_while_dynamo_holds_compiled_code(cpu_device):
    import torch._dynamo

    torch._dynamo.reset()
    f = torch.compile(lambda t: t * 2, backend="eager")
    f(torch.ones(2))
    try:
        with vb.enabled("balanced", mixed_precision="off", banner=False):
            m = Holder()
            for _ in range(WARM_CALLS + 2):
                m(torch.randn(2, 4))
            stats = vb.get_stats()["forward_fast_path"]
        assert not stats["on"] and "earlier in this process" in stats["off_reason"] and stats["calls"] == 0
        torch._dynamo.reset()  # drops every compiled frame: the next session starts on
        with vb.enabled("balanced", mixed_precision="off", banner=False):
            assert vb.get_stats()["forward_fast_path"]["on"]
    finally:
        torch._dynamo.reset()


def test_the_start_callback_is_registered_again_after_a_dynamo_reset(armed):
    """``torch._dynamo.reset()`` clears Dynamo's start callbacks; the next optimizer step registers
    the switch's again, so a layer compiled by a route the switch did not patch, traced outside the
    model's forward and then called inside it, still compiles once."""
    import torch._dynamo
    import torch._dynamo.testing

    counts = torch._dynamo.testing.CompileCounter()
    compile_ = torch._dynamo.optimize(counts)  # a route that is not torch.compile
    m = Holder()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(WARM_CALLS + 1):
        m(torch.randn(2, 4))
    torch._dynamo.reset()
    opt.step()
    m.lin = compile_(nn.Linear(4, 4))
    m.lin(torch.randn(2, 4))
    for _ in range(3):
        m(torch.randn(2, 4))
    assert counts.frame_count == 1
    assert not vb.get_stats()["forward_fast_path"]["on"]


class Disables(nn.Module):
    def __init__(self, at: int):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at, self.n = at, 0

    def forward(self, x):
        self.n += 1
        if self.n == self.at:
            vb.disable()
        return self.lin(x)


def test_disable_inside_forward_leaves_no_hook_behind(cpu_device):
    vb.enable("balanced", mixed_precision="off", banner=False)
    try:
        m = Disables(at=WARM_CALLS + 1)
        for _ in range(WARM_CALLS + 2):
            m(torch.randn(2, 4))
        assert not vb.is_enabled()
        assert not any(is_switch(fn) for fn in GLOBAL_PRE.values())
        assert not any(is_switch(fn) for fn in m._forward_hooks.values())
    finally:
        vb.disable()


def test_a_nested_adopted_model_leaves_the_hook_out_for_its_caller(armed):
    inner = Holder()
    for _ in range(WARM_CALLS + 1):
        inner(torch.randn(2, 4))  # adopted, and ready, on its own

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner
            self.after = Probe()

        def forward(self, x):
            return self.after(self.inner(x))

    outer = Outer()
    for _ in range(WARM_CALLS + 2):
        outer(torch.randn(2, 4))
    assert outer.after.seen == [1] * WARM_CALLS + [0] * 2  # the inner model's end did not put it back
    assert len(GLOBAL_PRE) == 1


# ---------------------------------------------------------------------------- quiet: out between calls
# In a fresh interpreter: a module left alive by an earlier test (the switch cannot tell it from a
# copy the script keeps) would be pending, and rightly keep the hook in place.

class BuildsInForward(nn.Module):
    """Builds a layer with parameters inside its forward, at every call (it happens)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return nn.LayerNorm(4)(self.lin(x))


QUIET_PRELUDE = """
import copy, gc
import torch, torch.nn as nn
import torch.nn.modules.module as module_mod
import apt_model.optimization.vb_global as vb

torch.set_num_threads(1)
GLOBAL_PRE = module_mod._global_forward_pre_hooks

def hook_in():
    return any((getattr(f, "__module__", "") or "").startswith("apt_model") for f in GLOBAL_PRE.values())

def fast_path():
    return vb.get_stats()["forward_fast_path"]

x = torch.randn(2, 4)
"""


def run_quiet(body: str) -> None:
    from conftest import clean_env, run_python

    classes = "\n".join(inspect.getsource(c) for c in (Probe, Holder, BuildsInForward))
    out = run_python(QUIET_PRELUDE + classes + body + "\nprint('OK')\n", env=clean_env(VB_DEVICE="cpu"))
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-2000:] + out.stderr[-3000:]


def test_with_nothing_pending_the_hook_is_out_between_calls():
    """Every module with state the switch knows of is seen: the hook stays out between calls too
    (PyTorch's hook-free path for the model, its loss module, everything), from the adoption call on."""
    run_quiet("""
vb.enable("balanced", mixed_precision="off", banner=False)
m = Holder()
loss_fn = nn.MSELoss()
for _ in range(3):
    loss_fn(m(x), x).backward()
    assert not hook_in()
s = fast_path()
assert s["quiet"] and s["away"] and s["pending"] == 0 and s["on"], s
assert m.probe.seen == [0, 0, 0], m.probe.seen
assert vb.get_stats()["adopted_models"] == 1
""")


def test_while_quiet_a_ready_root_runs_without_its_exit_hook():
    """Quiet, the ready roots' exit hooks are out of their ``_forward_hooks`` too, so a model with no
    other hook takes PyTorch's hook-free call path; they come back, in their places, when the global
    hook does (a model built), and go with disable()."""
    run_quiet("""
vb.enable("balanced", mixed_precision="off", banner=False)
m = Holder()
script_hook = m.register_forward_hook(lambda mod, a, o: None)  # registered before adoption
m(x)  # adopted: the exit hook registered after the script's hook
seen = []
late = m.register_forward_hook(lambda mod, a, o: seen.append(1))  # and this one after it
opt = torch.optim.SGD(m.parameters(), 0.1)
for _ in range(4):
    m(x).sum().backward()
    opt.step()
s = fast_path()
assert s["quiet"] and s["ready_models"] == 1, s
ours = [k for k, h in m._forward_hooks.items() if type(h).__module__.startswith("apt_model")]
assert ours == [] and len(m._forward_hooks) == 2, list(m._forward_hooks.values())
assert not any(k not in m._forward_hooks for k in m._forward_hooks_always_called)
new = nn.Linear(4, 4)  # a model built: the global hook and the exit hook come back
assert hook_in()
back = [type(h).__module__.split(".")[0] for h in m._forward_hooks.values()]
assert len(back) == 3 and back[1] == "apt_model", back  # in its place: between the script's two
assert sum(m._forward_hooks_always_called.values()) == 1
n = len(seen)
m(x)
assert len(seen) == n + 1  # the script's hooks still run
new(x)
m(x)
assert not hook_in() and len(m._forward_hooks) == 2
vb.disable()
assert len(m._forward_hooks) == 2 and not m._forward_hooks_always_called  # the script's two only
""")


def test_a_copy_a_ready_roots_forward_makes_while_quiet_is_adopted_after_the_next_step():
    """Quiet, a ready root's call has no exit hook: a module its forward makes (a teacher copy made
    late) puts the global hook back at the next optimizer step, and is adopted at its first call
    after it."""
    run_quiet("""
vb.enable("balanced", mixed_precision="off", banner=False)

class Late(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = Holder()
        self.copies, self.calls = [], 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 5:
            self.copies.append(copy.deepcopy(self.student))
        return self.student(x)

t = Late()
opt = torch.optim.SGD(t.parameters(), 0.1)
for _ in range(5):
    t(x).sum().backward()
    assert fast_path()["quiet"] or t.calls < 4
opt.step()
assert hook_in()
t.copies[0](x)
assert vb.get_stats()["adopted_models"] == 2
""")


def test_a_model_built_while_quiet_is_adopted_at_its_first_call():
    """Building a model puts the hook back (its parameters' registration); a deep copy (an EMA or
    evaluation copy, which registers nothing) too, through unpickling."""
    run_quiet("""
vb.enable("balanced", mixed_precision="off", banner=False)
m = Holder()
m(x)
assert not hook_in()
new = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
assert hook_in() and fast_path()["pending"] == 2  # the Linear, and the Sequential holding it
new(x)
assert vb.get_stats()["adopted_models"] == 2
m(x)
assert not hook_in() and fast_path()["pending"] == 0
ema = copy.deepcopy(m)
assert hook_in()
with torch.no_grad():
    ema(x)
assert [r["name"] for r in vb.get_report()["models"]] == ["Holder", "Sequential", "Holder"]
m(x)
assert not hook_in()
""")


def test_a_model_built_before_enable_and_first_called_late_is_adopted():
    """Modules alive when the switch starts are pending too: an evaluation network built before
    ``enable()`` and first called after many training calls of another model is adopted then."""
    run_quiet("""
late = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
vb.enable("balanced", mixed_precision="off", banner=False)
m = Holder()
for _ in range(5):
    m(x)
assert hook_in() and fast_path()["pending"] == 3  # armed: late and its layers were never seen
late(x)
assert vb.get_stats()["adopted_models"] == 2
m(x)
assert not hook_in()
""")


def test_wrappers_and_containers_of_adopted_models_are_adopted_at_their_first_call():
    """A module with no state of its own around adopted models (a wrapper, ``nn.Sequential(a, b)``)
    is a model of its own, as before the hook went quiet (a review probe's finding: its submodules'
    registration now puts the hook back)."""
    run_quiet("""
vb.enable("balanced", mixed_precision="off", banner=False)

class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)

m = Holder()
m(x)
a, b = nn.Linear(4, 4), nn.Linear(4, 4)
a(x), b(x)
m(x)
assert not hook_in() and vb.get_stats()["adopted_models"] == 3
Wrap(m)(x)
nn.Sequential(a, b)(x)
assert [r["name"] for r in vb.get_report()["models"]] == ["Holder", "Linear", "Linear", "Wrap", "Sequential"]
""")


def test_a_copy_made_inside_a_forward_and_called_afterwards_is_adopted():
    """A forward that makes a copy (an EMA or teacher copy made lazily) inside the call: the hook
    comes back when the call ends, so the script's call of the copy adopts it."""
    run_quiet("""
vb.enable("balanced", mixed_precision="off", banner=False)

class Teacher(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = Holder()
        self.copies = []

    def forward(self, x):
        if not self.copies:
            self.copies.append(copy.deepcopy(self.student))
        return self.student(x)

t = Teacher()
for _ in range(3):
    t(x)
assert vb.get_stats()["adopted_models"] == 1 and hook_in()
t.copies[0](x)
assert vb.get_stats()["adopted_models"] == 2
t(x)
assert not hook_in()
""")


def test_a_network_a_loss_module_builds_lazily_is_adopted_at_its_first_call():
    """A module that is no model (no parameters) builds a network inside its call, after the hook
    went out: put back at once, so the network is adopted at that first call, as before (a review
    probe's finding: it was left for the end of a root's call, and none came)."""
    run_quiet("""
vb.enable("balanced", mixed_precision="off", banner=False)

class PerceptualLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.nets = []

    def forward(self, a, b):
        if not self.nets:
            self.nets.append(nn.Sequential(nn.Linear(4, 8), nn.Tanh()).requires_grad_(False))
        return (self.nets[0](a) - self.nets[0](b)).pow(2).mean()

m = Holder()
loss_fn = PerceptualLoss()
for _ in range(3):
    with torch.no_grad():
        m(x)
assert not hook_in()
loss_fn(m(x), x).backward()
assert [r["name"] for r in vb.get_report()["models"]] == ["Holder", "Sequential"]
assert [r["trigger"] for r in vb.get_report()["models"]][1] == "first forward"
""")


def test_pending_modules_are_not_looked_at_again_at_every_step():
    """A copy kept and never called (pending for good) beside a loop that makes its loss module at
    every step: each step's new module must not make the switch look at every pending module again
    (a review probe: 1.5x the step with 450 pending, 10x with 9000)."""
    run_quiet("""
import sys
vb.enable("balanced", mixed_precision="off", banner=False)
kept = nn.ModuleList(nn.Linear(4, 4) for _ in range(300))
m = Holder()
opt = torch.optim.SGD(m.parameters(), lr=0.1)
looks = []

def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "<lambda>" and frame.f_code.co_filename.endswith("controller.py"):
        looks.append(1)

for step in range(6):
    if step == 2:
        sys.setprofile(profile)
    loss = nn.MSELoss(reduction="sum")(m(x), x)
    loss.backward()
    opt.step()
    opt.zero_grad()
sys.setprofile(None)
assert fast_path()["pending"] == 301, fast_path()
assert len(looks) < 100, len(looks)  # 4 steps: a few looks each, not 300
""")


class Slim(nn.Module):
    """Pickles its configuration only and rebuilds itself in ``__setstate__`` after its base's."""

    def __init__(self, width=4):
        super().__init__()
        self.width = width
        self.lin = nn.Linear(width, width)

    def __getstate__(self):
        return {"width": self.width}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__init__(state["width"])

    def forward(self, x):
        return self.lin(x)


def test_unpickling_a_module_that_rebuilds_itself_works(cpu_device):
    """The switch's ``nn.Module.__setstate__`` looked at the module's parameters before such a
    class had rebuilt them (``AttributeError``: a review probe's finding)."""
    import copy
    import pickle

    vb.enable("balanced", mixed_precision="off", banner=False)
    try:
        m = Slim()
        m(torch.randn(2, 4))
        for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
            assert clone.lin.weight.shape == (4, 4)
            clone(torch.randn(2, 4))
    finally:
        vb.disable()


def test_a_layer_built_inside_a_forward_is_no_model_of_its_own():
    run_quiet("""
vb.enable("balanced", mixed_precision="off", banner=False)
m = BuildsInForward()
for _ in range(5):
    m(x)
assert vb.get_stats()["adopted_models"] == 1
assert not hook_in() and fast_path()["pending"] == 0
""")


# ---------------------------------------------------------------------------- the class on its own


def test_restore_keeps_registration_order_and_stop_puts_it_back():
    hooks = {}
    ours = lambda mod, args: None  # noqa: E731
    hooks[5] = ours
    fp = ForwardFastPath(hooks, 5, ours, warm_calls=0)
    root = nn.Linear(2, 2)
    patches = PatchSet()
    fp.attach(root, patches)
    fp.step_aside(root)
    assert hooks == {} and fp.away
    hooks[9] = "script's"
    fp.restore()
    assert list(hooks) == [5, 9] and not fp.away
    fp.step_aside(root)  # another global hook: stays
    assert list(hooks) == [5, 9]
    del hooks[9]
    fp.step_aside(root)
    fp.stop("a reason")
    assert hooks == {5: ours} and not fp.on and fp.off_reason == "a reason"
    fp.step_aside(root)
    assert hooks == {5: ours}
    patches.restore_all()
    assert not root._forward_hooks


def test_bad_arguments_are_refused():
    hooks = {3: print}
    with pytest.raises(ValueError, match="warm_calls=-1"):
        ForwardFastPath(hooks, 3, print, warm_calls=-1)
    with pytest.raises(ValueError, match="hook_id=4"):
        ForwardFastPath(hooks, 4, print)
