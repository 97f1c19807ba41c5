"""Rule 1: active allocations are adopted ACTIVE when they match the live hardware exactly (pure).

See ``sidecar.model.recovery_plan`` for the rule in full; ``plan`` runs the rules in order.
"""

from __future__ import annotations

import msgspec

from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Identity, OwnerKind, State
from sidecar.model.ownership import Origin, OwnershipRecord, instance_ref, live_record, record_name
from sidecar.model.recovery_plan.actions import Action, PutRecord, Reported, Step
from sidecar.model.recovery_plan.draft import PlanDraft, live_ref
from sidecar.model.states import enter


def adopt_active(b: PlanDraft) -> PlanDraft:
    by_key: dict[object, ActiveAllocation] = {}
    by_instance: dict[tuple[str, int], ActiveAllocation] = {}
    unverifiable: list[str] = []
    keys: set[str] = set()
    for listed in b.inputs.active:
        alloc = listed
        seen = by_key.get(alloc.key)
        if seen is not None:
            if seen.reservation != alloc.reservation or seen.identity != alloc.identity:
                keys.add(str(alloc.key))
                unverifiable.append(
                    f"allocation {alloc.key} is listed twice with different reservations or identities"
                )
            continue
        by_key[alloc.key] = alloc
        if alloc.identity is None:
            continue  # a pending reservation: nothing live to verify (``sidecar.model.pending``)
        why = verify_active(b, alloc)
        if why is not None:
            keys.add(str(alloc.key))
            unverifiable.append(f"allocation {alloc.key} ({alloc.reservation}): {why}")
            continue
        alloc = with_live_identity(b, alloc)
        assert alloc.identity is not None
        instance = (alloc.reservation.gpu_uuid, alloc.identity.gpu_instance_id)
        other = by_instance.get(instance)
        if other is not None:
            keys.update((str(other.key), str(alloc.key)))
            unverifiable.append(
                f"allocations {other.key} and {alloc.key} both claim GPU instance "
                f"{instance[1]} on {instance[0]}"
            )
            continue
        by_instance[instance] = alloc
    if unverifiable:
        raise errors.UnverifiableState(
            "startup recovery cannot verify the active allocations against the hardware; nothing was "
            "modified: " + "; ".join(unverifiable),
            {"allocations": ",".join(sorted(keys))},
        )
    corrupt_names = {c.name for c in b.inputs.corrupt}
    existing = {r.name: r for r in b.inputs.records}
    for (gpu_uuid, gi_id), alloc in by_instance.items():
        assert alloc.identity is not None
        gi = b.gi_at(gpu_uuid, alloc.reservation.placement)
        assert gi is not None
        ci = gi.compute_instances[0]
        name = record_name(gpu_uuid, alloc.reservation.placement)
        if held_by_claim(b, alloc, existing.get(name)):
            b.refused.add(alloc.identity.mig_uuid)
            continue
        if b.inputs.recovered and (
            stays_error(b, alloc, existing.get(name))
            or held_by_another_key(b, alloc, existing.get(name), name)
            or stays_idle(b, alloc, existing.get(name))
        ):
            b.refused.add(alloc.identity.mig_uuid)
            continue
        b.claimed.add((gpu_uuid, gi_id))
        if name in corrupt_names:
            # The hardware matches the pod, but the record file is corrupt and must not be
            # overwritten: the instance stays foreign until the operator deals with the file.
            b.protected_cdi.add(ci.mig_uuid)
            b.preserved_foreign.append(live_ref(gpu_uuid, alloc.reservation.profile, gi))
            b.errors.append(
                f"allocation {alloc.key} matches the live instance {ci.mig_uuid}, but its ownership "
                f"record {name} is corrupt; the instance is preserved as foreign"
            )
            continue
        old = existing.get(name)
        keep_activation = (
            old is not None
            and old.state is State.ACTIVE
            and old.owner == alloc.owner
            and old.identity == alloc.identity
        )
        idled = 0
        if keep_activation:
            assert old is not None
            activated, since, boot = old.activated_generation, old.since, old.boot_id
            idled = old.idled_generation
        else:
            b.handed_out = True
            activated, since = b.fresh_generation, b.inputs.now
            boot = old.boot_id if old is not None and old.mig_uuid == ci.mig_uuid else b.inputs.boot_id
        record = enter(
            live_record(
                alloc.reservation.profile,
                gi.info,
                ci,
                state=State.ACTIVE,
                owner=alloc.owner,
                activated_generation=activated,
                idled_generation=idled,
                cdi_device=b.cdi_name(ci.mig_uuid),
                boot_id=boot or b.inputs.boot_id,
                since=since,
                # Kept for the same allocation; an adopted one may have been made by anyone.
                origin=old.origin if keep_activation and old is not None else Origin.REUSED,
                # The mark of an instance taken over from HAMi stays with it: teardown removes
                # HAMi's spec of it after the destroy.
                taken_over_from=old.taken_over_from
                if old is not None and old.mig_uuid == ci.mig_uuid
                else "",
                # A fault stays with the very instance it named: its release destroys it.
                xid=old.xid if old is not None and old.mig_uuid == ci.mig_uuid else 0,
            ),
            replacing=old,
            recovery=True,
        )
        actions: tuple[Action, ...] = () if old == record else (PutRecord(record),)
        b.steps.append(
            Step(
                subject=f"adopt {alloc.key}",
                actions=actions,
                record_name=name,
                on_failure=record,
                reported=Reported("adopted_active", instance_ref(record)),
            )
        )
        b.table[name] = record
    return b


