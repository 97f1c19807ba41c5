"""One GPU as the advice sees it (``advice.GpuView``), built from what the lifecycle already knows.

``RankPlacements`` and the idle policy both rank placements over the same view, so both get it here:
the owned instances from the in-memory table, the foreign GIs of the layout view
(``Inventory.foreign_view``: the last listing, kept current by every listing the lifecycle makes and
by the reconciler's ``refresh_layout`` each round), the record files left for the operator, and the
scheduler's pending reservations. Creates and destroys in flight are in the table already (CREATING
and DELETING records are written before the hardware is touched), so they block like any occupant.
Nothing here mutates NVML; after the first call per GPU (profile table, one GI listing) it makes no
NVML call at all.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Collection, Sequence

from sidecar.lifecycle.context import LifecycleContext
from sidecar.model.advice import GpuView, Hold, OwnedInstance, RankedPlacement, rank_placements
from sidecar.model.domain import ForeignInstance, Reservation
from sidecar.model.errors import SidecarError, nvml_errors
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import GpuInstanceProfile
from sidecar.store.left_for_operator import records_for_the_operator

_log = logging.getLogger(__name__)


def pending_reservations(ctx: LifecycleContext) -> frozenset[Reservation]:
    """The scheduler's pending reservations (``sidecar.model.pending``): they protect an
    IDLE instance from the idle policy and keep advice off their placements."""
    return frozenset(p.reservation for p in ctx.pending.current)


def last_used(record: OwnershipRecord) -> float:
    """When the instance last stopped serving a pod, in seconds since the epoch: the record's
    ``since``, stamped when it entered its state (for an IDLE instance: when it went IDLE, or when
    recovery restored it). An unreadable stamp counts as "just now", so it is never trimmed for age."""
    try:
        return dt.datetime.fromisoformat(record.since).timestamp()
    except ValueError:
        return math.inf


def owned_instance(record: OwnershipRecord, *, busy: bool = False) -> OwnedInstance:
    return OwnedInstance(
        profile=record.profile,
        placement=record.placement,
        state=record.state,
        mig_uuid=record.mig_uuid or "",
        gpu_instance_id=record.gpu_instance_id,
        compute_instance_id=record.compute_instance_id,
        last_used=last_used(record),
        busy=busy,
    )


def operator_holds(ctx: LifecycleContext, gpu_uuid: str) -> tuple[Hold, ...]:
    """The record files on the GPU that ``Allocate`` refuses to create over (PLACEMENT_BUSY), as
    ``store.left_for_operator`` finds them: a corrupt one, or one without a boot id."""
    return tuple(
        Hold(left.placement, left.blocker, f"ownership record {left.path} ({left.blocker})")
        for left in records_for_the_operator(ctx.table, gpu_uuid)
    )


def memory_slices(profiles: Sequence[GpuInstanceProfile]) -> int:
    """The GPU's size on the memory-slice axis: the end of its furthest legal placement."""
    return max((p.end for prof in profiles for p in prof.placements), default=0)


class NotListedError(Exception):
    """A GPU's foreign view was asked for without listing (``gpu_view(list_missing=False)``) and
    there is none yet."""


def foreign(
    ctx: LifecycleContext, gpu_uuid: str, *, list_missing: bool = True
) -> tuple[ForeignInstance, ...]:
    """The foreign GIs of the layout view; the first call for a GPU lists it (under its lock), or,
    with ``list_missing`` False, raises NotListedError: a caller that holds another GPU's lock must not
    take this one's out of order."""
    cached = ctx.inventory.foreign_view(gpu_uuid, ctx.table.on_gpu(gpu_uuid))
    if cached is not None:
        return cached
    if not list_missing:
        raise NotListedError(gpu_uuid)
    return refresh_foreign(ctx, gpu_uuid)


def refresh_foreign(ctx: LifecycleContext, gpu_uuid: str) -> tuple[ForeignInstance, ...]:
    """List the GPU's GIs under its lock (the listing becomes its layout view) and return the
    foreign ones. MigDisabled / NvmlFailure."""
    with ctx.locks.gpu(gpu_uuid):
        ctx.inventory.require_mig_enabled(gpu_uuid)
        with nvml_errors(f"list GPU instances of {gpu_uuid}"):
            ctx.port.gpu_instances(gpu_uuid)
        listed = ctx.inventory.foreign_view(gpu_uuid, ctx.table.on_gpu(gpu_uuid))
    assert listed is not None  # the listing just made is the view
    return listed


def refresh_layout(ctx: LifecycleContext) -> list[str]:
    """The reconciler's round: list the GIs of every MIG-enabled GPU (each under its lock), so the
    advice sees a change made outside the sidecar within one round. Returns the GPUs listed; a GPU
    whose listing fails keeps its view until the next round (logged), and the others are listed."""
    with nvml_errors("list GPUs"):
        gpus = ctx.port.gpus()
    listed: list[str] = []
    for gpu in sorted((g for g in gpus if g.mig_current), key=lambda g: g.index):
        try:
            with ctx.locks.gpu(gpu.uuid), nvml_errors(f"list GPU instances of {gpu.uuid}"):
                ctx.port.gpu_instances(gpu.uuid)
        except SidecarError as exc:
            _log.warning("layout view of %s not refreshed: %s", gpu.uuid, exc)
            continue
        listed.append(gpu.uuid)
    return listed


def gpu_view(
    ctx: LifecycleContext, gpu_uuid: str, *, busy: Collection[str] = (), list_missing: bool = True
) -> GpuView:
    """The GPU's view; ``busy`` names MIG UUIDs of IDLE instances known to run processes.
    ``list_missing`` as for ``foreign``."""
    return GpuView(
        gpu_uuid=gpu_uuid,
        memory_slices=memory_slices(ctx.inventory.profiles(gpu_uuid)),
        owned=tuple(owned_instance(r, busy=r.mig_uuid in busy) for r in ctx.table.on_gpu(gpu_uuid)),
        foreign=foreign(ctx, gpu_uuid, list_missing=list_missing),
        holds=operator_holds(ctx, gpu_uuid),
        pending=tuple(r for r in pending_reservations(ctx) if r.gpu_uuid == gpu_uuid),
    )


def rank(ctx: LifecycleContext, gpu_uuid: str, profile: str) -> list[RankedPlacement]:
    """``RankPlacements``: every legal placement of ``profile`` on the GPU, best first.

    NotRecovered before recovery (the table is not trusted yet); UnknownGpu / UnknownProfile as for
    ``Allocate``. Read-only; an IDLE instance that still runs
    processes ranks as REUSE here (counting them costs an NVML call per instance), and ``Allocate``
    answers INSTANCE_IN_USE for it as usual."""
    ctx.require_recovered()
    legal = ctx.inventory.resolve_profile(gpu_uuid, profile).placements
    return rank_placements(profile, legal, gpu_view(ctx, gpu_uuid))
