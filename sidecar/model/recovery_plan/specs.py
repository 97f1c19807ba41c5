"""Rule 5: CDI specs of live owned instances are ensured, every other spec of ours removed (pure).

See ``sidecar.model.recovery_plan`` for the rule in full; ``plan`` runs the rules in order.
"""

from __future__ import annotations

import msgspec

from sidecar.model.recovery_plan.actions import EnsureCdi, Step
from sidecar.model.recovery_plan.draft import LIVE_STATES, PlanDraft


def reconcile_cdi(b: PlanDraft) -> PlanDraft:
    live_owned: set[str] = set()
    # The spec is written in the step that records the instance, after its record: a step stops at
    # its first failure, so an instance whose record could not be written (left foreign) is never
    # published. A spec that cannot be written does not fail the step (see ``EnsureCdi``).
    step_of = {step.record_name: i for i, step in enumerate(b.steps) if step.record_name is not None}
    for name, record in sorted(b.table.items()):
        identity = record.identity
        if identity is None:
            continue
        live_owned.add(identity.mig_uuid)
        if record.state not in LIVE_STATES or not b.cdi_name(identity.mig_uuid):
            continue
        ensure = EnsureCdi(b.gpus[record.gpu_uuid].info.minor, identity)
        index = step_of.get(name)
        if index is None:
            b.steps.append(Step(subject=f"ensure CDI spec of {name}", actions=(ensure,)))
            continue
        step = b.steps[index]
        b.steps[index] = msgspec.structs.replace(step, actions=(*step.actions, ensure))
    for mig_uuid in sorted(b.inputs.cdi_files):
        if mig_uuid in live_owned or mig_uuid in b.protected_cdi:
            continue
        actions = b.remove_cdi(mig_uuid)
        if actions:
            b.steps.append(Step(subject=f"remove CDI spec of {mig_uuid}", actions=actions))
    return b
