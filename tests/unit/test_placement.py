"""What blocks a placement, decided from plain values (no NVML, no disk)."""

from __future__ import annotations

import pytest

from sidecar.model import placement
from sidecar.model.domain import Owner, PodRef, State
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import GpuInstanceInfo, GpuInstanceProfile, Placement

GPU = "GPU-11111111-2222-3333-4444-555555555555"
OTHER_GPU = "GPU-aaaaaaaa-2222-3333-4444-555555555555"

# H100-80GB 1g.10gb and 3g.40gb as NVML lists them (ID 19 and 9); placements are memory slices.
ONE_G = GpuInstanceProfile(
    index=0,
    id=19,
    name="1g.10gb",
    slice_count=1,
    instance_count=7,
    memory_mb=9856,
    multiprocessor_count=16,
    placements=tuple(Placement(i, 1) for i in range(7)),
    ci_profile_id=0,
)
THREE_G = GpuInstanceProfile(
    index=2,
    id=9,
    name="3g.40gb",
    slice_count=3,
    instance_count=2,
    memory_mb=40192,
    multiprocessor_count=60,
    placements=(Placement(0, 4), Placement(4, 4)),
    ci_profile_id=2,
)


def gi(gi_id: int, start: int, size: int, profile_id: int = 19, gpu: str = GPU) -> GpuInstanceInfo:
    return GpuInstanceInfo(gpu_uuid=gpu, id=gi_id, profile_id=profile_id, placement=Placement(start, size))


def rec(
    state: State, gi_id: int | None, start: int, size: int, *, profile_id: int = 19, gpu: str = GPU
) -> OwnershipRecord:
    owner = Owner(PodRef("pod-a"), "main", 0, 0) if state in (State.ACTIVE, State.CREATING) else None
    return OwnershipRecord(
        gpu_uuid=gpu,
        profile="1g.10gb" if profile_id == 19 else "3g.40gb",
        gi_profile_id=profile_id,
        ci_profile_id=0,
        placement=Placement(start, size),
        state=state,
        gpu_instance_id=gi_id,
        compute_instance_id=0 if gi_id is not None else None,
        mig_uuid=f"MIG-00000000-0000-0000-0000-{gi_id or 0:012d}" if gi_id is not None else None,
        owner=owner,
    )


class TestLegality:
    def test_a_placement_from_the_possible_list_is_legal(self) -> None:
        assert placement.is_legal(THREE_G, Placement(4, 4))

    @pytest.mark.parametrize(
        "candidate", [Placement(2, 4), Placement(0, 3), Placement(0, 8), Placement(8, 4)]
    )
    def test_a_placement_not_in_the_possible_list_is_illegal(self, candidate: Placement) -> None:
        assert not placement.is_legal(THREE_G, candidate)


class TestOwnership:
    def test_a_record_owns_the_gi_with_its_id_profile_and_placement(self) -> None:
        assert placement.owns(rec(State.IDLE, 7, 0, 1), gi(7, 0, 1))

    def test_the_same_gi_id_at_another_placement_is_not_owned(self) -> None:
        # The driver numbers GIs by placement, but a record is only trusted when everything matches.
        assert not placement.owns(rec(State.IDLE, 7, 0, 1), gi(7, 1, 1))

    def test_the_same_placement_with_another_profile_is_not_owned(self) -> None:
        assert not placement.owns(rec(State.IDLE, 7, 0, 1), gi(7, 0, 1, profile_id=20))

    def test_a_record_of_another_gpu_owns_nothing_here(self) -> None:
        assert not placement.owns(rec(State.IDLE, 7, 0, 1, gpu=OTHER_GPU), gi(7, 0, 1))

    def test_foreign_instances_are_the_live_gis_no_record_claims(self) -> None:
        live = [gi(7, 0, 1), gi(8, 1, 1), gi(2, 4, 4, profile_id=9)]
        foreign = placement.foreign_instances(live, [rec(State.ACTIVE, 8, 1, 1)])
        assert [g.id for g in foreign] == [7, 2]


