"""Destroying owned instances, and the rules for what is ours to destroy.

The order of a destroy, records first so a crash leaves work the next recovery can finish:
DELETING recorded -> CI and GI destroyed (already gone counts as done, once a fresh listing agrees) ->
CDI spec removed (queued on failure) -> the record deleted (``delete_after_destroy``). A destroy
that fails puts the record in ERROR; the reconciler retries it (``retry_error``).

What is ours: a live GI is the record's only when ID, profile and placement match
(``placement.owns``); a CI only when ``ci_targets`` says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.logs import hardware_change
from sidecar.model import placement
from sidecar.model.domain import MIG_UUID_RE, InstanceRef, State
from sidecar.model.errors import ComputeInstanceNotOurs, SidecarError, UnverifiableState, nvml_errors
from sidecar.model.ownership import OwnershipRecord, instance_ref
from sidecar.model.states import now_rfc3339, transition
from sidecar.nvml.port import ComputeInstanceInfo, GpuInstanceInfo, NvmlError, NvmlPort
from sidecar.store.cdi import ForeignSpecFile

_log = logging.getLogger(__name__)


def owned_gi(
    port: NvmlPort, record: OwnershipRecord, listing: Sequence[GpuInstanceInfo] | None = None
) -> GpuInstanceInfo | None:
    """The record's GI in the GPU's GI listing (``listing``, or read now), when it is still the
    record's: same ID, profile and placement (``placement.owns``). None otherwise. Raises NvmlError."""
    live = port.gpu_instances(record.gpu_uuid) if listing is None else listing
    gi = next((g for g in live if g.id == record.gpu_instance_id), None)
    return gi if gi is not None and placement.owns(record, gi) else None


def ci_targets(rec: OwnershipRecord, cis: Sequence[ComputeInstanceInfo]) -> list[ComputeInstanceInfo]:
    """The CIs in the record's (verified) GI that are the record's to destroy.

    With a recorded CI ID: that CI, and only if its MIG UUID is the recorded one (the driver reuses
    IDs; another MIG UUID means the instance was re-created behind our back: UnverifiableState).
    Without one: every CI when the record may own an unrecorded CI
    (``OwnershipRecord.may_own_unrecorded_ci``), none otherwise; a CI found in a GI recorded bare
    refuses the destroy (``ComputeInstanceNotOurs``), whoever made it."""
    gpu = rec.gpu_uuid
    if rec.compute_instance_id is None:
        if cis and not rec.may_own_unrecorded_ci:
            found = ", ".join(f"{c.id} {c.mig_uuid}" for c in cis)
            raise ComputeInstanceNotOurs(
                f"GPU instance {rec.gpu_instance_id} at {rec.placement} on {gpu} was recorded ({rec.name},"
                f" {rec.state}) without a compute instance, but has compute instance {found} now, made by"
                " someone else; nothing was destroyed, the instance is preserved as foreign and the record"
                " is kept for the operator",
                {"record": rec.name, "gpu_uuid": gpu, "gpu_instance_id": str(rec.gpu_instance_id)},
            )
        return list(cis)
    targets = [c for c in cis if c.id == rec.compute_instance_id]
    if any(c.mig_uuid != rec.mig_uuid for c in targets):
        raise UnverifiableState(
            f"compute instance {rec.compute_instance_id} in GI {rec.gpu_instance_id} on {gpu} has MIG UUID"
            f" {targets[0].mig_uuid}, not the recorded {rec.mig_uuid}; not destroying it",
            {"record": rec.name, "mig_uuid": rec.mig_uuid or ""},
        )
    return targets


def destroy_hardware(
    port: NvmlPort,
    rec: OwnershipRecord,
    live: Sequence[GpuInstanceInfo] | None = None,
    *,
    proven: bool = False,
) -> None:
    """Destroy the CI then the GI of an owned instance; what is already gone counts as done.

    Only what verifies as the record's (``placement.owns``, ``ci_targets``); "gone" as
    ``_destroy_unless_gone`` judges it. ``live``: the GI listing read under the same GPU lock hold,
    if the caller has one. ``proven``: the caller found the record's MIG UUID live in its GI under
    this lock hold (``Allocator.prove_reclaim``), which proves the GI and its recorded CI ours: they
    are destroyed by ID without a listing. Raises NvmlError."""
    if rec.gpu_instance_id is None:
        return
    gpu = rec.gpu_uuid
    if proven and rec.compute_instance_id is not None:
        try:
            port.destroy_compute_instance(gpu, rec.gpu_instance_id, rec.compute_instance_id)
            crashpoints.crashpoint("after-destroy-ci")
            port.destroy_gpu_instance(gpu, rec.gpu_instance_id)
        except NvmlError as exc:
            if not exc.not_found:
                raise
            # A NOT_FOUND proves nothing (see ``_destroy_unless_gone``): judged on a fresh listing.
            _destroy_listed(port, rec, None)
            return
        crashpoints.crashpoint("after-destroy-gi")
        return
    _destroy_listed(port, rec, live)


