"""The lifecycle facade: the one object server, recovery and reconciler talk to (architecture 5).

It only wires the parts together; every rule lives in the module named beside its method:
``allocate`` (Allocate), ``release`` (Release, SyncActive), ``undo`` (UndoAllocate), ``reclaim``
(ReclaimIdle), ``migmode`` (SetMigMode), ``teardown`` (destroys, the reconciler's retry),
``inventory`` (caches, GetState), ``views`` (RankPlacements), ``table`` (the in-memory table, disk
first), ``generation`` (the fence), ``locks`` (the lock order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

from sidecar.lifecycle import gpu_views, inventory, migmode, reclaim, release, teardown, undo
from sidecar.lifecycle.allocate import Allocator
from sidecar.lifecycle.context import Context
from sidecar.lifecycle.inventory import GpuSnapshot, StateSnapshot
from sidecar.model.advice import RankedPlacement
from sidecar.model.domain import ActiveAllocation, AllocateRequest, AllocateResult, InstanceRef
from sidecar.model.errors import ComputeInstanceNotOurs, nvml_errors
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import GpuInfo, GpuInstanceProfile, NvmlPort
from sidecar.store.cdi import CdiSpecs
from sidecar.store.generation import GENERATION_BLOCK
from sidecar.store.records import RecordStore


class Lifecycle:
    def __init__(self, port: NvmlPort, records: RecordStore, cdi: CdiSpecs, boot_id: str) -> None:
        self.ctx = Context(port, records, cdi, boot_id)
        self.port, self.records, self.cdi, self.boot_id = port, records, cdi, boot_id
        self.locks = self.ctx.locks
        self.allocator = Allocator(self.ctx)

    # -- state ---------------------------------------------------------------------------------------
    @property
    def recovered(self) -> bool:
        return self.ctx.recovered

    @property
    def generation(self) -> int:
        return self.ctx.generations.current

    @property
    def referenced_mig_uuids(self) -> frozenset[str]:
        """MIG UUIDs held by live pods: the last SyncActive's list (before the first: the last Recover's)."""
        return self.ctx.table.referenced

    # -- queries (inventory) -------------------------------------------------------------------------
    def gpu_info(self, gpu_uuid: str) -> GpuInfo:
        return self.ctx.inventory.gpu_info(gpu_uuid)

    def profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        return self.ctx.inventory.profiles(gpu_uuid)

    def gpu_busy(self, gpu_uuid: str) -> bool:
        return inventory.gpu_busy(self.port, self.ctx.table, gpu_uuid)

    def instances(self) -> list[OwnershipRecord]:
        return self.ctx.table.instances()

    def record(self, name: str) -> OwnershipRecord | None:
        return self.ctx.table.get(name)

    def rank_placements(self, gpu_uuid: str, profile: str) -> list[RankedPlacement]:
        return gpu_views.rank(self.ctx, gpu_uuid, profile)

    def snapshot(self) -> StateSnapshot:
        c = self.ctx
        return inventory.snapshot(c.inventory, c.table, c.locks, c.generations, c.cdi)

    # -- transactions (each raises errors.NotRecovered until ``recovered``) -----------------------------
    def allocate(self, request: AllocateRequest) -> AllocateResult:
        return self.allocator.allocate(request)

    def release(self, pod_uid: str) -> list[InstanceRef]:
        return release.release(self.ctx, pod_uid)

    def sync_active(
        self, generation: int, active: Sequence[ActiveAllocation]
    ) -> tuple[list[InstanceRef], list[InstanceRef]]:
        return release.sync_active(self.ctx, generation, active)

    def undo_allocate(
        self, pod_uid: str, container_index: int
    ) -> tuple[list[InstanceRef], list[InstanceRef]]:
        """(destroyed, idled): the rollback of a successful Allocate for (pod, container)."""
        return undo.undo_allocate(self.ctx, pod_uid, container_index)

    def reclaim_idle(self, gpu_uuid: str, mig_uuids: Sequence[str] = ()) -> list[InstanceRef]:
        """Destroy IDLE instances of a GPU (the named ones; none named: all); the one way to ask for it."""
        return reclaim.reclaim_idle(self.ctx, gpu_uuid, mig_uuids)

    def set_mig_mode(
        self, gpu_uuid: str, enabled: bool, *, reclaim_idle: bool = False
    ) -> tuple[bool, bool, bool]:
        return migmode.set_mig_mode(self.ctx, gpu_uuid, enabled, reclaim_idle=reclaim_idle)

    # -- used by recovery and the reconciler ---------------------------------------------------------
    def install(
        self,
        records: Sequence[OwnershipRecord],
        generation: int,
        *,
        referenced_mig_uuids: Iterable[str] = (),
        pending: Iterable[ActiveAllocation] = (),
    ) -> None:
        """Replace the table with recovered records (under every GPU lock) and open the gate.

        ``referenced_mig_uuids`` (the MIG UUIDs the recovery's active allocations name) stand in for
        the last SyncActive until the first one arrives: without them the reconciler would destroy an
        ERROR instance that a live pod holds. ``pending`` (its entries without runtime identity)
        becomes the pending set (``sidecar.model.pending``) the same way. The generation becomes the
        largest of the given one, the current one and every record's generations, so it never goes
        backwards across restarts."""
        with self.exclusive(r.gpu_uuid for r in records):
            self.ctx.table.replace(records, referenced_mig_uuids)
            self.ctx.inventory.forget_foreign()
            self.ctx.pending.replace(pending)
            self.ctx.generations.install(
                [
                    generation,
                    *(r.activated_generation for r in records),
                    *(r.idled_generation for r in records),
                ]
            )
            self.ctx.recovered = True

    @contextlib.contextmanager
    def exclusive(self, gpu_uuids: Iterable[str] = ()) -> Iterator[None]:
        """Hold the lock of every known GPU and of ``gpu_uuids``: no transaction runs meanwhile.

        Recovery holds this from gather to install, so a Recover repeated while the sidecar serves
        never plans over a half-finished Allocate (its CREATING record would look like a crash)."""
        with self.locks.every_gpu(gpu_uuids):
            yield

    def reserve_generations(self, through: int, stored_ceiling: int = 0) -> None:
        self.ctx.generations.reserve(through, stored_ceiling)

    def destroy_owned(self, record: OwnershipRecord, *, mark_deleting: bool = True) -> InstanceRef:
        return teardown.destroy_owned(self.ctx, record, mark_deleting=mark_deleting)

    def retry_error(self, name: str) -> InstanceRef | None:
        return teardown.retry_error(self.ctx, name)


__all__ = [
    "GENERATION_BLOCK",
    "ComputeInstanceNotOurs",
    "GpuSnapshot",
    "Lifecycle",
    "StateSnapshot",
    "nvml_errors",
]
