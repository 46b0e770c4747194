"""No import cycles inside `polyrl` (issue 37), counting every import a module makes: at
module level, under `if TYPE_CHECKING:` and inside functions. A cycle hidden behind a
deferred import still ties the modules together (neither can be read, tested or moved
alone) and turns into an ImportError the day someone hoists the import.

The graph is read from the source with `ast`, not from `sys.modules`, so imports that
never run (type checking, a function not called) count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the `polyrl` package by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((src / "polyrl").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """`name` or its nearest enclosing module of ours (`polyrl.x.y.attr` -> `polyrl.x.y`)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of ours that `module` imports anywhere in its body."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `.` is the package, each further dot one package up
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        out |= {t for t in (_resolve(t, mods) for t in targets) if t is not None and t != module}
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the modules it imports. An edge to a package's `__init__` is dropped when that
    `__init__` is empty: importing it runs nothing, so it cannot close a cycle."""
    mods = modules(src)
    empty = {m for m, p in mods.items() if p.name == "__init__.py" and not p.read_text().strip()}
    return {m: imports_of(m, p, mods) - empty for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as its path (first module repeated at the end), or None. Iterative DFS."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if colour[root] != WHITE:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        colour[root] = GREY
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = BLACK
                stack.pop()
            elif colour.get(child, BLACK) == GREY:
                path = [n for n, _ in stack]
                return path[path.index(child) :] + [child]
            elif colour.get(child) == WHITE:
                colour[child] = GREY
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_the_graph_is_read() -> None:
    """The checker sees imports of every kind (a guard against it passing by seeing none)."""
    graph = import_graph()
    assert len(graph) > 100
    assert "polyrl.protocol.manager_api" in graph["polyrl.manager.batch"]  # module level
    assert "polyrl.protocol.manager_api" in graph["polyrl.rollout.source"]  # under TYPE_CHECKING
    assert "polyrl.console" in graph["polyrl.cli"]  # inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_and_deferred_imports_are_edges(tmp_path: Path) -> None:
    pkg = tmp_path / "polyrl" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "polyrl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import f\n")  # not empty: its edges count
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..sub.a import f\n")
    (pkg / "c.py").write_text("from polyrl.sub import a, f\nimport polyrl.sub.b\n")
    graph = import_graph(tmp_path)
    assert graph["polyrl.sub.a"] == {"polyrl.sub.b"}
    assert graph["polyrl.sub.b"] == {"polyrl.sub.a"}
    assert graph["polyrl.sub.c"] == {"polyrl.sub.a", "polyrl.sub.b", "polyrl.sub"}
    assert graph["polyrl.sub"] == {"polyrl.sub.a"}
    assert find_cycle(graph) == ["polyrl.sub.a", "polyrl.sub.b", "polyrl.sub.a"]


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
