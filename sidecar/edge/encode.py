"""Domain values -> response protos: how the gRPC edge writes what the lifecycle answered.

Pure functions with no gRPC state; ``server`` calls them. A value that cannot be shown faithfully (an
unparsable time) is left unset rather than failing the whole answer. An Xid is 64 bits in NVML's
event and in the record, 32 in the contract's first ``xid`` field: that one is clamped to the
largest uint32 (never 0, which reads as HEALTHY) and ``xid64`` carries the value whole.
"""

from __future__ import annotations

from typing import cast

from google.protobuf import timestamp_pb2
from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar.lifecycle import undo
from sidecar.lifecycle.inventory import StateSnapshot
from sidecar.model import domain
from sidecar.model.advice import OwnedInstance, RankedPlacement
from sidecar.model.domain import InstanceRef
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.recovery_plan.actions import RecoveryReport
from sidecar.nvml.port import GpuInfo, Placement

XID32_MAX = 2**32 - 1


def xid32(xid: int) -> int:
    """The contract's ``xid`` (uint32) for a recorded Xid: itself, or ``XID32_MAX`` above it."""
    return min(xid, XID32_MAX)


def pb_placement(placement: Placement) -> pb.Placement:
    return pb.Placement(start=placement.start, size=placement.size)


def encode_allocated(result: domain.AllocateResult) -> pb.AllocateResponse:
    """The AllocateResponse. Devices are added in place and their placement set field by field:
    a nested message passed to a constructor is built and then copied, which costs twice as much."""
    message = pb.AllocateResponse(reclaimed=[encode_ref(ref) for ref in result.reclaimed])
    for device in result.devices:
        identity = device.identity
        added = message.devices.add(
            device_index=device.device_index,
            gpu_uuid=device.reservation.gpu_uuid,
            profile=device.reservation.profile,
            mig_uuid=identity.mig_uuid,
            gpu_instance_id=identity.gpu_instance_id,
            compute_instance_id=identity.compute_instance_id,
            cdi_device=device.cdi_device,
            outcome=device.outcome.value,
        )
        added.placement.start = device.reservation.placement.start
        added.placement.size = device.reservation.placement.size
    return message


def encode_ref(ref: InstanceRef) -> pb.InstanceRef:
    message = pb.InstanceRef(
        gpu_uuid=ref.reservation.gpu_uuid,
        profile=ref.reservation.profile,
        placement=pb_placement(ref.reservation.placement),
    )
    if ref.identity is not None:
        message.mig_uuid = ref.identity.mig_uuid
        message.gpu_instance_id = ref.identity.gpu_instance_id
        message.compute_instance_id = ref.identity.compute_instance_id
    return message


def encode_ranked(gpu_uuid: str, ranked: RankedPlacement) -> pb.RankedPlacement:
    """One RankPlacements entry, its reclaim victims as InstanceRefs with their identity."""

    def victim(inst: OwnedInstance) -> pb.InstanceRef:
        ref = pb.InstanceRef(gpu_uuid=gpu_uuid, profile=inst.profile, placement=pb_placement(inst.placement))
        ref.mig_uuid = inst.mig_uuid
        ref.gpu_instance_id = inst.gpu_instance_id or 0
        ref.compute_instance_id = inst.compute_instance_id or 0
        return ref

    return pb.RankedPlacement(
        placement=pb_placement(ranked.placement),
        cost=pb.PlacementCost.Name(int(ranked.cost)),
        idle_mig_uuid=ranked.idle_mig_uuid,
        reclaim=[victim(i) for i in ranked.reclaim],
        free_slices_after=ranked.free_slices_after,
        blocker=ranked.blocker,
    )


def encode_gpu(gpu: GpuInfo, busy: bool) -> pb.Gpu:
    return pb.Gpu(
        index=gpu.index,
        uuid=gpu.uuid,
        minor=gpu.minor,
        model=gpu.model,
        memory_mb=gpu.memory_mb,
        mig_mode=pb.MigMode(current=gpu.mig_current, pending=gpu.mig_pending),
        busy=busy,
    )


def _timestamp(text: str) -> timestamp_pb2.Timestamp | None:
    stamp = timestamp_pb2.Timestamp()
    if text:
        try:
            stamp.FromJsonString(text)
        except ValueError:
            return None  # an unparsable time is shown as unset rather than failing GetState
        return stamp
    return None


