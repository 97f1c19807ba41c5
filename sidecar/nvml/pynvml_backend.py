"""The ``NvmlPort`` adapter over pynvml (nvidia-ml-py): the only domain-facing code that speaks pynvml.

It runs unchanged over the real ``libnvidia-ml.so.1`` and over ``sim.SimulatedLibrary``. What it
takes care of, so that the domain never has to:

* profile *index* vs profile *ID*: profiles are enumerated by index constant, everything else is
  addressed by the ID the profile info returns;
* caller-allocated arrays: possible placements are fetched with a count query (NULL array) and then a
  sized array; GI/CI lists use arrays sized by the profile's ``instanceCount``;
* placements passed by reference (``byref(c_nvmlGpuInstancePlacement_t)``): pynvml passes the
  argument through untouched;
* ``nvmlDeviceIsMigDeviceHandle`` returning the ``c_uint`` itself rather than its value;
* the MIG UUID of a CI, proven by GI and CI ID (``mig_identity``, the adapter's other half);
* handles going stale: GIs and CIs are looked up by ID, never cached across operations, except the
  one GI handle handed on to the next create or destroy on the same GPU (``handoff`` says when it is
  used and when dropped). A retry looks the GI up afresh, and a handed-on handle that answers
  INVALID_ARGUMENT (the GI was destroyed outside meanwhile) is looked up by ID, which answers what it
  answered before.

What it caches (physical GPU handles, each GPU's static facts, the profile and placement tables of
each GPU model) and why that is safe: ``device_cache``. A compute instance listing reads its GI's ID
once (it found the GI by that ID), not once per CI.

Everything that describes the *layout* is read live on every call: MIG mode (current and pending),
the GIs of every profile with their placements, the CIs of a GI with their MIG UUIDs, processes. A GI
or CI created or destroyed behind the sidecar's back is therefore seen at the next call, as before.

Errors are mapped and transient ones retried in ``calls`` (``mapped``, ``Caller``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from ctypes import byref, c_uint
from typing import Any, TypeVar

import pynvml

from sidecar.nvml.calls import TRANSIENT_CODES, TRANSIENT_DESTROY_CODES, Caller, mapped
from sidecar.nvml.device_cache import DeviceCache, text
from sidecar.nvml.handoff import KeptGiHandles
from sidecar.nvml.mig_identity import UnprovableMigUuidError, proven_mig_uuid
from sidecar.nvml.port import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
    ComputeInstanceInfo,
    GpuInfo,
    GpuInstanceInfo,
    GpuInstanceProfile,
    IdleProof,
    NvmlError,
    Placement,
    prove_by_parts,
)

T = TypeVar("T")


def _gi_info(gpu_uuid: str, gi: Any) -> GpuInstanceInfo:
    info = pynvml.nvmlGpuInstanceGetInfo(gi)
    return GpuInstanceInfo(
        gpu_uuid=gpu_uuid,
        id=int(info.id),
        profile_id=int(info.profileId),
        placement=Placement(int(info.placement.start), int(info.placement.size)),
    )


class PynvmlBackend:
    """``NvmlPort`` over pynvml. ``nvmlInit`` runs once, here; a missing library raises ``NvmlError``
    (LIBRARY_NOT_FOUND or DRIVER_NOT_LOADED) and is never papered over."""

    def __init__(self, retry_wait: bool = True, attempts: int = 3) -> None:
        self._caller = Caller(retry_wait, attempts)
        self._lock = threading.Lock()
        self._cache = DeviceCache()
        # The GI handle a create or a CI destroy leaves for the next call on its GPU (``handoff``).
        self._handoff = KeptGiHandles()
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

    def _gpu_info(self, handle: Any, gpu_uuid: str, index: int | None = None) -> GpuInfo:
        """MIG mode read live; the static facts read once per GPU (``device_cache``).

        The MIG mode is read first, so a GPU that fell off the bus fails here with GPU_IS_LOST exactly
        as it did before the static facts were cached."""
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError_NotSupported:  # a GPU without MIG hardware
            current, pending = 0, 0
        static = self._cache.static_facts(gpu_uuid, handle, index)
        return GpuInfo(
            index=static.gpu_index,
            uuid=gpu_uuid,
            minor=static.minor,
            model=static.name,
            memory_mb=static.memory_mb,
            mig_current=bool(current),
            mig_pending=bool(pending),
        )

    def _ci_info(self, gpu_uuid: str, gi: Any, ci: Any, gi_id: int | None = None) -> ComputeInstanceInfo:
        info = pynvml.nvmlComputeInstanceGetInfo(ci)
        ci_id, gi_id = int(info.id), int(pynvml.nvmlGpuInstanceGetInfo(gi).id) if gi_id is None else gi_id
        return ComputeInstanceInfo(
            gpu_uuid=gpu_uuid,
            gpu_instance_id=gi_id,
            id=ci_id,
            profile_id=int(info.profileId),
            mig_uuid=proven_mig_uuid(gpu_uuid, self._cache.device(gpu_uuid), info.device, gi_id, ci_id),
        )

    # -- NvmlPort ------------------------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        def read() -> list[GpuInfo]:
            result = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                # The UUID is read every time: it says which GPU sits at this index now.
                gpu_uuid = text(pynvml.nvmlDeviceGetUUID(handle))
                result.append(self._gpu_info(handle, gpu_uuid, index))
                self._cache.remember(gpu_uuid, handle)
            return result

        return self._run("list GPUs", read)

    def gpu(self, gpu_uuid: str) -> GpuInfo:
        return self._run(
            f"read GPU {gpu_uuid}", lambda: self._gpu_info(self._cache.device(gpu_uuid), gpu_uuid)
        )

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> int:
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE

        def apply() -> int:
            # Only the call's own return code raises; a refused activation comes back as the status.
            return int(pynvml.nvmlDeviceSetMigMode(self._cache.device(gpu_uuid), mode))

        try:
            return self._run(f"set MIG mode {'on' if enabled else 'off'} on {gpu_uuid}", apply)
        finally:
            # nvml.h: the call may unbind or reset the device, after which its minor number (and the
            # handle) may differ and must be queried again. Whatever the outcome, nothing cached about
            # this GPU is trusted any longer; the next call reads it afresh.
            self._cache.forget(gpu_uuid)
            self._handoff.drop(gpu_uuid)

    def gpu_instance_profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        def read() -> list[GpuInstanceProfile]:
            handle = self._cache.device(gpu_uuid)
            key = self._cache.static_facts(gpu_uuid, handle).model
            result = []
            rows = self._cache.gi_profiles(gpu_uuid, handle)
            one_slice = [r for r in rows if r.profile_index == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE]
            plain_sms = one_slice[0].multiprocessor_count if one_slice else 0
            for row in rows:
                # A profile whose full-size CI cannot be told is left out: it could never be created right.
                ci_profile_id = self._cache.full_ci(key, row, plain_sms)
                if ci_profile_id is None:
                    continue
                result.append(
                    GpuInstanceProfile(
                        index=row.profile_index,
                        id=row.id,
                        name=row.name,
                        slice_count=row.slice_count,
                        instance_count=row.instance_count,
                        memory_mb=row.memory_mb,
                        multiprocessor_count=row.multiprocessor_count,
                        placements=self._cache.placements(gpu_uuid, handle, row.id),
                        ci_profile_id=ci_profile_id,
                    )
                )
            return result

        return self._run(f"read GPU instance profiles of {gpu_uuid}", read)

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceInfo]:
        operation = f"list GPU instances of {gpu_uuid}"

        def read() -> list[GpuInstanceInfo]:
            handle = self._cache.device(gpu_uuid)
            table = self._cache.gi_profiles(gpu_uuid, handle)
            if not table:
                # No profile to list GIs by: "no GIs" cannot be read from that. MIG disabled is the
                # port's NOT_SUPPORTED; MIG enabled with no profile answering is unverifiable, and
                # fails the same way (the table is read again at the next call).
                current, _ = pynvml.nvmlDeviceGetMigMode(handle)
                why = "MIG mode is " + (
                    "enabled but no GPU instance profile answered" if current else "disabled"
                )
                raise NvmlError(operation, NVML_ERROR_NOT_SUPPORTED, why)
            result: list[GpuInstanceInfo] = []
            for row in table:
                array = (pynvml.c_nvmlGpuInstance_t * max(1, row.instance_count))()
                count = c_uint(len(array))
                pynvml.nvmlDeviceGetGpuInstances(handle, row.id, array, byref(count))
                result.extend(_gi_info(gpu_uuid, array[i]) for i in range(count.value))
            return sorted(result, key=lambda g: g.id)

        return self._run(operation, read)

    def compute_instances(self, gpu_uuid: str, gpu_instance_id: int) -> list[ComputeInstanceInfo]:
        operation = f"list compute instances of GI {gpu_instance_id} on {gpu_uuid}"

        def read() -> list[ComputeInstanceInfo]:
            gi = pynvml.nvmlDeviceGetGpuInstanceById(self._cache.device(gpu_uuid), gpu_instance_id)
            table = self._cache.ci_profiles(gpu_uuid, gi)
            if not table:  # every GI offers at least its full-size CI profile; "no CIs" is unverifiable
                raise NvmlError(operation, NVML_ERROR_NOT_SUPPORTED, "no compute instance profile answered")
            result: list[ComputeInstanceInfo] = []
            for row in table:
                array = (pynvml.c_nvmlComputeInstance_t * max(1, row.instance_count))()
                count = c_uint(len(array))
                pynvml.nvmlGpuInstanceGetComputeInstances(gi, row.id, array, byref(count))
                # The GI was found by this ID just now: its ID needs no read per CI.
                result.extend(
                    self._ci_info(gpu_uuid, gi, array[i], gpu_instance_id) for i in range(count.value)
                )
            return sorted(result, key=lambda c: c.id)

        return self._run(operation, read)

    # Creates retry the create call and the read-back separately: a create that returned SUCCESS is
    # never issued again because the read-back hiccuped (it would meet its own instance). A read-back
    # that keeps failing reaches the caller with the instance in place, for the lifecycle's undo.

    def create_gpu_instance(self, gpu_uuid: str, profile_id: int, placement: Placement) -> GpuInstanceInfo:
        operation = f"create GPU instance profile {profile_id} at {placement} on {gpu_uuid}"

        def create() -> Any:
            self._handoff.drop(gpu_uuid)
            where = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
            device = self._cache.device(gpu_uuid)
            return pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, profile_id, byref(where))

        gi = self._run(operation, create)
        made = self._run(f"{operation}: read back the new GPU instance", lambda: _gi_info(gpu_uuid, gi))
        self._handoff.keep(gpu_uuid, made.id, gi)  # for the CI create that follows
        return made

    def create_compute_instance(
        self, gpu_uuid: str, gpu_instance_id: int, ci_profile_id: int
    ) -> ComputeInstanceInfo:
        operation = f"create compute instance profile {ci_profile_id} in GI {gpu_instance_id} on {gpu_uuid}"

        def create() -> tuple[Any, Any]:
            gi = self._handoff.take(gpu_uuid, gpu_instance_id)  # used once: a retry looks it up
            if gi is None:
                gi = pynvml.nvmlDeviceGetGpuInstanceById(self._cache.device(gpu_uuid), gpu_instance_id)
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
            self._handoff.drop(gpu_uuid)
            gi = pynvml.nvmlDeviceGetGpuInstanceById(self._cache.device(gpu_uuid), gpu_instance_id)
            ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, compute_instance_id)
            pynvml.nvmlComputeInstanceDestroy(ci)
            self._handoff.keep(gpu_uuid, gpu_instance_id, gi)  # for the GI destroy that follows

        self._run(
            f"destroy compute instance {compute_instance_id} of GI {gpu_instance_id} on {gpu_uuid}",
            destroy,
            TRANSIENT_DESTROY_CODES,
        )

    def destroy_gpu_instance(self, gpu_uuid: str, gpu_instance_id: int) -> None:
        def destroy() -> None:
            gi = self._handoff.take(gpu_uuid, gpu_instance_id)  # used once: a retry looks it up
            try:
                if gi is not None:
                    pynvml.nvmlGpuInstanceDestroy(gi)
                    return
            except pynvml.NVMLError as exc:
                # A handle that no longer names a GI (destroyed outside since) is looked up by ID, which
                # answers what it answered before; any other error is the destroy's own.
                if exc.value != NVML_ERROR_INVALID_ARGUMENT:
                    raise
            pynvml.nvmlGpuInstanceDestroy(
                pynvml.nvmlDeviceGetGpuInstanceById(self._cache.device(gpu_uuid), gpu_instance_id)
            )

        self._run(f"destroy GPU instance {gpu_instance_id} on {gpu_uuid}", destroy, TRANSIENT_DESTROY_CODES)

    def mig_device_processes(self, mig_uuid: str) -> int:
        def read() -> int:
            handle = pynvml.nvmlDeviceGetHandleByUUID(mig_uuid)
            return len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))

        return self._run(f"look up MIG device {mig_uuid}", read)

    def prove_idle(self, gpu_uuid: str, mig_uuid: str) -> IdleProof:
        return prove_by_parts(self, gpu_uuid, mig_uuid)

    def gpu_processes(self, gpu_uuid: str) -> int:
        return self._run(
            f"count processes on {gpu_uuid}",
            lambda: len(pynvml.nvmlDeviceGetComputeRunningProcesses(self._cache.device(gpu_uuid))),
        )
