"""ReclaimIdle: destroy IDLE owned instances of a GPU on request.

Only IDLE owned instances are ever destroyed here, through the recorded destroy of ``teardown``
(DELETING recorded -> CI, GI destroyed -> CDI spec removed -> record deleted). Every refusal is
decided before anything is destroyed: the instances are chosen and checked (named ones known and
IDLE, no process on any of them) under the GPU lock, and only then destroyed one after the other.
``reclaim_idle`` is the one entry point for anything that destroys IDLE instances on request (the
RPC, the operator's CLI, an idle policy). The guards (``pending.Guards``) spare an IDLE instance a
pending reservation keeps: a reclaim of every IDLE instance skips it and lists it as kept, a named
one is refused (RESERVED); ``force`` is the operator's override.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.steps import destroy_all, require_no_processes
from sidecar.model.domain import MIG_UUID_RE, InstanceRef, State
from sidecar.model.errors import InvalidRequest, NotIdle, Reserved, UnknownInstance
from sidecar.model.ownership import OwnershipRecord, instance_ref
from sidecar.model.pending import Guards


class Reclaimed(msgspec.Struct, frozen=True):
    """What a reclaim did: ``reclaimed`` destroyed, ``kept`` spared by a guard (reclaim-all only)."""

    reclaimed: tuple[InstanceRef, ...] = ()
    kept: tuple[InstanceRef, ...] = ()


def reclaim_idle(
    ctx: LifecycleContext, gpu_uuid: str, mig_uuids: Sequence[str] = (), *, force: bool = False
) -> Reclaimed:
    """Destroy the named IDLE instances of a GPU (none named: every IDLE one a guard does not keep).

    Refuses, destroying nothing: InvalidRequest for a malformed MIG UUID, UnknownGpu,
    UnknownInstance for a MIG UUID no owned instance on that GPU has, NotIdle for a named instance
    in any other state, Reserved for a named one a pending reservation keeps (unless ``force``),
    InstanceInUse when a chosen instance runs a process. A destroy that fails leaves that instance
    ERROR (the reconciler retries it); the others are still destroyed and the first failure is
    raised at the end."""
    ctx.require_recovered()
    for mig in mig_uuids:
        if not MIG_UUID_RE.fullmatch(mig):
            raise InvalidRequest(f"{mig!r} is not a MIG UUID", {"mig_uuid": mig, "field": "mig_uuids"})
    ctx.inventory.gpu_info(gpu_uuid)
    with ctx.locks.gpu(gpu_uuid):
        guards = ctx.pending.guards(ctx.table.referenced, force=force)
        chosen, kept = choose(ctx, gpu_uuid, mig_uuids, guards)
        reclaimed = destroy_all(ctx, chosen, "after-reclaim-idle-one")
    return Reclaimed(tuple(reclaimed), tuple(instance_ref(r) for r in kept))


def choose(
    ctx: LifecycleContext, gpu_uuid: str, mig_uuids: Sequence[str], guards: Guards
) -> tuple[list[OwnershipRecord], list[OwnershipRecord]]:
    """(the IDLE instances to reclaim, every one checked; those a guard keeps). Raises the first
    refusal. GPU lock held."""
    owned = sorted(ctx.table.on_gpu(gpu_uuid), key=lambda r: (r.placement.start, r.placement.size))
    if not mig_uuids:
        judged = [(r, guards.why(r)) for r in owned if r.state is State.IDLE]
        chosen = [r for r, why in judged if why is None]
        kept = [r for r, why in judged if why is not None]
    else:
        by_mig = {r.mig_uuid: r for r in owned if r.mig_uuid is not None}
        chosen, kept = [], []
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
            why = guards.why(record)
            if why is not None:
                raise Reserved(
                    f"IDLE instance {mig} at {record.placement} on {gpu_uuid} is kept by the {why};"
                    " nothing was destroyed (force overrides)",
                    {"mig_uuid": mig, "gpu_uuid": gpu_uuid, "guarded_by": why},
                )
            chosen.append(record)
    for record in chosen:
        require_no_processes(ctx, record)
    return chosen, kept
