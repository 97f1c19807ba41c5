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
  answered before. Only physical GPU handles are cached by
  UUID (they stay valid until a MIG mode change, and an uncached by-UUID lookup can take seconds on a
  loaded node).

What is cached, and why that is safe (every NVML call is a driver round trip on the Allocate path of
kubelet, and ``sim stats`` counts them): only facts that cannot change while the driver that answered
them stays loaded and the device stays bound, which is also the lifetime of the cached GPU handles
they are read through. A MIG mode change may rebind the device (nvml.h: minor number and handle may
change), so ``set_mig_mode`` drops everything cached about that GPU, and the tables of its model.

* per GPU: index, minor number, name, total memory — properties of the physical device;
* per GPU *model* (``ModelKey``: the name ``nvmlDeviceGetName`` reports and the total memory): the GI
  profile table (every profile index with its info), the possible placements of each GI profile, and
  the CI profile table of each GI profile. These are the MIG geometry of a board, fixed by its chip
  and memory configuration and by the loaded driver (one per node, shared by every GPU the adapter
  sees), and independent of occupancy: nvml.h documents the placements as "independent of the
  currently used placements". Boards that share a name and a memory size share that geometry (the
  name carries the form factor and memory kind: "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL"). That
  is an assumption about the driver, not something NVML promises per GPU; ``sidecar.nvml.probe``
  checks it on a real node (``static_tables_agree``: every GPU's tables against the others of its
  key, with the board part number and PCI IDs beside each GPU). An empty table is never cached
  (Ampere answers NOT_SUPPORTED for every index while MIG is disabled), and GIs are never listed
  from one. The tables are read under one lock, so the threads of Recover's gather wait for one read
  of their model's table instead of each making it: a node of 8 identical GPUs reads each table once;
* the full-size CI profile of each GI profile follows from those tables, so it is told again from
  them at every call, without an NVML call. A compute instance listing reads its GI's ID once (it
  found the GI by that ID), not once per CI.

Everything that describes the *layout* is read live on every call: MIG mode (current and pending),
the GIs of every profile with their placements, the CIs of a GI with their MIG UUIDs, processes. A GI
or CI created or destroyed behind the sidecar's back is therefore seen at the next call, as before.

Errors are mapped and transient ones retried in ``calls`` (``mapped``, ``Caller``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from ctypes import byref, c_uint
from typing import Any, NamedTuple, TypeVar

import pynvml

from sidecar.nvml.calls import TRANSIENT_CODES, TRANSIENT_DESTROY_CODES, Caller, mapped
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
from sidecar.nvml.profile_types import CI_PROFILE_1_SLICE_REV1, full_ci_profile_id, pick_full_ci

T = TypeVar("T")

# Codes that mean "this index does not exist on this GPU" while enumerating profiles.
_SKIP_PROFILE = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT)
_MIB = 1024 * 1024


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# What identifies the MIG geometry of a GPU here: its name and total memory in MiB (module notes).
ModelKey = tuple[str, int]


def _model_key(static: tuple[int, int, str, int]) -> ModelKey:
    """The model key of a GPU's static facts (index, minor, name, memory MiB)."""
    return static[2], static[3]


def _gi_info(gpu_uuid: str, gi: Any) -> GpuInstanceInfo:
    info = pynvml.nvmlGpuInstanceGetInfo(gi)
    return GpuInstanceInfo(
        gpu_uuid=gpu_uuid,
        id=int(info.id),
        profile_id=int(info.profileId),
        placement=Placement(int(info.placement.start), int(info.placement.size)),
    )


class _GiProfileRow(NamedTuple):
    """One GI profile as ``nvmlDeviceGetGpuInstanceProfileInfo`` answered it, by profile index."""

    profile_index: int
    id: int
    name: str
    slice_count: int
    instance_count: int
    memory_mb: int
    multiprocessor_count: int


class _CiProfileRow(NamedTuple):
    id: int
    instance_count: int
    slice_count: int
    multiprocessor_count: int


