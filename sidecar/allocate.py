"""Allocate: all or nothing across the devices of a request (architecture section 5).

The transaction gathers (what each key holds, the IDLE instance at each reservation, the live
layout), asks the pure ``decision.decide`` what each device does, and applies it. A failure
after any device changed something rolls the whole request back (``undo_allocation``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from sidecar import crashpoints, placement
from sidecar.context import Context
from sidecar.create import create, require_no_record_for_the_operator
from sidecar.decision import AlreadyHeld, Busy, Conflict, Create, Decision, Reuse, decide
from sidecar.domain import AllocatedDevice, AllocateRequest, AllocateResult, InstanceRef, Outcome
from sidecar.errors import (
    InstanceInUse,
    KeyConflict,
    NvmlFailure,
    PlacementBusy,
    SidecarError,
    UnverifiableState,
    nvml_errors,
)
from sidecar.ownership import OwnershipRecord, record_name
from sidecar.teardown import destroy, destroy_error
from sidecar.validate import Validated, validate

_log = logging.getLogger(__name__)


class _Done(msgspec.Struct, frozen=True):
    """What one device of an allocation did, so a later failure can roll it back."""

    allocated: AllocatedDevice
    record_name: str


class Allocator:
    """The Allocate transaction over the shared lifecycle parts."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def allocate(self, request: AllocateRequest) -> AllocateResult:
        """All or nothing across the devices of the request."""
        ctx = self.ctx
        ctx.require_recovered()
        validated = validate(ctx.inventory, request)
        with ctx.locks.claim([v.key for v in validated]), ctx.locks.gpus(v.gpu.uuid for v in validated):
            # A SetMigMode(disable) may have finished between validation and the locks: the mode is
            # read again under the lock (MIG_DISABLED, not an NVML error later), and its answer
            # replaces the GPU facts, since a mode change may renumber the device (the CDI spec is
            # rendered from its minor number).
            now = {
                uuid: ctx.inventory.require_mig_enabled(uuid)
                for uuid in sorted({v.gpu.uuid for v in validated})
            }
            validated = [msgspec.structs.replace(v, gpu=now[v.gpu.uuid]) for v in validated]
            for v in validated:
                self.decide_without_room(v)  # KEY_CONFLICT before anything else
            self.judge_all(validated)
            done: list[_Done] = []
            reclaimed: list[InstanceRef] = []
            try:
                for v in validated:
                    done.append(self.allocate_one(v, reclaimed))
            except Exception:
                self.undo_allocation(done)
                raise
            # Each key's own pending reservation waited for this Allocate: it guards nothing now.
            ctx.pending.consume(v.key for v in validated)
            return AllocateResult(devices=tuple(d.allocated for d in done), reclaimed=tuple(reclaimed))

    def judge_all(self, validated: Sequence[Validated]) -> None:
        """Judge every device's placement before any device changes anything.

        A request that must fail with PLACEMENT_BUSY or INSTANCE_IN_USE for a later device would
        otherwise have reclaimed idle instances for an earlier one already, and a rollback cannot
        bring those back. The devices of one request never overlap (validated), so what an earlier
        device creates or reclaims cannot change the verdict for a later one. A reusable instance
        that still runs processes is checked too when some device reclaims (``reuse`` checks it
        again after verifying the instance live)."""
        reclaims = False
        for v in validated:
            if isinstance(self.decide_without_room(v), Create) and self.room_for(v).reclaim:
                reclaims = True
        for v in validated if reclaims else ():
            decided = self.decide_without_room(v)
            if isinstance(decided, Reuse):
                self.require_no_processes(decided.record)

    def decide_without_room(self, v: Validated) -> Decision:
        """The decision from the table alone (``Create()`` means: the placement must be gathered)."""
        res = v.device.reservation
        held = self.ctx.table.held_by(v.key)
        decided = decide(res, held, self.ctx.table.get(record_name(res.gpu_uuid, res.placement)), None)
        if isinstance(decided, Conflict):
            raise KeyConflict(
                f"allocation {v.key} already holds {decided.held.reservation}, not {res}",
                {"key": str(v.key), "held": str(decided.held.reservation), "requested": str(res)},
            )
        return decided

    def room_for(self, v: Validated) -> Create:
        """The ERROR instances to retry and the IDLE ones to reclaim for the placement;
        PlacementBusy / InstanceInUse otherwise.

        Reads only: the record files left for the operator, the live layout, the owned records, the
        guards (the MIG UUIDs live pods hold, the pending reservations) and the process counts of
        the reclaim candidates."""
        ctx = self.ctx
        gpu = v.gpu.uuid
        res = v.device.reservation
        require_no_record_for_the_operator(ctx, gpu, res.placement)
        with nvml_errors(f"list GPU instances of {gpu}"):
            live = ctx.port.gpu_instances(gpu)
        plan = placement.plan_placement(res.placement, live, ctx.table.on_gpu(gpu))
        decided = decide(res, None, None, plan, ctx.pending.guards(ctx.table.referenced, v.key))
        if isinstance(decided, Busy):
            first = decided.blocker
            raise PlacementBusy(
                f"placement {res.placement} on {gpu} is held by {first.describe()}",
                {**first.metadata(), "gpu_uuid": gpu, "blockers": str(len(decided.blockers))},
            )
        assert isinstance(decided, Create)
        for r in decided.reclaim:  # every one is checked before any is destroyed (all are on ``gpu``)
            self.require_no_processes(r)
        return decided

    def allocate_one(self, v: Validated, reclaimed: list[InstanceRef]) -> _Done:
        """Apply the decision for one device."""
        decided = self.decide_without_room(v)
        if isinstance(decided, AlreadyHeld):
            held = decided.record
            return _Done(self.allocated(v, held, Outcome.ALREADY_ALLOCATED), held.name)
        if isinstance(decided, Reuse):
            same_spot = decided.record
            return _Done(self.allocated(v, self.reuse(v, same_spot), Outcome.REUSED), same_spot.name)
        room = self.room_for(v)
        for r in room.retry:  # first: a retry that fails must not have cost any idle instance
            reclaimed.append(self.retry_error(r))
        if room.retry:
            crashpoints.crashpoint("after-inline-error-retry")
        for r in room.reclaim:
            reclaimed.append(destroy(self.ctx, r, mark_deleting=True))
        created = create(self.ctx, v)
        return _Done(self.allocated(v, created, Outcome.CREATED), created.name)

    def retry_error(self, record: OwnershipRecord) -> InstanceRef:
        """Destroy an ERROR instance in the request's way now, as the reconciler would later.

        The same recorded teardown (``teardown.destroy_error``). Whatever stops it, the instance
        stays ERROR (or, proven not ours, foreign) and the answer is UNAVAILABLE: the reconciler
        keeps retrying, so the same request may succeed later (a STATE_WRITE_FAILED stays as it is)."""
        try:
            return destroy_error(self.ctx, record)
        except (NvmlFailure, UnverifiableState) as exc:
            raise NvmlFailure(
                f"ERROR instance {record.profile}@{record.placement} ({record.mig_uuid or 'no MIG UUID'})"
                f" on {record.gpu_uuid} is in the way and its destroy failed again: {exc}",
                {
                    **exc.metadata,
                    "blocker": "ERROR",
                    "record": record.name,
                    "gpu_uuid": record.gpu_uuid,
                    "placement": str(record.placement),
                    "mig_uuid": record.mig_uuid or "",
                },
            ) from exc

    @staticmethod
    def allocated(v: Validated, record: OwnershipRecord, outcome: Outcome) -> AllocatedDevice:
        identity = record.identity
        assert identity is not None  # ACTIVE records are complete by construction
        return AllocatedDevice(
            device_index=v.device.device_index,
            reservation=record.reservation,
            identity=identity,
            cdi_device=record.cdi_device,
            outcome=outcome,
        )

    def reuse(self, v: Validated, record: OwnershipRecord) -> OwnershipRecord:
        """Verify an IDLE instance live, make sure its CDI file is right, hand it to the new owner."""
        ctx = self.ctx
        # Only a real identity mismatch condemns the instance. An NVML error says nothing about it:
        # ERROR would make the reconciler destroy a healthy instance, so it stays IDLE and the
        # request fails with NVML_ERROR (the client retries the same key).
        try:
            with nvml_errors(f"verify idle instance {record.name}"):
                self.verify_live(record)
        except UnverifiableState as exc:
            ctx.table.fail(record, f"reuse verification failed: {exc}")
            raise
        self.require_no_processes(record)
        identity = record.identity
        assert identity is not None
        cdi_device = ctx.cdi.ensure(v.gpu.minor, identity)
        active = ctx.activate(msgspec.structs.replace(record, cdi_device=cdi_device), v.owner)
        ctx.table.put(active)
        return active

    def require_no_processes(self, record: OwnershipRecord) -> None:
        """InstanceInUse while a process runs on an idle instance (a pod in its grace period).

        Handing it to a new pod would make two pods share one device. Nothing changes: the instance
        stays IDLE and the client retries the same key later. An NVML error fails closed the same way."""
        if record.mig_uuid is None:
            return
        with nvml_errors(f"count processes on {record.mig_uuid}"):
            running = self.ctx.port.mig_device_processes(record.mig_uuid)
        if running > 0:
            raise InstanceInUse(
                f"idle instance {record.mig_uuid} at {record.placement} still runs {running} processes",
                {"mig_uuid": record.mig_uuid, "processes": str(running), "gpu_uuid": record.gpu_uuid},
            )

    def verify_live(self, record: OwnershipRecord) -> None:
        """GI with the recorded ID, profile and placement; exactly one CI, the recorded one, same MIG UUID."""
        port = self.ctx.port
        gi = next((g for g in port.gpu_instances(record.gpu_uuid) if g.id == record.gpu_instance_id), None)
        if gi is None or not placement.owns(record, gi):
            raise UnverifiableState(
                f"GPU instance {record.gpu_instance_id} of {record.name} is gone or changed"
                f" (live: {gi.placement if gi else 'none'})",
                {"record": record.name},
            )
        cis = port.compute_instances(record.gpu_uuid, gi.id)
        if len(cis) != 1 or cis[0].id != record.compute_instance_id or cis[0].mig_uuid != record.mig_uuid:
            live = ", ".join(f"CI {c.id} {c.mig_uuid}" for c in cis) or "none"
            raise UnverifiableState(
                f"compute instance of {record.name} does not match its record"
                f" (recorded CI {record.compute_instance_id} {record.mig_uuid}; live: {live})",
                {"record": record.name, "mig_uuid": record.mig_uuid or ""},
            )

    def undo_allocation(self, done: Sequence[_Done]) -> None:
        """A failed allocation destroys what it created and gives back what it reused (newest first).

        Created instances are destroyed, reused ones go IDLE again, ones the key already held stay."""
        ctx = self.ctx
        for d in reversed(done):
            outcome = d.allocated.outcome
            record = ctx.table.get(d.record_name)
            if record is None or outcome is Outcome.ALREADY_ALLOCATED:
                continue
            try:
                if outcome is Outcome.CREATED:
                    destroy(ctx, record, mark_deleting=True)
                else:
                    ctx.table.put(ctx.idle(record))
            except SidecarError as exc:
                _log.error("rollback of %s (%s) failed: %s", record.name, outcome, exc)
