"""What the pynvml adapter (``pynvml_backend``) remembers between calls, and why that is safe.

Every NVML call is a driver round trip on the Allocate path of kubelet, and ``sim stats`` counts
them. So the adapter caches, and only facts that cannot change while the driver that answered them
stays loaded and the device stays bound, which is also the lifetime of the cached GPU handles they
are read through. A MIG mode change may rebind the device (nvml.h: minor number and handle may
change), so ``DeviceCache.forget`` (called by ``set_mig_mode``) drops everything cached about that
GPU, and the tables of its model.

* per GPU: the physical GPU handle by UUID (valid until a MIG mode change; an uncached by-UUID
  lookup can take seconds on a loaded node), and index, minor number, name, total memory —
  properties of the physical device;
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
  them at every call (``full_ci``), without an NVML call.

GIs and CIs are never cached here: their handles go stale when they are destroyed (the adapter looks
them up by ID; ``handoff`` keeps one for the call that follows), and everything that describes the
*layout* (MIG mode, the GIs, the CIs, processes) is read live by the adapter on every call.
"""

from __future__ import annotations

import threading
from ctypes import byref, c_uint
from typing import Any, NamedTuple

import pynvml

from sidecar.nvml.port import NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_SUPPORTED, Placement
from sidecar.nvml.profile_types import CI_PROFILE_1_SLICE_REV1, full_ci_profile_id, pick_full_ci

# Codes that mean "this index does not exist on this GPU" while enumerating profiles.
_SKIP_PROFILE = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT)
_MIB = 1024 * 1024


def text(value: Any) -> str:
    """A string NVML answered, as bytes or as str depending on the pynvml version."""
    return value.decode() if isinstance(value, bytes) else str(value)


# What identifies the MIG geometry of a GPU here: its name and total memory in MiB (module notes).
ModelKey = tuple[str, int]


class StaticFacts(NamedTuple):
    """What a GPU's physical device answers for as long as it stays bound."""

    gpu_index: int
    minor: int
    name: str
    memory_mb: int

    @property
    def model(self) -> ModelKey:
        return self.name, self.memory_mb


class GiProfileRow(NamedTuple):
    """One GI profile as ``nvmlDeviceGetGpuInstanceProfileInfo`` answered it, by profile index."""

    profile_index: int
    id: int
    name: str
    slice_count: int
    instance_count: int
    memory_mb: int
    multiprocessor_count: int


class CiProfileRow(NamedTuple):
    id: int
    instance_count: int
    slice_count: int
    multiprocessor_count: int


class DeviceCache:
    """GPU handles, static facts and per-model tables, each read from NVML once (module notes).
    Thread-safe; the callers' NVML errors pass through (the adapter maps and retries them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[str, Any] = {}
        self._static: dict[str, StaticFacts] = {}
        # Read under ``_tables_lock``, so GPUs read at once by several threads (Recover's gather)
        # wait for one read of their model's table instead of each making it.
        self._tables_lock = threading.Lock()
        self._gi_profiles: dict[ModelKey, tuple[GiProfileRow, ...]] = {}
        self._placements: dict[tuple[ModelKey, int], tuple[Placement, ...]] = {}
        # (model, GI profile ID) -> every CI profile a GI of that profile offers
        self._ci_profiles: dict[tuple[ModelKey, int], tuple[CiProfileRow, ...]] = {}

    def device(self, gpu_uuid: str) -> Any:
        """The physical GPU's handle, looked up by UUID once."""
        with self._lock:
            handle = self._handles.get(gpu_uuid)
        if handle is None:
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            with self._lock:
                self._handles[gpu_uuid] = handle
        return handle

    def remember(self, gpu_uuid: str, handle: Any) -> None:
        """A handle the caller found by index (listing the GPUs), kept unless one is already."""
        with self._lock:
            self._handles.setdefault(gpu_uuid, handle)

    def static_facts(self, gpu_uuid: str, handle: Any, index: int | None = None) -> StaticFacts:
        """Index, minor number, name and total memory (MiB) of a GPU, read once."""
        with self._lock:
            static = self._static.get(gpu_uuid)
        if static is None:
            static = StaticFacts(
                int(pynvml.nvmlDeviceGetIndex(handle)) if index is None else index,
                int(pynvml.nvmlDeviceGetMinorNumber(handle)),
                text(pynvml.nvmlDeviceGetName(handle)),
                int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB,
            )
            with self._lock:
                self._static[gpu_uuid] = static
        return static

    def model(self, gpu_uuid: str) -> ModelKey:
        return self.static_facts(gpu_uuid, self.device(gpu_uuid)).model

    def gi_profiles(self, gpu_uuid: str, handle: Any) -> tuple[GiProfileRow, ...]:
        """Every supported GI profile of the GPU's model, by *index*; read once per model.

        Missing indices answer NOT_SUPPORTED or INVALID_ARGUMENT and are skipped. An empty table is
        never cached: Ampere drivers answer NOT_SUPPORTED for every profile index while MIG is
        disabled, and remembering that answer would hide every GI made once MIG is on."""
        key = self.static_facts(gpu_uuid, handle).model
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
                    GiProfileRow(
                        profile_index=index,
                        id=int(info.id),
                        name=text(info.name).removeprefix("MIG "),
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

    def placements(self, gpu_uuid: str, handle: Any, profile_id: int) -> tuple[Placement, ...]:
        """GetGpuInstancePossiblePlacements of one GI profile (count query, then the array); per model."""
        key = (self.static_facts(gpu_uuid, handle).model, profile_id)
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

    def ci_profiles(self, gpu_uuid: str, gi: Any) -> tuple[CiProfileRow, ...]:
        """Every CI profile a GI of this GI's profile offers.

        Cached per (model, GI profile ID), not per GI: GI IDs are reused by the driver for GIs of
        other profiles, while the CI profiles of a GI profile are fixed for a GPU model and driver
        (module notes). The GI's profile ID is read live (one GetInfo) to pick the right table."""
        key = (self.model(gpu_uuid), int(pynvml.nvmlGpuInstanceGetInfo(gi).profileId))
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
                rows.append(CiProfileRow(int(info.id), *counts))
            table = tuple(rows)
            if table:  # never remember "no CI profiles": the CIs of this GI would be hidden for good
                self._ci_profiles[key] = table
            return table

    def full_ci(self, key: ModelKey, info: GiProfileRow, plain_sms: int) -> int | None:
        """The full-size CI profile of a GI profile, by ``profile_types.pick_full_ci``.

        Read from the CI profiles of a real GI of this profile once one has been seen (``ci_profiles``
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

    def forget(self, gpu_uuid: str) -> None:
        """Drop everything cached about one GPU: its handle and static facts, and the tables of its
        model (a mode change is rare, and after it nothing read through the old binding is trusted)."""
        with self._lock:
            self._handles.pop(gpu_uuid, None)
            static = self._static.pop(gpu_uuid, None)
        if static is None:
            return
        model = static.model
        with self._tables_lock:
            self._gi_profiles.pop(model, None)
            for key in [k for k in self._placements if k[0] == model]:
                del self._placements[key]
            for key in [k for k in self._ci_profiles if k[0] == model]:
                del self._ci_profiles[key]
