"""Where the switch finds the models a compiled function reaches (apt_model/switch/reachable.py)."""
import functools
import types

import torch
import torch.nn as nn

from apt_model.switch.reachable import reachable_modules

BIG = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
UNNAMED = nn.Linear(3, 3)  # a global the functions below never name


def _uses_big(x):
    def inner(y):
        return BIG(y)  # named only in a nested function's code
    return inner(x)


class _Holder:
    def __init__(self):
        self.model = nn.Linear(4, 4)
        self.note = "not a module"

    def step(self, x):
        return self.model(x)

    def __call__(self, x):
        return self.model(x)


def test_arguments_containers_closure_globals_bound_objects_and_partials_are_found():
    small, medium, in_list, in_dict = nn.Linear(2, 2), nn.Linear(8, 8), nn.Linear(5, 5), nn.Linear(6, 6)

    def closure(x):
        return medium(x)

    def method(self, x):  # compiled in a class body: self arrives as the first argument
        return self.model(x)

    assert reachable_modules(lambda *a, **k: None, (small, [in_list], "x"), {"d": {"m": in_dict}}) == \
        [small, in_list, in_dict]
    assert reachable_modules(closure, (small,)) == [small, medium]
    assert reachable_modules(closure, (small,), through_function=False) == [small]
    assert reachable_modules(_uses_big) == [BIG] and UNNAMED not in reachable_modules(_uses_big)
    holder = _Holder()
    assert reachable_modules(holder.step) == [holder.model]
    assert reachable_modules(holder) == [holder.model]  # a callable object
    assert reachable_modules(functools.partial(closure, small)) == [small, medium]
    assert reachable_modules(BIG.forward) == [BIG]  # a module's bound method: the module itself
    assert reachable_modules(closure, (small,), exclude={medium}) == [small]
    assert reachable_modules(method, (holder, 1), through_function=False) == [holder.model]
    trainer = types.SimpleNamespace(model=small, models=[in_list], note="x")  # an argument's attributes
    assert reachable_modules(lambda t: None, (trainer,)) == [small, in_list]
    assert reachable_modules(lambda **k: None, (), {"trainer": trainer}) == [small, in_list]


def test_only_the_outermost_modules_are_returned_whatever_the_order_found():
    """A model and a wrapper around it with no parameters of its own (same parameter count), or a
    block and its model: one set of parameters is adopted once, through the outer module."""
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    class WithLoss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    wrapped = WithLoss(net)
    for args in ((net, wrapped), (wrapped, net), (net[0], net)):
        assert reachable_modules(lambda *a: None, args) == [args[1] if args[0] in args[1].modules() else args[0]]
    assert reachable_modules(lambda *a: None, (net[0], nn.Linear(1, 1))) != []  # unrelated ones both stay
    assert len(reachable_modules(lambda *a: None, (net[0], nn.Linear(1, 1)))) == 2


def test_what_is_not_looked_at_and_what_cannot_be_inspected_is_skipped():
    holder = _Holder()

    def late(x):
        return later(x)  # a closure cell still empty when looked at

    assert reachable_modules(late) == []
    later = nn.Linear(1, 1)  # noqa: F841 - fills the cell after the look
    deep = types.SimpleNamespace(inner=types.SimpleNamespace(model=nn.Linear(1, 1)))
    assert reachable_modules(lambda h: h.inner.model, (deep,)) == []  # attributes of attributes: not followed
    crowded = types.SimpleNamespace(model=nn.Linear(1, 1), **{f"a{i}": i for i in range(64)})
    assert reachable_modules(lambda h: h.model, (crowded,)) == []  # too many attributes to walk every call
    tensor = torch.zeros(1)
    tensor.model = nn.Linear(1, 1)  # attributes of tensors, functions, classes, modules: not looked at
    assert reachable_modules(lambda *a: None, (tensor, _uses_big, _Holder, types)) == []
    many = [nn.Linear(1, 1)] + [1] * 40  # a long list is data: not walked on every call
    assert reachable_modules(lambda xs: None, (many,)) == []
    assert reachable_modules(len, (1,)) == [] and reachable_modules(print) == []
