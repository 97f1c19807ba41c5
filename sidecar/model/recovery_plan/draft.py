"""The plan being drafted: what recovery's rules have decided so far, passed from rule to rule (pure).

``plan`` builds one ``PlanDraft`` from the inputs and hands it to each rule in turn; each rule returns
it with what it decided added. What a rule reads from an earlier one is here and nowhere else:
``claimed`` (GIs already decided), ``protected_cdi`` (spec files that must stay), ``removed_cdi``,
``refused`` (MIG UUIDs a repeated Recover did not give the listed pod), the steps, the table, the
report's foreign instances and errors, and the one fresh generation this recovery hands out.
"""

from __future__ import annotations

from sidecar.model.domain import Identity, InstanceRef, Reservation, State
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.recovery_plan.actions import Action, RemoveCdi, Step
from sidecar.model.recovery_plan.inputs import Inputs, LiveGpuInstance
from sidecar.nvml.port import GpuInstanceProfile, Placement

LIVE_STATES = (State.ACTIVE, State.IDLE)


def live_ref(gpu_uuid: str, profile: str, gi: LiveGpuInstance) -> InstanceRef:
    """How the report names a live GI (identity only with exactly one CI)."""
    identity = None
    if len(gi.compute_instances) == 1:
        ci = gi.compute_instances[0]
        identity = Identity(gi.info.id, ci.id, ci.mig_uuid)
    return InstanceRef(Reservation(gpu_uuid, profile, gi.info.placement), identity)


class PlanDraft:
    """The draft of one ``plan`` call, with lookups over its inputs."""

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self.gpus = {gpu.info.uuid: gpu for gpu in inputs.gpus}
        self.claimed: set[tuple[str, int]] = set()  # (GPU UUID, GI ID) already decided
        self.protected_cdi: set[str] = set()  # MIG UUIDs whose spec file must stay
        self.removed_cdi: set[str] = set()
        self.steps: list[Step] = []
        self.table: dict[str, OwnershipRecord] = {}
        # The report's other lists come from the steps (``Step.reported``, ``settle_report``).
        self.preserved_foreign: list[InstanceRef] = []
        self.errors: list[str] = []
        # MIG UUIDs of listed allocations a repeated Recover did not give to the listed pod.
        self.refused: set[str] = set()
        self.generation = max(
            [
                inputs.generation,
                *(r.activated_generation for r in inputs.records),
                *(r.idled_generation for r in inputs.records),
            ]
        )
        # The one fresh generation this recovery hands out, to every instance it activates or
        # restores IDLE; the plan's generation moves to it once one is handed out.
        self.fresh_generation = self.generation + 1
        self.handed_out = False

    def profile_of(self, gpu_uuid: str, profile_id: int) -> GpuInstanceProfile | None:
        gpu = self.gpus.get(gpu_uuid)
        if gpu is None:
            return None
        return next((p for p in gpu.profiles if p.id == profile_id), None)

    def profile_name(self, gpu_uuid: str, profile_id: int) -> str:
        profile = self.profile_of(gpu_uuid, profile_id)
        return profile.name if profile is not None else f"profile-id-{profile_id}"

    def gi_at(self, gpu_uuid: str, placement: Placement) -> LiveGpuInstance | None:
        gpu = self.gpus.get(gpu_uuid)
        if gpu is None:
            return None
        return next((gi for gi in gpu.gpu_instances if gi.info.placement == placement), None)

    def cdi_name(self, mig_uuid: str | None) -> str:
        return self.inputs.cdi_devices.get(mig_uuid, "") if mig_uuid else ""

    def remove_cdi(self, mig_uuid: str | None) -> tuple[Action, ...]:
        """A RemoveCdi for a spec file that exists and was not removed yet (kept files excepted)."""
        if not mig_uuid or mig_uuid not in self.inputs.cdi_files or mig_uuid in self.removed_cdi:
            return ()
        self.removed_cdi.add(mig_uuid)
        return (RemoveCdi(mig_uuid, self.inputs.cdi_paths.get(mig_uuid, "")),)
