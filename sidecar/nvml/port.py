"""The hardware port: what the domain needs from NVML, in NVML's own words, typed.

The domain (``lifecycle``, ``recovery``, ``reconciler``, ``server``) depends on this module only.
One adapter implements it, ``pynvml_backend.PynvmlBackend``, over ``pynvml`` (the only module importing
it). On a real node it talks to ``libnvidia-ml.so.1``; with ``--backend simulated`` the very same
adapter runs over ``sim.SimulatedLibrary`` installed as ``pynvml.nvmlLib``.

The port is stateless and addressed by IDs (GPU UUID, GI ID, CI ID), never by NVML handles: handles go
stale after a destroy and the driver reuses IDs, so every call looks its objects up afresh and the MIG
UUID is what proves identity.

Errors: every NVML failure surfaces as ``NvmlError`` (``code`` is the ``nvmlReturn_t`` value, the
pynvml exception is kept as ``__cause__``). Bounded retries of transient codes happen inside the
adapter; what reaches the domain is final.

``prove_idle`` is the reads of a reuse in one port call: the GPU (its MIG mode, current and
pending), then, only when MIG is enabled now and after the next reset, the lookup by MIG UUID and
its processes. The NVML calls and the retries are those of ``gpu`` and ``mig_device_processes``
made one after the other (``prove_by_parts``); the layers above the adapter (the metering and
liveness of ``MeteredPort``, the inventory's listing tap) are passed once instead of twice. A
failure of the GPU read raises; one of the lookup comes back in the proof (``IdleProof.failure``),
for the lifecycle to judge as it judges a failed ``mig_device_processes`` (a NOT_FOUND the GPU's
listing contradicts proves nothing), and is counted under ``mig_device_processes``.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

# nvmlReturn_t values the domain reasons about (nvml.h).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_NOT_READY = 27
NVML_ERROR_UNKNOWN = 999

# nvmlReturn_t names without the NVML_ERROR_ prefix (nvml.h), what runbooks and nvidia-smi say: an
# operator reads INSUFFICIENT_RESOURCES, not 23, in a metric label or an alert.
_CODE_NAMES = (
    "SUCCESS", "UNINITIALIZED", "INVALID_ARGUMENT", "NOT_SUPPORTED", "NO_PERMISSION", "ALREADY_INITIALIZED",
    "NOT_FOUND", "INSUFFICIENT_SIZE", "INSUFFICIENT_POWER", "DRIVER_NOT_LOADED", "TIMEOUT", "IRQ_ISSUE",
    "LIBRARY_NOT_FOUND", "FUNCTION_NOT_FOUND", "CORRUPTED_INFOROM", "GPU_IS_LOST", "RESET_REQUIRED",
    "OPERATING_SYSTEM", "LIB_RM_VERSION_MISMATCH", "IN_USE", "MEMORY", "NO_DATA", "VGPU_ECC_NOT_SUPPORTED",
    "INSUFFICIENT_RESOURCES", "FREQ_NOT_SUPPORTED", "ARGUMENT_VERSION_MISMATCH", "DEPRECATED", "NOT_READY",
    "GPU_NOT_FOUND", "INVALID_STATE", "RESET_TYPE_NOT_SUPPORTED",
)  # fmt: skip


def code_name(code: int) -> str:
    """The name of an nvmlReturn_t (``INSUFFICIENT_RESOURCES``); a code newer than this table keeps
    its number (``CODE_31``), so a label never hides which one it was."""
    if code == NVML_ERROR_UNKNOWN:
        return "UNKNOWN"
    if 0 <= code < len(_CODE_NAMES):
        return _CODE_NAMES[code]
    return f"CODE_{code}"


class Placement(msgspec.Struct, frozen=True):
    """A range ``[start, start + size)`` of memory slices.

    ``size`` counts memory slices, not compute slices."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.end and other.start < self.end

    def __str__(self) -> str:
        return f"{self.start}:{self.size}"


