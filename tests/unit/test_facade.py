"""The lifecycle is reached through its facade only: no caller outside ``sidecar.lifecycle`` reads a
part through it (the port, the records, the CDI specs, the context, the locks ...).

Held as the layering is (``test_layers.py``), on the source: every attribute read off an expression
named ``lifecycle`` (``lifecycle.x``, ``self.lifecycle.x``, ``world.lifecycle.x``) anywhere in the
package, the tests, the benchmarks and the integration tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sidecar
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.facade import Lifecycle

ROOT = Path(sidecar.__file__).parent
REPO = ROOT.parent
PARTS = frozenset(
    {
        "ctx",
        "_ctx",
        "port",
        "records",
        "cdi",
        "locks",
        "allocator",
        "_allocator",
        "inventory",
        "table",
        "generations",
        "pending",
        "boot_id",
    }
)


def names_lifecycle(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "lifecycle") or (
        isinstance(node, ast.Attribute) and node.attr == "lifecycle"
    )


def reaches_through(source: str) -> list[tuple[int, str]]:
    """(line, part) of every part read off an expression named ``lifecycle`` in ``source``."""
    return sorted(
        (node.lineno, node.attr)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in PARTS and names_lifecycle(node.value)
    )


def callers() -> list[Path]:
    inside = ROOT / "lifecycle"
    paths = [p for p in ROOT.rglob("*.py") if inside not in p.parents]
    for folder in ("tests", "bench", "integration"):
        paths += (REPO / folder).rglob("*.py")
    return sorted(paths)


def test_no_caller_reads_a_part_through_the_facade() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line} .{part}"
        for path in callers()
        for line, part in reaches_through(path.read_text())
    ]
    assert found == []


def test_the_callers_are_the_edge_the_wiring_and_the_tests() -> None:
    paths = {str(p.relative_to(REPO)) for p in callers()}
    assert {"sidecar/edge/servicer.py", "sidecar/app.py", "tests/component/lifecycle_world.py"} <= paths
    assert not any(p.startswith("sidecar/lifecycle/") for p in paths)


def test_the_probe_sees_a_reach_through() -> None:
    source = (
        "def f(self, lifecycle):\n    return self.lifecycle.port, lifecycle.ctx.table, lifecycle.allocate\n"
    )
    assert reaches_through(source) == [(2, "ctx"), (2, "port")]


def test_the_facade_keeps_no_part_of_its_own(tmp_path: Path) -> None:
    """It holds the one context and the Allocate transaction, privately: no copies of the parts."""
    from sidecar.store.cdi import CdiSpecs  # noqa: PLC0415 - only this test builds one
    from sidecar.store.records import RecordStore  # noqa: PLC0415

    records = RecordStore(tmp_path / "state")
    ctx = LifecycleContext(port=None, records=records, cdi=CdiSpecs(None), boot_id="b")  # type: ignore[arg-type]
    assert set(vars(Lifecycle(ctx))) == {"_ctx", "_allocator"}
