"""Allocate / Release / SyncActive transactions over owned MIG instances (architecture section 5).

STUB — the interface below is fixed (server, recovery and reconciler are written against it); the
bodies are filled in by the lifecycle work.

``Lifecycle`` owns the in-memory table of owned instances (record name -> OwnershipRecord, mirroring
the record files exactly), one lock per GPU (GPUs proceed in parallel), the activation ``generation``
and the ``recovered`` gate. Every record change goes through the RecordStore *before* the in-memory
table changes; intent is recorded before each NVML mutation and completion after it.
Foreign instances are never cached: every allocation reads the live GI layout of its GPU, so anything
created outside the sidecar blocks its placement (PLACEMENT_BUSY) at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from sidecar.cdi import CdiSpecs
from sidecar.domain import (
    ActiveAllocation,
    AllocateRequest,
    AllocateResult,
    ForeignInstance,
    InstanceRef,
)
from sidecar.nvml.port import GpuInfo, GpuInstanceProfile, NvmlPort
from sidecar.records import OwnershipRecord, RecordStore


class GpuSnapshot(msgspec.Struct, frozen=True):
    gpu: GpuInfo
    busy: bool
    instances: tuple[OwnershipRecord, ...]
    foreign: tuple[ForeignInstance, ...]


class StateSnapshot(msgspec.Struct, frozen=True):
    generation: int
    gpus: tuple[GpuSnapshot, ...]
    pending_cdi_removals: tuple[str, ...]


class Lifecycle:
    def __init__(self, port: NvmlPort, records: RecordStore, cdi: CdiSpecs, boot_id: str) -> None:
        self.port = port
        self.records = records
        self.cdi = cdi
        self.boot_id = boot_id
        self.recovered = False
        self.generation = 0

    # -- queries -------------------------------------------------------------------------------------
    def profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        """The GPU's GI profiles (cached per GPU after the first successful read). UnknownGpu if absent."""
        raise NotImplementedError

    def resolve_profile(self, gpu_uuid: str, name: str) -> GpuInstanceProfile:
        """Full profile name -> profile; UnknownProfile if the GPU has no such profile."""
        raise NotImplementedError

    def gpu_busy(self, gpu_uuid: str) -> bool:
        """An ACTIVE instance or a running process on the GPU; an NVML error counts as busy."""
        raise NotImplementedError

    def instances(self) -> list[OwnershipRecord]:
        """A copy of the owned-instance table."""
        raise NotImplementedError

    def snapshot(self) -> StateSnapshot:
        raise NotImplementedError

    # -- transactions (each raises errors.NotRecovered until ``recovered``) -----------------------------
    def allocate(self, request: AllocateRequest) -> AllocateResult:
        raise NotImplementedError

    def release(self, pod_uid: str) -> list[InstanceRef]:
        raise NotImplementedError

    def sync_active(
        self, generation: int, active: Sequence[ActiveAllocation]
    ) -> tuple[list[InstanceRef], list[InstanceRef]]:
        """Returns (idled, reactivated)."""
        raise NotImplementedError

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> tuple[bool, bool, bool]:
        """Returns (current, pending, needs_reset). Refuses (PlacementBusy) to disable while any GI exists."""
        raise NotImplementedError

    # -- used by recovery and the reconciler ---------------------------------------------------------
    def install(self, records: Sequence[OwnershipRecord], generation: int) -> None:
        """Replace the table with recovered records (under every GPU lock) and mark recovered."""
        raise NotImplementedError
