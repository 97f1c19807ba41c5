"""UndoAllocate: the plugin's rollback of an Allocate that succeeded.

HAMi's plugin rolls back an Allocate whose later step failed (the runtime-identity annotation patch,
the answer to kubelet). The instances that Allocate created are destroyed, through the recorded
destroy of ``teardown``; those it reused go back to IDLE. Each record says which it was
(``OwnershipRecord.origin``, REUSED where the sidecar cannot know). Fenced: only instances that are
still ACTIVE for exactly that pod and container are touched, so an instance released or handed to
another key since is left alone, and repeating the undo finds nothing more to do.
"""

from __future__ import annotations

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.context import Context
from sidecar.lifecycle.steps import destroy_each, put_each, raise_first, require_no_processes
from sidecar.model.domain import POD_UID_RE, InstanceRef, State
from sidecar.model.errors import InvalidRequest, SidecarError
from sidecar.model.ownership import Origin, OwnershipRecord, instance_ref


def undo_allocate(
    ctx: Context, pod_uid: str, container_index: int
) -> tuple[list[InstanceRef], list[InstanceRef]]:
    """Returns (destroyed, idled). Unknown key: ([], []), nothing changes.

    Refuses, changing nothing, with InstanceInUse when a process runs on an instance it would
    destroy. A destroy that fails leaves that instance ERROR (the reconciler retries it); the rest
    of the undo still happens and the first failure is raised at the end (NVML_ERROR: UNAVAILABLE)."""
    ctx.require_recovered()
    if not POD_UID_RE.match(pod_uid):
        raise InvalidRequest(f"pod uid {pod_uid!r} is not a valid UID", {"pod_uid": pod_uid})
    seen = held(ctx, pod_uid, container_index)
    if not seen:
        return [], []
    keys = sorted({r.owner.key for r in seen if r.owner is not None}, key=str)
    # Allocate's lock order: an Allocate of one of these keys is either done or has not begun.
    with ctx.locks.claim(keys), ctx.locks.gpus(r.gpu_uuid for r in seen):
        names = {r.name for r in seen}
        current = [r for r in held(ctx, pod_uid, container_index) if r.name in names]
        created = [r for r in current if r.origin is Origin.CREATED]
        reused = [r for r in current if r.origin is not Origin.CREATED]
        for record in created:  # every check before anything changes
            require_no_processes(ctx, record)
        idled: list[InstanceRef] = []
        failures: list[SidecarError] = []
        destroyed = destroy_each(ctx, created, "after-undo-destroy-one", failures)
        for record in reused:
            if put_each(ctx, failures, ctx.idle, record):
                idled.append(instance_ref(record))
            crashpoints.crashpoint("after-undo-idle-one")
    raise_first(failures)
    return destroyed, idled


def held(ctx: Context, pod_uid: str, container_index: int) -> list[OwnershipRecord]:
    """The instances ACTIVE for (pod, container), in device order."""
    found = [
        r
        for r in ctx.table.instances()
        if r.state is State.ACTIVE
        and r.owner is not None
        and r.owner.pod.uid == pod_uid
        and r.owner.container_index == container_index
    ]
    return sorted(found, key=lambda r: r.owner.device_index if r.owner is not None else 0)
