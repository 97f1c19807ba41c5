"""Size limits of the hand-written code: no module over 500 lines, no class over 25 methods.

A module's lines are counted after its docstring: the docstring carries the module's why, as long
as the idea needs, and a cap on the whole file would push that why out of the module again.
"""

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


def code_lines(path: Path) -> int:
    """The lines of a module after its docstring (all of them when it has none)."""
    source = path.read_text()
    body = ast.parse(source).body
    has_docstring = bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    start = (body[0].end_lineno or 0) if has_docstring else 0
    return len(source.splitlines()) - start


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in hand_written() if (n := code_lines(p)) > 500}
    assert long == {}


def test_a_module_docstring_does_not_count_towards_its_lines(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""Why.\n\nMore why.\n"""\n\nX = 1\n')
    assert code_lines(module) == 2
    module.write_text("X = 1\nY = 2\n")
    assert code_lines(module) == 2
    module.write_text("X = 1\n" * 501)
    assert code_lines(module) == 501


def test_no_class_has_over_25_methods() -> None:
    big: dict[str, int] = {}
    for path in hand_written():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                count = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if count > 25:
                    big[f"{path.relative_to(ROOT)}:{node.name}"] = count
    assert big == {}