def held_by_claim(b: PlanDraft, alloc: ActiveAllocation, old: OwnershipRecord | None) -> bool:
    """True (and an error line) when the instance a pod list names is recorded ACTIVE for a claim.

    A pod list never touches a claim's instance, in the first Recover too: the record is the newer
    truth (the claim got the instance after the pod gave it back, and the list still names the pod),
    so the instance is rule 2's, which keeps it ACTIVE for its claim once it verifies."""
    if (
        old is None
        or old.state is not State.ACTIVE
        or old.owner is None
        or old.owner.kind is not OwnerKind.CLAIM
    ):
        return False
    b.errors.append(
        f"allocation {alloc.key} names the instance {where(alloc)}, which is ACTIVE for {old.owner.key} "
        f"(record {old.name}); a pod list never takes a claim's instance, so it stays with the claim"
    )
    return True


def held_by_another_key(
    b: PlanDraft, alloc: ActiveAllocation, old: OwnershipRecord | None, name: str
) -> bool:
    """True (and an error line) when a repeated Recover must not hand this instance to ``alloc``.

    Once the sidecar serves, the pod list of a repeated Recover may be older than a release and
    a reuse since: the instance it names may be ACTIVE for a newer pod now (same GI, CI and MIG
    UUID, since reuse keeps them), or the listed key may hold another instance now. The table is
    newer than the list, so the instance stays as it is (ACTIVE with its current owner, or IDLE,
    restored by rule 2) - the same rule SyncActive follows for an IDLE instance it reactivates.
    Before the first Recover there is no newer truth than the pod list, and this never applies.
    """
    assert alloc.identity is not None
    at = where(alloc)
    if old is not None and old.state is State.ACTIVE and old.owner is not None and old.owner.key != alloc.key:
        b.table[name] = old
        b.claimed.add((old.gpu_uuid, alloc.identity.gpu_instance_id))
        b.steps.append(Step(subject=f"keep {name} ACTIVE for {old.owner.key}", record_name=name))
        b.errors.append(
            f"allocation {alloc.key} names the instance {at}, which is ACTIVE for {old.owner.key} "
            f"now (released and reused since the pod list was taken); it stays with {old.owner.key}"
        )
        return True
    if old is not None and old.state is State.ACTIVE:
        return False  # this key holds it already
    other = next(
        (
            r
            for r in b.inputs.records
            if r.name != name and r.state is State.ACTIVE and r.owner is not None and r.owner.key == alloc.key
        ),
        None,
    )
    if other is None:
        return False
    b.errors.append(
        f"allocation {alloc.key} names the instance {at}, but {alloc.key} holds {other.mig_uuid} at "
        f"{other.placement} now; one key never holds two instances, so it is not activated for it"
    )
    return True


def stays_error(b: PlanDraft, alloc: ActiveAllocation, old: OwnershipRecord | None) -> bool:
    """True (and an error line) when a repeated Recover names an instance that is ERROR now.

    ERROR is an instance whose destroy failed (a reclaim of an IDLE instance, an undo): the spec
    keeps it ERROR, never reuses it, and the reconciler retries the destroy. The pod list of a
    repeated Recover may predate the release after which it was reclaimed; adopting it ACTIVE
    would stop those retries, and once a SyncActive idled it an Allocate would reuse an instance
    whose destroy failed. So it stays ERROR (rule 2 keeps it) - unless its owner is the listed
    allocation's: then it is recovery's own adoption of that pod whose record could not be
    written (apply records the failed step ERROR with the allocation as owner), and the pod
    really holds it. A refused MIG UUID is left out of the plan's referenced ones, so the
    reconciler keeps retrying the destroy."""
    if old is None or old.state is not State.ERROR or old.owner == alloc.owner:
        return False
    holder = f"it was {old.owner.key}'s" if old.owner is not None else "it had no owner"
    b.errors.append(
        f"allocation {alloc.key} names the ERROR instance {where(alloc)} (record {old.name}, {holder}); "
        "a repeated Recover never adopts an "
        "instance whose destroy failed for another owner, since its pod list may predate the "
        "release: it stays ERROR, is never reused, and the reconciler retries its destroy"
    )
    return True


