"""The lifecycle facade: the one object the server and the reconciler call.

Its methods are the lifecycle's whole interface, written here once: each one forwards to the module
that holds its rule, named beside it: ``allocate``, ``release`` (Release, SyncActive), ``undo``,
``reclaim``, ``migmode``, ``teardown`` (the reconciler's retry), ``inventory`` (caches, GetState),
``gpu_views`` (RankPlacements). It holds the one context and the Allocate transaction, nothing
else, so a caller typed against ``Lifecycle`` reaches a rule by go-to-definition in one step, and
no caller outside the lifecycle reads a part (port, records, CDI specs, context) off it
(``tests/unit/test_facade.py``). Recover is ``recover.Recoverer``, beside it over the same context.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.lifecycle import gpu_views, idle_trim, inventory, migmode, reclaim, release, teardown, undo
from sidecar.lifecycle.allocate import Allocator
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.inventory import StateSnapshot
from sidecar.model.advice import RankedPlacement
from sidecar.model.domain import (
    ActiveAllocation,
    AllocateRequest,
    AllocateResult,
    AllocationKey,
    InstanceRef,
    OwnerKind,
    Reservation,
)
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import GpuInfo, GpuInstanceProfile


class Lifecycle:
    """Queries (change nothing), transactions (each raises ``errors.NotRecovered`` until a Recover has
    succeeded) and the reconciler's maintenance, over one context."""

    def __init__(self, ctx: LifecycleContext) -> None:
        self._ctx = ctx
        self._allocator = Allocator(ctx)

    # -- queries -------------------------------------------------------------------------------------
    @property
    def recovered(self) -> bool:
        return self._ctx.recovered

    @property
    def generation(self) -> int:
        return self._ctx.generations.current

    @property
    def revision(self) -> int:
        return self._ctx.table.revision

    @property
    def referenced_mig_uuids(self) -> frozenset[str]:
        """MIG UUIDs held by live pods: the last SyncActive's list (before the first: the last Recover's)."""
        return self._ctx.table.referenced

    def gpus(self) -> list[GpuInfo]:
        """Every GPU as NVML lists it now (raises NvmlError)."""
        return self._ctx.port.gpus()

    def gpu_info(self, gpu_uuid: str) -> GpuInfo:
        return self._ctx.inventory.gpu_info(gpu_uuid)

    def profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        return self._ctx.inventory.profiles(gpu_uuid)

    def gpu_busy(self, gpu_uuid: str) -> bool:
        return inventory.gpu_busy(self._ctx.port, self._ctx.table, gpu_uuid)

    def instances(self) -> list[OwnershipRecord]:
        return self._ctx.table.instances()

    def record(self, name: str) -> OwnershipRecord | None:
        return self._ctx.table.get(name)

    def rank_placements(self, gpu_uuid: str, profile: str) -> list[RankedPlacement]:
        return gpu_views.rank(self._ctx, gpu_uuid, profile)

    def snapshot(self) -> StateSnapshot:
        c = self._ctx
        return inventory.snapshot(c.inventory, c.table, c.locks, c.generations, c.cdi, recovered=c.recovered)

    # -- transactions (each raises errors.NotRecovered until ``recovered``) -----------------------------
    def allocate(self, request: AllocateRequest) -> AllocateResult:
        return self._allocator.allocate(request)

    def release(self, uid: str, kind: OwnerKind = OwnerKind.POD) -> list[InstanceRef]:
        """The pod's (or claim's) ACTIVE instances IDLE (``release.release``)."""
        return release.release(self._ctx, uid, kind)

    def sync_active(
        self, generation: int, active: Sequence[ActiveAllocation]
    ) -> tuple[list[InstanceRef], list[InstanceRef]]:
        return release.sync_active(self._ctx, generation, active)

    def undo_allocate(
        self, pod_uid: str, container_index: int
    ) -> tuple[list[InstanceRef], list[InstanceRef]]:
        """(destroyed, idled): the rollback of a successful Allocate for (pod, container)."""
        return undo.undo_allocate(self._ctx, pod_uid, container_index)

    def undo_device(self, mig_uuid: str, owner: AllocationKey) -> undo.DeviceUndo:
        """The undo of one MIG UUID, only while ``owner`` holds it (``undo.undo_device``)."""
        return undo.undo_device(self._ctx, mig_uuid, owner)

    def reclaim_idle(
        self, gpu_uuid: str, mig_uuids: Sequence[str] = (), *, force: bool = False
    ) -> reclaim.Reclaimed:
        """Destroy IDLE instances of a GPU (the named ones; none named: all); the one way to ask for it."""
        return reclaim.reclaim_idle(self._ctx, gpu_uuid, mig_uuids, force=force)

    def keep_free(self, placements: Sequence[Reservation], gpus: Sequence[str] = ()) -> None:
        """The placements the client's scheduler takes next, on the GPUs it allocates: the idle trim
        keeps them free (``idle_trim.set_keep_free``)."""
        idle_trim.set_keep_free(self._ctx, placements, gpus)

    def set_mig_mode(
        self, gpu_uuid: str, enabled: bool, *, reclaim_idle: bool = False, force: bool = False
    ) -> tuple[bool, bool, bool]:
        return migmode.set_mig_mode(self._ctx, gpu_uuid, enabled, reclaim_idle=reclaim_idle, force=force)

    # -- maintenance (the reconciler) ------------------------------------------------------------------
    def retry_error(self, name: str) -> InstanceRef | None:
        return teardown.retry_error(self._ctx, name)

    def retry_cdi_removals(self) -> list[str]:
        """Retry the queued CDI spec removals; the paths removed now."""
        return self._ctx.cdi.retry_removals()

    def refresh_layout(self) -> list[str]:
        """List every MIG-enabled GPU's GIs into the advice's layout view (``gpu_views.refresh_layout``)."""
        return gpu_views.refresh_layout(self._ctx)