class TestPlanPlacement:
    def test_a_free_placement_needs_nothing(self) -> None:
        plan = placement.plan_placement(Placement(4, 4), [gi(7, 0, 1)], [rec(State.ACTIVE, 7, 0, 1)])
        assert plan == placement.PlacementPlan()
        assert not plan.busy

    def test_overlapping_idle_instances_are_reclaimed_and_non_overlapping_ones_are_kept(self) -> None:
        idle_in_way = rec(State.IDLE, 11, 4, 1)
        idle_in_way_too = rec(State.IDLE, 13, 6, 1)
        idle_elsewhere = rec(State.IDLE, 7, 0, 1)
        live = [gi(7, 0, 1), gi(11, 4, 1), gi(13, 6, 1)]
        plan = placement.plan_placement(Placement(4, 4), live, [idle_elsewhere, idle_in_way_too, idle_in_way])
        assert not plan.busy
        assert plan.reclaim == (idle_in_way, idle_in_way_too)

    @pytest.mark.parametrize("state", [State.ACTIVE, State.ERROR, State.CREATING, State.DELETING])
    def test_an_overlapping_instance_that_is_not_idle_blocks_and_nothing_is_reclaimed(
        self, state: State
    ) -> None:
        blocking = rec(state, 11, 4, 1)
        idle = rec(State.IDLE, 12, 5, 1)
        plan = placement.plan_placement(Placement(4, 4), [gi(11, 4, 1), gi(12, 5, 1)], [blocking, idle])
        assert plan.busy
        assert plan.reclaim == ()
        assert [b.kind for b in plan.blockers] == [str(state)]
        assert plan.blockers[0].record == blocking

    def test_a_record_blocks_its_slices_even_when_its_gi_is_not_live(self) -> None:
        half_created = rec(State.CREATING, None, 4, 1)
        plan = placement.plan_placement(Placement(4, 4), [], [half_created])
        assert [b.kind for b in plan.blockers] == ["CREATING"]

    def test_an_overlapping_gi_that_no_record_claims_is_a_foreign_blocker(self) -> None:
        plan = placement.plan_placement(Placement(0, 4), [gi(9, 2, 1)], [rec(State.IDLE, 7, 0, 1)])
        assert plan.reclaim == ()
        assert plan.blockers == (placement.Blocker("foreign", Placement(2, 1), 9),)

    def test_a_live_gi_that_disagrees_with_the_record_at_its_spot_is_foreign(self) -> None:
        # Record says GI 7 at 0:1, the hardware has a 2g GI 3 at 0:2: ours is gone, that one is not ours.
        stale = rec(State.IDLE, 7, 0, 1)
        plan = placement.plan_placement(Placement(0, 1), [gi(3, 0, 2, profile_id=14)], [stale])
        assert [b.kind for b in plan.blockers] == ["foreign"]


class TestBlockerMetadata:
    def test_a_foreign_blocker_names_its_gi_and_placement(self) -> None:
        meta = placement.Blocker("foreign", Placement(2, 1), 9).metadata()
        assert meta == {"blocker": "foreign", "placement": "2:1", "gpu_instance_id": "9"}

    def test_an_active_blocker_names_its_mig_uuid_and_owner(self) -> None:
        active = rec(State.ACTIVE, 11, 4, 1)
        meta = placement.Blocker("ACTIVE", active.placement, 11, active).metadata()
        assert meta["blocker"] == "ACTIVE"
        assert meta["mig_uuid"] == active.mig_uuid
        assert meta["owner"] == "pod-a/0/0"
        assert meta["pod_uid"] == "pod-a"


class TestRequestOverlap:
    def test_two_devices_on_one_gpu_that_overlap_are_found(self) -> None:
        assert placement.first_overlap(
            [(GPU, Placement(0, 4)), (GPU, Placement(4, 1)), (GPU, Placement(3, 1))]
        ) == (
            0,
            2,
        )

    def test_the_same_placement_on_two_gpus_is_no_overlap(self) -> None:
        assert placement.first_overlap([(GPU, Placement(0, 4)), (OTHER_GPU, Placement(0, 4))]) is None
