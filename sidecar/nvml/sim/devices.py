"""Emulated C functions of the system and of devices (GPUs and MIG devices): identity, MIG mode,
MIG device enumeration, processes."""

from __future__ import annotations

from typing import Any

from sidecar.nvml.port import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_RESET_REQUIRED,
    NVML_SUCCESS,
)
from sidecar.nvml.sim import state as rules
from sidecar.nvml.sim.cabi import (
    DRIVER_VERSION,
    ERROR_STRINGS,
    KIND_GPU,
    KIND_MIG,
    NVML_ERROR_INSUFFICIENT_SIZE,
    as_int,
    cfunc,
    device_of,
    gpu_of,
    handle,
    mig_of,
    query,
    set_pointer,
    target,
    write_string,
)
from sidecar.nvml.sim.state import SimError, SimState, StateView

# -- system ----------------------------------------------------------------------------------------


@query("nvmlInit_v2", "nvmlInit", "nvmlShutdown")
def _ok(state: StateView) -> int:
    return NVML_SUCCESS


@query("nvmlInitWithFlags")
def _init_flags(state: StateView, flags: Any) -> int:
    return NVML_SUCCESS


@query("nvmlErrorString")
def _error_string(state: None, code: Any) -> bytes:
    return ERROR_STRINGS.get(as_int(code), f"Unknown Error ({as_int(code)})").encode()


@query("nvmlSystemGetDriverVersion")
def _driver_version(state: StateView, buf: Any, length: Any) -> int:
    write_string(buf, length, DRIVER_VERSION)
    return NVML_SUCCESS


# -- devices ---------------------------------------------------------------------------------------


@query("nvmlDeviceGetCount_v2", "nvmlDeviceGetCount")
def _count(state: StateView, count: Any) -> int:
    target(count).value = len(state.gpus)
    return NVML_SUCCESS


@query("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex")
def _by_index(state: StateView, index: Any, device: Any) -> int:
    i = as_int(index)
    if not 0 <= i < len(state.gpus):
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"no GPU at index {i}")
    if state.gpus[i].lost:
        raise SimError(NVML_ERROR_GPU_IS_LOST, f"GPU {i} has fallen off the bus")
    set_pointer(target(device), handle(KIND_GPU, i))
    return NVML_SUCCESS


@query("nvmlDeviceGetHandleByUUID")
def _by_uuid(state: StateView, uuid: Any, device: Any) -> int:
    """Takes a GPU UUID or a MIG UUID (then the handle is the MIG device's)."""
    raw = getattr(uuid, "value", uuid)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    for gpu in state.gpus:
        if gpu.uuid == text:
            if gpu.lost:
                raise SimError(NVML_ERROR_GPU_IS_LOST, f"GPU {gpu.index} has fallen off the bus")
            set_pointer(target(device), handle(KIND_GPU, gpu.index))
            return NVML_SUCCESS
        for gi in gpu.gis:  # MIG UUIDs are unique: order is moot
            for ci in gi.cis:
                if ci.mig_uuid == text:
                    if gpu.lost:
                        raise SimError(NVML_ERROR_GPU_IS_LOST, f"GPU {gpu.index} has fallen off the bus")
                    set_pointer(target(device), handle(KIND_MIG, gpu.index, ci.serial))
                    return NVML_SUCCESS
    raise SimError(NVML_ERROR_NOT_FOUND, f"no device with UUID {text}")


@query("nvmlDeviceGetName")
def _name(state: StateView, h: Any, buf: Any, length: Any) -> int:
    gpu, mig = device_of(state, h)
    model = rules.model_of(gpu)
    name = model.name
    if mig is not None:
        name = f"{model.name} MIG {rules.gi_profile(gpu, mig[0].profile_id).name}"
    write_string(buf, length, name)
    return NVML_SUCCESS


@query("nvmlDeviceGetUUID")
def _uuid(state: StateView, h: Any, buf: Any, length: Any) -> int:
    gpu, mig = device_of(state, h)
    write_string(buf, length, gpu.uuid if mig is None else mig[1].mig_uuid)
    return NVML_SUCCESS


@query("nvmlDeviceGetMinorNumber")
def _minor(state: StateView, h: Any, minor: Any) -> int:
    target(minor).value = gpu_of(state, h).minor
    return NVML_SUCCESS


@query("nvmlDeviceGetIndex")
def _index(state: StateView, h: Any, index: Any) -> int:
    target(index).value = gpu_of(state, h).index
    return NVML_SUCCESS