def _destroy_listed(port: NvmlPort, rec: OwnershipRecord, live: Sequence[GpuInstanceInfo] | None) -> None:
    """``destroy_hardware`` judged on a GI listing (``live``, or read now); see there."""
    assert rec.gpu_instance_id is not None
    gpu = rec.gpu_uuid
    gi = owned_gi(port, rec, live)
    if gi is None:
        return
    for ci in ci_targets(rec, port.compute_instances(gpu, gi.id)):
        _destroy_unless_gone(port, gi, ci)
    crashpoints.crashpoint("after-destroy-ci")
    _destroy_unless_gone(port, gi, None)
    crashpoints.crashpoint("after-destroy-gi")


def with_created_gi(ctx: LifecycleContext, record: OwnershipRecord) -> OwnershipRecord:
    """``record`` with the GI ID of the bare GI its create made but never reported, if there is one.

    A create can make the GI and still fail: reading the new GI's info fails after the create
    succeeded, or a TIMEOUT retry of the whole create meets the GI the first attempt made. The
    placement was proven free under the GPU lock before the create, so a GI at exactly this placement
    with this GI profile, without a CI and claimed by no other record, is the one this record made.
    Anything else is left alone. Raises NvmlError. Call with the GPU lock held."""
    if record.gpu_instance_id is not None:
        return record
    others = [r for r in ctx.table.on_gpu(record.gpu_uuid) if r.name != record.name]
    for gi in ctx.port.gpu_instances(record.gpu_uuid):
        if (
            gi.placement == record.placement
            and gi.profile_id == record.gi_profile_id
            and placement.owner_of(gi, others) is None
        ):
            if not ctx.port.compute_instances(record.gpu_uuid, gi.id):
                return msgspec.structs.replace(record, gpu_instance_id=gi.id)
            break
    return record


def with_created_ci(port: NvmlPort, record: OwnershipRecord) -> OwnershipRecord:
    """``record`` with the ID and MIG UUID of the CI its create made but never reported, if any.

    The GI is this record's and only this create makes a CI in it, so its one full-size CI is ours.
    Recording it before the undo destroys anything means a failed undo leaves an ERROR record with
    the full identity, which the reconciler destroys like any other. A GI seen without a CI clears
    ``ci_create_issued``: from then on the record stands for a bare GI. Raises NvmlError. Call with
    the GPU lock held."""
    if record.gpu_instance_id is None or record.compute_instance_id is not None:
        return record
    gi = owned_gi(port, record)
    if gi is None:
        return record
    cis = port.compute_instances(record.gpu_uuid, gi.id)
    if not cis:
        return msgspec.structs.replace(record, ci_create_issued=False)
    if len(cis) != 1 or cis[0].profile_id != record.ci_profile_id:
        return record  # not the one full-size CI this create makes: nothing to name it by
    return msgspec.structs.replace(
        record, compute_instance_id=cis[0].id, mig_uuid=cis[0].mig_uuid, ci_create_issued=False
    )


def remove_spec(ctx: LifecycleContext, mig_uuid: str | None) -> None:
    """Remove an instance's CDI spec; a failure is queued for the reconciler, never raised.

    A file at the spec's path that is not this sidecar's (``cdi.ForeignSpecFile``) is left as it
    is and not queued: the instance is gone either way, and no retry makes that file ours."""
    if mig_uuid is None:
        return
    try:
        if not ctx.cdi.remove(mig_uuid):
            _log.warning("CDI removal for %s failed; queued for the reconciler", mig_uuid)
    except ForeignSpecFile as exc:
        _log.error("CDI spec of %s not removed: %s", mig_uuid, exc)
        crashpoints.crashpoint("after-foreign-cdi-kept")


