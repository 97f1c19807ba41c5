"""Recoverer's planner: the rules, in the order they run, over one ``PlanDraft`` (pure).

An active allocation that does not match the live hardware exactly raises
``errors.UnverifiableState`` before a single action exists. Re-exports the plan's value types so
callers and tests import one module.
"""

from __future__ import annotations

from sidecar.model.recovery_plan.actions import (
    Plan,
    RecoveryReport,
    settle_report,
)
from sidecar.model.recovery_plan.active import adopt_active
from sidecar.model.recovery_plan.corrupt import preserve_corrupt
from sidecar.model.recovery_plan.draft import PlanDraft
from sidecar.model.recovery_plan.hami import take_over_hami
from sidecar.model.recovery_plan.inputs import Inputs
from sidecar.model.recovery_plan.recorded import reconcile_records
from sidecar.model.recovery_plan.specs import reconcile_cdi
from sidecar.model.recovery_plan.unowned import handle_unowned


def plan(inputs: Inputs) -> Plan:
    """Decide what recovery does, from plain values only (no I/O).

    The rules run in this order because each reads what the earlier ones claimed (``PlanDraft``):
    active allocations first (the pod list outranks records), then records, then HAMi's records
    (what the sidecar verified of its own is never taken on HAMi's word), then corrupt files,
    then whatever nobody claimed, and the CDI specs last, over the table the others built."""
    draft = PlanDraft(inputs)
    draft = adopt_active(draft)
    draft = reconcile_records(draft)
    draft = take_over_hami(draft)
    draft = preserve_corrupt(draft)
    draft = handle_unowned(draft)
    draft = reconcile_cdi(draft)
    return result(draft)


def result(b: PlanDraft) -> Plan:
    generation = b.fresh_generation if b.handed_out else b.generation
    report = settle_report(
        RecoveryReport(preserved_foreign=tuple(b.preserved_foreign), errors=tuple(b.errors)),
        done=b.steps,
    )
    return Plan(
        steps=tuple(b.steps),
        table=tuple(record for _, record in sorted(b.table.items())),
        report=report,
        generation=generation,
        generation_ceiling=b.inputs.generation_ceiling,
        referenced_mig_uuids=frozenset(a.identity.mig_uuid for a in b.inputs.active if a.identity is not None)
        - b.refused,
        pending=tuple(a for a in b.inputs.active if a.identity is None),
    )
