"""Emulated C functions of GPU instance profiles, GPU instances and compute instances.

The rules they enforce live in ``state``; these functions only translate between pynvml's ctypes
arguments and those rules.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

from sidecar.nvml import profiles
from sidecar.nvml.port import NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED, NVML_SUCCESS
from sidecar.nvml.sim import state as rules
from sidecar.nvml.sim.cabi import (
    KIND_CI,
    KIND_GI,
    KIND_GPU,
    KIND_MIG,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    NVML_ERROR_INSUFFICIENT_SIZE,
    as_int,
    cfunc,
    ci_of,
    gi_of,
    gpu_of,
    handle,
    query,
    set_pointer,
    target,
)
from sidecar.nvml.sim.state import AnyCi, AnyGi, AnyGpu, SimError, SimState, StateView

# -- GPU instance profiles -------------------------------------------------------------------------


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


def _gi_profile_by_index(state: StateView, h: Any, index: Any) -> profiles.GiProfile:
    gpu = gpu_of(state, h)
    i = as_int(index)
    if not 0 <= i < profiles.GI_PROFILE_COUNT:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"GI profile index {i} out of range")
    rules.require_mig(gpu)  # nvml.h: NOT_SUPPORTED "if device doesn't have MIG mode enabled"
    p = rules.model_of(gpu).profile_by_index(i)
    if p is None:
        raise SimError(NVML_ERROR_NOT_SUPPORTED, f"GI profile index {i} is not supported on this GPU")
    return p


def _check_version(info: Any, version: int) -> None:
    if info.version != version:
        raise SimError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "struct version mismatch")


@query("nvmlDeviceGetGpuInstanceProfileInfoV")
def _gi_profile_info_v(state: StateView, h: Any, index: Any, info: Any) -> int:
    out = target(info)
    _check_version(out, pynvml.nvmlGpuInstanceProfileInfo_v2)
    _fill_gi_profile(out, _gi_profile_by_index(state, h, index), with_name=True)
    return NVML_SUCCESS


@query("nvmlDeviceGetGpuInstanceProfileInfo")
def _gi_profile_info_v1(state: StateView, h: Any, index: Any, info: Any) -> int:
    _fill_gi_profile(target(info), _gi_profile_by_index(state, h, index), with_name=False)
    return NVML_SUCCESS


@query("nvmlDeviceGetGpuInstanceProfileInfoByIdV")
def _gi_profile_info_by_id(state: StateView, h: Any, profile_id: Any, info: Any) -> int:
    out = target(info)
    _check_version(out, pynvml.nvmlGpuInstanceProfileInfo_v2)
    gpu = gpu_of(state, h)
    rules.require_mig(gpu)
    p = rules.model_of(gpu).profile_by_id(as_int(profile_id))
    if p is None:
        raise SimError(NVML_ERROR_NOT_SUPPORTED, f"GI profile ID {as_int(profile_id)} is not supported")
    _fill_gi_profile(out, p, with_name=True)
    return NVML_SUCCESS


@query("nvmlDeviceGetGpuInstancePossiblePlacements_v2")
def _gi_placements(state: StateView, h: Any, profile_id: Any, placements: Any, count: Any) -> int:
    """Static per profile, answered whatever the MIG mode; NULL array = count query."""
    gpu = gpu_of(state, h)
    p = rules.gi_profile(gpu, as_int(profile_id))
    n = target(count)
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


@query("nvmlDeviceGetGpuInstanceRemainingCapacity")
def _gi_capacity(state: StateView, h: Any, profile_id: Any, count: Any) -> int:
    gpu = gpu_of(state, h)
    rules.require_mig(gpu)
    target(count).value = rules.remaining_capacity(gpu, rules.gi_profile(gpu, as_int(profile_id)))
    return NVML_SUCCESS


# -- GPU instances ---------------------------------------------------------------------------------


def _gi_handle(gpu: AnyGpu, gi: AnyGi) -> int:
    return handle(KIND_GI, gpu.index, gi.serial)


@cfunc("nvmlDeviceCreateGpuInstanceWithPlacement")
def _create_gi_at(state: SimState, h: Any, profile_id: Any, placement: Any, gi: Any) -> int:
    gpu = gpu_of(state, h)
    p = target(placement)
    created = rules.create_gi(state, gpu, as_int(profile_id), int(p.start), int(p.size))
    set_pointer(target(gi), _gi_handle(gpu, created))
    return NVML_SUCCESS


@cfunc("nvmlDeviceCreateGpuInstance")
def _create_gi(state: SimState, h: Any, profile_id: Any, gi: Any) -> int:
    gpu = gpu_of(state, h)
    created = rules.create_gi(state, gpu, as_int(profile_id), None, None)
    set_pointer(target(gi), _gi_handle(gpu, created))
    return NVML_SUCCESS


def _fill(handles: list[Any], out: Any, count: Any, handle_type: Any, what: str) -> int:
    """NVML's count-then-fill arrays: INSUFFICIENT_SIZE with the count when ``out`` is too short."""
    if out is None:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"NULL {what} array")
    target(count).value = len(handles)
    if len(handles) > len(out):
        return NVML_ERROR_INSUFFICIENT_SIZE
    for i, h in enumerate(handles):
        out[i] = ctypes.cast(h, handle_type)
    return NVML_SUCCESS


