"""Release and SyncActive: ACTIVE instances go IDLE, IDLE ones may come back.

A Release names one owner, a pod or a claim (``OwnerKind``), and gives back that owner's instances
only. SyncActive is HAMi's level-triggered release from its pod list: it idles pod instances only,
so a claim's instance, which no pod list names, stays ACTIVE until its own Release.

The one exception: a faulted instance (an Xid named it, ``OwnershipRecord.xid``) is destroyed at
its release instead of going IDLE, so it is never handed to the next pod (``release_faulted``).

Both change a batch of instances; one instance's failure is kept for the end of the batch
(``steps.change_in_batch``, ``steps.raise_first``) so one corrupt file does not keep the others from changing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.steps import change_in_batch, raise_first
from sidecar.lifecycle.teardown import destroy
from sidecar.model.domain import POD_UID_RE, ActiveAllocation, InstanceRef, OwnerKind, Reservation, State
from sidecar.model.errors import InvalidRequest, SidecarError
from sidecar.model.ownership import OwnershipRecord, instance_ref

_log = logging.getLogger(__name__)


def release_faulted(ctx: LifecycleContext, record: OwnershipRecord) -> None:
    """Destroy a faulted ACTIVE instance its pod has left (under its GPU lock). A destroy that
    fails leaves it ERROR (``teardown.destroy``), which the reconciler retries: released either way."""
    _log.warning("destroying faulted instance %s (Xid %d) at its release", record.name, record.xid)
    try:
        destroy(ctx, record, mark_deleting=True)
    except SidecarError as exc:
        _log.error("faulted instance %s not destroyed yet: %s", record.name, exc)


def release(ctx: LifecycleContext, uid: str, kind: OwnerKind = OwnerKind.POD) -> list[InstanceRef]:
    """A confirmed release of a pod, or (``kind`` CLAIM) of a claim at its unprepare: the ACTIVE
    instances of exactly that owner become IDLE (a faulted one is destroyed instead), never those of
    the other kind, whatever their uid; unknown owner = []."""
    ctx.require_recovered()
    if not POD_UID_RE.fullmatch(uid):
        what = kind.value.lower()
        raise InvalidRequest(f"{what} uid {uid!r} is not a valid UID", {f"{what}_uid": uid})
    targets = [
        r
        for r in ctx.table.instances()
        if r.state is State.ACTIVE and r.owner is not None and r.owner.kind is kind and r.owner.uid == uid
    ]
    released: list[InstanceRef] = []
    failures: list[SidecarError] = []
    with ctx.locks.gpus(r.gpu_uuid for r in targets):
        for r in targets:
            current = ctx.table.get(r.name)
            if current is None or current.state is not State.ACTIVE or current.owner != r.owner:
                continue  # changed while we waited for the lock
            if current.xid:
                release_faulted(ctx, current)
                released.append(instance_ref(current))
                continue
            if change_in_batch(ctx, failures, ctx.idle, current):
                released.append(instance_ref(current))
    raise_first(failures)
    return released


def sync_active(
    ctx: LifecycleContext, generation: int, active: Sequence[ActiveAllocation]
) -> tuple[list[InstanceRef], list[InstanceRef]]:
    """Returns (idled, reactivated): level-triggered release from a fresh pod list.

    An ACTIVE instance of a pod whose key is not listed and that was activated at or before
    ``generation`` becomes IDLE (one activated later raced the pod list and is left alone); a
    claim's ACTIVE instance is no pod list's to release (only its claim's Release is). An IDLE
    instance whose reservation and MIG UUID are listed, and that went IDLE at or before
    ``generation``, is held by a live pod after all and becomes ACTIVE again with that owner; one
    that went IDLE later was released after the list was taken, which still names the pod that is
    gone, and stays IDLE.
    Listed entries that match nothing are ignored. Entries without runtime identity are pending
    reservations: their keys count as listed, and they replace the pending set (``sidecar.model.pending``),
    which keeps the IDLE or ERROR instance at exactly each one from being destroyed. Destroys only
    a faulted instance it would have made IDLE (``release_faulted``).

    A ``generation`` larger than any handed out is no fence at all: InvalidRequest, nothing changes."""
    ctx.require_recovered()
    handed_out = ctx.generations.current
    if generation > handed_out:
        raise InvalidRequest(
            f"generation {generation} was never handed out (the current one is {handed_out}); read"
            " it with GetInfo before listing pods",
            {"generation": str(generation), "current": str(handed_out)},
        )
    listed_keys = {a.key for a in active}
    by_identity: dict[tuple[Reservation, str], ActiveAllocation] = {
        (a.reservation, a.identity.mig_uuid): a for a in active if a.identity is not None
    }
    ctx.table.referenced = frozenset(mig for _, mig in by_identity)
    ctx.pending.replace(active)  # the entries without runtime identity (``sidecar.model.pending``)
    crashpoints.crashpoint("after-sync-pending")
    table = ctx.table.instances()
    to_idle = [
        r
        for r in table
        if r.state is State.ACTIVE
        and r.owner is not None
        and r.owner.kind is OwnerKind.POD
        and r.owner.key not in listed_keys
        and r.activated_generation <= generation
    ]
    to_activate = [
        (r, by_identity[(r.reservation, r.mig_uuid)])
        for r in table
        if r.state is State.IDLE
        and r.mig_uuid is not None
        and (r.reservation, r.mig_uuid) in by_identity
        and names(by_identity[(r.reservation, r.mig_uuid)], r)
        and r.idled_generation <= generation
    ]
    idled: list[InstanceRef] = []
    reactivated: list[InstanceRef] = []
    failures: list[SidecarError] = []
    gpus = [r.gpu_uuid for r in to_idle] + [r.gpu_uuid for r, _ in to_activate]
    # A reactivation gives an allocation key an instance, as Allocate does: it claims the key first
    # (the same order Allocate takes), so an Allocate of that key on another GPU is either done or
    # has not begun, never half-way past its key check.
    keys = sorted({alloc.key for _, alloc in to_activate}, key=str)
    with ctx.locks.claim(keys), ctx.locks.gpus(gpus):
        for r in to_idle:
            current = ctx.table.get(r.name)
            if (
                current is None
                or current.state is not State.ACTIVE
                or current.owner != r.owner
                or current.activated_generation > generation
            ):
                continue
            if current.xid:
                release_faulted(ctx, current)
                idled.append(instance_ref(current))
                continue
            if change_in_batch(ctx, failures, ctx.idle, current):
                idled.append(instance_ref(current))
        for r, alloc in to_activate:
            current = ctx.table.get(r.name)
            if (
                current is None
                or current.state is not State.IDLE
                or current.mig_uuid != r.mig_uuid
                or current.idled_generation > generation
            ):
                continue
            if ctx.table.held_by(alloc.key) is not None:
                continue  # that key already holds another instance; never give it two
            if change_in_batch(ctx, failures, functools.partial(ctx.activate, owner=alloc.owner), current):
                reactivated.append(instance_ref(current))
    raise_first(failures)
    return idled, reactivated


def names(alloc: ActiveAllocation, record: OwnershipRecord) -> bool:
    """Whether a listed allocation names the recorded instance (``Identity.names``: the rule
    ``Recover`` applies too: the MIG UUID, and the GI and CI IDs unless the list gave them as 0)."""
    return (
        alloc.identity is not None and record.identity is not None and alloc.identity.names(record.identity)
    )
