"""The small interfaces the callers of the lifecycle see; ``Lifecycle`` and ``Recovery`` provide them.

``Queries`` (read-only answers), ``Transactions`` (the mutating RPCs), ``Recover`` (the Recover RPC),
``Maintenance`` (what the reconciler retries). The server holds ``Service`` (queries and
transactions) and ``Recover``; the reconciler holds ``Maintenance``. None of them names a part
(port, records, CDI specs, context). See ``docs/architecture.md``, "The facade".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sidecar.lifecycle.inventory import StateSnapshot
from sidecar.lifecycle.reclaim import Reclaimed
from sidecar.lifecycle.undo import DeviceUndo
from sidecar.model.advice import RankedPlacement
from sidecar.model.domain import ActiveAllocation, AllocateRequest, AllocateResult, AllocationKey, InstanceRef
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.recovery.steps import RecoveryReport
from sidecar.nvml.port import GpuInfo, GpuInstanceProfile


class Queries(Protocol):
    """Answers that change nothing (ListGpus, DiscoverProfiles, GetInfo, GetState, RankPlacements)."""

    @property
    def recovered(self) -> bool: ...
    @property
    def generation(self) -> int: ...
    @property
    def referenced_mig_uuids(self) -> frozenset[str]: ...
    def gpus(self) -> list[GpuInfo]: ...
    def gpu_info(self, gpu_uuid: str) -> GpuInfo: ...
    def gpu_busy(self, gpu_uuid: str) -> bool: ...
    def profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]: ...
    def instances(self) -> list[OwnershipRecord]: ...
    def record(self, name: str) -> OwnershipRecord | None: ...
    def snapshot(self) -> StateSnapshot: ...
    def rank_placements(self, gpu_uuid: str, profile: str) -> list[RankedPlacement]: ...


class Transactions(Protocol):
    """The mutating RPCs; each raises ``errors.NotRecovered`` until a Recover has succeeded."""

    def allocate(self, request: AllocateRequest) -> AllocateResult: ...
    def release(self, pod_uid: str) -> list[InstanceRef]: ...
    def sync_active(
        self, generation: int, active: Sequence[ActiveAllocation]
    ) -> tuple[list[InstanceRef], list[InstanceRef]]: ...
    def undo_allocate(
        self, pod_uid: str, container_index: int
    ) -> tuple[list[InstanceRef], list[InstanceRef]]: ...
    def undo_device(self, mig_uuid: str, owner: AllocationKey) -> DeviceUndo: ...
    def reclaim_idle(
        self, gpu_uuid: str, mig_uuids: Sequence[str] = (), *, force: bool = False
    ) -> Reclaimed: ...
    def set_mig_mode(
        self, gpu_uuid: str, enabled: bool, *, reclaim_idle: bool = False, force: bool = False
    ) -> tuple[bool, bool, bool]: ...


class Service(Queries, Transactions, Protocol):
    """What the gRPC edge serves besides Recover."""


class Recover(Protocol):
    """The Recover RPC: idempotent; a failure modifies nothing."""

    def recover(self, active: Sequence[ActiveAllocation]) -> RecoveryReport: ...


class Maintenance(Protocol):
    """What the reconciler does each round: retry ERROR instances and queued CDI removals."""

    @property
    def recovered(self) -> bool: ...
    def instances(self) -> list[OwnershipRecord]: ...
    def retry_error(self, name: str) -> InstanceRef | None: ...
    def retry_cdi_removals(self) -> list[str]: ...
    def refresh_layout(self) -> list[str]: ...
