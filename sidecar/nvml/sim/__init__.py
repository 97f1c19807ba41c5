"""The simulated GPU node: a ``libnvidia-ml`` for pynvml, its state, and the knobs to operate it.

Kept apart from the port (``sidecar.nvml.port``) and the real adapter (``sidecar.nvml.pynvml_backend``):
the adapter runs unchanged over this library, installed as ``pynvml.nvmlLib``.

It is stricter than NVIDIA's go-nvml mock and says no where a real driver says no:

* overlap with an existing GI, or the profile's instance count exhausted -> INSUFFICIENT_RESOURCES;
* a placement not in the profile's list -> INVALID_ARGUMENT;
* destroying a GI that still has CIs, or a CI with processes -> IN_USE;
* GI create/list/lookups with MIG disabled -> NOT_SUPPORTED;
* a handle to a destroyed GI/CI -> INVALID_ARGUMENT, even when the same ID was created again;
* by-ID lookups of missing instances -> NOT_FOUND;
* a GI without a CI has no MIG device; every CI gets a fresh ``MIG-<uuid>``;
* GI IDs as real drivers number them (``profiles.gpu_instance_id``), CI IDs lowest free.

Modules: ``state`` (the hardware, its frozen view for queries, and its rules), ``store`` (memory or a
shared file), ``counters`` (call counts beside a state file), ``procfs`` (the fake /proc tree),
``cabi`` (ctypes plumbing, handles, the C symbol registry), ``devices`` and ``instances`` (the
emulated C functions), ``events`` (event sets and critical Xids: ``sim xid`` appends an Xid to the
shared state, and each event set, kept in the process that created it, delivers those raised after
its creation on its registered GPUs, once each; its wait polls outside the store's lock),
``library`` (what pynvml loads), ``hardware`` (layouts and knobs), ``cli`` (the ``sim`` commands).
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
