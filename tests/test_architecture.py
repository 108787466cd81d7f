"""The floors of the checkout: the library (spardl_grace, then deepreduce_compat) at the bottom,
testbed (what both drivers share: models, data sets, the emulated network, the config
vocabulary, records) above it, and the two drivers, experiments and benchmarks, on top, which
never import each other. Every import counts, also one inside a function, since a cycle of
lazy imports is still a cycle. The import graph is read from the sources (ast), not run."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = ("spardl_grace", "deepreduce_compat", "testbed", "experiments", "benchmarks")
#: what each package may import from the others: the floors below it
MAY_IMPORT = {
    "spardl_grace": set(),
    "deepreduce_compat": {"spardl_grace"},
    "testbed": {"spardl_grace", "deepreduce_compat"},
    "experiments": {"spardl_grace", "deepreduce_compat", "testbed"},
    "benchmarks": {"spardl_grace", "deepreduce_compat", "testbed"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "results" not in path.relative_to(ROOT).parts:
                found[module_name(path)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_each_floor_imports_only_the_floors_below_it():
    wrong = sorted(
        f"{name} imports {target}"
        for name, targets in graph().items()
        for target in targets
        if (mine := name.split(".")[0]) != (theirs := target.split(".")[0])
        and theirs not in MAY_IMPORT[mine]
    )
    assert not wrong, "\n".join(wrong)


def test_the_drivers_have_no_import_cycle():
    edges = graph()
    drivers = {n: {t for t in ts if t.split(".")[0] in ("testbed", "experiments", "benchmarks")}
               for n, ts in edges.items() if n.split(".")[0] in ("testbed", "experiments", "benchmarks")}
    assert cycles(drivers) == []


def test_the_checks_see_a_cycle_and_a_wrong_direction():
    """The checks can fail: a made-up cycle is found, and the real graph has the arrows the
    floors rely on (the training CLI imports the shared vocabulary)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    edges = graph()
    assert "testbed.configs" in edges["experiments.cli"]
    assert "testbed.configs" in edges["benchmarks.train_step"]
