"""A simulated ``libnvidia-ml`` for pynvml, and the knobs to operate it.

``SimulatedLibrary`` is installed as ``pynvml.nvmlLib``. Its attributes emulate the C functions: they
take what pynvml's wrappers pass (ctypes handles, ``byref`` out-parameters, caller-allocated arrays),
write results through them and return ``nvmlReturn_t`` codes. The real pynvml wrappers, ctypes
structs and ``NVMLError`` classes therefore run in every test, and the adapter cannot tell this
library from the real one. (This module and the adapter are the only ones that import pynvml: the
simulator has to, to install itself and to speak pynvml's ctypes types.)

It is stricter than NVIDIA's go-nvml mock and says no where a real driver says no:

* overlap with an existing GI, or the profile's instance count exhausted -> INSUFFICIENT_RESOURCES;
* a placement not in the profile's list -> INVALID_ARGUMENT;
* destroying a GI that still has CIs, or a CI with processes -> IN_USE;
* GI create/list/lookups with MIG disabled -> NOT_SUPPORTED (possible placements and profile info
  answer regardless of MIG mode, as on current drivers);
* a handle to a destroyed GI/CI -> INVALID_ARGUMENT, even when the same ID was created again;
* by-ID lookups of missing instances -> NOT_FOUND;
* a GI without a CI has no MIG device; every CI gets a fresh ``MIG-<uuid>``;
* GI IDs as real drivers number them (``profiles.gpu_instance_id``), CI IDs lowest free.

Handles are opaque pointers whose value encodes (kind, GPU index, serial). Serials are never reused
(they live in the shared state), so a stale handle is recognised across processes and reboots.

Knobs (``SimulatedHardware`` and the ``sim`` commands): create an instance no sidecar owns, mark a
MIG device busy (a process runs on it), inject faults (the next N calls of an operation fail with a
code), lose a GPU (every call on it -> GPU_IS_LOST), add latency, reboot the node.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pynvml

from sidecar.domain import Placement
from sidecar.nvml import profiles
from sidecar.nvml import simstate as rules
from sidecar.nvml.port import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_SUCCESS,
)
from sidecar.nvml.simstate import (
    FileStore,
    MemoryStore,
    SimCi,
    SimError,
    SimFault,
    SimGi,
    SimGpu,
    SimState,
    StateStore,
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
_UNFAULTABLE = frozenset({"nvmlErrorString"})

_KIND_GPU, _KIND_GI, _KIND_CI, _KIND_MIG = 1, 2, 3, 4


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


def _op_matches(op: str, fn: str) -> bool:
    return op in {fn, "any"} or fn in OP_ALIASES.get(op, ())


def known_op(op: str) -> bool:
    return op == "any" or op in OP_ALIASES or op in _FUNCTIONS


# -- ctypes plumbing ----------------------------------------------------------------------------------


def _handle(kind: int, gpu: int, serial: int = 0) -> int:
    return (kind << 60) | (gpu << 48) | serial


def _handle_value(h: Any) -> int:
    if h is None:
        return 0
    if isinstance(h, int):
        return h
    return ctypes.cast(h, ctypes.c_void_p).value or 0


def _out(ref: Any) -> Any:
    """The object behind a ``byref()`` argument (or a pointer's target)."""
    if ref is None:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "NULL output pointer")
    obj = getattr(ref, "_obj", None)
    if obj is not None:
        return obj
    if hasattr(ref, "contents"):
        return ref.contents
    return ref


def _int(x: Any) -> int:
    return int(getattr(x, "value", x))


def _set_pointer(ptr: Any, value: int) -> None:
    """Store an opaque handle value into a caller's ``c_nvml*_t`` (a ctypes POINTER instance)."""
    ctypes.c_void_p.from_address(ctypes.addressof(ptr)).value = value


def _write_string(buf: Any, length: Any, text: str) -> None:
    data = text.encode()
    if len(data) + 1 > _int(length):
        raise SimError(NVML_ERROR_INSUFFICIENT_SIZE, "buffer too small")
    buf.value = data


# -- the library --------------------------------------------------------------------------------------

_FUNCTIONS: dict[str, str] = {}  # C symbol -> method name


