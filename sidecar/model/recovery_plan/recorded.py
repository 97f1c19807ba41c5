"""Rule 2: each valid record against the live GI at exactly its placement (pure).

See ``sidecar.model.recovery_plan`` for the rule in full; ``plan`` runs the rules in order.
"""

from __future__ import annotations

from sidecar.model.domain import OwnerKind, State
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.recovery_plan.actions import Action, DeleteRecord, DestroyOwned, PutRecord, Reported, Step
from sidecar.model.recovery_plan.draft import LIVE_STATES, PlanDraft, live_ref
from sidecar.model.recovery_plan.inputs import LiveGpuInstance
from sidecar.model.states import transition


def reconcile_records(b: PlanDraft) -> PlanDraft:
    for record in sorted(b.inputs.records, key=lambda r: r.name):
        if record.name in b.table:
            continue  # adopted by an active allocation
        if not record.boot_id:
            keep_unstamped(b, record)
            continue
        earlier_boot = record.boot_id != b.inputs.boot_id
        if record.gpu_uuid not in b.gpus:
            if earlier_boot:
                drop(b, record, "it is from an earlier boot and its GPU is not visible")
            else:
                keep_unseen(b, record)
            continue
        gi = b.gi_at(record.gpu_uuid, record.placement)
        if gi is None:
            drop(b, record, "its GPU instance no longer exists")
            continue
        if earlier_boot and not any(ci.mig_uuid == record.mig_uuid for ci in gi.compute_instances):
            # GI IDs are reused and placements repeat: after a reboot a GI someone else made can
            # match this record in everything but the MIG UUID, which only its own instance has.
            # Without that proof the record describes nothing live; the GI is left unclaimed.
            drop(b, record, "it is from an earlier boot and no live compute instance has its MIG UUID")
            continue
        why = record_mismatch(b, record, gi)
        if why is not None:
            if earlier_boot:
                drop(b, record, f"it is from an earlier boot and {why}")
                continue
            keep_aside(b, record, gi, why)
            continue
        b.claimed.add((record.gpu_uuid, gi.info.id))
        if record.state is State.ACTIVE and (b.inputs.recovered or claim_holds(record)):
            keep_active(b, record)
        elif record.state in LIVE_STATES and record.xid:
            fault_to_error(b, record)
        elif record.state in LIVE_STATES:
            restore_idle(b, record, gi)
        elif record.state is State.ERROR and record.gpu_instance_id is not None:
            keep_error(b, record)
        else:
            finish_destroy(b, record, gi)
    return b


def record_mismatch(b: PlanDraft, record: OwnershipRecord, gi: LiveGpuInstance) -> str | None:
    """Why the live GI at the record's placement is not the record's instance, or None."""
    live_profile = b.profile_name(record.gpu_uuid, gi.info.profile_id)
    if gi.info.profile_id != record.gi_profile_id or live_profile != record.profile:
        return f"the live GPU instance has profile {live_profile}, the record says {record.profile}"
    if record.gpu_instance_id is None:
        # A crash between creating the GI and recording its ID. The CREATING record was written
        # before the create, for exactly this placement and profile, and nobody else creates GIs
        # here (the ownership requirement), so a bare GI there is the one it made. A GI that
        # already has a CI was completed by someone: that is not what this record describes.
        # ERROR without a GI ID is the same case: the create made the GI and failed, and its
        # undo failed to find the GI too.
        if record.state in (State.CREATING, State.ERROR) and not gi.compute_instances:
            return None
        return f"the record has no GPU instance ID to verify live GPU instance {gi.info.id} against"
    if gi.info.id != record.gpu_instance_id:
        return f"the live GPU instance ID is {gi.info.id}, the record says {record.gpu_instance_id}"
    cis = gi.compute_instances
    if record.state in LIVE_STATES:
        if record.identity is None:
            return "the record has no complete identity"
        if len(cis) != 1:
            return f"the live GPU instance has {len(cis)} compute instances, not one"
        if cis[0].id != record.compute_instance_id or cis[0].mig_uuid != record.mig_uuid:
            return (
                f"the live compute instance is {cis[0].id} {cis[0].mig_uuid}, the record says "
                f"{record.compute_instance_id} {record.mig_uuid}"
            )
        return None
    # CREATING, DELETING, ERROR: a partial instance is expected; what exists must be its own.
    if len(cis) > 1:
        return f"the live GPU instance has {len(cis)} compute instances"
    if not cis:
        return None
    ci = cis[0]
    if record.compute_instance_id is None and not record.may_own_unrecorded_ci:
        # The rule lifecycle's destroy applies too (ComputeInstanceNotOurs): only a record whose
        # create issued the CI create (CREATING, or ERROR after a failed undo) may own a CI it never
        # recorded. Any other record without a CI ID is written only for a GI that had no CI when
        # its destroy was decided (an orphan GI being removed, a bare GI a create left). Nothing of
        # ours creates a CI in such a GI, so this one was made since by someone else.
        return (
            f"the live GPU instance has compute instance {ci.id} {ci.mig_uuid}, but the record "
            f"({record.state}) stands for a bare GPU instance"
        )
    if record.compute_instance_id is None:
        # Crash between creating the CI and recording it: a full-size CI inside a GI verified as
        # ours can only be ours (the ownership requirement: nobody else creates CIs here).
        if ci.profile_id != record.ci_profile_id:
            return f"the live compute instance {ci.id} has another compute profile"
        if record.mig_uuid and ci.mig_uuid != record.mig_uuid:
            return f"the live compute instance is {ci.mig_uuid}, the record says {record.mig_uuid}"
        return None
    if ci.id != record.compute_instance_id or (record.mig_uuid and ci.mig_uuid != record.mig_uuid):
        return (
            f"the live compute instance is {ci.id} {ci.mig_uuid}, the record says "
            f"{record.compute_instance_id} {record.mig_uuid}"
        )
    return None