class PynvmlBackend:
    """``NvmlPort`` over pynvml. ``nvmlInit`` runs once, here; a missing library raises ``NvmlError``
    (LIBRARY_NOT_FOUND or DRIVER_NOT_LOADED) and is never papered over."""

    def __init__(self, retry_wait: bool = True, attempts: int = 3) -> None:
        self._caller = Caller(retry_wait, attempts)
        self._lock = threading.Lock()
        self._handles: dict[str, Any] = {}
        self._static: dict[str, tuple[int, int, str, int]] = {}  # uuid -> index, minor, name, memory MiB
        # The GI handle a create or a CI destroy leaves for the next call on its GPU (``handoff``).
        self._handoff = KeptGiHandles()
        # The static tables of each GPU model (module notes). Read under ``_tables_lock``, so GPUs
        # read at once by several threads (Recover's gather) wait for one read of their model's table
        # instead of each making it.
        self._tables_lock = threading.Lock()
        self._gi_profiles: dict[ModelKey, tuple[_GiProfileRow, ...]] = {}
        self._placements: dict[tuple[ModelKey, int], tuple[Placement, ...]] = {}
        # (model, GI profile ID) -> every CI profile a GI of that profile offers
        self._ci_profiles: dict[tuple[ModelKey, int], tuple[_CiProfileRow, ...]] = {}
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
        """MIG mode read live; the static facts read once per GPU (module notes).

        The MIG mode is read first, so a GPU that fell off the bus fails here with GPU_IS_LOST exactly
        as it did before the static facts were cached."""
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError_NotSupported:  # a GPU without MIG hardware
            current, pending = 0, 0
        static = self._static_facts(gpu_uuid, handle, index)
        return GpuInfo(
            index=static[0],
            uuid=gpu_uuid,
            minor=static[1],
            model=static[2],
            memory_mb=static[3],
            mig_current=bool(current),
            mig_pending=bool(pending),
        )

    def _static_facts(
        self, gpu_uuid: str, handle: Any, index: int | None = None
    ) -> tuple[int, int, str, int]:
        """Index, minor number, name and total memory (MiB) of a GPU, read once (module notes)."""
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
        return static

    def _profile_rows(self, gpu_uuid: str, handle: Any) -> tuple[_GiProfileRow, ...]:
        """Every supported GI profile of the GPU's model, by *index*; read once per model.

        Missing indices answer NOT_SUPPORTED or INVALID_ARGUMENT and are skipped. An empty table is
        never cached: Ampere drivers answer NOT_SUPPORTED for every profile index while MIG is
        disabled, and remembering that answer would hide every GI made once MIG is on."""
        key = _model_key(self._static_facts(gpu_uuid, handle))
        with self._tables_lock:
            cached = self._gi_profiles.get(key)
            if cached is not None:
                return cached
            rows = []
            for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                try:
                    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
                except pynvml.NVMLError as exc:
                    if exc.value in _SKIP_PROFILE:
                        continue
                    raise
                rows.append(
                    _GiProfileRow(
                        profile_index=index,
                        id=int(info.id),
                        name=_text(info.name).removeprefix("MIG "),
                        slice_count=int(info.sliceCount),
                        instance_count=int(info.instanceCount),
                        memory_mb=int(info.memorySizeMB),
                        multiprocessor_count=int(info.multiprocessorCount),
                    )
                )
            table = tuple(rows)
            if table:
                self._gi_profiles[key] = table
            return table

    def _possible_placements(self, gpu_uuid: str, handle: Any, profile_id: int) -> tuple[Placement, ...]:
        """GetGpuInstancePossiblePlacements of one GI profile (count query, then the array); per model."""
        key = (_model_key(self._static_facts(gpu_uuid, handle)), profile_id)
        with self._tables_lock:
            cached = self._placements.get(key)
            if cached is not None:
                return cached
            count = c_uint(0)
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, byref(count))
            array = (pynvml.c_nvmlGpuInstancePlacement_t * max(1, count.value))()
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, byref(count))
            placements = tuple(Placement(int(array[i].start), int(array[i].size)) for i in range(count.value))
            self._placements[key] = placements
            return placements

    def _full_ci(self, key: ModelKey, info: _GiProfileRow, plain_sms: int) -> int | None:
        """The full-size CI profile of a GI profile, by ``profile_types.pick_full_ci``.

        Read from the CI profiles of a real GI of this profile once one has been seen (``_ci_profile_table``
        is filled by every create and listing). Before that, NVML offers no way to ask (CI profiles are
        queried on a GI), so it is told from the GI profile alone: the CI of as many slices, except that
        a 1-slice GI with more SMs than the plain 1-slice profile (the double-memory 1g on Hopper and
        Blackwell) spans its SMs with CI 7 (1_SLICE_REV1); A100's double-memory 1g has a plain slice's
        SMs and keeps CI 0. The probe (``sidecar.nvml.probe``) shows a real GPU's CI tables to check it."""
        slices = info.slice_count
        with self._tables_lock:
            seen = self._ci_profiles.get((key, info.id))
        if seen is not None:
            return pick_full_ci(slices, [(c.id, c.slice_count, c.multiprocessor_count) for c in seen])
        if slices == 1 and plain_sms and info.multiprocessor_count > plain_sms:
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
        """Drop everything cached about one GPU: its handle and static facts, and the tables of its
        model (a mode change is rare, and after it nothing read through the old binding is trusted)."""
        with self._lock:
            self._handles.pop(gpu_uuid, None)
            static = self._static.pop(gpu_uuid, None)
        self._handoff.drop(gpu_uuid)
        if static is None:
            return
        model = _model_key(static)
        with self._tables_lock:
            self._gi_profiles.pop(model, None)
            for key in [k for k in self._placements if k[0] == model]:
                del self._placements[key]
            for key in [k for k in self._ci_profiles if k[0] == model]:
                del self._ci_profiles[key]

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
            key = _model_key(self._static_facts(gpu_uuid, handle))
            result = []
            rows = self._profile_rows(gpu_uuid, handle)
            one_slice = [r for r in rows if r.profile_index == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE]
            plain_sms = one_slice[0].multiprocessor_count if one_slice else 0
            for row in rows:
                # A profile whose full-size CI cannot be told is left out: it could never be created right.
                ci_profile_id = self._full_ci(key, row, plain_sms)
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
                        placements=self._possible_placements(gpu_uuid, handle, row.id),
                        ci_profile_id=ci_profile_id,
                    )
                )
            return result

        return self._run(f"read GPU instance profiles of {gpu_uuid}", read)

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceInfo]:
        operation = f"list GPU instances of {gpu_uuid}"

        def read() -> list[GpuInstanceInfo]:
            handle = self._device(gpu_uuid)
            table = self._profile_rows(gpu_uuid, handle)
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

    def _ci_profile_table(self, gpu_uuid: str, gi: Any) -> tuple[_CiProfileRow, ...]:
        """Every CI profile a GI of this GI's profile offers.

        Cached per (model, GI profile ID), not per GI: GI IDs are reused by the driver for GIs of
        other profiles, while the CI profiles of a GI profile are fixed for a GPU model and driver
        (module notes). The GI's profile ID is read live (one GetInfo) to pick the right table."""
        key = (
            _model_key(self._static_facts(gpu_uuid, self._device(gpu_uuid))),
            int(pynvml.nvmlGpuInstanceGetInfo(gi).profileId),
        )
        with self._tables_lock:
            cached = self._ci_profiles.get(key)
            if cached is not None:
                return cached
            rows = []
            for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                    )
                except pynvml.NVMLError as exc:
                    if exc.value in _SKIP_PROFILE:
                        continue
                    raise
                counts = int(info.instanceCount), int(info.sliceCount), int(info.multiprocessorCount)
                rows.append(_CiProfileRow(int(info.id), *counts))
            table = tuple(rows)
            if table:  # never remember "no CI profiles": the CIs of this GI would be hidden for good
                self._ci_profiles[key] = table
            return table

    def compute_instances(self, gpu_uuid: str, gpu_instance_id: int) -> list[ComputeInstanceInfo]:
        operation = f"list compute instances of GI {gpu_instance_id} on {gpu_uuid}"

        def read() -> list[ComputeInstanceInfo]:
            gi = pynvml.nvmlDeviceGetGpuInstanceById(self._device(gpu_uuid), gpu_instance_id)
            table = self._ci_profile_table(gpu_uuid, gi)
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
            device = self._device(gpu_uuid)
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
            self._handoff.drop(gpu_uuid)
            gi = pynvml.nvmlDeviceGetGpuInstanceById(self._device(gpu_uuid), gpu_instance_id)
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
                pynvml.nvmlDeviceGetGpuInstanceById(self._device(gpu_uuid), gpu_instance_id)
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
            lambda: len(pynvml.nvmlDeviceGetComputeRunningProcesses(self._device(gpu_uuid))),
        )
