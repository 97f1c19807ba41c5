"""ReclaimIdle: destroy IDLE owned instances of a GPU on request.

Only IDLE owned instances are ever destroyed here, through the recorded destroy of ``teardown``
(DELETING recorded -> CI, GI destroyed -> CDI spec removed -> record deleted). Every refusal is
decided before anything is destroyed: the instances are chosen and checked (named ones known and
IDLE, no process on any of them) under the GPU lock, and only then destroyed one after the other.
``reclaim_idle`` is the one entry point for anything that destroys IDLE instances on request (the
RPC, the operator's CLI, an idle policy).
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.lifecycle.context import Context
from sidecar.lifecycle.steps import destroy_all, require_no_processes
from sidecar.model.domain import MIG_UUID_RE, InstanceRef, State
from sidecar.model.errors import InvalidRequest, NotIdle, UnknownInstance
from sidecar.model.ownership import OwnershipRecord


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
        return destroy_all(ctx, choose(ctx, gpu_uuid, mig_uuids), "after-reclaim-idle-one")


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
