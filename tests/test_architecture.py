"""The shape of the house, checked from the source: packages import each other without circles,
the layers point downward, and nobody reaches into another package's private names.

The walk reads every ``.py`` file with ``ast`` (function-local imports included, since a lazy
import is still a dependency) and maps each module to its package: ``apt_model.<pkg>`` for the
sub-packages, the module itself for the few top-level modules (``apt_model.errors``).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "apt_model"

#: Layers, lowest first. A package imports only packages of lower layers — except in the top
#: layer (the facade and the tools built on the switch: CLI, bench suite, reports, seed-era paths),
#: whose packages may use each other (the cycle test still forbids circles there).
LAYERS = [
    {"base"},                                   # ground floor: undo stack, feature protocol, settings, errors
    {"devices"},                                # the device layer
    {"memory"},                                 # the tiers: levels, swap, pager, paging
    {"activations", "attention", "precision", "quantization", "distributed", "compile"},  # the features
    {"switch"},                                 # enable(), adoption (the step list), report
    {"optimization", "core", "reports", "bench", "cli", "models", "data", "errors", "apt_model", "__main__"},
]
TOP = len(LAYERS) - 1


def _modules(base: Path, prefix: str) -> dict[str, Path]:
    out = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([prefix, *parts]) if prefix else ".".join(parts)] = path
    return out


MODULES = _modules(PKG, "apt_model")


def package_of(module: str) -> str:
    """``apt_model.memory.paging.pager`` -> ``memory``; ``apt_model.errors`` -> ``errors``;
    ``apt_model`` -> ``apt_model`` (the facade)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "apt_model"


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def walk(module: str, path: Path):
    """Yield ``(kind, target_module, name, line)`` for every apt_model import and private use in
    one file. kind: ``import`` (target_module imported), ``private`` (``name`` is a private name of
    ``target_module``, imported or reached as an attribute)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}  # local name -> apt_model module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "apt_model":
                    continue
                yield "import", a.name, None, node.lineno
                for part in a.name.split(".")[1:]:
                    if _private(part):
                        yield "private", a.name, part, node.lineno
                aliases[a.asname or "apt_model"] = a.name if a.asname else "apt_model"
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if not target or target.split(".")[0] != "apt_model":
                continue
            for part in target.split(".")[1:]:
                if _private(part):
                    yield "private", target, part, node.lineno
            for a in node.names:
                full = f"{target}.{a.name}"
                if full in MODULES:
                    yield "import", full, None, node.lineno
                    aliases[a.asname or a.name] = full
                else:
                    yield "import", target, None, node.lineno
                if _private(a.name):
                    yield "private", target, a.name, node.lineno
    for node in ast.walk(tree):  # module._name, apt_model.switch.controller._state
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                target = ".".join([aliases[value.id], *reversed(chain)])
                if target in MODULES:
                    yield "private", target, node.attr, node.lineno


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> ``["module:line -> target", ...]`` (cross-package only)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, path in MODULES.items():
        for kind, target, _, line in walk(module, path):
            a, b = package_of(module), package_of(target)
            if kind == "import" and a != b:
                graph[a][b].append(f"{module}:{line} -> {target}")
    return graph


def cycles(graph) -> list[list[str]]:
    """Every strongly connected set of more than one package (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_packages():
    graph = package_graph()
    found = cycles(graph)
    detail = []
    for comp in found:
        for a in comp:
            for b in comp:
                if b in graph[a]:
                    detail.append(f"{a} -> {b}: {graph[a][b][0]}")
    assert not found, f"package cycles {found}:\n" + "\n".join(detail)


def test_layers_point_downward():
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    graph = package_graph()
    unknown = sorted(set(graph) - set(layer))
    assert not unknown, f"packages missing from LAYERS: {unknown}"
    upward = []
    for a, targets in graph.items():
        for b, where in targets.items():
            if layer[b] > layer[a] or (layer[b] == layer[a] and layer[a] != TOP):
                upward.append(f"{a} (layer {layer[a]}) -> {b} (layer {layer[b]}): {where[0]}")
    assert not upward, "imports that climb the layers:\n" + "\n".join(upward)


def test_device_layer_and_ground_floor_import_nothing_above_them():
    graph = package_graph()
    assert set(graph.get("base", {})) == set(), dict(graph["base"])
    assert set(graph.get("devices", {})) <= {"base"}, dict(graph["devices"])


def _private_uses(files: dict[str, Path], own_package) -> list[str]:
    out = []
    for module, path in files.items():
        for kind, target, name, line in walk(module, path):
            if kind == "private" and package_of(target) != own_package(module):
                out.append(f"{path.relative_to(ROOT)}:{line}: {target}.{name}")
    return out


def test_no_private_name_used_across_packages():
    uses = _private_uses(MODULES, package_of)
    assert not uses, "private names used from another package:\n" + "\n".join(uses)


def test_tests_benchmarks_and_jobs_use_no_private_names_of_the_package():
    files = {}
    for folder in ("tests", "benchmarks", "training"):
        files.update(_modules(ROOT / folder, folder))
    uses = _private_uses(files, lambda module: None)
    assert not uses, "private apt_model names used outside the package:\n" + "\n".join(uses)


def test_the_walk_sees_function_local_imports_and_private_reach_ins(tmp_path):
    """The checker itself: a lazy import inside a function and a ``module._name`` reach-in are
    found (a checker that found nothing would pass every test above)."""
    src = tmp_path / "probe.py"
    src.write_text("def f():\n    from apt_model.switch import controller\n    return controller._state\n"
                   "import apt_model.memory.pager as pg\nx = pg._MISSING\nfrom apt_model.base.patches import _MISSING\n")
    found = list(walk("apt_model.devices.probe", src))
    imports = {t for k, t, _, _ in found if k == "import"}
    private = {(t, n) for k, t, n, _ in found if k == "private"}
    assert "apt_model.switch.controller" in imports and "apt_model.memory.pager" in imports
    assert ("apt_model.switch.controller", "_state") in private
    assert ("apt_model.memory.pager", "_MISSING") in private and ("apt_model.base.patches", "_MISSING") in private
    assert cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]
