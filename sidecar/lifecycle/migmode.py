"""SetMigMode: enable or disable MIG on one GPU, refusing while any GPU instance exists.

With ``reclaim_idle`` a disable first destroys the GPU's IDLE instances (``reclaim_for_disable``),
under the same GPU lock, so nothing can be allocated between the reclaim and the mode change.
"""

from __future__ import annotations

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.steps import destroy_all, refuse_reserved
from sidecar.model.domain import InstanceRef, State
from sidecar.model.errors import InstanceInUse, NvmlFailure, PlacementBusy, nvml_errors
from sidecar.model.placement import FOREIGN, Blocker, foreign_instances
from sidecar.nvml.port import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_RESET_REQUIRED,
    NVML_SUCCESS,
    GpuInfo,
    GpuInstanceInfo,
)


def set_mig_mode(
    ctx: LifecycleContext, gpu_uuid: str, enabled: bool, *, reclaim_idle: bool = False, force: bool = False
) -> tuple[bool, bool, bool]:
    """Returns (current, pending, needs_reset). Refuses (PlacementBusy) to disable while any GI exists,
    and answers InstanceInUse when the driver refuses the change because a process runs on the GPU.
    ``reclaim_idle`` (with ``enabled=False``): the IDLE instances are destroyed first; anything else
    on the GPU refuses as ``reclaim_for_disable`` says, before anything is destroyed. A disable is
    refused (Reserved) while a pending reservation is on the GPU (``pending.Guards.on_gpu``), unless
    ``force``.

    PLACEMENT_BUSY (FAILED_PRECONDITION) rather than INVALID_REQUEST because the request is well
    formed and becomes valid once the instances are gone; the metadata names ``blocker`` =
    ``gpu_instances`` and how many there are."""
    ctx.require_recovered()
    ctx.inventory.gpu_info(gpu_uuid)
    port = ctx.port
    with ctx.locks.gpu(gpu_uuid):
        if not enabled:
            refuse_reserved(gpu_uuid, ctx.pending.guards(ctx.table.referenced, force=force))
            if reclaim_idle:
                reclaim_for_disable(ctx, gpu_uuid)
            owned = ctx.table.on_gpu(gpu_uuid)
            live: list[GpuInstanceInfo] = []
            with nvml_errors(f"read MIG mode of {gpu_uuid}"):
                current = port.gpu(gpu_uuid)
            if current.mig_current:
                with nvml_errors(f"list GPU instances of {gpu_uuid}"):
                    live = port.gpu_instances(gpu_uuid)
            if live or owned:
                raise PlacementBusy(
                    f"cannot disable MIG on {gpu_uuid}: {len(live)} GPU instances exist"
                    f" and {len(owned)} are owned",
                    {
                        "blocker": "gpu_instances",
                        "gpu_uuid": gpu_uuid,
                        "count": str(max(len(live), len(owned))),
                    },
                )
        wanted = "enabled" if enabled else "disabled"
        with nvml_errors(f"set MIG mode of {gpu_uuid} to {wanted}"):
            before = port.gpu(gpu_uuid)
            try:
                status = port.set_mig_mode(gpu_uuid, enabled)
            finally:
                ctx.inventory.forget(gpu_uuid)  # whatever the outcome
            after = port.gpu(gpu_uuid)
            if status == NVML_ERROR_IN_USE and after.mig_pending != before.mig_pending:
                # The driver refused to activate the change but still recorded it as pending. Put
                # back the pending mode found before this call (one pending from earlier, say an
                # Ampere enable awaiting its reset, stays), so the refusal means what UNAVAILABLE
                # says: nothing changed.
                port.set_mig_mode(gpu_uuid, before.mig_pending)
                after = port.gpu(gpu_uuid)
        check_mig_mode_status(gpu_uuid, wanted, status, after)
    return after.mig_current, after.mig_pending, after.mig_current != after.mig_pending


def check_mig_mode_status(gpu_uuid: str, wanted: str, status: int, after: GpuInfo) -> None:
    """The activation status ``nvmlDeviceSetMigMode`` reports beside its own return code.

    SUCCESS: applied. RESET_REQUIRED: recorded as pending, applied by the next GPU reset (Ampere),
    a success with ``needs_reset``. IN_USE: refused because a process runs on the GPU
    (INSTANCE_IN_USE, UNAVAILABLE: it may succeed once the process ends). Anything else fails
    closed as NVML_ERROR with the code."""
    if status in (NVML_SUCCESS, NVML_ERROR_RESET_REQUIRED):
        return
    if status == NVML_ERROR_IN_USE:
        raise InstanceInUse(
            f"cannot set MIG mode of {gpu_uuid} to {wanted}: a process runs on the GPU; the mode"
            " stays as it was",
            {
                "gpu_uuid": gpu_uuid,
                "mig_current": str(after.mig_current).lower(),
                "mig_pending": str(after.mig_pending).lower(),
            },
        )
    raise NvmlFailure(
        f"set MIG mode of {gpu_uuid} to {wanted}: the driver refused the change (activation status {status})",
        {"nvml_code": str(status), "operation": f"set MIG mode of {gpu_uuid} to {wanted}"},
    )


def reclaim_for_disable(ctx: LifecycleContext, gpu_uuid: str) -> list[InstanceRef]:
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
    reclaimed = destroy_all(ctx, owned, "after-reclaim-idle-one")
    crashpoints.crashpoint("after-reclaim-for-disable")
    return reclaimed
