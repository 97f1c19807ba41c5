"""Creating one instance, records first, and dropping the record files left aside at its placement.

The order: CREATING recorded -> GI created -> GI recorded (with ``ci_create_issued``) -> CI created
-> CDI spec -> ACTIVE recorded: three record writes, intent before each NVML mutation and the
completion after it. Any failure undoes what was made (``teardown.undo_create``).
"""

from __future__ import annotations

import logging

import msgspec

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.logs import hardware_change
from sidecar.lifecycle.steps import placement_busy
from sidecar.lifecycle.teardown import remove_spec, undo_create
from sidecar.lifecycle.validate import Validated
from sidecar.model import placement
from sidecar.model.decision import Busy
from sidecar.model.domain import MIG_UUID_RE, Identity, State
from sidecar.model.errors import NvmlFailure, SidecarError, UnverifiableState, nvml_errors
from sidecar.model.ownership import Origin, OwnershipRecord, live_record
from sidecar.model.states import enter, now_rfc3339
from sidecar.nvml.port import NVML_ERROR_INSUFFICIENT_RESOURCES, NvmlError, Placement

_log = logging.getLogger(__name__)


def create_instance(ctx: LifecycleContext, v: Validated, *, listed: bool = True) -> OwnershipRecord:
    """Create the device's instance (see the module docstring); undo on any failure.

    ``listed``: the placement was proven free on a live listing. Without one (the records showed it
    free), the driver's refusal (INSUFFICIENT_RESOURCES) is the proof that something is in the way:
    nothing was made, the record goes, and one listing names the blocker (PlacementBusy)."""
    res = v.device.reservation
    gpu = v.gpu.uuid
    rec = enter(
        OwnershipRecord(
            gpu_uuid=gpu,
            profile=res.profile,
            gi_profile_id=v.profile.id,
            ci_profile_id=v.profile.ci_profile_id,
            placement=res.placement,
            state=State.CREATING,
            owner=v.owner,
            boot_id=ctx.boot_id,
            since=now_rfc3339(),
        )
    )
    drop_records_left_aside(ctx, gpu, res.placement)
    ctx.table.put(rec)
    crashpoints.crashpoint("after-record-creating")
    known = rec
    try:
        try:
            gi = ctx.port.create_gpu_instance(gpu, v.profile.id, res.placement)
        except NvmlError as exc:
            if exc.code == NVML_ERROR_INSUFFICIENT_RESOURCES and not listed:
                raise _Refused from exc
            with nvml_errors(f"create GPU instance {res.profile} at {res.placement} on {gpu}"):
                raise
        crashpoints.crashpoint("after-create-gi")
        known = msgspec.structs.replace(known, gpu_instance_id=gi.id, ci_create_issued=True)
        ctx.table.put(known)
        crashpoints.crashpoint("after-record-gi")
        with nvml_errors(f"create compute instance {v.profile.ci_profile_id} in GI {gi.id} on {gpu}"):
            ci = ctx.port.create_compute_instance(gpu, gi.id, v.profile.ci_profile_id)
        crashpoints.crashpoint("after-create-ci")
        # Known in memory only: ACTIVE records it. A crash before that leaves the GI record with
        # ``ci_create_issued``, which tells recovery that the one CI in that GI is ours (as for a crash
        # right after the CI create), so this write would buy nothing but a third of a create's fsyncs.
        known = live_record(
            res.profile, gi, ci, state=State.CREATING, owner=v.owner, boot_id=ctx.boot_id, since=rec.since
        )
        if not MIG_UUID_RE.fullmatch(ci.mig_uuid):
            # R450/R460 drivers answer MIG-GPU-<uuid>/<gi>/<ci>: built from reused IDs, it cannot
            # prove "same instance" later, and it is no valid CDI name. Fail closed; undo below.
            raise UnverifiableState(
                f"the driver names the new compute instance {ci.id} in GPU instance {gi.id} on {gpu}"
                f" {ci.mig_uuid!r}, not MIG-<uuid> (a driver older than R470?)",
                {"gpu_uuid": gpu, "mig_uuid": ci.mig_uuid},
            )
        identity = Identity(gi.id, ci.id, ci.mig_uuid)
        cdi_device = ctx.cdi.ensure(v.gpu.minor, identity)
        crashpoints.crashpoint("after-write-cdi")
        active = ctx.activate(msgspec.structs.replace(known, cdi_device=cdi_device), v.owner, Origin.CREATED)
        ctx.table.put(active)
        hardware_change("created", active)
    except _Refused as refused:
        # Nothing was made, so there is nothing to undo: the search for a GI this create made would
        # take whatever is in the way for ours.
        try:
            ctx.table.delete(rec.name)
        except SidecarError as exc:  # a CREATING record without a GI: recovery deletes it
            _log.error("cannot delete record %s after the driver refused its create: %s", rec.name, exc)
            ctx.table.forget(rec.name)
        raise _blocker_of(ctx, gpu, res.placement) from refused.__cause__
    except Exception as exc:
        undo_create(ctx, known, exc)
        raise
    return active


class _Refused(Exception):  # noqa: N818 - internal signal, never raised out of ``create_instance``
    """The driver refused the GPU instance create of an unlisted placement: something is in the way."""


def _blocker_of(ctx: LifecycleContext, gpu_uuid: str, wanted: Placement) -> SidecarError:
    """What the driver's refusal of a create at ``wanted`` met: one listing names it. A listing that
    shows nothing in the way (it went meanwhile) still fails the request, as NVML_ERROR: retryable."""
    with nvml_errors(f"list GPU instances of {gpu_uuid}"):
        live = ctx.port.gpu_instances(gpu_uuid)
    plan = placement.plan_placement(wanted, live, ctx.table.on_gpu(gpu_uuid))
    if plan.busy:
        return placement_busy(gpu_uuid, wanted, Busy(plan.blockers))
    return NvmlFailure(
        f"the driver refused a GPU instance at {wanted} on {gpu_uuid} (insufficient resources),"
        " but nothing is in the way now",
        {"nvml_code": str(NVML_ERROR_INSUFFICIENT_RESOURCES), "gpu_uuid": gpu_uuid},
    )


def drop_records_left_aside(ctx: LifecycleContext, gpu_uuid: str, wanted: Placement) -> None:
    """Delete the record files recovery left aside at placements overlapping ``wanted``, with their specs.

    Recoverer keeps some records on disk, out of the table: those of a GPU NVML did not list and those
    that contradicted the live instance at their placement. When a create overlaps one, the live
    layout read under the GPU lock has just shown the placement free: no GI of that record exists any
    more. Records without a boot id never get here (``left_for_operator``). The record and its CDI
    spec go (a failed spec removal is queued), so neither is overwritten silently
    nor left behind describing an instance that is gone. Call with the GPU lock held, after the
    placement was proven free."""
    valid, _ = ctx.table.left_aside()
    aside = [
        r
        for _, r in sorted(valid.items())
        if r.gpu_uuid == gpu_uuid and r.placement.overlaps(wanted) and r.boot_id
    ]
    for r in aside:
        _log.warning(
            "dropping record %s, left aside while its GPU was not visible: its placement is free now", r.name
        )
        if ctx.cdi.enabled and r.mig_uuid is not None and MIG_UUID_RE.fullmatch(r.mig_uuid):
            remove_spec(ctx, r.mig_uuid)
        ctx.table.delete(r.name)
