"""Rule 2b: HAMi's in-process lifecycle's records and specs are taken over (pure).

Runs after the active allocations and the sidecar's own records have claimed what they verify, and
before corrupt files and unowned instances, so a HAMi instance that is converted is never seen as
unowned (adopted twice, or destroyed as an orphan) and one that is kept stays foreign. The decision
is ``hami_takeover.plan_takeover``; this module turns it into steps:

- convert: PutRecord (the sidecar's record, durable first), then RemoveHamiRecord; rule 5 appends
  the EnsureCdi of the sidecar's own spec to the same step.
- finish: RemoveHamiRecord alone, after every step that writes records (the pod list's adoption of
  the instance, in this plan, writes its record first, marked as taken over in that same write).
- conflict: a HAMi file naming an instance the sidecar owned by its own record before: kept, the
  sidecar's record unchanged, the conflict in errors.
- keep: the instance is foreign and its MIG UUIDs' spec files stay; the file is named in errors.
- HAMi specs to remove go last, after every record step.
"""

from __future__ import annotations

import msgspec

from sidecar.model.domain import State
from sidecar.model.hami_takeover import TAKEN_OVER_FROM, Keep, TakeoverInputs, plan_takeover, pointed_at
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.recovery_plan.actions import (
    PutRecord,
    RemoveHamiRecord,
    RemoveHamiSpec,
    Reported,
    ReportList,
    Step,
)
from sidecar.model.recovery_plan.draft import PlanDraft, live_ref


def take_over_hami(b: PlanDraft) -> PlanDraft:
    inputs = b.inputs
    if not inputs.hami_records and not inputs.hami_specs:
        return b
    if not inputs.hami_takeover:
        # Every instance a file points at stays foreign, an undecodable file's too (adoption of
        # unowned instances must not take them either).
        keep_reason = "the takeover of HAMi's files is turned off (--no-hami-takeover)"
        for file in inputs.hami_records:
            b.errors.append(f"HAMi ownership record {file.filename} is kept untouched: {keep_reason}")
            _foreign(b, Keep(file.filename, keep_reason, tuple(pointed_at(inputs.gpus, file.pointer))))
        return b
    owned_gis = {(r.gpu_uuid, r.gpu_instance_id) for r in b.table.values()}
    decided = plan_takeover(
        TakeoverInputs(
            hami_records=inputs.hami_records,
            hami_specs=inputs.hami_specs,
            gpus=inputs.gpus,
            active=inputs.active,
            owned=tuple(b.table.values()),
            own_records=frozenset(
                r.mig_uuid for r in inputs.records if r.mig_uuid and r.taken_over_from != TAKEN_OVER_FROM
            ),
            claimed=frozenset(gi for gi in b.claimed if gi not in owned_gis),
            cdi_devices=inputs.cdi_devices,
            boot_id=inputs.boot_id,
            now=inputs.now,
            generation=b.fresh_generation,
        )
    )
    for conv in decided.converted:
        record = conv.record
        assert record.mig_uuid is not None
        assert record.gpu_instance_id is not None
        b.handed_out = True
        gi = b.gi_at(record.gpu_uuid, record.placement)
        assert gi is not None
        b.claimed.add((record.gpu_uuid, record.gpu_instance_id))
        into: ReportList = "adopted_active" if record.state is State.ACTIVE else "restored_idle"
        b.steps.append(
            Step(
                subject=f"take over {conv.filename} as {record.name} ({record.state})",
                actions=(PutRecord(record), RemoveHamiRecord(conv.filename, record.name, record.mig_uuid)),
                record_name=record.name,
                foreign_ref=live_ref(record.gpu_uuid, record.profile, gi),
                reported=Reported(into, live_ref(record.gpu_uuid, record.profile, gi)),
            )
        )
        b.table[record.name] = record
    for fin in decided.finished:
        ours = b.table[fin.record_name]
        actions: tuple[PutRecord | RemoveHamiRecord, ...] = (
            RemoveHamiRecord(fin.filename, fin.record_name, fin.mig_uuid),
        )
        if ours.taken_over_from != TAKEN_OVER_FROM:
            ours = msgspec.structs.replace(ours, taken_over_from=TAKEN_OVER_FROM)
            b.table[fin.record_name] = ours
            if not _mark_in_its_write(b, ours):
                actions = (PutRecord(ours), *actions)
        b.steps.append(
            Step(subject=f"finish taking over {fin.filename} ({fin.record_name})", actions=actions)
        )
    for keep in decided.kept:
        _foreign(b, keep)
    b.errors.extend(decided.errors)
    for spec in decided.keep_specs:
        b.protected_cdi.add(spec.mig_uuid)
    for spec in decided.remove_specs:
        b.steps.append(
            Step(subject=f"remove HAMi's CDI spec {spec.filename}", actions=(RemoveHamiSpec(spec.mig_uuid),))
        )
    return b


def _mark_in_its_write(b: PlanDraft, marked: OwnershipRecord) -> bool:
    """Put the mark into the step of this plan that writes the record (the pod list's adoption), so
    no crash can leave an unmarked record of a HAMi instance on disk (the next recovery would take it
    for the sidecar's own and keep HAMi's file as a conflict). False when no step writes it."""
    for i, step in enumerate(b.steps):
        if step.record_name != marked.name or not any(isinstance(a, PutRecord) for a in step.actions):
            continue
        actions = tuple(PutRecord(marked) if isinstance(a, PutRecord) else a for a in step.actions)
        on_failure = step.on_failure
        if on_failure is not None:
            on_failure = msgspec.structs.replace(on_failure, taken_over_from=TAKEN_OVER_FROM)
        b.steps[i] = msgspec.structs.replace(step, actions=actions, on_failure=on_failure)
        return True
    return False


def _foreign(b: PlanDraft, keep: Keep) -> None:
    for gpu_uuid, gi_id in keep.foreign:
        if (gpu_uuid, gi_id) in b.claimed:
            continue
        b.claimed.add((gpu_uuid, gi_id))
        gpu = b.gpus[gpu_uuid]
        gi = next(g for g in gpu.gpu_instances if g.info.id == gi_id)
        b.protected_cdi.update(ci.mig_uuid for ci in gi.compute_instances)
        b.preserved_foreign.append(live_ref(gpu_uuid, b.profile_name(gpu_uuid, gi.info.profile_id), gi))