@query("nvmlDeviceGetGpuInstances")
def _get_gis(state: StateView, h: Any, profile_id: Any, gis: Any, count: Any) -> int:
    gpu = gpu_of(state, h)
    rules.require_mig(gpu)
    p = rules.gi_profile(gpu, as_int(profile_id))
    found = [_gi_handle(gpu, gi) for gi in gpu.gis if gi.profile_id == p.id]
    return _fill(found, gis, count, pynvml.c_nvmlGpuInstance_t, "GPU instance")


@query("nvmlDeviceGetGpuInstanceById")
def _gi_by_id(state: StateView, h: Any, gi_id: Any, gi: Any) -> int:
    gpu = gpu_of(state, h)
    rules.require_mig(gpu)
    set_pointer(target(gi), _gi_handle(gpu, rules.find_gi(gpu, as_int(gi_id))))
    return NVML_SUCCESS


@query("nvmlGpuInstanceGetInfo")
def _gi_info(state: StateView, h: Any, info: Any) -> int:
    gpu, gi = gi_of(state, h)
    out = target(info)
    out.device = ctypes.cast(handle(KIND_GPU, gpu.index), pynvml.c_nvmlDevice_t)
    out.id = gi.id
    out.profileId = gi.profile_id
    out.placement.start = gi.start
    out.placement.size = gi.size
    return NVML_SUCCESS


@cfunc("nvmlGpuInstanceDestroy")
def _destroy_gi(state: SimState, h: Any) -> int:
    gpu, gi = gi_of(state, h)
    rules.destroy_gi(state, gpu, gi)
    return NVML_SUCCESS


# -- compute instances -----------------------------------------------------------------------------


def _ci_profile_info(state: StateView, h: Any, index: Any, eng: Any, info: Any, *, v2: bool) -> int:
    gpu, gi = gi_of(state, h)
    out = target(info)
    if v2:
        _check_version(out, pynvml.nvmlComputeInstanceProfileInfo_v2)
    if as_int(eng) != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "only shared engine profiles exist")
    cp = rules.ci_profile(gpu, gi, as_int(index))
    gp = rules.gi_profile(gpu, gi.profile_id)
    out.id = cp.id
    out.sliceCount = cp.slice_count
    out.instanceCount = cp.instance_count
    # SMs split evenly across compute slices (real drivers round a little differently).
    out.multiprocessorCount = cp.multiprocessor_count
    out.sharedCopyEngineCount = gp.copy_engines
    out.sharedDecoderCount = gp.decoders
    out.sharedEncoderCount = gp.encoders
    out.sharedJpegCount = gp.jpegs
    out.sharedOfaCount = gp.ofas
    if v2:
        out.name = f"MIG {profiles.ci_profile_name(gp, cp)}".encode()
    return NVML_SUCCESS


@query("nvmlGpuInstanceGetComputeInstanceProfileInfoV")
def _ci_profile_info_v(state: StateView, h: Any, index: Any, eng: Any, info: Any) -> int:
    return _ci_profile_info(state, h, index, eng, info, v2=True)


@query("nvmlGpuInstanceGetComputeInstanceProfileInfo")
def _ci_profile_info_v1(state: StateView, h: Any, index: Any, eng: Any, info: Any) -> int:
    return _ci_profile_info(state, h, index, eng, info, v2=False)


