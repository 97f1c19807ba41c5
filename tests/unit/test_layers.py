"""The packages of ``sidecar`` are layers: a module imports only its own package and the ones below it.

From the top: the wiring (``app``, ``cli``, ``config``), ``edge`` (gRPC), ``lifecycle`` (transactions),
``store`` (durable state), ``model`` (pure values and rules), ``nvml`` (the hardware port).
"""

from __future__ import annotations

import ast
from pathlib import Path

import sidecar

ROOT = Path(sidecar.__file__).parent
LAYERS = ("nvml", "model", "store", "lifecycle", "edge")
WIRING = {"app", "cli", "config", "__main__", "__init__"}


def layer_of(module: str) -> int:
    """The rank of ``sidecar.<part>...``: higher is further up; the wiring is above every package."""
    part = module.split(".")[1] if "." in module else ""
    return LAYERS.index(part) if part in LAYERS else len(LAYERS)


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "sidecar":
                found |= {f"sidecar.{alias.name}" for alias in node.names}
            elif node.module.startswith("sidecar."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("sidecar.")}
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def arrows_up() -> list[str]:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        here = module_name(path)
        for target in imports_of(path):
            if target != "sidecar" and layer_of(target) > layer_of(here):
                wrong.append(f"{here} -> {target}")
    return wrong


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert arrows_up() == []


def test_the_top_level_holds_only_the_packages_and_the_wiring() -> None:
    entries = {p.stem if p.suffix == ".py" else p.name for p in ROOT.iterdir() if p.name != "__pycache__"}
    entries -= {"__init__", "__main__", "py.typed"}
    assert entries == {*LAYERS, "app", "cli", "config"}
    assert len(entries) <= 8


def test_the_probe_sees_an_arrow_up() -> None:
    assert (
        layer_of("sidecar.edge.server") > layer_of("sidecar.lifecycle.facade") > layer_of("sidecar.store.cdi")
    )
    assert layer_of("sidecar.store.cdi") > layer_of("sidecar.model.domain") > layer_of("sidecar.nvml.port")
    assert layer_of("sidecar.app") > layer_of("sidecar.edge.server")


# -- inside the lifecycle: transactions stand side by side, on the steps below them -------------------

# A transaction is one operation a caller asks for, with its own locks and its own all-or-nothing
# rule; the facade and the reconciler call them. A step is a part several transactions share (or one
# transaction delegates to), below them: it takes the locks its caller holds.
TRANSACTIONS = frozenset({"allocate", "release", "reclaim", "undo", "migmode", "idle_trim", "recover"})
STEPS = frozenset({"create", "teardown", "steps", "validate", "gpu_views", "inventory", "context"})


def lifecycle_imports() -> dict[str, set[str]]:
    """Each module of ``sidecar.lifecycle`` (by its last name) and the lifecycle modules it imports."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "lifecycle").glob("*.py")):
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "sidecar.lifecycle":
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sidecar.lifecycle."):
                targets.add((node.module or "").split(".")[2])
        found[path.stem] = targets
    return found


def test_every_transaction_and_step_is_a_module_of_the_lifecycle() -> None:
    assert set(lifecycle_imports()) >= TRANSACTIONS | STEPS


def test_no_transaction_imports_another_transaction() -> None:
    wrong = [
        f"{here} -> {there}"
        for here, targets in lifecycle_imports().items()
        if here in TRANSACTIONS
        for there in targets & TRANSACTIONS
    ]
    assert wrong == []


def test_no_step_imports_a_transaction() -> None:
    wrong = [
        f"{here} -> {there}"
        for here, targets in lifecycle_imports().items()
        if here in STEPS
        for there in targets & TRANSACTIONS
    ]
    assert wrong == []