def delete_after_destroy(ctx: LifecycleContext, rec: OwnershipRecord) -> None:
    """The record goes only after the destroy: call once the hardware is gone.

    If the delete fails, a DELETING entry would block its slices until a restart (the reconciler
    retries ERROR only), so it becomes ERROR: the reconciler finds the instance gone and deletes the
    record once the state directory works again."""
    try:
        ctx.table.delete(rec.name)
    except SidecarError as exc:
        ctx.table.fail(rec, f"destroyed, but deleting its record failed: {exc}")
        raise


def destroy(
    ctx: LifecycleContext,
    record: OwnershipRecord,
    *,
    mark_deleting: bool,
    live: Sequence[GpuInstanceInfo] | None = None,
    proven: bool = False,
) -> InstanceRef:
    """Destroy an owned instance in the order of the module docstring. Call with the GPU lock held.

    DELETING is not recorded for an ERROR record or with ``mark_deleting=False``. A failure puts the
    record in ERROR and raises NvmlFailure / UnverifiableState; a CI that is not ours
    (``ComputeInstanceNotOurs``) leaves the instance foreign instead."""
    rec = record
    if mark_deleting and rec.state is not State.ERROR:
        rec = transition(rec, State.DELETING, since=now_rfc3339())
        ctx.table.put(rec)
        crashpoints.crashpoint("after-record-deleting")
    try:
        with nvml_errors(f"destroy instance {rec.profile}@{rec.placement} on {rec.gpu_uuid}"):
            destroy_hardware(ctx.port, rec, live, proven=proven)
    except ComputeInstanceNotOurs as exc:
        # Not ERROR: the reconciler would retry a destroy that must never happen. The record on
        # disk stays as it is for the operator; the next recovery preserves the GI as foreign too.
        _log.error("instance %s is foreign now: %s", rec.name, exc)
        ctx.table.forget(rec.name)
        raise
    except SidecarError as exc:
        ctx.table.fail(rec, str(exc))
        raise
    remove_spec(ctx, rec.mig_uuid)
    if rec.taken_over_from and rec.mig_uuid is not None and not ctx.cdi.remove_hami_spec(rec.mig_uuid):
        # The spec HAMi wrote for an instance taken over from it goes with the instance.
        _log.warning("removing HAMi's CDI spec of %s failed; queued for the reconciler", rec.mig_uuid)
    crashpoints.crashpoint("after-remove-cdi")
    delete_after_destroy(ctx, rec)
    # An IDLE instance destroyed is reclaimed (for a placement, by ReclaimIdle or the idle trim);
    # anything else (an undone allocation, an ERROR retried, recovery's cleanup) is destroyed.
    hardware_change("reclaimed" if record.state is State.IDLE else "destroyed", record, was=str(record.state))
    return instance_ref(record)


def destroy_owned(
    ctx: LifecycleContext, record: OwnershipRecord, *, mark_deleting: bool = True
) -> InstanceRef:
    """``destroy`` under the GPU lock. The record need not be in the table (recovery calls this
    before it installs its table)."""
    with ctx.locks.gpu(record.gpu_uuid):
        return destroy(ctx, record, mark_deleting=mark_deleting)


def undo_create(ctx: LifecycleContext, known: OwnershipRecord, cause: Exception) -> None:
    """Undo what one create made, newest first. An undo that fails leaves ERROR with what is known.

    The CDI spec goes whenever the MIG UUID is known, written or not as far as the create could
    tell: ``CdiSpecs.ensure`` renames the file into place before it syncs the directory, so a
    failed sync fails the write with the file already there (a missing file counts as removed)."""
    _log.warning("create of %s failed (%s); undoing", known.name, cause)
    try:
        with nvml_errors(f"undo create of {known.name}"):
            known = with_created_ci(ctx.port, with_created_gi(ctx, known))
            destroy_hardware(ctx.port, known)
    except SidecarError as exc:
        ctx.table.fail(known, f"create failed ({cause}) and its undo failed too: {exc}")
        return
    mig_uuid = known.mig_uuid
    if (
        ctx.cdi.enabled
        and mig_uuid is not None
        and MIG_UUID_RE.fullmatch(mig_uuid)  # a legacy MIG-GPU-... name never had a spec file
    ):
        remove_spec(ctx, mig_uuid)
    hardware_change("destroyed", known, was=str(known.state), cause=f"create undone: {cause}")
    try:
        ctx.table.delete(known.name)
    except SidecarError as exc:
        # The hardware is gone; a CREATING record left on disk is finished by recovery.
        _log.error("cannot delete record %s after undoing its create: %s", known.name, exc)
        ctx.table.forget(known.name)


