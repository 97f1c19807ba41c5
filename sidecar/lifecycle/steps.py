"""The steps the transactions share, one home below them: no transaction imports another.

Batches (``change_in_batch``, ``raise_first``, ``destroy_each``, ``destroy_all``), the process check before a
destroy or a hand-over (``require_no_processes``), whether a GPU still lists an owned instance
(``still_listed``), the PLACEMENT_BUSY answer (``placement_busy``) and the RESERVED refusal of a MIG
disable (``refuse_reserved``). Each calls down: into the
recorded destroy (``teardown``), the table, the NVML port. See ``docs/architecture.md``, "Layers".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.teardown import destroy, owned_gi
from sidecar.model.decision import Busy
from sidecar.model.domain import InstanceRef
from sidecar.model.errors import Code, InstanceInUse, PlacementBusy, Reserved, SidecarError, nvml_errors
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.pending import Guards
from sidecar.nvml.port import NvmlPort, Placement

_log = logging.getLogger(__name__)


def change_in_batch(
    ctx: LifecycleContext,
    failures: list[SidecarError],
    change: Callable[[OwnershipRecord], OwnershipRecord],
    record: OwnershipRecord,
) -> bool:
    """One instance's change in a batch: a failure is kept for the end of the batch instead of
    stopping it. True when the change was made."""
    try:
        ctx.table.put(change(record))
    except SidecarError as exc:
        _log.error("%s", exc)
        failures.append(exc)
        return False
    return True


def raise_first(failures: Sequence[SidecarError]) -> None:
    """The first failure of a batch, once every other instance of it has been dealt with.

    A retryable one (UNAVAILABLE) comes first: the client repeats the call, which finishes the rest,
    and the failure no retry clears (a corrupt record file) is answered once only it is left."""
    if failures:
        first = next((f for f in failures if f.code is Code.UNAVAILABLE), failures[0])
        if len(failures) > 1:
            first.message = f"{first.message} (and {len(failures) - 1} more, logged)"
            first.args = (first.message,)
        raise first


def destroy_each(
    ctx: LifecycleContext, chosen: Sequence[OwnershipRecord], point: str, failures: list[SidecarError]
) -> list[InstanceRef]:
    """Destroy ``chosen`` one by one, crash point ``point`` after each; a failure (ERROR) is added to
    ``failures`` and does not stop the others. Returns what was destroyed. GPU locks held."""
    destroyed: list[InstanceRef] = []
    for record in chosen:
        try:
            destroyed.append(destroy(ctx, record, mark_deleting=True))
        except SidecarError as exc:
            failures.append(exc)
        crashpoints.crashpoint(point)
    return destroyed


def destroy_all(ctx: LifecycleContext, chosen: Sequence[OwnershipRecord], point: str) -> list[InstanceRef]:
    """``destroy_each``, then the first failure raised once every instance was dealt with."""
    failures: list[SidecarError] = []
    destroyed = destroy_each(ctx, chosen, point, failures)
    raise_first(failures)
    return destroyed


def require_no_processes(ctx: LifecycleContext, record: OwnershipRecord) -> None:
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


def still_listed(port: NvmlPort, record: OwnershipRecord) -> bool:
    """Whether the GPU still lists ``record``'s GI (``teardown.owned_gi``) holding its CI (ID and MIG
    UUID): NVML can answer NOT_FOUND for an instance that exists, so a lookup's NOT_FOUND condemns the
    instance only when this listing agrees. Raises NvmlError."""
    gi = owned_gi(port, record)
    if gi is None:
        return False
    return any(
        ci.id == record.compute_instance_id and ci.mig_uuid == record.mig_uuid
        for ci in port.compute_instances(record.gpu_uuid, gi.id)
    )


def placement_busy(gpu_uuid: str, wanted: Placement, busy: Busy) -> PlacementBusy:
    """The PLACEMENT_BUSY error naming the first blocker of ``wanted``."""
    first = busy.blocker
    return PlacementBusy(
        f"placement {wanted} on {gpu_uuid} is held by {first.describe()}",
        {**first.metadata(), "gpu_uuid": gpu_uuid, "blockers": str(len(busy.blockers))},
    )


def refuse_reserved(gpu_uuid: str, guards: Guards) -> None:
    """Reserved while a pending reservation (of anyone ``guards`` guards against) is on the GPU: a
    MIG disable would pull the GPU from under the pod the scheduler placed there."""
    reserved = guards.on_gpu(gpu_uuid)
    if reserved:
        first = reserved[0]
        why = f"pending reservation of {first.holder()}"
        raise Reserved(
            f"cannot disable MIG on {gpu_uuid}: {why} at {first.reservation.profile}@"
            f"{first.reservation.placement} ({len(reserved)} on this GPU); nothing was destroyed"
            " (force overrides)",
            {
                "gpu_uuid": gpu_uuid,
                "guarded_by": why,
                "placement": str(first.reservation.placement),
                "profile": first.reservation.profile,
                "reservations": str(len(reserved)),
            },
        )
