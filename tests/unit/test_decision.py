"""The pure allocation decision, over plain values."""

from __future__ import annotations

from sidecar.decision import AlreadyHeld, Busy, Conflict, Create, Reuse, decide, needs_placement
from sidecar.domain import Owner, Placement, PodRef, Reservation, State
from sidecar.ownership import OwnershipRecord
from sidecar.placement import FOREIGN, Blocker, PlacementPlan

GPU = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
RES = Reservation(GPU, "1g.10gb", Placement(0, 1))
OWNER = Owner(PodRef("pod-a"), "main", 0, 0)


def rec(state: State, res: Reservation = RES, complete: bool = True) -> OwnershipRecord:
    ids = {"gpu_instance_id": 9, "compute_instance_id": 0, "mig_uuid": "MIG-x"} if complete else {}
    return OwnershipRecord(
        gpu_uuid=res.gpu_uuid,
        profile=res.profile,
        gi_profile_id=19,
        ci_profile_id=0,
        placement=res.placement,
        state=state,
        owner=OWNER,
        **ids,  # type: ignore[arg-type]
    )


def test_a_key_holding_another_reservation_is_a_conflict() -> None:
    other = rec(State.ACTIVE, Reservation(GPU, "1g.10gb", Placement(1, 1)))
    assert decide(RES, other, None, None) == Conflict(other)


def test_a_complete_active_instance_of_the_key_is_already_held_even_beside_an_idle_one() -> None:
    held = rec(State.ACTIVE)
    assert decide(RES, held, rec(State.IDLE), PlacementPlan()) == AlreadyHeld(held)


def test_an_idle_instance_at_exactly_the_reservation_is_reused() -> None:
    idle = rec(State.IDLE)
    assert decide(RES, None, idle, None) == Reuse(idle)
    assert not needs_placement(RES, None, idle)


def test_an_idle_instance_of_another_profile_is_not_reused() -> None:
    other = rec(State.IDLE, Reservation(GPU, "1g.10gb+me", Placement(0, 1)))
    assert needs_placement(RES, None, other)
    assert decide(RES, None, other, PlacementPlan(reclaim=(other,))) == Create(reclaim=(other,))


def test_a_half_created_instance_of_the_key_is_not_already_held() -> None:
    creating = rec(State.CREATING, complete=False)
    assert needs_placement(RES, creating, None)


def test_anything_but_idle_in_the_way_is_busy_and_reclaims_nothing() -> None:
    blocker = Blocker(FOREIGN, Placement(0, 2), 3)
    decided = decide(RES, None, None, PlacementPlan(blockers=(blocker,)))
    assert decided == Busy((blocker,))
    assert isinstance(decided, Busy)
    assert decided.blocker == blocker
