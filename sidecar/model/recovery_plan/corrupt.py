"""Rule 3: a corrupt record file is never touched; the GIs its name points at stay foreign (pure).

See ``sidecar.model.recovery_plan`` for the rule in full; ``plan`` runs the rules in order.
"""

from __future__ import annotations

from sidecar.model.ownership import parse_record_name
from sidecar.model.recovery_plan.draft import PlanDraft, live_ref


def preserve_corrupt(b: PlanDraft) -> PlanDraft:
    for corrupt in sorted(b.inputs.corrupt, key=lambda c: c.name):
        where = parse_record_name(corrupt.name)
        if where is None:
            b.errors.append(
                f"ownership record {corrupt.name} is corrupt ({corrupt.why}) and its name names no "
                "placement; it is left untouched"
            )
            continue
        gpu_uuid, placement = where
        gpu = b.gpus.get(gpu_uuid)
        preserved: list[int] = []
        for gi in gpu.gpu_instances if gpu is not None else ():
            if not gi.info.placement.overlaps(placement) or (gpu_uuid, gi.info.id) in b.claimed:
                continue
            b.claimed.add((gpu_uuid, gi.info.id))
            b.protected_cdi.update(ci.mig_uuid for ci in gi.compute_instances)
            b.preserved_foreign.append(live_ref(gpu_uuid, b.profile_name(gpu_uuid, gi.info.profile_id), gi))
            preserved.append(gi.info.id)
        kept = f"; GPU instances {preserved} are preserved as foreign" if preserved else ""
        b.errors.append(
            f"ownership record {corrupt.name} is corrupt ({corrupt.why}); it is left untouched{kept}"
        )
    return b