@query("nvmlDeviceGetMemoryInfo")
def _memory(state: StateView, h: Any, memory: Any) -> int:
    gpu, mig = device_of(state, h)
    model = rules.model_of(gpu)
    mb = model.memory_mb if mig is None else rules.gi_profile(gpu, mig[0].profile_id).memory_mb
    info = target(memory)
    info.total = mb * 1024 * 1024
    info.used = 0
    info.free = info.total
    return NVML_SUCCESS


@query("nvmlDeviceGetMigMode")
def _get_mig_mode(state: StateView, h: Any, current: Any, pending: Any) -> int:
    gpu = gpu_of(state, h)
    target(current).value = int(gpu.mig_current)
    target(pending).value = int(gpu.mig_pending)
    return NVML_SUCCESS


@cfunc("nvmlDeviceSetMigMode")
def _set_mig_mode(state: SimState, h: Any, mode: Any, status: Any) -> int:
    """Hopper toggles at once. Ampere only records the pending mode and reports RESET_REQUIRED as
    activation status until the node reboots (``sim reboot``). Disabling while GIs exist, or any
    change while a process runs on the GPU, is refused with activation status IN_USE; only the
    call's own return code raises in pynvml, so the caller must look at the status.

    A refused activation still records the pending mode, as real drivers do (nvidia-smi: "MIG
    mode is in pending enable state for GPU ...: In use by another client"): it applies at the
    next GPU reset or reboot, or is withdrawn by asking for the current mode again."""
    gpu = gpu_of(state, h)
    enable = as_int(mode)
    if enable not in (0, 1):
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"bad MIG mode {enable}")
    result = target(status)
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


@query("nvmlDeviceGetMaxMigDeviceCount")
def _max_mig(state: StateView, h: Any, count: Any) -> int:
    gpu = gpu_of(state, h)
    target(count).value = rules.model_of(gpu).max_mig_devices if gpu.mig_current else 0
    return NVML_SUCCESS


@query("nvmlDeviceGetMigDeviceHandleByIndex")
def _mig_by_index(state: StateView, h: Any, index: Any, device: Any) -> int:
    gpu = gpu_of(state, h)
    rules.require_mig(gpu)
    i = as_int(index)
    if not 0 <= i < rules.model_of(gpu).max_mig_devices:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"MIG device index {i} out of range")
    devices = rules.mig_devices(gpu)
    if i >= len(devices):
        raise SimError(NVML_ERROR_NOT_FOUND, f"no MIG device at index {i}")
    set_pointer(target(device), handle(KIND_MIG, gpu.index, devices[i][1].serial))
    return NVML_SUCCESS


@query("nvmlDeviceIsMigDeviceHandle")
def _is_mig(state: StateView, h: Any, result: Any) -> int:
    _, mig = device_of(state, h)
    target(result).value = int(mig is not None)
    return NVML_SUCCESS


@query("nvmlDeviceGetGpuInstanceId")
def _mig_gi_id(state: StateView, h: Any, result: Any) -> int:
    target(result).value = mig_of(state, h)[1].id
    return NVML_SUCCESS


@query("nvmlDeviceGetComputeInstanceId")
def _mig_ci_id(state: StateView, h: Any, result: Any) -> int:
    target(result).value = mig_of(state, h)[2].id
    return NVML_SUCCESS


@query("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
def _mig_parent(state: StateView, h: Any, device: Any) -> int:
    gpu, _, _ = mig_of(state, h)
    set_pointer(target(device), handle(KIND_GPU, gpu.index))
    return NVML_SUCCESS


@query("nvmlDeviceGetComputeRunningProcesses_v3")
def _processes(state: StateView, h: Any, count: Any, infos: Any) -> int:
    """Busy markers as processes: a busy MIG device lists one, and its parent GPU lists it too."""
    gpu, mig = device_of(state, h)
    procs: list[tuple[str, int, int]] = []
    if mig is None and gpu.uuid in state.busy:
        procs.append((gpu.uuid, 0xFFFFFFFF, 0xFFFFFFFF))
    for gi, ci in rules.mig_devices(gpu) if state.busy else ():  # only busy devices list processes
        if ci.mig_uuid in state.busy and (mig is None or mig[1] is ci):
            procs.append((ci.mig_uuid, gi.id, ci.id))
    n = target(count)
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