class NvmlError(Exception):
    """An NVML call failed. ``operation`` names the port method and its target, ``code`` the nvmlReturn_t."""

    def __init__(self, operation: str, code: int, message: str) -> None:
        super().__init__(f"{operation}: {message} (nvml code {code})")
        self.operation = operation
        self.code = code
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.code == NVML_ERROR_NOT_FOUND

    @property
    def in_use(self) -> bool:
        return self.code == NVML_ERROR_IN_USE


class GpuInfo(msgspec.Struct, frozen=True):
    index: int
    uuid: str
    minor: int
    model: str  # nvmlDeviceGetName, e.g. "NVIDIA H100 80GB HBM3"
    memory_mb: int  # total memory in MiB
    mig_current: bool
    mig_pending: bool


class GpuInstanceProfile(msgspec.Struct, frozen=True):
    """One GPU instance profile of a GPU, with the full-size CI profile that goes with it."""

    index: int  # the NVML_GPU_INSTANCE_PROFILE_* constant passed to GetGpuInstanceProfileInfo
    id: int  # the GI profile ID (nvidia-smi "ID"), what create/list/placements take
    name: str  # without the "MIG " prefix: "1g.10gb", "1g.10gb+me"
    slice_count: int  # compute slices
    instance_count: int
    memory_mb: int
    multiprocessor_count: int
    placements: tuple[Placement, ...]  # GetGpuInstancePossiblePlacements (static, occupancy-independent)
    ci_profile_id: int  # ID of the full-size compute instance profile (shared engines) inside such a GI


class GpuInstanceInfo(msgspec.Struct, frozen=True):
    gpu_uuid: str
    id: int
    profile_id: int
    placement: Placement


class ComputeInstanceInfo(msgspec.Struct, frozen=True):
    gpu_uuid: str
    gpu_instance_id: int
    id: int
    profile_id: int
    mig_uuid: str  # nvmlDeviceGetUUID of nvmlComputeInstanceInfo_t.device (the MIG device handle)


class IdleProof(msgspec.Struct, frozen=True):
    """What ``NvmlPort.prove_idle`` read: the GPU with its MIG mode, then the MIG device's processes.

    ``processes`` is None when the MIG device was not looked up (MIG is not enabled now and after
    the next reset) or the lookup failed; ``failure`` is that lookup's error, as
    ``mig_device_processes`` would have raised it (NOT_FOUND when the device is gone)."""

    gpu: GpuInfo
    processes: int | None = None
    failure: NvmlError | None = None


