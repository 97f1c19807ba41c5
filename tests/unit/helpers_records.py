"""A sample ownership record, shared by the record store's tests (a test module never imports another).

``make_record`` builds one valid record of a 1g.10gb instance; each test varies only what it is about.
"""

from __future__ import annotations

from sidecar.model.domain import Owner, PodRef, State
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement

GPU = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
MIG = "MIG-5c2f3a9e-1111-2222-3333-444455556666"
BOOT = "7e1f3c2a-0000-4000-8000-000000000001"


def make_record(
    gpu: str = GPU, start: int = 0, size: int = 1, state: State = State.IDLE, boot_id: str = BOOT
) -> OwnershipRecord:
    return OwnershipRecord(
        gpu_uuid=gpu,
        profile="1g.10gb",
        gi_profile_id=19,
        ci_profile_id=0,
        placement=Placement(start, size),
        state=state,
        gpu_instance_id=9,
        compute_instance_id=0,
        mig_uuid=MIG,
        owner=Owner(PodRef("pod-uid-1", "default", "trainer"), "main", 0, 0),
        activated_generation=3,
        cdi_device=f"k8s.hami.io/mig={MIG}",
        boot_id=boot_id,
        since="2026-01-01T00:00:00Z",
    )
