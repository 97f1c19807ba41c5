"""Size limits of the hand-written code: no module over 500 lines, no class over 25 methods."""

from __future__ import annotations

import ast
from pathlib import Path

import sidecar

ROOT = Path(sidecar.__file__).parent
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def hand_written() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if not p.name.endswith(GENERATED)]


def test_the_walk_finds_the_modules() -> None:
    assert ROOT / "lifecycle" / "facade.py" in hand_written()


def test_no_module_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in hand_written() if (n := len(p.read_text().splitlines())) > 500
    }
    assert long == {}


def test_no_class_has_over_25_methods() -> None:
    big: dict[str, int] = {}
    for path in hand_written():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                count = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if count > 25:
                    big[f"{path.relative_to(ROOT)}:{node.name}"] = count
    assert big == {}
