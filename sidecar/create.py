"""Creating one instance: records first, and what record files left on disk mean for a placement.

The order: CREATING recorded -> GI created -> GI recorded -> CI created -> CI recorded -> CDI spec
-> ACTIVE recorded. Any failure undoes what was made (``teardown.undo_create``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from sidecar import crashpoints
from sidecar.context import Context
from sidecar.domain import MIG_UUID_RE, Identity, Placement, State
from sidecar.errors import PlacementBusy, UnverifiableState, nvml_errors
from sidecar.ownership import OwnershipRecord, parse_record_name
from sidecar.states import enter, now_rfc3339
from sidecar.teardown import remove_spec, undo_create
from sidecar.validate import Validated

_log = logging.getLogger(__name__)


def create(ctx: Context, v: Validated) -> OwnershipRecord:
    """Create the device's instance (see the module docstring); undo on any failure."""
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
        with nvml_errors(f"create GPU instance {res.profile} at {res.placement} on {gpu}"):
            gi = ctx.port.create_gpu_instance(gpu, v.profile.id, res.placement)
        crashpoints.crashpoint("after-create-gi")
        known = msgspec.structs.replace(known, gpu_instance_id=gi.id, ci_create_issued=True)
        ctx.table.put(known)
        crashpoints.crashpoint("after-record-gi")
        with nvml_errors(f"create compute instance {v.profile.ci_profile_id} in GI {gi.id} on {gpu}"):
            ci = ctx.port.create_compute_instance(gpu, gi.id, v.profile.ci_profile_id)
        crashpoints.crashpoint("after-create-ci")
        known = msgspec.structs.replace(
            known, compute_instance_id=ci.id, mig_uuid=ci.mig_uuid, ci_create_issued=False
        )
        ctx.table.put(known)
        crashpoints.crashpoint("after-record-ci")
        if not MIG_UUID_RE.match(ci.mig_uuid):
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
        active = ctx.activate(msgspec.structs.replace(known, cdi_device=cdi_device), v.owner)
        ctx.table.put(active)
    except Exception as exc:
        undo_create(ctx, known, exc)
        raise
    return active


def require_no_record_for_the_operator(ctx: Context, gpu_uuid: str, wanted: Placement) -> None:
    """PlacementBusy when a record file left for the operator names a placement on the GPU that
    overlaps ``wanted``: a corrupt one, or one without a boot id (made or edited by hand).

    Neither is ever overwritten or deleted automatically: a create at its placement could not write
    its own record, or would silently replace the operator's, a problem no retry clears; and the
    instance the file stood for may still be live. Its name says which placement it was written for
    (recovery keeps the GIs there foreign for the same reason), so the placement stays busy until the
    operator has dealt with the file, and nothing is reclaimed for a request that must fail anyway."""
    valid, corrupt = ctx.records.load_all()
    left: list[tuple[str, Path, str, str]] = [
        (name, exc.path, exc.why, "corrupt_record") for name, exc in corrupt.items()
    ]
    left += [
        (name, ctx.records.path(name), "it carries no boot id", "record_without_boot_id")
        for name, r in valid.items()
        if not r.boot_id and ctx.table.get(name) is None
    ]
    for name, path, why, blocker in sorted(left):
        where = parse_record_name(name)
        if where is None or where[0] != gpu_uuid or not where[1].overlaps(wanted):
            continue
        raise PlacementBusy(
            f"placement {wanted} on {gpu_uuid} overlaps {where[1]}, named by the ownership record"
            f" {path} ({why}); it is left for the operator to inspect and remove",
            {"blocker": blocker, "file": str(path), "gpu_uuid": gpu_uuid, "placement": str(where[1])},
        )


def drop_records_left_aside(ctx: Context, gpu_uuid: str, wanted: Placement) -> None:
    """Delete the record files recovery left aside at placements overlapping ``wanted``, with their specs.

    Recovery keeps some records on disk, out of the table: those of a GPU NVML did not list and those
    that contradicted the live instance at their placement. When a create overlaps one, the live
    layout read under the GPU lock has just shown the placement free: no GI of that record exists any
    more. Records without a boot id never get here (``require_no_record_for_the_operator``). The
    record and its CDI spec go (a failed spec removal is queued), so neither is overwritten silently
    nor left behind describing an instance that is gone. Call with the GPU lock held, after the
    placement was proven free."""
    valid, _ = ctx.records.load_all()
    aside = [
        r
        for name, r in sorted(valid.items())
        if r.gpu_uuid == gpu_uuid and r.placement.overlaps(wanted) and ctx.table.get(name) is None
    ]
    for r in aside:
        _log.warning(
            "dropping record %s, left aside while its GPU was not visible: its placement is free now", r.name
        )
        if ctx.cdi.enabled and r.mig_uuid is not None and MIG_UUID_RE.match(r.mig_uuid):
            remove_spec(ctx, r.mig_uuid)
        ctx.table.delete(r.name)
