"""ReclaimIdle, and the reclaim that SetMigMode(enabled=false, reclaim_idle=true) runs first.

Only IDLE owned instances are ever destroyed here, through the recorded destroy of ``teardown``
(DELETING recorded -> CI, GI destroyed -> CDI spec removed -> record deleted). Every refusal is
decided before anything is destroyed: the instances are chosen and checked (named ones known and
IDLE, no process on any of them) under the GPU lock, and only then destroyed one after the other.
``reclaim_idle`` is the one entry point for anything that destroys IDLE instances on request (the
RPC, the operator's CLI, an idle policy).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.context import Context
from sidecar.lifecycle.release import raise_first
from sidecar.lifecycle.teardown import destroy
from sidecar.model.domain import MIG_UUID_RE, InstanceRef, State
from sidecar.model.errors import (
    InstanceInUse,
    InvalidRequest,
    NotIdle,
    PlacementBusy,
    SidecarError,
    UnknownInstance,
    nvml_errors,
)
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.placement import FOREIGN, Blocker, foreign_instances


def reclaim_idle(ctx: Context, gpu_uuid: str, mig_uuids: Sequence[str] = ()) -> list[InstanceRef]:
    """Destroy the named IDLE instances of a GPU (none named: every IDLE one); their refs.

    Refuses, destroying nothing: InvalidRequest for a malformed MIG UUID, UnknownGpu,
    UnknownInstance for a MIG UUID no owned instance on that GPU has, NotIdle for a named instance
    in any other state, InstanceInUse when a chosen instance runs a process. A destroy that fails
    leaves that instance ERROR (the reconciler retries it); the others are still destroyed and the
    first failure is raised at the end."""
    ctx.require_recovered()
    for mig in mig_uuids:
        if not MIG_UUID_RE.match(mig):
            raise InvalidRequest(f"{mig!r} is not a MIG UUID", {"mig_uuid": mig, "field": "mig_uuids"})
    ctx.inventory.gpu_info(gpu_uuid)
    with ctx.locks.gpu(gpu_uuid):
        return destroy_all(ctx, choose(ctx, gpu_uuid, mig_uuids))


def choose(ctx: Context, gpu_uuid: str, mig_uuids: Sequence[str]) -> list[OwnershipRecord]:
    """The IDLE instances to reclaim, every one checked; raises the first refusal. GPU lock held."""
    owned = sorted(ctx.table.on_gpu(gpu_uuid), key=lambda r: (r.placement.start, r.placement.size))
    if not mig_uuids:
        chosen = [r for r in owned if r.state is State.IDLE]
    else:
        by_mig = {r.mig_uuid: r for r in owned if r.mig_uuid is not None}
        chosen = []
        for mig in dict.fromkeys(mig_uuids):
            record = by_mig.get(mig)
            if record is None:
                raise UnknownInstance(
                    f"no instance owned by this sidecar on {gpu_uuid} has MIG UUID {mig}; nothing was"
                    " destroyed",
                    {"mig_uuid": mig, "gpu_uuid": gpu_uuid},
                )
            if record.state is not State.IDLE:
                raise NotIdle(
                    f"instance {mig} at {record.placement} on {gpu_uuid} is {record.state}, not IDLE;"
                    " only IDLE instances are reclaimed and nothing was destroyed",
                    {"mig_uuid": mig, "gpu_uuid": gpu_uuid, "state": record.state.value},
                )
            chosen.append(record)
    for record in chosen:
        require_no_processes(ctx, record)
    return chosen


def destroy_each(
    ctx: Context, chosen: Sequence[OwnershipRecord], point: str, failures: list[SidecarError]
) -> list[InstanceRef]:
    """Destroy ``chosen`` one by one, crash point ``point`` after each; a failure (ERROR) is added to
    ``failures`` and does not stop the others. Returns what was destroyed."""
    destroyed: list[InstanceRef] = []
    for record in chosen:
        try:
            destroyed.append(destroy(ctx, record, mark_deleting=True))
        except SidecarError as exc:
            failures.append(exc)
        crashpoints.crashpoint(point)
    return destroyed


def destroy_all(ctx: Context, chosen: Sequence[OwnershipRecord]) -> list[InstanceRef]:
    """Destroy chosen IDLE instances one by one; a failure (ERROR) does not stop the others."""
    failures: list[SidecarError] = []
    reclaimed = destroy_each(ctx, chosen, "after-reclaim-idle-one", failures)
    raise_first(failures)
    return reclaimed


def reclaim_for_disable(ctx: Context, gpu_uuid: str) -> list[InstanceRef]:
    """Destroy every IDLE instance of a GPU whose MIG mode is about to be disabled. GPU lock held.

    Refuses first, destroying nothing, while anything that must outlive it is there: an owned
    instance in any other state or a foreign GI (PlacementBusy, the blocker in the metadata as for
    an Allocate), or a process anywhere on the GPU (InstanceInUse: MIG could not be disabled anyway)."""
    owned = sorted(ctx.table.on_gpu(gpu_uuid), key=lambda r: (r.placement.start, r.placement.size))
    kept = [r for r in owned if r.state is not State.IDLE]
    if kept:
        first = kept[0]
        blocker = Blocker(first.state.value, first.placement, first.gpu_instance_id, first)
        raise PlacementBusy(
            f"cannot disable MIG on {gpu_uuid}: {blocker.describe()} is not IDLE"
            f" ({len(kept)} owned instances are not); nothing was destroyed",
            {**blocker.metadata(), "gpu_uuid": gpu_uuid, "blockers": str(len(kept))},
        )
    with nvml_errors(f"read MIG mode of {gpu_uuid}"):
        mig_on = ctx.port.gpu(gpu_uuid).mig_current
    if mig_on:
        with nvml_errors(f"list GPU instances of {gpu_uuid}"):
            foreign = foreign_instances(ctx.port.gpu_instances(gpu_uuid), owned)
        if foreign:
            gi = foreign[0]
            blocker = Blocker(FOREIGN, gi.placement, gi.id)
            raise PlacementBusy(
                f"cannot disable MIG on {gpu_uuid}: {blocker.describe()} is not owned by this sidecar;"
                " nothing was destroyed",
                {**blocker.metadata(), "gpu_uuid": gpu_uuid, "blockers": str(len(foreign))},
            )
    with nvml_errors(f"count processes on {gpu_uuid}"):
        running = ctx.port.gpu_processes(gpu_uuid)
    if running:
        raise InstanceInUse(
            f"cannot disable MIG on {gpu_uuid}: {running} processes run on it; nothing was destroyed",
            {"gpu_uuid": gpu_uuid, "processes": str(running)},
        )
    reclaimed = destroy_all(ctx, owned)
    crashpoints.crashpoint("after-reclaim-for-disable")
    return reclaimed


def require_no_processes(ctx: Context, record: OwnershipRecord) -> None:
    """InstanceInUse while a process runs on an instance; an NVML error refuses too (NvmlFailure).

    Before a destroy and before an idle instance is handed to a new pod (one in its grace period
    still runs there: two pods would share a device). Nothing changes; the caller retries later."""
    if record.mig_uuid is None:
        return
    with nvml_errors(f"count processes on {record.mig_uuid}"):
        running = ctx.port.mig_device_processes(record.mig_uuid)
    if running > 0:
        raise InstanceInUse(
            f"instance {record.mig_uuid} at {record.placement} still runs {running} processes;"
            " nothing was destroyed",
            {"mig_uuid": record.mig_uuid, "processes": str(running), "gpu_uuid": record.gpu_uuid},
        )
