"""The modules of ``sidecar/`` and ``bench/`` import each other without a circle, and none is past 500 lines.

An import circle makes the import order matter (the module imported first sees the other half-built)
and hides which of the two is the lower one; a circle kept out of sight (under ``TYPE_CHECKING``, or
an import inside a function) is still one for a reader, so every ``import`` counts here, wherever it
stands. A module past 500 lines holds more than one idea: split it where a reader would look for the
part.

The graph is read from the sources with ``ast``: ``sidecar`` modules by their dotted names, and the
``bench/`` scripts by their bare names, as they import each other (a script's own folder is on the
import path when it runs, so ``from trace_state import Mirror`` is ``bench/trace_state.py``).
``from package import name`` is an arrow to the module ``package.name`` when there is one, else to
the package itself; importing a submodule is not counted as importing the packages above it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import sidecar

REPO = Path(sidecar.__file__).parent.parent
MAX_LINES = 500


def sources() -> Iterator[Path]:
    for folder in ("sidecar", "bench"):
        yield from sorted((REPO / folder).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[0] == "bench":  # a script, imported by its bare name from its own folder
        parts = parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(name: str, modules: set[str]) -> str | None:
    """The module of ours ``name`` is, or the nearest package above it that is; None when not ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def arrows(path: Path, here: str, modules: set[str]) -> set[str]:
    """The modules of ours that the module ``here``, read from ``path``, imports anywhere in it."""
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*above, base] if base else above)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        found |= {target for name in names if (target := resolve(name, modules)) not in (None, here)}
    return found


def import_graph() -> dict[str, set[str]]:
    paths = list(sources())
    modules = {module_name(p) for p in paths}
    return {module_name(p): arrows(p, module_name(p), modules) for p in paths}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_module_imports_itself_through_others() -> None:
    assert circles(import_graph()) == []


def test_no_module_is_past_500_lines() -> None:
    long = {
        str(p.relative_to(REPO)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


# -- the checker sees what it is there to see -------------------------------------------------------


def test_a_circle_through_three_modules_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_an_import_under_type_checking_or_in_a_function_is_an_arrow(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from sidecar.nvml.sim.library import SimulatedLibrary\n"
        "def f() -> None:\n"
        "    from trace_state import Mirror\n"
        "    from sidecar.nvml.sim import store\n"
    )
    modules = {"sidecar.nvml.sim", "sidecar.nvml.sim.library", "sidecar.nvml.sim.store", "trace_state"}
    assert arrows(source, "m", modules) == {
        "sidecar.nvml.sim.library",
        "sidecar.nvml.sim.store",
        "trace_state",
    }


def test_the_graph_has_both_trees() -> None:
    graph = import_graph()
    assert "sidecar.nvml.sim.library" in graph["sidecar.nvml.sim"]
    assert "trace_workload" in graph["policy_replay"]
