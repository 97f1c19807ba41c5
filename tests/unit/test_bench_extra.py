"""matplotlib is an optional bench dependency (``bench/trace.py --plot``): the sidecar never needs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sidecar


def test_no_sidecar_module_imports_matplotlib() -> None:
    root = Path(sidecar.__file__).parent
    assert [p for p in root.rglob("*.py") if "matplotlib" in p.read_text()] == []


def test_starting_the_sidecar_loads_no_matplotlib() -> None:
    code = "import sys, sidecar.app, sidecar.cli; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