def stays_idle(b: PlanDraft, alloc: ActiveAllocation, old: OwnershipRecord | None) -> bool:
    """True (and an error line) when a repeated Recover names an instance that is IDLE now.

    The pod list of a repeated Recover may predate the release that idled the instance, and
    Recover carries no generation to tell: reactivating it would hand it back to a pod that is
    gone, and the next pod's Allocate would find it busy. It stays IDLE (rule 2 restores it);
    SyncActive, which is fenced by the generation, reactivates it for a pod that still holds it.
    """
    if old is None or old.state is not State.IDLE:
        return False
    b.errors.append(
        f"allocation {alloc.key} names the IDLE instance {where(alloc)} (record {old.name}); a "
        "repeated Recover never reactivates an IDLE instance, since its pod list may predate the "
        "release: it stays IDLE, and SyncActive reactivates it if the pod still holds it"
    )
    return True


def where(alloc: ActiveAllocation) -> str:
    """The instance a verified allocation names, as the report's error lines say it."""
    assert alloc.identity is not None
    res = alloc.reservation
    return f"{alloc.identity.mig_uuid} at {res.placement} on {res.gpu_uuid}"


def with_live_identity(b: PlanDraft, alloc: ActiveAllocation) -> ActiveAllocation:
    """A verified allocation with the identity of the live instance it names (its GI and CI IDs
    filled in when the pod list gave the MIG UUID alone, ``Identity.names``)."""
    gi = b.gi_at(alloc.reservation.gpu_uuid, alloc.reservation.placement)
    assert gi is not None  # verified
    assert alloc.identity is not None
    ci = gi.compute_instances[0]
    return msgspec.structs.replace(alloc, identity=Identity(gi.info.id, ci.id, ci.mig_uuid))


def verify_active(b: PlanDraft, alloc: ActiveAllocation) -> str | None:
    """Why an allocation does not match the live hardware exactly, or None when it does.

    Exactly means ``Identity.names``: the MIG UUID, and the GI and CI IDs unless the pod list gave
    the MIG UUID alone (both IDs 0), which is the rule ``SyncActive`` applies too."""
    identity, reservation = alloc.identity, alloc.reservation
    if identity is None:
        return None  # a pending reservation: accepted, never verified (``sidecar.model.pending``)
    gpu = b.gpus.get(reservation.gpu_uuid)
    if gpu is None:
        return f"GPU {reservation.gpu_uuid} is not on this node"
    if not gpu.info.mig_current:
        return f"MIG is disabled on GPU {reservation.gpu_uuid}"
    if identity.ids_told:
        gi = next((g for g in gpu.gpu_instances if g.info.id == identity.gpu_instance_id), None)
    else:
        gi = b.gi_at(reservation.gpu_uuid, reservation.placement)
    if gi is None:
        if not identity.ids_told:
            return f"no GPU instance is at placement {reservation.placement}"
        return f"GPU instance {identity.gpu_instance_id} does not exist"
    profile = b.profile_of(reservation.gpu_uuid, gi.info.profile_id)
    live_name = profile.name if profile is not None else f"profile-id-{gi.info.profile_id}"
    if live_name != reservation.profile:
        return f"GPU instance {gi.info.id} has profile {live_name}, not {reservation.profile}"
    if gi.info.placement != reservation.placement:
        return f"GPU instance {gi.info.id} is at placement {gi.info.placement}, not {reservation.placement}"
    if len(gi.compute_instances) != 1:
        return f"GPU instance {gi.info.id} has {len(gi.compute_instances)} compute instances, not one"
    ci = gi.compute_instances[0]
    if identity.ids_told and ci.id != identity.compute_instance_id:
        return f"compute instance is {ci.id}, not {identity.compute_instance_id}"
    if ci.mig_uuid != identity.mig_uuid:
        return f"the live MIG UUID is {ci.mig_uuid}, not {identity.mig_uuid}"
    assert profile is not None
    if ci.profile_id != profile.ci_profile_id:
        return f"compute instance {ci.id} is not the full-size one of its GPU instance"
    return None
