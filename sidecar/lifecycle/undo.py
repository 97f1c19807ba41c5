"""UndoAllocate: the plugin's rollback of an Allocate that succeeded.

HAMi's plugin rolls back an Allocate whose later step failed (the runtime-identity annotation patch,
the answer to kubelet). The instances that Allocate created are destroyed, through the recorded
destroy of ``teardown``; those it reused go back to IDLE. Each record says which it was
(``OwnershipRecord.origin``, REUSED where the sidecar cannot know); a reused one that an Xid named
while ACTIVE is destroyed too, as at a release, so an undo never gives back a faulted instance
(``destroyed_by_undo``). Fenced: only instances that are
still ACTIVE for exactly that pod and container are touched, so an instance released or handed to
another key since is left alone, and repeating the undo finds nothing more to do. Both undos are
HAMi's device plugin's, so they see pod owners only: a claim's instance is never undone by them.

``undo_device`` is the same undo for one MIG UUID, with the owner it must still belong to: HAMi's
rollback releases exactly the devices its failed Allocate took, one MIG UUID at a time, and a
repeated or late release must not reach an instance that has since gone IDLE or to another pod, nor
the container's other devices. Because the guard is the owner in the sidecar's own record, it holds
across a plugin restart and between two plugins. When the owner does not hold the instance nothing
changes and the answer says why (``Skip``), as a repeated undo is the normal case, not an error.
"""

from __future__ import annotations

import enum

import msgspec

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.steps import change_in_batch, destroy_each, raise_first, require_no_processes
from sidecar.model.domain import MIG_UUID_RE, POD_UID_RE, AllocationKey, InstanceRef, OwnerKind, State
from sidecar.model.errors import InvalidRequest, SidecarError
from sidecar.model.ownership import Origin, OwnershipRecord, instance_ref


def undo_allocate(
    ctx: LifecycleContext, pod_uid: str, container_index: int
) -> tuple[list[InstanceRef], list[InstanceRef]]:
    """Returns (destroyed, idled). Unknown key: ([], []), nothing changes.

    Refuses, changing nothing, with InstanceInUse when a process runs on an instance it would
    destroy. A destroy that fails leaves that instance ERROR (the reconciler retries it); the rest
    of the undo still happens and the first failure is raised at the end (NVML_ERROR: UNAVAILABLE)."""
    ctx.require_recovered()
    if not POD_UID_RE.fullmatch(pod_uid):
        raise InvalidRequest(f"pod uid {pod_uid!r} is not a valid UID", {"pod_uid": pod_uid})
    seen = held(ctx, pod_uid, container_index)
    if not seen:
        return [], []
    keys = sorted({r.owner.key for r in seen if r.owner is not None}, key=str)
    # Allocate's lock order: an Allocate of one of these keys is either done or has not begun.
    with ctx.locks.claim(keys), ctx.locks.gpus(r.gpu_uuid for r in seen):
        names = {r.name for r in seen}
        current = [r for r in held(ctx, pod_uid, container_index) if r.name in names]
        created = [r for r in current if destroyed_by_undo(r)]
        reused = [r for r in current if not destroyed_by_undo(r)]
        for record in created:  # every check before anything changes
            require_no_processes(ctx, record)
        idled: list[InstanceRef] = []
        failures: list[SidecarError] = []
        destroyed = destroy_each(ctx, created, "after-undo-destroy-one", failures)
        for record in reused:
            if change_in_batch(ctx, failures, ctx.idle, record):
                idled.append(instance_ref(record))
            crashpoints.crashpoint("after-undo-idle-one")
    raise_first(failures)
    return destroyed, idled


def destroyed_by_undo(record: OwnershipRecord) -> bool:
    """What its Allocate created, and a faulted instance whatever its origin: neither goes IDLE."""
    return record.origin is Origin.CREATED or record.xid != 0


