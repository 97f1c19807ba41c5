"""Allocate: all or nothing across the devices of a request (``docs/architecture.md``, "Layers").

The transaction gathers (what each key holds, the IDLE instance at each reservation, the live
layout), asks the pure ``decision.decide`` what each device does, and applies it. A failure
after any device changed something rolls the whole request back (``undo_allocation``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import msgspec

from sidecar.lifecycle import crashpoints, gpu_views
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.create import create_instance
from sidecar.lifecycle.logs import hardware_change
from sidecar.lifecycle.steps import placement_busy, require_no_processes, still_listed
from sidecar.lifecycle.teardown import destroy, destroy_error
from sidecar.lifecycle.validate import Validated, validate
from sidecar.model import placement
from sidecar.model.advice import GpuView
from sidecar.model.decision import AlreadyHeld, Busy, Conflict, Create, Decision, Reuse, decide
from sidecar.model.domain import (
    AllocatedDevice,
    AllocateRequest,
    AllocateResult,
    InstanceRef,
    Outcome,
    OwnerKind,
    State,
)
from sidecar.model.errors import (
    InstanceInUse,
    KeyConflict,
    NvmlFailure,
    SidecarError,
    UnverifiableState,
    nvml_errors,
)
from sidecar.model.ownership import OwnershipRecord, record_name
from sidecar.nvml.port import GpuInstanceInfo, IdleProof, NvmlError, Placement
from sidecar.store.left_for_operator import require_no_record_for_the_operator

_log = logging.getLogger(__name__)


class _Done(msgspec.Struct, frozen=True):
    """What one device of an allocation did, so a later failure can roll it back."""

    allocated: AllocatedDevice
    record_name: str


class InTheWay(msgspec.Struct, frozen=True):
    """What a Create device must clear before its create, judged once under the GPU lock.

    ``live``: the GI listing it was judged on (None: the records alone showed the placement free, or
    covered only by IDLE instances proven live by their MIG UUID, so the create goes ahead and a
    refusal of the driver names the blocker). ``proven``: every instance in ``reclaim`` was found live
    by its MIG UUID under this lock hold, which proves its GI and CI the recorded ones, so the
    destroys go by ID without listing compute instances (``teardown.destroy_hardware``)."""

    reclaim: tuple[OwnershipRecord, ...] = ()
    retry: tuple[OwnershipRecord, ...] = ()  # ERROR instances in the way, destroyed first (``retry_error``)
    live: tuple[GpuInstanceInfo, ...] | None = None
    proven: bool = False


class Allocator:
    """The Allocate transaction over the shared lifecycle parts."""

    def __init__(self, ctx: LifecycleContext) -> None:
        self.ctx = ctx

    def allocate(self, request: AllocateRequest) -> AllocateResult:
        """All or nothing across the devices of the request."""
        ctx = self.ctx
        ctx.require_recovered()
        validated = validate(ctx.inventory, request)
        asked_at = time.time()
        for v in validated:
            ctx.last_asked[v.profile.name] = asked_at
        with ctx.locks.claim([v.key for v in validated]), ctx.locks.gpus(v.gpu.uuid for v in validated):
            # Decided once from the table, under the locks (KEY_CONFLICT first). What an earlier device
            # creates or reclaims cannot change a later one's decision: devices never overlap and
            # keys differ, so the decisions hold until each device is applied.
            decisions = [self.decide_from_table(v) for v in validated]
            held = [isinstance(d, AlreadyHeld) for d in decisions]
            self.observe(
                [v for v, h in zip(validated, held, strict=True) if not h and v.key.kind is OwnerKind.POD]
            )
            # The mode is read once under the lock, by the GPUs of devices that need hardware (a
            # SetMigMode(disable) may have finished before the locks: MIG_DISABLED, not an NVML error
            # later). Its answer replaces the GPU facts: a mode change may renumber the device, and
            # the CDI spec is rendered from its minor number. An instance the key holds needs neither.
            # A reuse that is the one device needing hardware reads the mode and its instance in one
            # port call: the same reads in the same order, as nothing comes between them.
            proofs: dict[int, IdleProof] = {}
            hardware = [i for i, h in enumerate(held) if not h]
            only = decisions[hardware[0]] if len(hardware) == 1 else None
            if isinstance(only, Reuse):
                i = hardware[0]
                mig_uuid = only.record.mig_uuid
                assert mig_uuid is not None  # IDLE records are complete by construction
                proofs[i] = proof = ctx.inventory.prove_idle_enabled(validated[i].gpu.uuid, mig_uuid)
                now = {proof.gpu.uuid: proof.gpu}
            else:
                now = {
                    uuid: ctx.inventory.require_mig_enabled(uuid)
                    for uuid in sorted({validated[i].gpu.uuid for i in hardware})
                }
            validated = [msgspec.structs.replace(v, gpu=now.get(v.gpu.uuid, v.gpu)) for v in validated]
            in_the_way_of_each = self.in_the_way_of_each(validated, decisions)
            done: list[_Done] = []
            reclaimed: list[InstanceRef] = []
            try:
                for i, v in enumerate(validated):
                    done.append(
                        self.allocate_one(
                            v, decisions[i], in_the_way_of_each.get(i), reclaimed, proofs.get(i)
                        )
                    )
            except Exception:
                self.undo_allocation(done)
                raise
            # Each key's own pending reservation waited for this Allocate: it guards nothing now.
            ctx.pending.consume(v.key for v in validated)
            return AllocateResult(devices=tuple(d.allocated for d in done), reclaimed=tuple(reclaimed))

    def observe(self, validated: Sequence[Validated]) -> None:
        """Teach the idle policy where the scheduler placed each device (``idle_policy.Choices``),
        from the table as it is before this Allocate changes it, over the GPUs whose profiles the
        inventory has read (no NVML call). Pods' devices only: HAMi's scheduler is the one it learns;
        kube-scheduler places a claim's from the DRA plugin's slices, which list IDLE instances."""
        if not validated:
            return
        ctx = self.ctx
        views = [
            GpuView(g, 0, tuple(gpu_views.owned_instance(r) for r in ctx.table.on_gpu(g)))
            for g in ctx.inventory.profiled_gpus()
        ]
        for v in validated:
            placements = ctx.inventory.cached_placements(v.profile.name)
            placements[v.gpu.uuid] = v.profile.placements
            where = v.device.reservation.placement
            ctx.choices.observe(v.profile.name, v.gpu.uuid, where, views, placements)

    # -- decide: reads only, before any device changes anything --------------------------------------
    def decide_from_table(self, v: Validated) -> Decision:
        """The decision from the table alone (``Create()`` means: the placement must be gathered).

        The guards are consulted here already: an IDLE instance at the reservation that another
        key's pending reservation keeps is PLACEMENT_BUSY (``guarded_by``), never reused."""
        ctx = self.ctx
        res = v.device.reservation
        held = ctx.table.held_by(v.key)
        at = ctx.table.get(record_name(res.gpu_uuid, res.placement))
        decided = decide(res, held, at, None, ctx.pending.guards(ctx.table.referenced, v.key))
        if isinstance(decided, Conflict):
            raise KeyConflict(
                f"allocation {v.key} already holds {decided.held.reservation}, not {res}",
                {"key": str(v.key), "held": str(decided.held.reservation), "requested": str(res)},
            )
        if held is not None and held.owner is not None and held.owner.request != v.owner.request:
            # A claim's device answers one request: the same reservation for another request is
            # another device, as another reservation is (pods name no request: always equal).
            raise KeyConflict(
                f"allocation {v.key} already holds {res} for request {held.owner.request!r},"
                f" not {v.owner.request!r}",
                {"key": str(v.key), "held": held.owner.request, "requested": v.owner.request},
            )
        if isinstance(decided, Busy):
            raise placement_busy(res.gpu_uuid, res.placement, decided)
        return decided

    def in_the_way_of_each(
        self, validated: Sequence[Validated], decisions: Sequence[Decision]
    ) -> dict[int, InTheWay]:
        """Judge every device's placement before any device changes anything.

        A request that must fail with PLACEMENT_BUSY or INSTANCE_IN_USE for a later device would
        otherwise have reclaimed idle instances for an earlier one already, and a rollback cannot
        bring those back. The devices of one request never overlap (validated), so what an earlier
        device creates or reclaims cannot change the verdict for a later one. A reusable instance
        that still runs processes is checked too when some device reclaims (``reuse`` checks it
        again after verifying the instance live). Returns what is in the way of each Create device,
        by index."""
        found = {
            i: self.in_the_way_of(v) for i, v in enumerate(validated) if isinstance(decisions[i], Create)
        }
        for decided in decisions if any(c.reclaim for c in found.values()) else ():
            if isinstance(decided, Reuse):
                require_no_processes(self.ctx, decided.record)
        return found

    def in_the_way_of(self, v: Validated) -> InTheWay:
        """The ERROR instances to retry and the IDLE ones to reclaim for the placement;
        PlacementBusy / InstanceInUse otherwise.

        Reads only: the record files left for the operator, the owned records, the guards (the MIG
        UUIDs live pods hold, the pending reservations), and, unless the records alone show the
        placement free (then the create itself is the check, ``create_instance``), the live layout and the
        process counts of the candidates."""
        ctx = self.ctx
        gpu = v.gpu.uuid
        res = v.device.reservation
        require_no_record_for_the_operator(ctx.table, gpu, res.placement)
        aside, _ = ctx.table.left_aside()
        recorded = [*ctx.table.on_gpu(gpu), *aside.values()]
        overlapping = [r for r in recorded if r.gpu_uuid == gpu and r.placement.overlaps(res.placement)]
        if not overlapping:
            return InTheWay()
        guards = ctx.pending.guards(ctx.table.referenced, v.key)
        # A guarded instance in the way is for ``decide`` to judge (it blocks); only unguarded ones
        # may be proven and reclaimed without a listing.
        if not any(guards.why(r) for r in overlapping):
            proven = self.prove_reclaim(overlapping, res.placement)
            if proven:
                return InTheWay(reclaim=proven, proven=True)
        with nvml_errors(f"list GPU instances of {gpu}"):
            live = ctx.port.gpu_instances(gpu)
        plan = placement.plan_placement(res.placement, live, ctx.table.on_gpu(gpu))
        decided = decide(res, None, None, plan, guards)
        if isinstance(decided, Busy):
            raise placement_busy(gpu, res.placement, decided)
        assert isinstance(decided, Create)
        for r in decided.reclaim:  # every one is checked before any is destroyed (all are on ``gpu``)
            require_no_processes(self.ctx, r)
        # The process count found each one by its MIG UUID (a gone one fails the request above): the
        # listing is needed for what else overlaps, never for the compute instances of the reclaimed.
        by_id = all(r.mig_uuid is not None and r.compute_instance_id is not None for r in decided.reclaim)
        return InTheWay(reclaim=decided.reclaim, retry=decided.retry, live=tuple(live), proven=by_id)

    def prove_reclaim(
        self, overlapping: Sequence[OwnershipRecord], wanted: Placement
    ) -> tuple[OwnershipRecord, ...]:
        """The owned IDLE instances in the way, when they alone are: () when it takes a listing to tell.

        Each is proven live by its MIG UUID, in its recorded GI, so its recorded slices are its own;
        when those slices cover ``wanted`` nothing else can sit there, and once they are destroyed
        the placement is free. Anything else (a record not IDLE or not in the table, slices of
        ``wanted`` no such instance covers, an instance not found) is judged on a listing.
        InstanceInUse as for ``steps.require_no_processes``."""
        table = self.ctx.table
        if any(
            r.state is not State.IDLE or table.get(r.name) != r or r.mig_uuid is None for r in overlapping
        ):
            return ()
        covered = {
            s for r in overlapping for s in range(r.placement.start, r.placement.start + r.placement.size)
        }
        if not covered.issuperset(range(wanted.start, wanted.start + wanted.size)):
            return ()
        ordered = tuple(sorted(overlapping, key=lambda r: (r.placement.start, r.placement.size)))
        for r in ordered:
            try:
                self.verify_live(r)
            except UnverifiableState:
                return ()
        return ordered

    # -- apply: one device at a time, each step calling down (create, teardown, the table) -----------
    def allocate_one(
        self,
        v: Validated,
        decided: Decision,
        in_the_way: InTheWay | None,
        reclaimed: list[InstanceRef],
        proof: IdleProof | None = None,
    ) -> _Done:
        """Apply ``decided`` for one device (``in_the_way``: what stands where it creates, judged by
        ``in_the_way_of_each``; ``proof``: the reads of its reuse, when they were made with the mode)."""
        if isinstance(decided, AlreadyHeld):
            held = decided.record
            return _Done(self.allocated(v, held, Outcome.ALREADY_ALLOCATED), held.name)
        if isinstance(decided, Reuse):
            same_spot = decided.record
            reused = self.reuse(v, same_spot, proof)
            return _Done(self.allocated(v, reused, Outcome.REUSED), same_spot.name)
        assert in_the_way is not None
        for r in in_the_way.retry:  # first: a retry that fails must not have cost any idle instance
            reclaimed.append(self.retry_error(r))
        if in_the_way.retry:
            crashpoints.crashpoint("after-inline-error-retry")
        for r in in_the_way.reclaim:
            reclaimed.append(
                destroy(self.ctx, r, mark_deleting=True, live=in_the_way.live, proven=in_the_way.proven)
            )
        created = create_instance(self.ctx, v, listed=in_the_way.live is not None)
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

    def reuse(self, v: Validated, record: OwnershipRecord, proof: IdleProof | None = None) -> OwnershipRecord:
        """Verify an IDLE instance live, make sure its CDI file is right, hand it to the new owner
        (``proof``: its lookup, already made; None: made here)."""
        ctx = self.ctx
        # Only a real identity mismatch condemns the instance. An NVML error says nothing about it:
        # ERROR would make the reconciler destroy a healthy instance, so it stays IDLE and the
        # request fails with NVML_ERROR (the client retries the same key).
        try:
            self.verify_live(record, proof)
        except UnverifiableState as exc:
            ctx.table.fail(record, f"reuse verification failed: {exc}")
            raise
        identity = record.identity
        assert identity is not None
        cdi_device = ctx.cdi.ensure(v.gpu.minor, identity)
        active = ctx.activate(msgspec.structs.replace(record, cdi_device=cdi_device), v.owner)
        ctx.table.put(active)
        hardware_change("reused", active)
        return active

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

    # -- used by both, and the rollback ------------------------------------------------------------
    def verify_live(self, record: OwnershipRecord, proof: IdleProof | None = None) -> None:
        """The recorded MIG UUID is live and runs no process (InstanceInUse). ``proof``: its lookup,
        already made by ``NvmlPort.prove_idle`` (None: looked up here).

        The lookup by MIG UUID proves the CI, and with it the GI: the driver mints the UUID at the
        CI's create and never again, and a GI cannot be destroyed or re-created under a live CI. So
        the CI is the one recorded, in the GI recorded with it (the record took both from the same
        create, or recovery matched both against the GPU's listing), with its recorded profile and
        placement. Gone: UnverifiableState. An NVML error proves nothing either way: NvmlFailure."""
        mig_uuid = record.mig_uuid
        assert mig_uuid is not None  # IDLE records are complete by construction
        with nvml_errors(f"verify idle instance {record.name}"):
            try:
                if proof is None:
                    processes: int | None = self.ctx.port.mig_device_processes(mig_uuid)
                elif proof.failure is not None:
                    raise proof.failure
                else:
                    processes = proof.processes
            except NvmlError as exc:
                if not exc.not_found or still_listed(self.ctx.port, record):
                    raise  # a NOT_FOUND the GPU's own listing contradicts proves nothing
                processes = None
        if processes is None:
            raise UnverifiableState(
                f"the compute instance of {record.name} ({mig_uuid}) is gone"
                f" (recorded GI {record.gpu_instance_id}, CI {record.compute_instance_id})",
                {"record": record.name, "mig_uuid": mig_uuid},
            )
        if processes > 0:
            raise InstanceInUse(
                f"idle instance {mig_uuid} at {record.placement} still runs {processes} processes",
                {"mig_uuid": mig_uuid, "processes": str(processes), "gpu_uuid": record.gpu_uuid},
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
