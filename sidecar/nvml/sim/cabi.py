"""The C side of the simulated library: ctypes plumbing, handles, and the registry of C symbols.

Every emulated C function is a plain function ``(state, *C arguments) -> nvmlReturn_t`` registered
under its symbol names (``devices`` and ``instances`` hold them); ``library`` turns the registry into the
attributes pynvml fetches. ``@cfunc(...)`` registers one that may change the hardware: it gets the
mutable ``SimState``. ``@query(...)`` registers one that only reads: it gets the frozen ``StateView``,
so it cannot change the hardware, and the store need not look for a change after it.

Handles are opaque pointers whose value encodes (kind, GPU index, serial); serials are never reused
(they live in the shared state), so a stale handle is recognised across processes and reboots.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from typing import Any, overload

import pynvml

from sidecar.nvml.port import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED
from sidecar.nvml.sim.state import (
    AnyCi,
    AnyGi,
    AnyGpu,
    AnyState,
    CiView,
    GiView,
    GpuView,
    SimCi,
    SimError,
    SimGi,
    SimGpu,
    SimState,
    StateView,
)

NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
DRIVER_VERSION = "580.65.06"

# Strings nvidia-smi prints; pynvml's own table lacks IN_USE and INSUFFICIENT_RESOURCES.
ERROR_STRINGS: dict[int, str] = {
    0: "Success",
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    4: "Insufficient Permissions",
    5: "Already Initialized",
    6: "Not Found",
    7: "Insufficient Size",
    9: "Driver Not Loaded",
    10: "Timeout",
    12: "NVML Shared Library Not Found",
    13: "Function Not Found",
    15: "GPU is lost",
    16: "GPU requires restart",
    19: "In use by another client",
    20: "Insufficient Memory",
    21: "No data",
    23: "Insufficient Resources",
    25: "Argument version mismatch",
    27: "Not Ready",
    28: "GPU not found",
    29: "Invalid state",
    999: "Unknown Error",
}

# Short operation names for faults and latency, as an operator would say them.
OP_ALIASES: dict[str, tuple[str, ...]] = {
    "init": ("nvmlInit_v2", "nvmlInitWithFlags"),
    "create-gi": ("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlDeviceCreateGpuInstance"),
    "create-ci": (
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
    ),
    "destroy-ci": ("nvmlComputeInstanceDestroy",),
    "destroy-gi": ("nvmlGpuInstanceDestroy",),
    "get-gpu-instances": ("nvmlDeviceGetGpuInstances",),
    "get-gpu-instance": ("nvmlDeviceGetGpuInstanceById",),
    "get-compute-instances": ("nvmlGpuInstanceGetComputeInstances",),
    "get-compute-instance": ("nvmlGpuInstanceGetComputeInstanceById",),
    "set-mig-mode": ("nvmlDeviceSetMigMode",),
    "get-mig-mode": ("nvmlDeviceGetMigMode",),
    "processes": ("nvmlDeviceGetComputeRunningProcesses_v3",),
    "handle-by-uuid": ("nvmlDeviceGetHandleByUUID",),
    "profile-info": ("nvmlDeviceGetGpuInstanceProfileInfoV", "nvmlDeviceGetGpuInstanceProfileInfo"),
}
# Never faulted or delayed: pynvml calls it while rendering another error.
UNFAULTABLE = frozenset({"nvmlErrorString"})

KIND_GPU, KIND_GI, KIND_CI, KIND_MIG = 1, 2, 3, 4


def parse_code(code: int | str) -> int:
    """An nvmlReturn_t from a number (``19``) or a name (``IN_USE``, ``NVML_ERROR_IN_USE``)."""
    if isinstance(code, int):
        return code
    text = code.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    name = text.upper().replace("-", "_")
    value = getattr(pynvml, name if name.startswith("NVML_ERROR_") else f"NVML_ERROR_{name}", None)
    if not isinstance(value, int):
        raise ValueError(f"unknown NVML return code {code!r}")
    return value


def op_matches(op: str, fn: str) -> bool:
    return op in {fn, "any"} or fn in OP_ALIASES.get(op, ())


def known_op(op: str) -> bool:
    return op == "any" or op in OP_ALIASES or op in FUNCTIONS


# -- ctypes plumbing ----------------------------------------------------------------------------------


def handle(kind: int, gpu: int, serial: int = 0) -> int:
    return (kind << 60) | (gpu << 48) | serial


_POINTER = struct.Struct("P")  # a native pointer: what a ctypes pointer instance holds in its buffer


def handle_value(h: Any) -> int:
    """A handle's value. A ctypes pointer (what pynvml passes) is read from its buffer, which is much
    cheaper than ``ctypes.cast`` and gives the same number."""
    if isinstance(h, ctypes._Pointer):
        value: int = _POINTER.unpack_from(h)[0]
        return value
    if h is None:
        return 0
    if isinstance(h, int):
        return h
    return ctypes.cast(h, ctypes.c_void_p).value or 0


def target(ref: Any) -> Any:
    """The object behind a ``byref()`` argument (or a pointer's target)."""
    if ref is None:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "NULL output pointer")
    obj = getattr(ref, "_obj", None)
    if obj is not None:
        return obj
    if hasattr(ref, "contents"):
        return ref.contents
    return ref