def held(ctx: LifecycleContext, pod_uid: str, container_index: int) -> list[OwnershipRecord]:
    """The instances ACTIVE for (pod, container), in device order."""
    found = [
        r
        for r in ctx.table.instances()
        if r.state is State.ACTIVE
        and r.owner is not None
        and r.owner.kind is OwnerKind.POD
        and r.owner.pod.uid == pod_uid
        and r.owner.container_index == container_index
    ]
    return sorted(found, key=lambda r: r.owner.device_index if r.owner is not None else 0)


class Skip(enum.StrEnum):
    """Why an ``undo_device`` changed nothing (the contract's ``UndoSkip``)."""

    UNKNOWN_INSTANCE = "UNKNOWN_INSTANCE"  # no owned instance has that MIG UUID
    NOT_ACTIVE = "NOT_ACTIVE"  # IDLE (released or undone before), ERROR, in flight
    OTHER_OWNER = "OTHER_OWNER"  # ACTIVE for another pod, container or device, or for a claim


class DeviceUndo(msgspec.Struct, frozen=True):
    """What ``undo_device`` did: destroyed it, gave it back IDLE, or (``skipped``) nothing."""

    destroyed: InstanceRef | None = None
    idled: InstanceRef | None = None
    skipped: Skip | None = None
    detail: str = ""


def undo_device(ctx: LifecycleContext, mig_uuid: str, owner: AllocationKey) -> DeviceUndo:
    """Undo the Allocate of ``mig_uuid`` while ``owner`` holds it ACTIVE; else change nothing.

    The refusals and the failure are undo_allocate's for one instance: InstanceInUse (nothing changed)
    when a process runs on a created instance; a destroy that fails leaves it ERROR and raises."""
    ctx.require_recovered()
    if not MIG_UUID_RE.fullmatch(mig_uuid):
        raise InvalidRequest(f"{mig_uuid!r} is not a MIG UUID", {"mig_uuid": mig_uuid[:64]})
    if not POD_UID_RE.fullmatch(owner.uid) or owner.kind is not OwnerKind.POD:
        raise InvalidRequest(f"pod uid {owner.uid!r} is not a valid UID", {"pod_uid": owner.uid[:64]})
    found = _held(ctx, mig_uuid, owner)
    if isinstance(found, DeviceUndo):
        return found
    # Allocate's lock order, as undo_allocate: an Allocate of this key is done or has not begun.
    with ctx.locks.claim([owner]), ctx.locks.gpus([found.gpu_uuid]):
        current = _held(ctx, mig_uuid, owner)  # it may have changed while we waited
        if isinstance(current, DeviceUndo):
            return current
        if destroyed_by_undo(current):
            require_no_processes(ctx, current)  # the check before anything changes
            failures: list[SidecarError] = []
            destroyed = destroy_each(ctx, [current], "after-undo-destroy-one", failures)
            raise_first(failures)
            return DeviceUndo(destroyed=destroyed[0])
        ctx.table.put(ctx.idle(current))
        crashpoints.crashpoint("after-undo-idle-one")
        return DeviceUndo(idled=instance_ref(current))


def _held(ctx: LifecycleContext, mig_uuid: str, owner: AllocationKey) -> OwnershipRecord | DeviceUndo:
    """The record of ``mig_uuid`` if ``owner`` holds it ACTIVE, else the skip answer saying why."""
    record = next((r for r in ctx.table.instances() if r.mig_uuid == mig_uuid), None)
    if record is None:
        return DeviceUndo(skipped=Skip.UNKNOWN_INSTANCE, detail=f"no owned instance has MIG UUID {mig_uuid}")
    if record.state is not State.ACTIVE or record.owner is None:
        return DeviceUndo(skipped=Skip.NOT_ACTIVE, detail=f"{mig_uuid} is {record.state.value}")
    if record.owner.key != owner:
        held = record.owner.key
        holder = (
            f"claim {held.uid}"
            if held.kind is OwnerKind.CLAIM
            else f"pod {held.uid} container {held.container_index}"
        )
        return DeviceUndo(
            skipped=Skip.OTHER_OWNER, detail=f"{mig_uuid} is held by {holder} device {held.device_index}"
        )
    return record
