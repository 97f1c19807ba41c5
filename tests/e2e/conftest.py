"""End-to-end fixtures: ``sidecar`` (one started sidecar) and ``sidecar_factory`` (make more).

The process handle and its helpers live in ``sidecar_process`` (``Sidecar``, ``error_info``); tests
import them from there (``from sidecar_process import Sidecar, error_info``). See that module for the
paths, methods and the reasons behind them. Keep these names stable: every e2e test uses them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from sidecar_process import DEFAULT_SIM_GPUS, Sidecar, SidecarFactory


@pytest.fixture
def sidecar_factory() -> Iterator[SidecarFactory]:
    """Make sidecars (started and answering unless ``start=False``); all are stopped and removed after.

    ``root`` reuses another sidecar's directory (same socket, state and hardware): how a test builds a
    second sidecar that must be refused by the first one's lock."""
    made: list[Sidecar] = []
    roots: list[Path] = []

    def make(
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        sim_gpus: str = DEFAULT_SIM_GPUS,
        start: bool = True,
        root: Path | None = None,
    ) -> Sidecar:
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="hms"))
            roots.append(root)
        car = Sidecar(root, extra_args, env, sim_gpus)
        made.append(car)
        if start:
            car.start()
        return car

    yield make
    for car in made:
        car.close()
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sidecar(sidecar_factory: SidecarFactory) -> Sidecar:
    """A started sidecar on h100-80gb:2,a100-40gb:1 simulated GPUs, not yet recovered."""
    return sidecar_factory()
