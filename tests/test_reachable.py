"""Where the switch finds the models a compiled function reaches (apt_model/switch/reachable.py)."""
import functools

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


def test_arguments_containers_closure_globals_bound_objects_and_partials_are_found_largest_first():
    small, medium, in_list, in_dict = nn.Linear(2, 2), nn.Linear(8, 8), nn.Linear(5, 5), nn.Linear(6, 6)

    def closure(x):
        return medium(x)

    assert reachable_modules(lambda *a, **k: None, (small, [in_list], "x"), {"d": {"m": in_dict}}) == \
        [in_dict, in_list, small]  # parameter count: 42, 30, 6
    assert reachable_modules(closure, (small,)) == [medium, small]
    assert reachable_modules(closure, (small,), through_function=False) == [small]
    assert reachable_modules(_uses_big) == [BIG] and UNNAMED not in reachable_modules(_uses_big)
    holder = _Holder()
    assert reachable_modules(holder.step) == [holder.model]
    assert reachable_modules(holder) == [holder.model]  # a callable object
    assert reachable_modules(functools.partial(closure, small)) == [medium, small]
    assert reachable_modules(BIG.forward) == [BIG]  # a module's bound method: the module itself
    assert reachable_modules(closure, (small,), exclude={medium}) == [small]


def test_what_is_not_looked_at_and_what_cannot_be_inspected_is_skipped():
    holder = _Holder()

    def late(x):
        return later(x)  # a closure cell still empty when looked at

    assert reachable_modules(late) == []
    later = nn.Linear(1, 1)  # noqa: F841 - fills the cell after the look
    assert reachable_modules(lambda h: h.model, (holder,)) == []  # attributes of arguments: not followed
    assert reachable_modules(len, (1,)) == [] and reachable_modules(print) == []
