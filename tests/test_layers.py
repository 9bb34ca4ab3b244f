"""The package's import graph, counting imports inside functions: no cycles, and every import points down
the layer order of docs/architecture.md."""

import ast
from pathlib import Path

import pytest

from conftest import ROOT

SRC = ROOT / "src"

# layer -> the layers it may import (besides itself); the order of docs/architecture.md
ALLOWED = {
    "util": set(),
    "config": {"util"},
    "core": {"util"},
    "tasks": {"util", "config"},
    "eval": {"util", "config", "core", "tasks"},
    "models": {"util", "config", "core", "tasks", "eval"},
    "algorithms": {"util", "config", "core", "models"},
    "report": {"util", "config", "core"},
    "federation": {"util", "config", "core", "algorithms"},
    "workloads": {"util", "config", "core", "tasks", "eval", "models", "algorithms", "federation"},
    "transports": {"util", "config", "core", "models", "algorithms", "federation", "workloads"},
    "experiments": {"util", "config", "core", "tasks", "eval", "models", "algorithms", "report", "workloads",
                    "federation", "transports"},
    "cli": set(),  # may import anything; nothing imports it
}
UTIL = {"ciders", "ciders._quiet", "ciders.errors", "ciders.fileio", "ciders.phases", "ciders.runtime"}


def layer_of(mod: str) -> str:
    if mod in UTIL:
        return "util"
    if mod == "ciders.config" or mod.startswith("ciders.config."):
        return "config"
    if mod == "ciders.cli":
        return "cli"
    return mod.split(".")[1]


def modules(root: Path = SRC) -> dict[str, Path]:
    out = {}
    for p in (root / "ciders").rglob("*.py"):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """module -> the ciders modules it imports anywhere in its body (function-level imports included)."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            deps |= {r for n in names if n.startswith("ciders") and (r := resolve(n)) and r != m}
        graph[m] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return out


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in graph.items():
        lm = layer_of(m)
        for d in deps:
            ld = layer_of(d)
            if ld == "cli" or (lm != "cli" and ld != lm and ld not in ALLOWED[lm]):
                bad.append(f"{m} ({lm}) imports {d} ({ld})")
    return sorted(bad)


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_every_import_points_down_the_layers():
    assert violations(import_graph()) == []


def test_every_module_belongs_to_a_layer():
    assert {layer_of(m) for m in modules()} <= set(ALLOWED)


def test_the_checker_sees_function_level_imports_and_cycles(tmp_path):
    """The checks catch what they are for: a cycle closed by an import inside a function, and an upward
    import."""
    pkg = tmp_path / "ciders"
    (pkg / "core").mkdir(parents=True)
    (pkg / "federation").mkdir()
    for d in (pkg, pkg / "core", pkg / "federation"):
        (d / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from ciders.federation import b\n")
    (pkg / "federation" / "b.py").write_text("from ciders.core import a\n")
    g = import_graph(tmp_path)
    assert g["ciders.core.a"] == {"ciders.federation.b"}
    assert cycles(g) == [["ciders.core.a", "ciders.federation.b"]]
    assert violations(g) == ["ciders.core.a (core) imports ciders.federation.b (federation)"]


@pytest.mark.parametrize("mod", ["ciders.config", "ciders.config.base", "ciders.config.bilevel"])
def test_config_imports_nothing_above_it(mod):
    assert {layer_of(d) for d in import_graph()[mod]} <= {"util", "config"}