def drop(b: PlanDraft, record: OwnershipRecord, why: str) -> None:
    actions = (*b.remove_cdi(record.mig_uuid), DeleteRecord(record.name))
    b.steps.append(
        Step(
            subject=f"drop {record.name}: {why}",
            actions=actions,
            reported=Reported("dropped_stale_records", record.name),
        )
    )


def keep_unseen(b: PlanDraft, record: OwnershipRecord) -> None:
    """A record of this boot on a GPU NVML does not list stays on disk as it is, with its CDI spec.

    The GPU may be hidden only (a device filter, a reset in progress) and come back with the
    instance: nothing verifies the instance is gone, so ownership is not given up. The record is
    not in the table (nothing can use a GPU that is not there); the next Recover that sees the
    GPU judges it as usual."""
    if record.mig_uuid:
        b.protected_cdi.add(record.mig_uuid)
    b.errors.append(
        f"GPU {record.gpu_uuid} is not visible; record kept: ownership record {record.name} "
        f"({record.state}) and its CDI spec stay as they are until a Recover sees the GPU again"
    )


def keep_unstamped(b: PlanDraft, record: OwnershipRecord) -> None:
    """A record without a boot ID is kept aside, whatever its state, and never acted upon.

    Every writer stamps the boot ID, so such a record was made or edited by hand: nothing tells
    whether it is of this boot (then a CREATING or DELETING one would destroy the GI at its
    placement) or of an earlier one (then it would be dropped as stale). On the safe side it is
    neither: it stays on disk untouched with its CDI spec, out of the table, and the GI at its
    placement (if any) is foreign - preserved, never reused, never adopted. ``records verify``
    lists it apart (``no_boot_id``) for the operator, who removes or fixes it."""
    if record.mig_uuid:
        b.protected_cdi.add(record.mig_uuid)
    gi = b.gi_at(record.gpu_uuid, record.placement)
    kept = ""
    if gi is not None and (record.gpu_uuid, gi.info.id) not in b.claimed:
        b.claimed.add((record.gpu_uuid, gi.info.id))
        b.protected_cdi.update(ci.mig_uuid for ci in gi.compute_instances)
        b.preserved_foreign.append(
            live_ref(record.gpu_uuid, b.profile_name(record.gpu_uuid, gi.info.profile_id), gi)
        )
        kept = f"; the GPU instance {gi.info.id} at its placement is preserved as foreign"
    b.errors.append(
        f"ownership record {record.name} ({record.state}) carries no boot ID, so nothing tells which "
        "boot wrote it (this sidecar stamps one in every record); it is left untouched for the "
        f"operator{kept}"
    )


def keep_aside(b: PlanDraft, record: OwnershipRecord, gi: LiveGpuInstance, why: str) -> None:
    b.claimed.add((record.gpu_uuid, gi.info.id))
    if record.mig_uuid:
        b.protected_cdi.add(record.mig_uuid)
    for ci in gi.compute_instances:
        b.protected_cdi.add(ci.mig_uuid)
    b.preserved_foreign.append(
        live_ref(record.gpu_uuid, b.profile_name(record.gpu_uuid, gi.info.profile_id), gi)
    )
    b.errors.append(
        f"ownership record {record.name} ({record.state}) contradicts the live GPU instance "
        f"{gi.info.id} at {record.placement} on {record.gpu_uuid}: {why}; the instance is preserved as "
        "foreign and the record is kept for the operator"
    )