def _c(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(method: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            _FUNCTIONS[name] = method.__name__
        return method

    return register


class _CFunction:
    """One emulated C symbol. A plain object, not a bound method, because pynvml assigns attributes
    (``restype``) to the function pointers it fetches."""

    def __init__(self, library: SimulatedLibrary, name: str, impl: Callable[..., Any]) -> None:
        self.__name__ = name
        self.restype: Any = None
        self.argtypes: Any = None
        self._library = library
        self._impl = impl

    def __call__(self, *args: Any) -> Any:
        return self._library.call(self.__name__, self._impl, args)


class SimulatedLibrary:
    """The emulated C API over a state store; attribute names are the C symbols pynvml fetches."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        for symbol, method in _FUNCTIONS.items():
            setattr(self, symbol, _CFunction(self, symbol, getattr(self, method)))

    def call(self, name: str, impl: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if name in _UNFAULTABLE:
            with self.store.transaction(call=name):
                pass  # counted like every other call, but never faulted or delayed
            return impl(None, *args)
        delay = 0.0
        with self.store.transaction(call=name) as state:
            delay = sum(s for op, s in state.latency.items() if _op_matches(op, name))
            code = self._consume_fault(state, name)
            if code is None:
                try:
                    code = impl(state, *args)
                except SimError as exc:
                    code = exc.code
        if delay > 0:
            time.sleep(delay)  # outside the lock: a slow call does not stall every other caller
        return code

    @staticmethod
    def _consume_fault(state: SimState, name: str) -> int | None:
        for fault in state.faults:
            if not _op_matches(fault.op, name):
                continue
            if fault.after > 0:
                fault.after -= 1
                continue
            fault.times -= 1
            if fault.times <= 0:
                state.faults.remove(fault)
            return fault.code
        return None

    # -- handle resolution ---------------------------------------------------------------------------

    @staticmethod
    def _decode(state: SimState, h: Any, kind: int) -> tuple[SimGpu, int]:
        value = _handle_value(h)
        if value >> 60 != kind:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "handle of the wrong kind")
        index = (value >> 48) & 0xFFF
        if index >= len(state.gpus):
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "unknown device handle")
        gpu = state.gpus[index]
        if gpu.lost:
            raise SimError(NVML_ERROR_GPU_IS_LOST, f"GPU {index} has fallen off the bus")
        return gpu, value & ((1 << 48) - 1)

    def _device(self, state: SimState, h: Any) -> tuple[SimGpu, tuple[SimGi, SimCi] | None]:
        """A GPU handle, or a MIG device handle (then with its GI and CI)."""
        if _handle_value(h) >> 60 == _KIND_MIG:
            gpu, serial = self._decode(state, h, _KIND_MIG)
            for gi, ci in rules.mig_devices(gpu):
                if ci.serial == serial:
                    return gpu, (gi, ci)
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "stale MIG device handle")
        gpu, _ = self._decode(state, h, _KIND_GPU)
        return gpu, None

    def _gpu(self, state: SimState, h: Any) -> SimGpu:
        gpu, mig = self._device(state, h)
        if mig is not None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "a MIG device handle where a GPU handle is needed")
        return gpu

    def _mig(self, state: SimState, h: Any) -> tuple[SimGpu, SimGi, SimCi]:
        gpu, mig = self._device(state, h)
        if mig is None:
            raise SimError(NVML_ERROR_NOT_SUPPORTED, "not a MIG device handle")
        return gpu, mig[0], mig[1]

    def _gi(self, state: SimState, h: Any) -> tuple[SimGpu, SimGi]:
        gpu, serial = self._decode(state, h, _KIND_GI)
        for gi in gpu.gis:
            if gi.serial == serial:
                return gpu, gi
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "stale GPU instance handle")

    def _ci(self, state: SimState, h: Any) -> tuple[SimGpu, SimGi, SimCi]:
        gpu, serial = self._decode(state, h, _KIND_CI)
        for gi in gpu.gis:
            for ci in gi.cis:
                if ci.serial == serial:
                    return gpu, gi, ci
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "stale compute instance handle")

    # -- system --------------------------------------------------------------------------------------

    @_c("nvmlInit_v2", "nvmlInit", "nvmlShutdown")
    def _ok(self, state: SimState) -> int:
        return NVML_SUCCESS

    @_c("nvmlInitWithFlags")
    def _init_flags(self, state: SimState, flags: Any) -> int:
        return NVML_SUCCESS

    @_c("nvmlErrorString")
    def _error_string(self, state: None, code: Any) -> bytes:
        return ERROR_STRINGS.get(_int(code), f"Unknown Error ({_int(code)})").encode()

    @_c("nvmlSystemGetDriverVersion")
    def _driver_version(self, state: SimState, buf: Any, length: Any) -> int:
        _write_string(buf, length, DRIVER_VERSION)
        return NVML_SUCCESS

    # -- devices -------------------------------------------------------------------------------------

    @_c("nvmlDeviceGetCount_v2", "nvmlDeviceGetCount")
    def _count(self, state: SimState, count: Any) -> int:
        _out(count).value = len(state.gpus)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex")
    def _by_index(self, state: SimState, index: Any, device: Any) -> int:
        i = _int(index)
        if not 0 <= i < len(state.gpus):
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"no GPU at index {i}")
        if state.gpus[i].lost:
            raise SimError(NVML_ERROR_GPU_IS_LOST, f"GPU {i} has fallen off the bus")
        _set_pointer(_out(device), _handle(_KIND_GPU, i))
        return NVML_SUCCESS

    @_c("nvmlDeviceGetHandleByUUID")
    def _by_uuid(self, state: SimState, uuid: Any, device: Any) -> int:
        """Takes a GPU UUID or a MIG UUID (then the handle is the MIG device's)."""
        raw = getattr(uuid, "value", uuid)
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        for gpu in state.gpus:
            if gpu.uuid == text:
                if gpu.lost:
                    raise SimError(NVML_ERROR_GPU_IS_LOST, f"GPU {gpu.index} has fallen off the bus")
                _set_pointer(_out(device), _handle(_KIND_GPU, gpu.index))
                return NVML_SUCCESS
            for _, ci in rules.mig_devices(gpu):
                if ci.mig_uuid == text:
                    if gpu.lost:
                        raise SimError(NVML_ERROR_GPU_IS_LOST, f"GPU {gpu.index} has fallen off the bus")
                    _set_pointer(_out(device), _handle(_KIND_MIG, gpu.index, ci.serial))
                    return NVML_SUCCESS
        raise SimError(NVML_ERROR_NOT_FOUND, f"no device with UUID {text}")

    @_c("nvmlDeviceGetName")
    def _name(self, state: SimState, h: Any, buf: Any, length: Any) -> int:
        gpu, mig = self._device(state, h)
        model = rules.model_of(gpu)
        name = model.name
        if mig is not None:
            name = f"{model.name} MIG {rules.gi_profile(gpu, mig[0].profile_id).name}"
        _write_string(buf, length, name)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetUUID")
    def _uuid(self, state: SimState, h: Any, buf: Any, length: Any) -> int:
        gpu, mig = self._device(state, h)
        _write_string(buf, length, gpu.uuid if mig is None else mig[1].mig_uuid)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetMinorNumber")
    def _minor(self, state: SimState, h: Any, minor: Any) -> int:
        _out(minor).value = self._gpu(state, h).minor
        return NVML_SUCCESS

    @_c("nvmlDeviceGetIndex")
    def _index(self, state: SimState, h: Any, index: Any) -> int:
        _out(index).value = self._gpu(state, h).index
        return NVML_SUCCESS

    @_c("nvmlDeviceGetMemoryInfo")
    def _memory(self, state: SimState, h: Any, memory: Any) -> int:
        gpu, mig = self._device(state, h)
        model = rules.model_of(gpu)
        mb = model.memory_mb if mig is None else rules.gi_profile(gpu, mig[0].profile_id).memory_mb
        info = _out(memory)
        info.total = mb * 1024 * 1024
        info.used = 0
        info.free = info.total
        return NVML_SUCCESS

    @_c("nvmlDeviceGetMigMode")
    def _get_mig_mode(self, state: SimState, h: Any, current: Any, pending: Any) -> int:
        gpu = self._gpu(state, h)
        _out(current).value = int(gpu.mig_current)
        _out(pending).value = int(gpu.mig_pending)
        return NVML_SUCCESS

    @_c("nvmlDeviceSetMigMode")
    def _set_mig_mode(self, state: SimState, h: Any, mode: Any, status: Any) -> int:
        """Hopper toggles at once. Ampere only records the pending mode and reports RESET_REQUIRED as
        activation status until the node reboots (``sim reboot``). Disabling while GIs exist, or any
        change while a process runs on the GPU, is refused with activation status IN_USE; only the
        call's own return code raises in pynvml, so the caller must look at the status.

        A refused activation still records the pending mode, as real drivers do (nvidia-smi: "MIG
        mode is in pending enable state for GPU ...: In use by another client"): it applies at the
        next GPU reset or reboot, or is withdrawn by asking for the current mode again."""
        gpu = self._gpu(state, h)
        enable = _int(mode)
        if enable not in (0, 1):
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"bad MIG mode {enable}")
        result = _out(status)
        wanted = bool(enable)
        busy = gpu.uuid in state.busy or any(ci.mig_uuid in state.busy for _, ci in rules.mig_devices(gpu))
        gpu.mig_pending = wanted
        if wanted != gpu.mig_current and (busy or (not wanted and gpu.gis)):
            result.value = NVML_ERROR_IN_USE
            return NVML_SUCCESS
        if rules.model_of(gpu).resetless_mig_toggle or wanted == gpu.mig_current:
            gpu.mig_current = wanted
            result.value = NVML_SUCCESS
        else:
            result.value = NVML_ERROR_RESET_REQUIRED
        return NVML_SUCCESS

    @_c("nvmlDeviceGetMaxMigDeviceCount")
    def _max_mig(self, state: SimState, h: Any, count: Any) -> int:
        gpu = self._gpu(state, h)
        _out(count).value = rules.model_of(gpu).max_mig_devices if gpu.mig_current else 0
        return NVML_SUCCESS

    @_c("nvmlDeviceGetMigDeviceHandleByIndex")
    def _mig_by_index(self, state: SimState, h: Any, index: Any, device: Any) -> int:
        gpu = self._gpu(state, h)
        rules.require_mig(gpu)
        i = _int(index)
        if not 0 <= i < rules.model_of(gpu).max_mig_devices:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"MIG device index {i} out of range")
        devices = rules.mig_devices(gpu)
        if i >= len(devices):
            raise SimError(NVML_ERROR_NOT_FOUND, f"no MIG device at index {i}")
        _set_pointer(_out(device), _handle(_KIND_MIG, gpu.index, devices[i][1].serial))
        return NVML_SUCCESS

    @_c("nvmlDeviceIsMigDeviceHandle")
    def _is_mig(self, state: SimState, h: Any, result: Any) -> int:
        _, mig = self._device(state, h)
        _out(result).value = int(mig is not None)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetGpuInstanceId")
    def _mig_gi_id(self, state: SimState, h: Any, result: Any) -> int:
        _out(result).value = self._mig(state, h)[1].id
        return NVML_SUCCESS

    @_c("nvmlDeviceGetComputeInstanceId")
    def _mig_ci_id(self, state: SimState, h: Any, result: Any) -> int:
        _out(result).value = self._mig(state, h)[2].id
        return NVML_SUCCESS

    @_c("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
    def _mig_parent(self, state: SimState, h: Any, device: Any) -> int:
        gpu, _, _ = self._mig(state, h)
        _set_pointer(_out(device), _handle(_KIND_GPU, gpu.index))
        return NVML_SUCCESS

    @_c("nvmlDeviceGetComputeRunningProcesses_v3")
    def _processes(self, state: SimState, h: Any, count: Any, infos: Any) -> int:
        """Busy markers as processes: a busy MIG device lists one, and its parent GPU lists it too."""
        gpu, mig = self._device(state, h)
        procs: list[tuple[str, int, int]] = []
        if mig is None and gpu.uuid in state.busy:
            procs.append((gpu.uuid, 0xFFFFFFFF, 0xFFFFFFFF))
        for gi, ci in rules.mig_devices(gpu):
            if ci.mig_uuid in state.busy and (mig is None or mig[1] is ci):
                procs.append((ci.mig_uuid, gi.id, ci.id))
        n = _out(count)
        if not procs:
            n.value = 0
            return NVML_SUCCESS
        if infos is None or n.value < len(procs):
            n.value = len(procs)
            return NVML_ERROR_INSUFFICIENT_SIZE
        for i, (owner, gi_id, ci_id) in enumerate(procs):
            infos[i].pid = 4000 + int(owner[-4:], 16) % 60000
            infos[i].usedGpuMemory = 256 * 1024 * 1024
            infos[i].gpuInstanceId = gi_id
            infos[i].computeInstanceId = ci_id
        n.value = len(procs)
        return NVML_SUCCESS

    # -- GPU instance profiles -----------------------------------------------------------------------

    @staticmethod
    def _fill_gi_profile(info: Any, p: profiles.GiProfile, with_name: bool) -> None:
        info.id = p.id
        info.isP2pSupported = 0
        info.sliceCount = p.slice_count
        info.instanceCount = p.instance_count
        info.multiprocessorCount = p.multiprocessor_count
        info.copyEngineCount = p.copy_engines
        info.decoderCount = p.decoders
        info.encoderCount = p.encoders
        info.jpegCount = p.jpegs
        info.ofaCount = p.ofas
        info.memorySizeMB = p.memory_mb
        if with_name:
            info.name = f"MIG {p.name}".encode()

    def _gi_profile_by_index(self, state: SimState, h: Any, index: Any) -> profiles.GiProfile:
        gpu = self._gpu(state, h)
        i = _int(index)
        if not 0 <= i < profiles.GI_PROFILE_COUNT:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"GI profile index {i} out of range")
        p = rules.model_of(gpu).profile_by_index(i)
        if p is None:
            raise SimError(NVML_ERROR_NOT_SUPPORTED, f"GI profile index {i} is not supported on this GPU")
        return p

    @staticmethod
    def _check_version(info: Any, version: int) -> None:
        if info.version != version:
            raise SimError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "struct version mismatch")

    @_c("nvmlDeviceGetGpuInstanceProfileInfoV")
    def _gi_profile_info_v(self, state: SimState, h: Any, index: Any, info: Any) -> int:
        out = _out(info)
        self._check_version(out, pynvml.nvmlGpuInstanceProfileInfo_v2)
        self._fill_gi_profile(out, self._gi_profile_by_index(state, h, index), with_name=True)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetGpuInstanceProfileInfo")
    def _gi_profile_info_v1(self, state: SimState, h: Any, index: Any, info: Any) -> int:
        self._fill_gi_profile(_out(info), self._gi_profile_by_index(state, h, index), with_name=False)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetGpuInstanceProfileInfoByIdV")
    def _gi_profile_info_by_id(self, state: SimState, h: Any, profile_id: Any, info: Any) -> int:
        out = _out(info)
        self._check_version(out, pynvml.nvmlGpuInstanceProfileInfo_v2)
        p = rules.model_of(self._gpu(state, h)).profile_by_id(_int(profile_id))
        if p is None:
            raise SimError(NVML_ERROR_NOT_SUPPORTED, f"GI profile ID {_int(profile_id)} is not supported")
        self._fill_gi_profile(out, p, with_name=True)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetGpuInstancePossiblePlacements_v2")
    def _gi_placements(self, state: SimState, h: Any, profile_id: Any, placements: Any, count: Any) -> int:
        """Static per profile, answered whatever the MIG mode; NULL array = count query."""
        gpu = self._gpu(state, h)
        p = rules.gi_profile(gpu, _int(profile_id))
        n = _out(count)
        if placements is None:
            n.value = len(p.starts)
            return NVML_SUCCESS
        if n.value < len(p.starts):
            n.value = len(p.starts)
            return NVML_ERROR_INSUFFICIENT_SIZE
        for i, start in enumerate(p.starts):
            placements[i].start = start
            placements[i].size = p.size
        n.value = len(p.starts)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetGpuInstanceRemainingCapacity")
    def _gi_capacity(self, state: SimState, h: Any, profile_id: Any, count: Any) -> int:
        gpu = self._gpu(state, h)
        rules.require_mig(gpu)
        _out(count).value = rules.remaining_capacity(gpu, rules.gi_profile(gpu, _int(profile_id)))
        return NVML_SUCCESS

    # -- GPU instances -------------------------------------------------------------------------------

    def _gi_handle(self, gpu: SimGpu, gi: SimGi) -> int:
        return _handle(_KIND_GI, gpu.index, gi.serial)

    @_c("nvmlDeviceCreateGpuInstanceWithPlacement")
    def _create_gi_at(self, state: SimState, h: Any, profile_id: Any, placement: Any, gi: Any) -> int:
        gpu = self._gpu(state, h)
        p = _out(placement)
        created = rules.create_gi(state, gpu, _int(profile_id), int(p.start), int(p.size))
        _set_pointer(_out(gi), self._gi_handle(gpu, created))
        return NVML_SUCCESS

    @_c("nvmlDeviceCreateGpuInstance")
    def _create_gi(self, state: SimState, h: Any, profile_id: Any, gi: Any) -> int:
        gpu = self._gpu(state, h)
        created = rules.create_gi(state, gpu, _int(profile_id), None, None)
        _set_pointer(_out(gi), self._gi_handle(gpu, created))
        return NVML_SUCCESS

    @_c("nvmlDeviceGetGpuInstances")
    def _get_gis(self, state: SimState, h: Any, profile_id: Any, gis: Any, count: Any) -> int:
        gpu = self._gpu(state, h)
        rules.require_mig(gpu)
        p = rules.gi_profile(gpu, _int(profile_id))
        found = [gi for gi in gpu.gis if gi.profile_id == p.id]
        if gis is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "NULL GPU instance array")
        if len(found) > len(gis):
            _out(count).value = len(found)
            return NVML_ERROR_INSUFFICIENT_SIZE
        for i, gi in enumerate(found):
            gis[i] = ctypes.cast(self._gi_handle(gpu, gi), pynvml.c_nvmlGpuInstance_t)
        _out(count).value = len(found)
        return NVML_SUCCESS

    @_c("nvmlDeviceGetGpuInstanceById")
    def _gi_by_id(self, state: SimState, h: Any, gi_id: Any, gi: Any) -> int:
        gpu = self._gpu(state, h)
        rules.require_mig(gpu)
        _set_pointer(_out(gi), self._gi_handle(gpu, rules.find_gi(gpu, _int(gi_id))))
        return NVML_SUCCESS

    @_c("nvmlGpuInstanceGetInfo")
    def _gi_info(self, state: SimState, h: Any, info: Any) -> int:
        gpu, gi = self._gi(state, h)
        out = _out(info)
        out.device = ctypes.cast(_handle(_KIND_GPU, gpu.index), pynvml.c_nvmlDevice_t)
        out.id = gi.id
        out.profileId = gi.profile_id
        out.placement.start = gi.start
        out.placement.size = gi.size
        return NVML_SUCCESS

    @_c("nvmlGpuInstanceDestroy")
    def _destroy_gi(self, state: SimState, h: Any) -> int:
        gpu, gi = self._gi(state, h)
        rules.destroy_gi(state, gpu, gi)
        return NVML_SUCCESS

    # -- compute instances ---------------------------------------------------------------------------

    def _ci_profile_info(self, state: SimState, h: Any, index: Any, eng: Any, info: Any, *, v2: bool) -> int:
        gpu, gi = self._gi(state, h)
        out = _out(info)
        if v2:
            self._check_version(out, pynvml.nvmlComputeInstanceProfileInfo_v2)
        if _int(eng) != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "only shared engine profiles exist")
        cp = rules.ci_profile(gpu, gi, _int(index))
        gp = rules.gi_profile(gpu, gi.profile_id)
        out.id = cp.id
        out.sliceCount = cp.slice_count
        out.instanceCount = cp.instance_count
        # SMs split evenly across compute slices (real drivers round a little differently).
        out.multiprocessorCount = gp.multiprocessor_count * cp.slice_count // gp.slice_count
        out.sharedCopyEngineCount = gp.copy_engines
        out.sharedDecoderCount = gp.decoders
        out.sharedEncoderCount = gp.encoders
        out.sharedJpegCount = gp.jpegs
        out.sharedOfaCount = gp.ofas
        if v2:
            out.name = f"MIG {profiles.ci_profile_name(gp, cp)}".encode()
        return NVML_SUCCESS

    @_c("nvmlGpuInstanceGetComputeInstanceProfileInfoV")
    def _ci_profile_info_v(self, state: SimState, h: Any, index: Any, eng: Any, info: Any) -> int:
        return self._ci_profile_info(state, h, index, eng, info, v2=True)

    @_c("nvmlGpuInstanceGetComputeInstanceProfileInfo")
    def _ci_profile_info_v1(self, state: SimState, h: Any, index: Any, eng: Any, info: Any) -> int:
        return self._ci_profile_info(state, h, index, eng, info, v2=False)

    @_c("nvmlGpuInstanceGetComputeInstanceRemainingCapacity")
    def _ci_capacity(self, state: SimState, h: Any, profile_id: Any, count: Any) -> int:
        gpu, gi = self._gi(state, h)
        cp = rules.ci_profile(gpu, gi, _int(profile_id))
        existing = sum(1 for c in gi.cis if c.profile_id == cp.id)
        _out(count).value = max(0, min(cp.instance_count - existing, len(rules.ci_free_starts(gi, cp))))
        return NVML_SUCCESS

    @_c("nvmlGpuInstanceGetComputeInstancePossiblePlacements")
    def _ci_placements(self, state: SimState, h: Any, profile_id: Any, placements: Any, count: Any) -> int:
        gpu, gi = self._gi(state, h)
        cp = rules.ci_profile(gpu, gi, _int(profile_id))
        n = _out(count)
        if placements is None:
            n.value = len(cp.starts)
            return NVML_SUCCESS
        if n.value < len(cp.starts):
            n.value = len(cp.starts)
            return NVML_ERROR_INSUFFICIENT_SIZE
        for i, start in enumerate(cp.starts):
            placements[i].start = start
            placements[i].size = cp.slice_count
        n.value = len(cp.starts)
        return NVML_SUCCESS

    def _ci_handle(self, gpu: SimGpu, ci: SimCi) -> int:
        return _handle(_KIND_CI, gpu.index, ci.serial)

    @_c("nvmlGpuInstanceCreateComputeInstance")
    def _create_ci(self, state: SimState, h: Any, profile_id: Any, ci: Any) -> int:
        gpu, gi = self._gi(state, h)
        created = rules.create_ci(state, gpu, gi, _int(profile_id))
        _set_pointer(_out(ci), self._ci_handle(gpu, created))
        return NVML_SUCCESS

    @_c("nvmlGpuInstanceCreateComputeInstanceWithPlacement")
    def _create_ci_at(self, state: SimState, h: Any, profile_id: Any, placement: Any, ci: Any) -> int:
        gpu, gi = self._gi(state, h)
        p = _out(placement)
        cp = rules.ci_profile(gpu, gi, _int(profile_id))
        if int(p.size) != cp.slice_count:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "CI placement size does not match the profile")
        created = rules.create_ci(state, gpu, gi, cp.id, int(p.start))
        _set_pointer(_out(ci), self._ci_handle(gpu, created))
        return NVML_SUCCESS

    @_c("nvmlGpuInstanceGetComputeInstances")
    def _get_cis(self, state: SimState, h: Any, profile_id: Any, cis: Any, count: Any) -> int:
        gpu, gi = self._gi(state, h)
        cp = rules.ci_profile(gpu, gi, _int(profile_id))
        found = [c for c in gi.cis if c.profile_id == cp.id]
        if cis is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "NULL compute instance array")
        if len(found) > len(cis):
            _out(count).value = len(found)
            return NVML_ERROR_INSUFFICIENT_SIZE
        for i, c in enumerate(found):
            cis[i] = ctypes.cast(self._ci_handle(gpu, c), pynvml.c_nvmlComputeInstance_t)
        _out(count).value = len(found)
        return NVML_SUCCESS

    @_c("nvmlGpuInstanceGetComputeInstanceById")
    def _ci_by_id(self, state: SimState, h: Any, ci_id: Any, ci: Any) -> int:
        gpu, gi = self._gi(state, h)
        _set_pointer(_out(ci), self._ci_handle(gpu, rules.find_ci(gpu, gi, _int(ci_id))))
        return NVML_SUCCESS

    @_c("nvmlComputeInstanceGetInfo_v2", "nvmlComputeInstanceGetInfo")
    def _ci_info(self, state: SimState, h: Any, info: Any) -> int:
        """``device`` is the MIG device handle (its UUID is the MIG UUID), as drivers that real-world
        controllers were tested against return it, although nvml.h calls it the parent device."""
        gpu, gi, ci = self._ci(state, h)
        out = _out(info)
        out.device = ctypes.cast(_handle(_KIND_MIG, gpu.index, ci.serial), pynvml.c_nvmlDevice_t)
        out.gpuInstance = ctypes.cast(self._gi_handle(gpu, gi), pynvml.c_nvmlGpuInstance_t)
        out.id = ci.id
        out.profileId = ci.profile_id
        out.placement.start = ci.start
        out.placement.size = ci.size
        return NVML_SUCCESS

    @_c("nvmlComputeInstanceDestroy")
    def _destroy_ci(self, state: SimState, h: Any) -> int:
        gpu, gi, ci = self._ci(state, h)
        rules.destroy_ci(state, gpu, gi, ci)
        return NVML_SUCCESS