def encode_health(record: OwnershipRecord, *, current: bool) -> pb.InstanceHealthUpdate:
    """One ``InstanceHealthUpdate`` of ``WatchHealth``: the instance and whether an Xid faulted it."""
    return pb.InstanceHealthUpdate(
        gpu_uuid=record.gpu_uuid,
        profile=record.profile,
        placement=pb_placement(record.placement),
        mig_uuid=record.mig_uuid or "",
        gpu_instance_id=record.gpu_instance_id or 0,
        compute_instance_id=record.compute_instance_id or 0,
        health=pb.FAULTED if record.xid else pb.HEALTHY,
        xid=xid32(record.xid),
        xid64=record.xid,
        current=current,
    )


def encode_owner(owner: domain.Owner) -> pb.Owner:
    """A pod's owner (kind OWNER_KIND_POD, never UNSPECIFIED from this sidecar) or a claim's (its
    claim and request, no pod)."""
    if owner.claim is not None:
        claim = owner.claim
        return pb.Owner(
            kind=pb.OWNER_KIND_CLAIM,
            claim=pb.ClaimRef(uid=claim.uid, namespace=claim.namespace, name=claim.name),
            request=owner.request,
            device_index=owner.device_index,
        )
    return pb.Owner(
        kind=pb.OWNER_KIND_POD,
        pod=pb.PodRef(uid=owner.pod.uid, namespace=owner.pod.namespace, name=owner.pod.name),
        container_name=owner.container_name,
        container_index=owner.container_index,
        device_index=owner.device_index,
    )


def encode_instance(record: OwnershipRecord) -> pb.Instance:
    message = pb.Instance(
        gpu_uuid=record.gpu_uuid,
        profile=record.profile,
        placement=pb_placement(record.placement),
        mig_uuid=record.mig_uuid or "",
        gpu_instance_id=record.gpu_instance_id or 0,
        compute_instance_id=record.compute_instance_id or 0,
        state=record.state.value,
        cdi_device=record.cdi_device,
        last_error=record.last_error,
        taken_over_from=record.taken_over_from,
        health=pb.FAULTED if record.xid else pb.HEALTHY,
        xid=xid32(record.xid),
        xid64=record.xid,
    )
    if record.owner is not None:
        message.owner.CopyFrom(encode_owner(record.owner))
    since = _timestamp(record.since)
    if since is not None:
        message.since.CopyFrom(since)
    return message


def encode_foreign(foreign: domain.ForeignInstance) -> pb.ForeignInstance:
    return pb.ForeignInstance(
        profile=foreign.profile,
        placement=pb_placement(foreign.placement),
        gpu_instance_id=foreign.gpu_instance_id,
        has_compute_instance=foreign.compute_instance_id is not None,
        compute_instance_id=foreign.compute_instance_id or 0,
        mig_uuid=foreign.mig_uuid or "",
        recorded_as=foreign.recorded_as,
    )


def encode_state(snapshot: StateSnapshot) -> pb.GetStateResponse:
    return pb.GetStateResponse(
        generation=snapshot.generation,
        gpus=[
            pb.GpuState(
                gpu=encode_gpu(gpu.gpu, gpu.busy),
                instances=[encode_instance(record) for record in gpu.instances],
                foreign=[encode_foreign(foreign) for foreign in gpu.foreign],
                unreadable=gpu.unreadable,
            )
            for gpu in snapshot.gpus
        ],
        pending_cdi_removals=list(snapshot.pending_cdi_removals),
    )


def encode_report(report: RecoveryReport) -> pb.RecoverResponse:
    return pb.RecoverResponse(
        adopted_active=[encode_ref(r) for r in report.adopted_active],
        restored_idle=[encode_ref(r) for r in report.restored_idle],
        preserved_foreign=[encode_ref(r) for r in report.preserved_foreign],
        adopted_foreign=[encode_ref(r) for r in report.adopted_foreign],
        removed_orphan_gis=[encode_ref(r) for r in report.removed_orphan_gis],
        dropped_stale_records=list(report.dropped_stale_records),
        errors=list(report.errors),
    )


# cast: the stubs' ``Value`` answers a bare int; the number is one of UndoSkip's (an unknown name raises).
_UNDO_SKIPS: dict[undo.Skip, pb.UndoSkip] = {
    skip: cast(pb.UndoSkip, pb.UndoSkip.Value("UNDO_SKIP_" + skip.value)) for skip in undo.Skip
}


def encode_device_undo(done: undo.DeviceUndo, generation: int) -> pb.UndoDeviceResponse:
    """The UndoDeviceResponse: what was destroyed or idled, or why nothing was (``skipped``)."""
    message = pb.UndoDeviceResponse(detail=done.detail, generation=generation)
    if done.destroyed is not None:
        message.destroyed.CopyFrom(encode_ref(done.destroyed))
    if done.idled is not None:
        message.idled.CopyFrom(encode_ref(done.idled))
    if done.skipped is not None:
        message.skipped = _UNDO_SKIPS[done.skipped]
    return message
