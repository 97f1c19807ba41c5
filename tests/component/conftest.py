"""Fixtures for lifecycle component tests.

Every test that uses ``world`` runs twice: with CDI files and in legacy mode (CDI disabled), where the
CDI directory must stay empty whatever happens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lifecycle_world import World, build_world

from sidecar.nvml.sim import uninstall


@pytest.fixture(params=[True, False], ids=["cdi", "no-cdi"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    w = build_world(tmp_path, cdi_enabled=request.param)
    try:
        yield w
    finally:
        w.records.close()
        uninstall()


@pytest.fixture
def cdi_world(tmp_path: Path) -> Iterator[World]:
    w = build_world(tmp_path, cdi_enabled=True)
    try:
        yield w
    finally:
        w.records.close()
        uninstall()
