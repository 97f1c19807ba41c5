"""Test modules share helpers through helper modules and ``conftest.py``, never by importing each other.

A test module imported by another runs its module-level code twice under two names when the two are
collected apart (in parallel workers, say), and ties a helper's fate to a test file's: moving or
deleting the test then breaks an unrelated one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sidecar

REPO = Path(sidecar.__file__).parent.parent
TEST_FOLDERS = ("tests", "integration")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_test_module_imports_another_test_module() -> None:
    files = sorted(p for folder in TEST_FOLDERS for p in (REPO / folder).rglob("*.py"))
    assert len(files) > 50
    found = {
        f"{path.relative_to(REPO)} imports {name}"
        for path in files
        for name in imported_modules(path)
        if name.split(".")[0].startswith("test_") or name.split(".")[0] == "tests"
    }
    assert found == set()
