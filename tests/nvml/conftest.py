"""Fixtures of the NVML layer tests: in-memory simulated hardware with the adapter over it.

The ``backend`` fixture parametrises adapter tests over the simulated library (always) and a real
driver (only when ``pynvml.nvmlInit()`` succeeds on one; those runs are read-only and marked ``nvml``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall


def _real_driver_present() -> bool:
    uninstall()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    finally:
        uninstall()
    return True


@pytest.fixture
def real_driver() -> bool:
    """Whether a real NVIDIA driver answers on this machine."""
    return _real_driver_present()


@pytest.fixture
def make_hw(tmp_path: Path) -> Iterator[Callable[..., SimulatedHardware]]:
    """Build in-memory hardware and install it under pynvml; uninstalled after the test."""

    def make(*gpus: tuple[str, int], mig_enabled: bool = True) -> SimulatedHardware:
        hw = SimulatedHardware.create(list(gpus), mig_enabled=mig_enabled, proc_root=tmp_path / "proc")
        install(hw)
        return hw

    yield make
    uninstall()


@pytest.fixture
def h100(make_hw: Callable[..., SimulatedHardware]) -> SimulatedHardware:
    return make_hw(("h100-80gb", 1))


@pytest.fixture
def port(h100: SimulatedHardware) -> Iterator[PynvmlBackend]:
    backend = PynvmlBackend(retry_wait=False)
    yield backend
    backend.close()


@pytest.fixture(params=["simulated", pytest.param("nvml", marks=pytest.mark.nvml)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PynvmlBackend]:
    """The adapter over the simulated library, or over a real driver when one is present."""
    if request.param == "nvml":
        if not _real_driver_present():
            pytest.skip("no NVIDIA driver on this machine")
        real = PynvmlBackend(retry_wait=False)
        yield real
        real.close()
        uninstall()
        return
    install(SimulatedHardware.create([("a100-40gb", 1), ("h100-80gb", 1)], proc_root=tmp_path / "proc"))
    sim = PynvmlBackend(retry_wait=False)
    yield sim
    sim.close()
    uninstall()
