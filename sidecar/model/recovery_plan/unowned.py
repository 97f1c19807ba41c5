"""Rule 4: live GIs nobody claims are foreign; with adopt_existing, adopted or removed (pure).

See ``sidecar.model.recovery_plan`` for the rule in full; ``plan`` runs the rules in order.
"""

from __future__ import annotations

from sidecar.model.domain import InstanceRef, State
from sidecar.model.ownership import live_record
from sidecar.model.recovery_plan.actions import DestroyOwned, PutRecord, Reported, Step
from sidecar.model.recovery_plan.draft import PlanDraft, live_ref
from sidecar.model.recovery_plan.inputs import LiveGpu, LiveGpuInstance
from sidecar.model.states import enter
from sidecar.nvml.port import ComputeInstanceInfo, GpuInstanceProfile


def handle_unowned(b: PlanDraft) -> PlanDraft:
    # Busy: a listed allocation, or an instance that stays ACTIVE (a repeated Recover keeps
    # ACTIVE records its possibly older pod list does not name). Runs after rules 1-3 fill the table.
    active_gpus = {alloc.reservation.gpu_uuid for alloc in b.inputs.active} | {
        r.gpu_uuid for r in b.table.values() if r.state is State.ACTIVE
    }
    for gpu in b.inputs.gpus:
        uuid = gpu.info.uuid
        for gi in gpu.gpu_instances:
            if (uuid, gi.info.id) in b.claimed:
                continue
            b.claimed.add((uuid, gi.info.id))
            profile = b.profile_of(uuid, gi.info.profile_id)
            name = profile.name if profile is not None else f"profile-id-{gi.info.profile_id}"
            ref = live_ref(uuid, name, gi)
            if not b.inputs.adopt_existing or profile is None:
                b.preserved_foreign.append(ref)
                continue
            cis = gi.compute_instances
            if len(cis) == 1 and cis[0].profile_id == profile.ci_profile_id:
                adopt_foreign(b, gpu, profile, gi, cis[0], ref)
            elif not cis and uuid not in active_gpus and gpu.processes == 0:
                remove_orphan(b, gpu, profile, gi, ref)
            else:
                b.preserved_foreign.append(ref)
    return b


def adopt_foreign(  # noqa: PLR0917 - the parts of one adoption, all decided by the caller
    b: PlanDraft,
    gpu: LiveGpu,
    profile: GpuInstanceProfile,
    gi: LiveGpuInstance,
    ci: ComputeInstanceInfo,
    ref: InstanceRef,
) -> None:
    record = enter(
        live_record(
            profile.name,
            gi.info,
            ci,
            state=State.IDLE,
            cdi_device=b.cdi_name(ci.mig_uuid),
            idled_generation=b.fresh_generation,
            boot_id=b.inputs.boot_id,
            since=b.inputs.now,
        ),
        recovery=True,
    )
    b.handed_out = True
    # No ``on_failure``: an adoption that cannot be recorded leaves the instance foreign, and the
    # report names it there (``foreign_ref``), not as adopted.
    b.steps.append(
        Step(
            subject=f"adopt foreign {record.name}",
            actions=(PutRecord(record),),
            record_name=record.name,
            foreign_ref=ref,
            reported=Reported("adopted_foreign", ref),
        )
    )
    b.table[record.name] = record


def remove_orphan(
    b: PlanDraft, gpu: LiveGpu, profile: GpuInstanceProfile, gi: LiveGpuInstance, ref: InstanceRef
) -> None:
    """Destroy an unowned GI without a CI, records first: a crash mid-way leaves a DELETING record."""
    bare = live_record(
        profile.name,
        gi.info,
        None,
        state=State.DELETING,
        ci_profile_id=profile.ci_profile_id,
        boot_id=b.inputs.boot_id,
        since=b.inputs.now,
    )
    record = enter(bare, recovery=True)
    b.steps.append(
        Step(
            subject=f"remove orphan GPU instance {gi.info.id} on {gpu.info.uuid}",
            actions=(DestroyOwned(record, require_idle_gpu=True),),
            record_name=record.name,
            on_failure=record,
            foreign_ref=ref,
            reported=Reported("removed_orphan_gis", ref),
        )
    )
