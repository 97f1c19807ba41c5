"""The alerts fire on the series that should fire them and stay quiet otherwise (promtool's tests).

``deploy/tests/prometheus-rules-test.yaml`` holds promtool unit tests of ``deploy/prometheus-rules.yaml``;
``scripts/promtool-test`` runs them. Here: every alert has a test that expects it to fire and one that
expects silence, and promtool passes them. Without promtool (Debian's ``prometheus`` package) the
run is skipped, except under CI, where ``.ci/run`` installs it and a missing one fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus-rules.yaml"
TESTS = ROOT / "deploy/tests/prometheus-rules-test.yaml"


def alerts() -> list[str]:
    return re.findall(r"^\s*- alert: (\S+)\s*$", RULES.read_text(), re.MULTILINE)


def expectations() -> dict[str, set[bool]]:
    """Alert name -> the kinds of test it has: True (expected to fire), False (expected quiet)."""
    found: dict[str, set[bool]] = {}
    pattern = r"^\s*alertname: (\S+)\s*\n\s*exp_alerts:(.*)$"
    for name, rest in re.findall(pattern, TESTS.read_text(), re.MULTILINE):
        found.setdefault(name, set()).add(rest.strip() != "[]")
    return found


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not() -> None:
    names = alerts()
    assert len(names) >= 7, names
    tested = expectations()
    for name in names:
        assert tested.get(name) == {True, False}, f"{name}: tests {tested.get(name)}"
    assert set(tested) <= set(names), "a test names an alert the rules do not have"


def test_promtool_passes_every_alert_test() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool not found (.ci/run installs Debian's prometheus package)")
        pytest.skip("promtool not found (Debian's prometheus package has it)")
    done = subprocess.run(
        [str(ROOT / "scripts/promtool-test"), promtool], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: " in done.stdout
    assert done.stdout.rstrip().endswith("SUCCESS")