# -- installing into pynvml ---------------------------------------------------------------------------


def install(hardware: SimulatedHardware) -> SimulatedLibrary:
    """Make pynvml talk to ``hardware``: set ``pynvml.nvmlLib`` and forget cached function pointers."""
    library = SimulatedLibrary(hardware.store)
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
    for code, text in ERROR_STRINGS.items():
        pynvml.NVMLError._errcode_to_string.setdefault(code, text)
    return library


def uninstall() -> None:
    """Undo ``install`` (tests): pynvml is back to "no library loaded"."""
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0


# -- the operator's view and knobs --------------------------------------------------------------------


class CiLayout(msgspec.Struct, frozen=True):
    id: int
    profile_id: int
    start: int
    size: int
    mig_uuid: str
    busy: bool


class GiLayout(msgspec.Struct, frozen=True):
    id: int
    profile_id: int
    profile: str
    placement: Placement
    cis: tuple[CiLayout, ...]

    @property
    def mig_uuid(self) -> str | None:
        return self.cis[0].mig_uuid if self.cis else None


class GpuLayout(msgspec.Struct, frozen=True):
    index: int
    uuid: str
    model: str
    name: str
    minor: int
    mig_current: bool
    mig_pending: bool
    lost: bool
    busy: bool
    gis: tuple[GiLayout, ...]


