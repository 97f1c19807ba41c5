"""matplotlib is an optional bench dependency (``bench/trace.py --plot``): the sidecar never needs it.

What it draws is shown where the results are: ``bench/README.md`` embeds the latency CDF of the
latest default run (``bench/trace.png``), and every figure a bench document links is in the tree.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import sidecar

BENCH = Path(sidecar.__file__).parent.parent / "bench"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_no_sidecar_module_imports_matplotlib() -> None:
    root = Path(sidecar.__file__).parent
    assert [p for p in root.rglob("*.py") if "matplotlib" in p.read_text()] == []


def test_starting_the_sidecar_loads_no_matplotlib() -> None:
    code = "import sys, sidecar.app, sidecar.cli; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def images(document: Path) -> list[str]:
    return IMAGE.findall(document.read_text())


def test_the_bench_readme_shows_the_trace_plot() -> None:
    assert "trace.png" in images(BENCH / "README.md")


def test_every_figure_a_bench_document_shows_is_a_png_in_the_tree() -> None:
    shown = [BENCH / link for doc in ("README.md", "HISTORY.md") for link in images(BENCH / doc)]
    assert shown
    assert [p for p in shown if not p.is_file() or not p.read_bytes().startswith(PNG_SIGNATURE)] == []
