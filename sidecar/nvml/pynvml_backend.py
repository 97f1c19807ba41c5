"""The ``NvmlPort`` adapter over pynvml (nvidia-ml-py): the only domain-facing code that speaks pynvml.

It runs unchanged over the real ``libnvidia-ml.so.1`` and over ``sim.SimulatedLibrary``. What it
takes care of, so that the domain never has to:

The rest: ``docs/architecture.md``, "Module notes", ``sidecar.nvml.pynvml_backend``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from ctypes import byref, c_uint
from typing import Any, TypeVar

import pynvml

from sidecar.nvml.calls import TRANSIENT_CODES, TRANSIENT_DESTROY_CODES, Caller, mapped
from sidecar.nvml.mig_identity import UnprovableMigUuidError, proven_mig_uuid
from sidecar.nvml.port import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    ComputeInstanceInfo,
    GpuInfo,
    GpuInstanceInfo,
    GpuInstanceProfile,
    NvmlError,
    Placement,
)
from sidecar.nvml.profile_model import CI_PROFILE_1_SLICE_REV1, full_ci_profile_id, pick_full_ci

T = TypeVar("T")

# Codes that mean "this index does not exist on this GPU" while enumerating profiles.
_SKIP_PROFILE = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT)
_MIB = 1024 * 1024


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlBackend:
    """``NvmlPort`` over pynvml. ``nvmlInit`` runs once, here; a missing library raises ``NvmlError``
    (LIBRARY_NOT_FOUND or DRIVER_NOT_LOADED) and is never papered over."""

    def __init__(self, retry_wait: bool = True, attempts: int = 3) -> None:
        self._caller = Caller(retry_wait, attempts)
        self._lock = threading.Lock()
        self._handles: dict[str, Any] = {}
        self._static: dict[str, tuple[int, int, str, int]] = {}  # uuid -> index, minor, name, memory MiB
        self._profile_ids: dict[str, list[tuple[int, int]]] = {}
        # (GPU, GI ID) -> handle of a GI this adapter just created, for the CI create that follows.
        self._fresh_gis: dict[tuple[str, int], Any] = {}
        # (GPU, GI profile ID) -> (CI profile ID, instance count, compute slices, SMs) of every CI profile
        self._ci_profile_ids: dict[tuple[str, int], list[tuple[int, int, int, int]]] = {}
        with mapped("nvmlInit"):
            pynvml.nvmlInit()
        self._open = True

    def close(self) -> None:
        with self._lock:
            if not self._open:
                return
            self._open = False
        with mapped("nvmlShutdown"):
            pynvml.nvmlShutdown()

    # -- plumbing ------------------------------------------------------------------------------------

    def _run(self, operation: str, fn: Callable[[], T], transient: frozenset[int] = TRANSIENT_CODES) -> T:
        return self._caller.run(operation, fn, transient)

    def _device(self, gpu_uuid: str) -> Any:
        with self._lock:
            handle = self._handles.get(gpu_uuid)
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            with self._lock:
                self._handles[gpu_uuid] = handle
        return handle

    def _gpu_info(self, handle: Any, gpu_uuid: str, index: int | None = None) -> GpuInfo:
        """MIG mode read live; the static facts read once per GPU (see the module docstring).

        The MIG mode is read first, so a GPU that fell off the bus fails here with GPU_IS_LOST exactly
        as it did before the static facts were cached."""
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError_NotSupported:  # a GPU without MIG hardware
            current, pending = 0, 0
        with self._lock:
            static = self._static.get(gpu_uuid)
        if static is None:
            static = (
                int(pynvml.nvmlDeviceGetIndex(handle)) if index is None else index,
                int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                _text(pynvml.nvmlDeviceGetName(handle)),
                int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB,
            )
            with self._lock:
                self._static[gpu_uuid] = static
        return GpuInfo(
            index=static[0],
            uuid=gpu_uuid,
            minor=static[1],
            model=static[2],
            memory_mb=static[3],
            mig_current=bool(current),
            mig_pending=bool(pending),
        )

    def _profile_table(self, gpu_uuid: str, handle: Any) -> list[tuple[int, int]]:
        """(profile ID, instance count) of every supported GI profile; static, so cached per GPU.

        An empty table is never cached: Ampere drivers answer NOT_SUPPORTED for every profile index
        while MIG is disabled, and remembering that answer would hide every GI made once MIG is on."""
        with self._lock:
            cached = self._profile_ids.get(gpu_uuid)
        if cached is not None:
            return cached
        table = [(int(info.id), int(info.instanceCount)) for _, info in self._profile_infos(handle)]
        if table:
            with self._lock:
                self._profile_ids[gpu_uuid] = table
        return table

    @staticmethod
    def _profile_infos(handle: Any) -> list[tuple[int, Any]]:
        """Enumerate GI profiles by *index*; missing indices answer NOT_SUPPORTED or INVALID_ARGUMENT."""
        infos = []
        for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                infos.append((index, pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)))
            except pynvml.NVMLError as exc:
                if exc.value in _SKIP_PROFILE:
                    continue
                raise
        return infos

    @staticmethod
    def _gi_info(gpu_uuid: str, gi: Any) -> GpuInstanceInfo:
        info = pynvml.nvmlGpuInstanceGetInfo(gi)
        return GpuInstanceInfo(
            gpu_uuid=gpu_uuid,
            id=int(info.id),
            profile_id=int(info.profileId),
            placement=Placement(int(info.placement.start), int(info.placement.size)),
        )

    def _full_ci(self, gpu_uuid: str, info: Any, plain_sms: int) -> int | None:
        """The full-size CI profile of a GI profile, by ``profile_model.pick_full_ci``.

        Read from the CI profiles of a real GI of this profile once one has been seen (``_ci_profile_table``
        is filled by every create and listing). Before that, NVML offers no way to ask (CI profiles are
        queried on a GI), so it is told from the GI profile alone: the CI of as many slices, except that
        a 1-slice GI with more SMs than the plain 1-slice profile (the double-memory 1g on Hopper and
        Blackwell) spans its SMs with CI 7 (1_SLICE_REV1); A100's double-memory 1g has a plain slice's
        SMs and keeps CI 0. The probe (``sidecar.nvml.probe``) shows a real GPU's CI tables to check it."""
        slices = int(info.sliceCount)
        with self._lock:
            seen = self._ci_profile_ids.get((gpu_uuid, int(info.id)))
        if seen is not None:
            return pick_full_ci(slices, [(cid, s, sms) for cid, _, s, sms in seen])
        if slices == 1 and plain_sms and int(info.multiprocessorCount) > plain_sms:
            return CI_PROFILE_1_SLICE_REV1
        return full_ci_profile_id(slices)

    def _ci_info(self, gpu_uuid: str, gi: Any, ci: Any, gi_id: int | None = None) -> ComputeInstanceInfo:
        info = pynvml.nvmlComputeInstanceGetInfo(ci)
        ci_id, gi_id = int(info.id), int(pynvml.nvmlGpuInstanceGetInfo(gi).id) if gi_id is None else gi_id
        return ComputeInstanceInfo(
            gpu_uuid=gpu_uuid,
            gpu_instance_id=gi_id,
            id=ci_id,
            profile_id=int(info.profileId),
            mig_uuid=proven_mig_uuid(gpu_uuid, self._device(gpu_uuid), info.device, gi_id, ci_id),
        )

    # -- NvmlPort ------------------------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        def read() -> list[GpuInfo]:
            result = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                # The UUID is read every time: it says which GPU sits at this index now.
                gpu_uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                result.append(self._gpu_info(handle, gpu_uuid, index))
                with self._lock:
                    self._handles.setdefault(gpu_uuid, handle)
            return result

        return self._run("list GPUs", read)

    def gpu(self, gpu_uuid: str) -> GpuInfo:
        return self._run(f"read GPU {gpu_uuid}", lambda: self._gpu_info(self._device(gpu_uuid), gpu_uuid))

    def _forget(self, gpu_uuid: str) -> None:
        """Drop everything cached about one GPU: its handle, static facts and profile tables."""
        with self._lock:
            self._handles.pop(gpu_uuid, None)
            self._static.pop(gpu_uuid, None)
            self._profile_ids.pop(gpu_uuid, None)
            for gone in [k for k in self._fresh_gis if k[0] == gpu_uuid]:
                del self._fresh_gis[gone]
            for key in [k for k in self._ci_profile_ids if k[0] == gpu_uuid]:
                del self._ci_profile_ids[key]

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> int:
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE

        def apply() -> int:
            # Only the call's own return code raises; a refused activation comes back as the status.
            return int(pynvml.nvmlDeviceSetMigMode(self._device(gpu_uuid), mode))

        try:
            return self._run(f"set MIG mode {'on' if enabled else 'off'} on {gpu_uuid}", apply)
        finally:
            # nvml.h: the call may unbind or reset the device, after which its minor number (and the
            # handle) may differ and must be queried again. Whatever the outcome, nothing cached about
            # this GPU is trusted any longer; the next call reads it afresh.
            self._forget(gpu_uuid)

    def gpu_instance_profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        def read() -> list[GpuInstanceProfile]:
            handle = self._device(gpu_uuid)
            result = []
            infos = self._profile_infos(handle)
            plain_sms = next(
                (
                    int(i.multiprocessorCount)
                    for x, i in infos
                    if x == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
                ),
                0,
            )
            for index, info in infos:
                # A profile whose full-size CI cannot be told is left out: it could never be created right.
                ci_profile_id = self._full_ci(gpu_uuid, info, plain_sms)
                if ci_profile_id is None:
                    continue
                count = c_uint(0)
                pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, None, byref(count))
                array = (pynvml.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
                pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, array, byref(count))
                placements = tuple(
                    Placement(int(array[i].start), int(array[i].size)) for i in range(count.value)
                )
                result.append(
                    GpuInstanceProfile(
                        index=index,
                        id=int(info.id),
                        name=_text(info.name).removeprefix("MIG "),
                        slice_count=int(info.sliceCount),
                        instance_count=int(info.instanceCount),
                        memory_mb=int(info.memorySizeMB),
                        multiprocessor_count=int(info.multiprocessorCount),
                        placements=placements,
                        ci_profile_id=ci_profile_id,
                    )
                )
            return result

        return self._run(f"read GPU instance profiles of {gpu_uuid}", read)

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceInfo]:
        operation = f"list GPU instances of {gpu_uuid}"

        def read() -> list[GpuInstanceInfo]:
            handle = self._device(gpu_uuid)
            table = self._profile_table(gpu_uuid, handle)
            if not table:
                # No profile to list GIs by: "no GIs" cannot be read from that. MIG disabled is the
                # port's NOT_SUPPORTED; MIG enabled with no profile answering is unverifiable, and
                # fails the same way (the table is read again at the next call).
                current, _ = pynvml.nvmlDeviceGetMigMode(handle)
                why = (
                    "MIG mode is disabled"
                    if not current
                    else "MIG mode is enabled but no GPU instance profile answered"
                )
                raise NvmlError(operation, NVML_ERROR_NOT_SUPPORTED, why)
            result: list[GpuInstanceInfo] = []
            for profile_id, instance_count in table:
                array = (pynvml.c_nvmlGpuInstance_t * max(1, instance_count))()
                count = c_uint(len(array))
                pynvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, byref(count))
                result.extend(self._gi_info(gpu_uuid, array[i]) for i in range(count.value))
            return sorted(result, key=lambda g: g.id)

        return self._run(operation, read)

    def _ci_profile_table(self, gpu_uuid: str, gi: Any) -> list[tuple[int, int, int, int]]:
        """(CI profile ID, instance count, slices, SMs) of every CI profile a GI of this profile has.

        Cached per (GPU, GI profile ID), not per GI: GI IDs are reused by the driver for GIs of other
        profiles, while the CI profiles of a GI profile are fixed for a GPU model and driver. The GI's
        profile ID is read live (one GetInfo) to pick the right table."""
        gi_profile_id = int(pynvml.nvmlGpuInstanceGetInfo(gi).profileId)
        with self._lock:
            cached = self._ci_profile_ids.get((gpu_uuid, gi_profile_id))
        if cached is not None:
            return cached
        table = []
        for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except pynvml.NVMLError as exc:
                if exc.value in _SKIP_PROFILE:
                    continue
                raise
            table.append(
                (int(info.id), int(info.instanceCount), int(info.sliceCount), int(info.multiprocessorCount))
            )
        if table:  # never remember "no CI profiles": the CIs of this GI would be hidden for good
            with self._lock:
                self._ci_profile_ids[(gpu_uuid, gi_profile_id)] = table
        return table

    def compute_instances(self, gpu_uuid: str, gpu_instance_id: int) -> list[ComputeInstanceInfo]:
        operation = f"list compute instances of GI {gpu_instance_id} on {gpu_uuid}"

        def read() -> list[ComputeInstanceInfo]:
            gi = pynvml.nvmlDeviceGetGpuInstanceById(self._device(gpu_uuid), gpu_instance_id)
            table = self._ci_profile_table(gpu_uuid, gi)
            if not table:  # every GI offers at least its full-size CI profile; "no CIs" is unverifiable
                raise NvmlError(operation, NVML_ERROR_NOT_SUPPORTED, "no compute instance profile answered")
            result: list[ComputeInstanceInfo] = []
            for ci_profile_id, instance_count, _, _ in table:
                array = (pynvml.c_nvmlComputeInstance_t * max(1, instance_count))()
                count = c_uint(len(array))
                pynvml.nvmlGpuInstanceGetComputeInstances(gi, ci_profile_id, array, byref(count))
                result.extend(self._ci_info(gpu_uuid, gi, array[i]) for i in range(count.value))
            return sorted(result, key=lambda c: c.id)

        return self._run(operation, read)

    # Creates retry the create call and the read-back separately: a create that returned SUCCESS is
    # never issued again because the read-back hiccuped (it would meet its own instance). A read-back
    # that keeps failing reaches the caller with the instance in place, for the lifecycle's undo.

    def create_gpu_instance(self, gpu_uuid: str, profile_id: int, placement: Placement) -> GpuInstanceInfo:
        operation = f"create GPU instance profile {profile_id} at {placement} on {gpu_uuid}"

        def create() -> Any:
            where = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
            device = self._device(gpu_uuid)
            return pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, profile_id, byref(where))

        gi = self._run(operation, create)
        made = self._run(f"{operation}: read back the new GPU instance", lambda: self._gi_info(gpu_uuid, gi))
        with self._lock:  # the CI create that follows takes this handle instead of looking it up by ID
            self._fresh_gis[(gpu_uuid, made.id)] = gi
        return made

    def create_compute_instance(
        self, gpu_uuid: str, gpu_instance_id: int, ci_profile_id: int
    ) -> ComputeInstanceInfo:
        operation = f"create compute instance profile {ci_profile_id} in GI {gpu_instance_id} on {gpu_uuid}"

        def create() -> tuple[Any, Any]:
            with self._lock:  # used once: a retry looks the GI up afresh
                gi = self._fresh_gis.pop((gpu_uuid, gpu_instance_id), None)
            if gi is None:
                gi = pynvml.nvmlDeviceGetGpuInstanceById(self._device(gpu_uuid), gpu_instance_id)
            return gi, pynvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile_id)

        gi, ci = self._run(operation, create)
        try:
            return self._run(
                f"{operation}: read back the new compute instance",
                lambda: self._ci_info(gpu_uuid, gi, ci, gpu_instance_id),
            )
        except UnprovableMigUuidError:
            # A CI nobody can name is destroyed here, by the handle that made it: left in place it would
            # fail every listing of its GI, the caller's undo included.
            self._run(
                f"{operation}: destroy the unidentifiable CI", lambda: pynvml.nvmlComputeInstanceDestroy(ci)
            )
            raise

    def destroy_compute_instance(self, gpu_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        def destroy() -> None:
            gi = pynvml.nvmlDeviceGetGpuInstanceById(self._device(gpu_uuid), gpu_instance_id)
            ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, compute_instance_id)
            pynvml.nvmlComputeInstanceDestroy(ci)

        self._run(
            f"destroy compute instance {compute_instance_id} of GI {gpu_instance_id} on {gpu_uuid}",
            destroy,
            TRANSIENT_DESTROY_CODES,
        )

    def destroy_gpu_instance(self, gpu_uuid: str, gpu_instance_id: int) -> None:
        with self._lock:
            self._fresh_gis.pop((gpu_uuid, gpu_instance_id), None)

        def destroy() -> None:
            gi = pynvml.nvmlDeviceGetGpuInstanceById(self._device(gpu_uuid), gpu_instance_id)
            pynvml.nvmlGpuInstanceDestroy(gi)

        self._run(f"destroy GPU instance {gpu_instance_id} on {gpu_uuid}", destroy, TRANSIENT_DESTROY_CODES)

    def mig_device_processes(self, mig_uuid: str) -> int:
        def read() -> int:
            handle = pynvml.nvmlDeviceGetHandleByUUID(mig_uuid)
            return len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))

        return self._run(f"look up MIG device {mig_uuid}", read)

    def gpu_processes(self, gpu_uuid: str) -> int:
        return self._run(
            f"count processes on {gpu_uuid}",
            lambda: len(pynvml.nvmlDeviceGetComputeRunningProcesses(self._device(gpu_uuid))),
        )