def restore_idle(b: PlanDraft, record: OwnershipRecord, gi: LiveGpuInstance) -> None:
    changed = record.state is not State.IDLE
    if changed:
        # Going IDLE takes a fresh generation, as a release does (SyncActive's reactivation fence).
        b.handed_out = True
    restored = transition(
        record,
        State.IDLE,
        recovery=True,
        owner=None,
        last_error="",
        cdi_device=b.cdi_name(record.mig_uuid),
        idled_generation=b.fresh_generation if changed else record.idled_generation,
        since=b.inputs.now if changed else record.since,
    )
    actions: tuple[Action, ...] = () if restored == record else (PutRecord(restored),)
    ref = live_ref(record.gpu_uuid, record.profile, gi)
    # No ``on_failure``: an ERROR entry would have the reconciler destroy a healthy instance. When
    # the record cannot be written, the instance is foreign for this process life and the record
    # on disk stays as it was, so a later Recover with a working state directory restores it.
    b.steps.append(
        Step(
            subject=f"restore {record.name}",
            actions=actions,
            record_name=record.name,
            foreign_ref=ref,
            reported=Reported("restored_idle", ref),
        )
    )
    b.table[record.name] = restored


def claim_holds(record: OwnershipRecord) -> bool:
    """Whether a claim's request holds the instance. No pod list names a claim's instance, so its
    absence from one says nothing: only the claim's own Release gives the instance back, and every
    Recover keeps it ACTIVE, across a restart of the sidecar too."""
    return record.owner is not None and record.owner.kind is OwnerKind.CLAIM


def keep_active(b: PlanDraft, record: OwnershipRecord) -> None:
    """A repeated Recover leaves a verified ACTIVE instance as it is (rule 2's exception), and every
    Recover a claim's (``claim_holds``)."""
    b.table[record.name] = record
    b.steps.append(Step(subject=f"keep {record.name} ACTIVE", record_name=record.name))


def fault_to_error(b: PlanDraft, record: OwnershipRecord) -> None:
    """A faulted instance no pod holds (an Xid named it) is never restored IDLE: it goes ERROR, so
    it is never reused and the reconciler destroys it, its CDI spec after the hardware."""
    failed = transition(
        record,
        State.ERROR,
        recovery=True,
        owner=None,
        last_error=f"Xid {record.xid} on its GPU instance: never reused, destroyed by the reconciler",
        since=b.inputs.now,
    )
    if record.mig_uuid:
        b.protected_cdi.add(record.mig_uuid)
    b.table[record.name] = failed
    b.steps.append(
        Step(
            subject=f"keep faulted {record.name} in ERROR",
            actions=() if failed == record else (PutRecord(failed),),
            record_name=record.name,
            on_failure=failed,
        )
    )


def keep_error(b: PlanDraft, record: OwnershipRecord) -> None:
    """ERROR stays ERROR: the reconciler retries the destroy; its CDI file goes only after that."""
    if record.mig_uuid:
        b.protected_cdi.add(record.mig_uuid)
    b.table[record.name] = record
    b.steps.append(Step(subject=f"keep {record.name} in ERROR", record_name=record.name))


def finish_destroy(b: PlanDraft, record: OwnershipRecord, gi: LiveGpuInstance) -> None:
    """Undo a CREATING record (or an ERROR one a failed create left without a GI ID) or finish a
    DELETING one; the record carries the verified live IDs."""
    ci = gi.compute_instances[0] if gi.compute_instances else None
    deleting = transition(
        record,
        State.DELETING,
        recovery=True,
        gpu_instance_id=gi.info.id,
        compute_instance_id=ci.id if ci is not None else record.compute_instance_id,
        mig_uuid=ci.mig_uuid if ci is not None else record.mig_uuid,
        ci_create_issued=False,
        since=record.since if record.state is State.DELETING else b.inputs.now,
    )
    if deleting.mig_uuid:
        b.removed_cdi.add(deleting.mig_uuid)  # destroy_owned removes it after the hardware
    verb = "finish deleting" if record.state is State.DELETING else "undo"
    b.steps.append(
        Step(
            subject=f"{verb} {record.name}",
            actions=(DestroyOwned(deleting),),
            record_name=record.name,
            on_failure=deleting,
            foreign_ref=live_ref(record.gpu_uuid, b.profile_name(record.gpu_uuid, gi.info.profile_id), gi),
            reported=Reported("dropped_stale_records", record.name),
        )
    )