def as_int(x: Any) -> int:
    return int(getattr(x, "value", x))


def set_pointer(ptr: Any, value: int) -> None:
    """Store an opaque handle value into a caller's ``c_nvml*_t`` (a ctypes POINTER instance)."""
    _POINTER.pack_into(ptr, 0, value)  # into its buffer: cheaper than a c_void_p at its address


def write_string(buf: Any, length: Any, text: str) -> None:
    data = text.encode()
    if len(data) + 1 > as_int(length):
        raise SimError(NVML_ERROR_INSUFFICIENT_SIZE, "buffer too small")
    buf.value = data


# -- the registry of emulated C functions ------------------------------------------------------------

FUNCTIONS: dict[str, Callable[..., Any]] = {}  # C symbol -> implementation (state, *C arguments)
QUERIES: set[str] = set()  # the C symbols registered with ``query``: they get a ``StateView``


def cfunc(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a C function that may change the hardware (it gets the mutable ``SimState``)."""

    def register(method: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            FUNCTIONS[name] = method
            QUERIES.discard(name)
        return method

    return register


def query(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a C function that only reads the hardware (it gets the frozen ``StateView``)."""

    def register(method: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            FUNCTIONS[name] = method
            QUERIES.add(name)
        return method

    return register


# -- handle resolution --------------------------------------------------------------------------------
# Each resolver takes the mutable state or its frozen view and answers in the same form.


def _decode(state: AnyState, value: int, kind: int) -> tuple[AnyGpu, int]:
    if value >> 60 != kind:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "handle of the wrong kind")
    index = (value >> 48) & 0xFFF
    if index >= len(state.gpus):
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "unknown device handle")
    gpu = state.gpus[index]
    if gpu.lost:
        raise SimError(NVML_ERROR_GPU_IS_LOST, f"GPU {index} has fallen off the bus")
    return gpu, value & ((1 << 48) - 1)


def device_of(state: AnyState, h: Any) -> tuple[AnyGpu, tuple[AnyGi, AnyCi] | None]:
    """A GPU handle, or a MIG device handle (then with its GI and CI)."""
    value = handle_value(h)
    if value >> 60 == KIND_MIG:
        gpu, serial = _decode(state, value, KIND_MIG)
        for gi in gpu.gis:  # serials are unique: no need for the enumeration order of mig_devices
            for ci in gi.cis:
                if ci.serial == serial:
                    return gpu, (gi, ci)
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "stale MIG device handle")
    gpu, _ = _decode(state, value, KIND_GPU)
    return gpu, None


@overload
def gpu_of(state: SimState, h: Any) -> SimGpu: ...
@overload
def gpu_of(state: StateView, h: Any) -> GpuView: ...
def gpu_of(state: AnyState, h: Any) -> AnyGpu:
    value = handle_value(h)
    if value >> 60 == KIND_GPU:  # the common case, without the detour through device_of
        return _decode(state, value, KIND_GPU)[0]
    gpu, mig = device_of(state, h)
    if mig is not None:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "a MIG device handle where a GPU handle is needed")
    return gpu


def mig_of(state: AnyState, h: Any) -> tuple[AnyGpu, AnyGi, AnyCi]:
    gpu, mig = device_of(state, h)
    if mig is None:
        raise SimError(NVML_ERROR_NOT_SUPPORTED, "not a MIG device handle")
    return gpu, mig[0], mig[1]


@overload
def gi_of(state: SimState, h: Any) -> tuple[SimGpu, SimGi]: ...
@overload
def gi_of(state: StateView, h: Any) -> tuple[GpuView, GiView]: ...
def gi_of(state: AnyState, h: Any) -> tuple[AnyGpu, AnyGi]:
    gpu, serial = _decode(state, handle_value(h), KIND_GI)
    for gi in gpu.gis:
        if gi.serial == serial:
            return gpu, gi
    raise SimError(NVML_ERROR_INVALID_ARGUMENT, "stale GPU instance handle")


@overload
def ci_of(state: SimState, h: Any) -> tuple[SimGpu, SimGi, SimCi]: ...
@overload
def ci_of(state: StateView, h: Any) -> tuple[GpuView, GiView, CiView]: ...
def ci_of(state: AnyState, h: Any) -> tuple[AnyGpu, AnyGi, AnyCi]:
    gpu, serial = _decode(state, handle_value(h), KIND_CI)
    for gi in gpu.gis:
        for ci in gi.cis:
            if ci.serial == serial:
                return gpu, gi, ci
    raise SimError(NVML_ERROR_INVALID_ARGUMENT, "stale compute instance handle")