def retry_error(ctx: LifecycleContext, name: str) -> InstanceRef | None:
    """One reconciler attempt at an ERROR instance; returns its ref once destroyed, None if skipped.

    Skipped: the record is gone or no longer ERROR, or a guard keeps it (``pending.Guards``: the
    plugin's last pod list names its MIG UUID as held by a pod, or has a pending reservation at
    exactly its spot). A failure keeps it ERROR with the new ``last_error`` and raises."""
    current = ctx.table.get(name)
    if current is None:
        return None
    with ctx.locks.gpu(current.gpu_uuid):
        current = ctx.table.get(name)
        if current is None or current.state is not State.ERROR:
            return None
        if ctx.pending.guards(ctx.table.referenced).why(current) is not None:
            return None
        return destroy_error(ctx, current)


def destroy_error(ctx: LifecycleContext, record: OwnershipRecord) -> InstanceRef:
    """Destroy an ERROR instance (the reconciler's retry, or an Allocate's inline one); the
    caller checked the guards. Raises as ``destroy``. Call with the GPU lock held."""
    if record.gpu_instance_id is None:
        record = find_created_gi(ctx, record)
    return destroy(ctx, record, mark_deleting=False)


def find_created_gi(ctx: LifecycleContext, record: OwnershipRecord) -> OwnershipRecord:
    """The GI of an ERROR record without a GI ID, found again before anything is destroyed.

    Such a record is a create that made its GI and failed, and whose undo could not find the GI.
    Without a GI ID the destroy would delete the record while the bare GI lives on, owned by nobody,
    so the search (``with_created_gi``) runs again: found, the destroy proceeds; nothing at exactly
    the record's placement and profile, the GI is gone and the record may go. A GI there that the
    search cannot claim (someone made a CI in it) is left alone and the record stays ERROR
    (UnverifiableState), as it does when the search fails (NvmlFailure). Call with the GPU lock held."""
    try:
        with nvml_errors(f"find the GPU instance the failed create of {record.name} made"):
            found = with_created_gi(ctx, record)
            if found.gpu_instance_id is not None:
                return found
            there = [
                gi.id
                for gi in ctx.port.gpu_instances(record.gpu_uuid)
                if gi.placement == record.placement and gi.profile_id == record.gi_profile_id
            ]
        if there:
            raise UnverifiableState(
                f"GPU instance {there[0]} at {record.placement} on {record.gpu_uuid} may be the one the"
                f" failed create of {record.name} made, but it has a compute instance now; nothing was"
                " destroyed and the record stays in ERROR",
                {"record": record.name, "gpu_uuid": record.gpu_uuid, "gpu_instance_id": str(there[0])},
            )
    except SidecarError as exc:
        ctx.table.fail(record, str(exc))
        raise
    return found


def _destroy_unless_gone(port: NvmlPort, gi: GpuInstanceInfo, ci: ComputeInstanceInfo | None) -> None:
    """Destroy ``ci`` (or, with None, ``gi``); NOT_FOUND counts as done only if a fresh listing agrees.

    The one judge of "already gone" for every destroy path (reclaim, undo, the reconciler's retry,
    recovery). NVML answers NOT_FOUND from the destroy itself or from the by-ID lookups before it
    while the instance still exists; taken at its word, the record would go and the instance would
    live on unowned. So the GPU is listed again: an instance still listed (same ID, profile and
    placement; a CI also the same MIG UUID) fails the destroy, and the caller keeps it ERROR. A
    failing listing proves nothing either and fails the destroy the same way."""
    gpu = gi.gpu_uuid
    try:
        if ci is None:
            port.destroy_gpu_instance(gpu, gi.id)
        else:
            port.destroy_compute_instance(gpu, gi.id, ci.id)
    except NvmlError as exc:
        if not exc.not_found:
            raise
        gi_listed = gi in port.gpu_instances(gpu)
        still_there = gi_listed if ci is None else gi_listed and ci in port.compute_instances(gpu, gi.id)
        if still_there:
            what = f"GPU instance {gi.id}" if ci is None else f"compute instance {ci.id} of GI {gi.id}"
            raise NvmlError(
                exc.operation, exc.code, f"{exc.message}, but {what} on {gpu} is still listed: not destroyed"
            ) from exc
