"""The simulated GPU node: a ``libnvidia-ml`` for pynvml, its state, and the knobs to operate it.

Kept apart from the port (``sidecar.nvml.port``) and the real adapter (``sidecar.nvml.pynvml_backend``):
the adapter runs unchanged over this library, installed as ``pynvml.nvmlLib``.

It is stricter than NVIDIA's go-nvml mock and says no where a real driver says no:

The rest: ``docs/architecture.md``, "Module notes", ``sidecar.nvml.sim``.
"""

from sidecar.nvml.sim.cabi import OP_ALIASES, parse_code
from sidecar.nvml.sim.hardware import CiLayout, GiLayout, GpuLayout, SimulatedHardware, open_or_init
from sidecar.nvml.sim.library import SimulatedLibrary, install, uninstall
from sidecar.nvml.sim.state import SimError

__all__ = [
    "OP_ALIASES",
    "CiLayout",
    "GiLayout",
    "GpuLayout",
    "SimError",
    "SimulatedHardware",
    "SimulatedLibrary",
    "install",
    "open_or_init",
    "parse_code",
    "uninstall",
]