@query("nvmlGpuInstanceGetComputeInstanceRemainingCapacity")
def _ci_capacity(state: StateView, h: Any, profile_id: Any, count: Any) -> int:
    gpu, gi = gi_of(state, h)
    cp = rules.ci_profile(gpu, gi, as_int(profile_id))
    existing = sum(1 for c in gi.cis if c.profile_id == cp.id)
    target(count).value = max(0, min(cp.instance_count - existing, len(rules.ci_free_starts(gi, cp))))
    return NVML_SUCCESS


@query("nvmlGpuInstanceGetComputeInstancePossiblePlacements")
def _ci_placements(state: StateView, h: Any, profile_id: Any, placements: Any, count: Any) -> int:
    gpu, gi = gi_of(state, h)
    cp = rules.ci_profile(gpu, gi, as_int(profile_id))
    n = target(count)
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


def _ci_handle(gpu: AnyGpu, ci: AnyCi) -> int:
    return handle(KIND_CI, gpu.index, ci.serial)


@cfunc("nvmlGpuInstanceCreateComputeInstance")
def _create_ci(state: SimState, h: Any, profile_id: Any, ci: Any) -> int:
    gpu, gi = gi_of(state, h)
    created = rules.create_ci(state, gpu, gi, as_int(profile_id))
    set_pointer(target(ci), _ci_handle(gpu, created))
    return NVML_SUCCESS


@cfunc("nvmlGpuInstanceCreateComputeInstanceWithPlacement")
def _create_ci_at(state: SimState, h: Any, profile_id: Any, placement: Any, ci: Any) -> int:
    gpu, gi = gi_of(state, h)
    p = target(placement)
    cp = rules.ci_profile(gpu, gi, as_int(profile_id))
    if int(p.size) != cp.slice_count:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "CI placement size does not match the profile")
    created = rules.create_ci(state, gpu, gi, cp.id, int(p.start))
    set_pointer(target(ci), _ci_handle(gpu, created))
    return NVML_SUCCESS


@query("nvmlGpuInstanceGetComputeInstances")
def _get_cis(state: StateView, h: Any, profile_id: Any, cis: Any, count: Any) -> int:
    gpu, gi = gi_of(state, h)
    cp = rules.ci_profile(gpu, gi, as_int(profile_id))
    found = [_ci_handle(gpu, c) for c in gi.cis if c.profile_id == cp.id]
    return _fill(found, cis, count, pynvml.c_nvmlComputeInstance_t, "compute instance")


@query("nvmlGpuInstanceGetComputeInstanceById")
def _ci_by_id(state: StateView, h: Any, ci_id: Any, ci: Any) -> int:
    gpu, gi = gi_of(state, h)
    set_pointer(target(ci), _ci_handle(gpu, rules.find_ci(gpu, gi, as_int(ci_id))))
    return NVML_SUCCESS


@query("nvmlComputeInstanceGetInfo_v2", "nvmlComputeInstanceGetInfo")
def _ci_info(state: StateView, h: Any, info: Any) -> int:
    """``device`` is the MIG device handle (its UUID is the MIG UUID), as drivers that real-world
    controllers were tested against return it, or the parent GPU as nvml.h documents it when the
    hardware is switched so (``SimulatedHardware.set_ci_info_device``)."""
    gpu, gi, ci = ci_of(state, h)
    out = target(info)
    device = (
        handle(KIND_GPU, gpu.index)
        if state.ci_info_device_is_parent
        else handle(KIND_MIG, gpu.index, ci.serial)
    )
    out.device = ctypes.cast(device, pynvml.c_nvmlDevice_t)
    out.gpuInstance = ctypes.cast(_gi_handle(gpu, gi), pynvml.c_nvmlGpuInstance_t)
    out.id = ci.id
    out.profileId = ci.profile_id
    out.placement.start = ci.start
    out.placement.size = ci.size
    return NVML_SUCCESS


@cfunc("nvmlComputeInstanceDestroy")
def _destroy_ci(state: SimState, h: Any) -> int:
    gpu, gi, ci = ci_of(state, h)
    rules.destroy_ci(state, gpu, gi, ci)
    return NVML_SUCCESS