def _layout(state: SimState, gpu: SimGpu) -> GpuLayout:
    m = rules.model_of(gpu)
    gis = []
    for gi in sorted(gpu.gis, key=lambda g: g.id):
        p = rules.gi_profile(gpu, gi.profile_id)
        cis = tuple(
            CiLayout(c.id, c.profile_id, c.start, c.size, c.mig_uuid, c.mig_uuid in state.busy)
            for c in sorted(gi.cis, key=lambda c: c.id)
        )
        gis.append(GiLayout(gi.id, gi.profile_id, p.name, Placement(gi.start, gi.size), cis))
    return GpuLayout(
        gpu.index,
        gpu.uuid,
        m.key,
        m.name,
        gpu.minor,
        gpu.mig_current,
        gpu.mig_pending,
        gpu.lost,
        gpu.uuid in state.busy,
        tuple(gis),
    )


class SimulatedHardware:
    """A simulated GPU node: the state store plus the knobs a test or an operator turns.

    ``create`` keeps the hardware in memory (tests); ``open``/``init_file`` share it through a state
    file. The knobs change the same state the library reads, under the same lock, and obey the same
    rules (an unowned instance still needs a legal, free placement)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    @classmethod
    def create(
        cls, gpus: Sequence[tuple[str, int]], *, mig_enabled: bool = True, proc_root: Path | None = None
    ) -> SimulatedHardware:
        """In-memory hardware, e.g. ``create([("h100-80gb", 2)], proc_root=tmp_path / "proc")``."""
        return cls(MemoryStore(rules.new_state(list(gpus), mig_enabled), proc_root))

    @classmethod
    def open(cls, state_file: Path) -> SimulatedHardware:
        store = FileStore(state_file)
        if not state_file.exists():
            raise FileNotFoundError(f"simulated hardware state {state_file} does not exist (run `sim init`)")
        return cls(store)

    @classmethod
    def init_file(
        cls,
        state_file: Path,
        gpus: Sequence[tuple[str, int]],
        *,
        mig_enabled: bool = True,
        overwrite: bool = False,
    ) -> SimulatedHardware:
        return cls(FileStore.create(state_file, rules.new_state(list(gpus), mig_enabled), overwrite))

    @property
    def proc_root(self) -> Path | None:
        return self.store.proc_root

    # -- reading -------------------------------------------------------------------------------------

    def state(self) -> SimState:
        """A detached copy of the whole state."""
        with self.store.transaction() as state:
            return msgspec.json.decode(msgspec.json.encode(state), type=SimState)

    def call_counts(self) -> dict[str, int]:
        """Calls of each simulated C function since the hardware was created or the counts were reset,
        by C symbol (``nvmlDeviceCreateGpuInstanceWithPlacement`` …), summed over every process that
        uses this hardware. Faulted calls count too: the caller made them. Only functions called at
        least once appear. The numbers are exact and noise-free, which makes them the honest measure
        of what a decision costs in NVML round trips (each one a driver ioctl on a real node)."""
        return self.store.call_counts()

    def reset_call_counts(self) -> None:
        """Start counting from zero (the layout, faults and knobs are untouched)."""
        self.store.reset_call_counts()

    @property
    def boot_id(self) -> str:
        return self.state().boot_id

    def gpu_uuid(self, gpu_index: int) -> str:
        return self.state().gpus[gpu_index].uuid

    def layout(self, gpu_index: int) -> GpuLayout:
        with self.store.transaction() as state:
            return _layout(state, self._gpu(state, gpu_index))

    def layouts(self) -> list[GpuLayout]:
        with self.store.transaction() as state:
            return [_layout(state, g) for g in state.gpus]

    @staticmethod
    def _gpu(state: SimState, gpu_index: int) -> SimGpu:
        if not 0 <= gpu_index < len(state.gpus):
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"no GPU at index {gpu_index}")
        return state.gpus[gpu_index]

    # -- knobs ---------------------------------------------------------------------------------------

    def create_instance(
        self, gpu_index: int, profile_name: str, start: int, size: int, with_ci: bool = True
    ) -> GiLayout:
        """An instance no sidecar owns (what ``nvidia-smi mig -cgi … -C`` would leave behind)."""
        with self.store.transaction() as state:
            gpu = self._gpu(state, gpu_index)
            p = rules.model_of(gpu).profile_by_name(profile_name)
            if p is None:
                msg = f"GPU {gpu_index} has no profile {profile_name!r}"
                raise SimError(NVML_ERROR_INVALID_ARGUMENT, msg)
            gi = rules.create_gi(state, gpu, p.id, start, size)
            if with_ci:
                rules.create_ci(state, gpu, gi, p.full_ci_profile_id)
            layout = _layout(state, gpu)
        return next(g for g in layout.gis if g.id == gi.id)

    def destroy_instance(self, gpu_index: int, gi_id: int) -> None:
        """Destroy a GI's CIs, then the GI, as ``nvidia-smi mig -dci`` then ``-dgi`` would."""
        with self.store.transaction() as state:
            gpu = self._gpu(state, gpu_index)
            rules.require_mig(gpu)
            gi = rules.find_gi(gpu, gi_id)
            for ci in list(gi.cis):
                rules.destroy_ci(state, gpu, gi, ci)
            rules.destroy_gi(state, gpu, gi)

    def set_busy(self, uuid: str, busy: bool = True) -> None:
        """A process runs (or no longer runs) on a MIG device, or on a whole GPU for a GPU UUID."""
        with self.store.transaction() as state:
            known = {g.uuid for g in state.gpus} | {
                ci.mig_uuid for g in state.gpus for _, ci in rules.mig_devices(g)
            }
            if busy and uuid not in known:
                raise SimError(NVML_ERROR_NOT_FOUND, f"no GPU or MIG device with UUID {uuid}")
            if busy and uuid not in state.busy:
                state.busy.append(uuid)
            elif not busy and uuid in state.busy:
                state.busy.remove(uuid)

    def inject_fault(self, op: str, code: int | str, after: int = 0, times: int = 1) -> None:
        """The matching calls after the next ``after`` ones fail with ``code``, ``times`` times."""
        if not known_op(op):
            aliases = ", ".join(sorted(OP_ALIASES))
            raise ValueError(f"unknown operation {op!r}: a C function name, 'any' or one of {aliases}")
        if after < 0 or times < 1:
            raise ValueError("after must be >= 0 and times >= 1")
        with self.store.transaction() as state:
            state.faults.append(SimFault(op, parse_code(code), after, times))

    def faults(self) -> list[SimFault]:
        return self.state().faults

    def clear_faults(self) -> None:
        with self.store.transaction() as state:
            state.faults.clear()

    def set_latency(self, op: str, seconds: float) -> None:
        if not known_op(op):
            raise ValueError(f"unknown operation {op!r}")
        with self.store.transaction() as state:
            if seconds > 0:
                state.latency[op] = seconds
            else:
                state.latency.pop(op, None)

    def lose_gpu(self, gpu_index: int) -> None:
        """The GPU falls off the bus: every call on it answers GPU_IS_LOST until ``reboot``."""
        with self.store.transaction() as state:
            self._gpu(state, gpu_index).lost = True

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> None:
        """Set current and pending MIG mode directly (an operator with a GPU reset at hand)."""
        with self.store.transaction() as state:
            gpu = self._gpu(state, gpu_index)
            if not enabled and gpu.gis:
                raise SimError(NVML_ERROR_IN_USE, f"GPU {gpu_index} still has GPU instances")
            gpu.mig_current = gpu.mig_pending = enabled

    def reset_gpu(self, gpu_index: int) -> None:
        """A GPU reset: its instances vanish, a lost GPU is back, its pending MIG mode applies."""
        with self.store.transaction() as state:
            gpu = self._gpu(state, gpu_index)
            gone = {ci.mig_uuid for _, ci in rules.mig_devices(gpu)} | {gpu.uuid}
            state.busy[:] = [u for u in state.busy if u not in gone]
            gpu.gis.clear()
            gpu.lost = False
            gpu.mig_current = gpu.mig_pending

    def reboot(self) -> None:
        """Clears every GI/CI and busy marker, applies pending MIG modes, new boot_id."""
        with self.store.transaction() as state:
            rules.reboot(state)


def open_or_init(state_file: Path, sim_gpus: str | None) -> SimulatedHardware:
    """Open the hardware in ``state_file``, creating it from ``sim_gpus`` when it does not exist.

    A new file has MIG enabled on every GPU: a demo node is useful at once, and MIG mode changes
    are the operator's business (``SetMigMode`` over the API)."""
    if state_file.exists():
        return SimulatedHardware.open(state_file)
    if not sim_gpus:
        raise FileNotFoundError(
            f"simulated hardware state {state_file} does not exist; "
            "give --sim-gpus MODEL[:COUNT],... to create it"
        )
    try:
        return SimulatedHardware.init_file(state_file, profiles.parse_gpus(sim_gpus))
    except FileExistsError:  # another process created it first
        return SimulatedHardware.open(state_file)


__all__ = [
    "NVML_ERROR_INSUFFICIENT_RESOURCES",
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