class NvmlPort(Protocol):
    """What the lifecycle needs from NVML. Every method raises ``NvmlError`` on failure."""

    def gpus(self) -> list[GpuInfo]:
        """All physical GPUs (nvmlDeviceGetCount / GetHandleByIndex), in index order."""
        ...

    def gpu(self, gpu_uuid: str) -> GpuInfo:
        """One GPU by UUID; unknown UUID -> NvmlError (NOT_FOUND or INVALID_ARGUMENT as NVML says)."""
        ...

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> int:
        """nvmlDeviceSetMigMode; returns the activation status (an nvmlReturn_t, 0 = applied)."""
        ...

    def gpu_instance_profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        """Every GI profile the GPU supports.

        Profile indices that answer NOT_SUPPORTED or INVALID_ARGUMENT are skipped, and so is a profile
        whose compute slice count has no known full-size CI profile (it could not be created right)."""
        ...

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceInfo]:
        """Every GI on the GPU, across all profiles, sorted by GI ID.

        MIG disabled -> NvmlError NOT_SUPPORTED. So is a GPU on which no GI profile answers (the GIs
        cannot be enumerated): an empty list always means "no GIs", never "could not tell"."""
        ...

    def compute_instances(self, gpu_uuid: str, gpu_instance_id: int) -> list[ComputeInstanceInfo]:
        """Every CI inside one GI, across all CI profiles, sorted by CI ID.

        No CI profile answering for the GI -> NvmlError NOT_SUPPORTED, never an empty list."""
        ...

    def create_gpu_instance(self, gpu_uuid: str, profile_id: int, placement: Placement) -> GpuInstanceInfo:
        """nvmlDeviceCreateGpuInstanceWithPlacement; never lets the driver choose the placement."""
        ...

    def create_compute_instance(
        self, gpu_uuid: str, gpu_instance_id: int, ci_profile_id: int
    ) -> ComputeInstanceInfo:
        """nvmlGpuInstanceCreateComputeInstance in the given GI; the result carries the fresh MIG UUID."""
        ...

    def destroy_compute_instance(self, gpu_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        """nvmlComputeInstanceDestroy; IN_USE while processes run on it."""
        ...

    def destroy_gpu_instance(self, gpu_uuid: str, gpu_instance_id: int) -> None:
        """nvmlGpuInstanceDestroy; IN_USE while it has compute instances or processes."""
        ...

    def mig_device_processes(self, mig_uuid: str) -> int:
        """How many compute processes run on the MIG device with this MIG UUID, found by it
        (nvmlDeviceGetHandleByUUID). Gone -> NvmlError NOT_FOUND.

        Two calls whatever the layout. Finding the UUID proves that very CI live, and with it the GI
        it was made in: the driver mints a MIG UUID at each CI create and never hands it out again,
        and a GI cannot be destroyed (nor re-created) under a live CI."""
        ...

    def prove_idle(self, gpu_uuid: str, mig_uuid: str) -> IdleProof:
        """The reads of a reuse in one call: ``gpu(gpu_uuid)``, then, only when its MIG mode is
        enabled now and after the next reset, ``mig_device_processes(mig_uuid)``, each exactly as
        its own method makes it (the same NVML calls and retries). A failure of the GPU read raises;
        one of the lookup is returned in ``IdleProof.failure``, with the GPU read it followed."""
        ...

    def gpu_processes(self, gpu_uuid: str) -> int:
        """How many compute processes run anywhere on a physical GPU."""
        ...


# Xids that are application errors, after which the GPU is still healthy: the NVIDIA device
# plugin's default list of ignored Xids (13 graphics engine exception, 31 GPU memory page fault,
# 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor exception, 109 context
# switch timeout). Every other critical Xid faults what it names.
XID_APPLICATION_ERRORS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
XID_ALL_INSTANCES = 0xFFFFFFFF  # nvmlEventData_t's GI/CI ID when the event is about the whole GPU


class XidEvent(msgspec.Struct, frozen=True):
    """One critical Xid event (nvmlEventTypeXidCriticalError) as NVML delivered it.

    ``gpu_instance_id``/``compute_instance_id`` are None when the event names the whole GPU (NVML's
    0xFFFFFFFF); a compute instance ID of None with a GI ID names every CI of that GI."""

    gpu_uuid: str
    xid: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class XidEvents(Protocol):
    """Critical Xid events of some GPUs, waited for on one thread (``sidecar.lifecycle.xid_watch``).

    Not part of ``NvmlPort``: nothing on a request's path waits for events, and a wait is not a call
    whose time the liveness probe should count (it returns at its timeout by design)."""

    def watch_xids(self, gpu_uuids: list[str]) -> object:
        """nvmlEventSetCreate, then nvmlDeviceRegisterEvents(XidCriticalError) for each GPU; the
        returned set is for ``wait_xid`` and ``stop_watching``. A GPU that cannot be registered
        raises (NvmlError) after the set is freed."""
        ...

    def wait_xid(self, watch: object, timeout_ms: int) -> XidEvent | None:
        """nvmlEventSetWait_v2: the next event, or None when none came within ``timeout_ms``."""
        ...

    def stop_watching(self, watch: object) -> None:
        """nvmlEventSetFree."""
        ...


def prove_by_parts(port: NvmlPort, gpu_uuid: str, mig_uuid: str) -> IdleProof:
    """``NvmlPort.prove_idle`` made of the port's own ``gpu`` and ``mig_device_processes`` calls."""
    gpu = port.gpu(gpu_uuid)
    if not (gpu.mig_current and gpu.mig_pending):
        return IdleProof(gpu)
    try:
        return IdleProof(gpu, port.mig_device_processes(mig_uuid))
    except NvmlError as exc:
        return IdleProof(gpu, None, exc)
