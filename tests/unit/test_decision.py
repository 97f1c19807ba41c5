"""The pure allocation decision, over plain values."""

from __future__ import annotations

from sidecar.model.decision import AlreadyHeld, Busy, Conflict, Create, Reuse, decide
from sidecar.model.domain import ActiveAllocation, AllocationKey, Identity, Owner, PodRef, Reservation, State
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.pending import Guards, PendingReservation, pending_of
from sidecar.model.placement import FOREIGN, Blocker, PlacementPlan
from sidecar.nvml.port import Placement

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


def test_an_idle_instance_of_another_profile_is_not_reused() -> None:
    other = rec(State.IDLE, Reservation(GPU, "1g.10gb+me", Placement(0, 1)))
    assert decide(RES, None, other, PlacementPlan(reclaim=(other,))) == Create(reclaim=(other,))


def test_a_half_created_instance_of_the_key_is_not_already_held() -> None:
    creating = rec(State.CREATING, complete=False)
    assert decide(RES, creating, None, None) == Create()


def test_anything_but_idle_in_the_way_is_busy_and_reclaims_nothing() -> None:
    blocker = Blocker(FOREIGN, Placement(0, 2), 3)
    decided = decide(RES, None, None, PlacementPlan(blockers=(blocker,)))
    assert decided == Busy((blocker,))
    assert isinstance(decided, Busy)
    assert decided.blocker == blocker


# -- an ERROR instance in the way is retried inline, unless a guard keeps it ---------------------------

OTHER_KEY = AllocationKey("pod-b", 0, 0)
WIDE = Reservation(GPU, "2g.20gb", Placement(0, 2))


def error_blocker(record: OwnershipRecord) -> Blocker:
    return Blocker("ERROR", record.placement, record.gpu_instance_id, record)


def test_an_error_instance_at_exactly_the_reservation_is_retried_before_the_create() -> None:
    broken = rec(State.ERROR)
    plan = PlacementPlan(blockers=(error_blocker(broken),))
    assert decide(RES, None, broken, plan, Guards(requester=OWNER.key)) == Create(retry=(broken,))


def test_an_error_instance_overlapping_the_placement_is_retried_and_idle_ones_behind_it_reclaimed() -> None:
    broken = rec(State.ERROR)
    idle = rec(State.IDLE, Reservation(GPU, "1g.10gb", Placement(1, 1)))
    plan = PlacementPlan(blockers=(error_blocker(broken),), idle_behind=(idle,))
    assert decide(WIDE, None, None, plan) == Create(reclaim=(idle,), retry=(broken,))


def test_an_error_instance_a_live_pod_holds_stays_a_blocker() -> None:
    broken = rec(State.ERROR)
    plan = PlacementPlan(blockers=(error_blocker(broken),))
    decided = decide(WIDE, None, None, plan, Guards(referenced=frozenset({"MIG-x"})))
    assert isinstance(decided, Busy)
    assert decided.blocker.record == broken
    assert decided.blocker.metadata()["guarded_by"].startswith("a live pod holds it")


def test_one_blocker_no_retry_moves_keeps_the_whole_request_busy_and_retries_nothing() -> None:
    broken = rec(State.ERROR)
    foreign = Blocker(FOREIGN, Placement(1, 1), 3)
    decided = decide(WIDE, None, None, PlacementPlan(blockers=(error_blocker(broken), foreign)))
    assert decided == Busy((foreign, error_blocker(broken)))  # the one no retry moves is named first


def test_another_keys_pending_reservation_guards_an_error_instance_at_exactly_it() -> None:
    broken = rec(State.ERROR)
    plan = PlacementPlan(blockers=(error_blocker(broken),))
    guards = Guards(pending=frozenset({PendingReservation(OTHER_KEY, RES)}), requester=OWNER.key)
    decided = decide(WIDE, None, None, plan, guards)
    assert isinstance(decided, Busy)
    assert decided.blocker.guarded_by == f"pending reservation of {OTHER_KEY}"


def test_the_pending_keys_own_allocate_retries_the_error_instance_it_reserved() -> None:
    broken = rec(State.ERROR)
    plan = PlacementPlan(blockers=(error_blocker(broken),))
    guards = Guards(pending=frozenset({PendingReservation(OTHER_KEY, RES)}), requester=OTHER_KEY)
    assert decide(RES, None, broken, plan, guards) == Create(retry=(broken,))


def test_a_pending_reservation_guards_an_idle_instance_at_exactly_it_from_placement_pressure() -> None:
    idle = rec(State.IDLE)
    guards = Guards(pending=frozenset({PendingReservation(OTHER_KEY, RES)}), requester=OWNER.key)
    decided = decide(WIDE, None, None, PlacementPlan(reclaim=(idle,)), guards)
    assert isinstance(decided, Busy)
    assert (decided.blocker.kind, decided.blocker.record) == ("IDLE", idle)


def test_a_pending_reservation_of_another_profile_at_the_same_spot_guards_nothing() -> None:
    idle = rec(State.IDLE)
    elsewhere = Reservation(GPU, "1g.10gb+me", Placement(0, 1))
    guards = Guards(pending=frozenset({PendingReservation(OTHER_KEY, elsewhere)}))
    assert decide(WIDE, None, None, PlacementPlan(reclaim=(idle,)), guards) == Create(reclaim=(idle,))


def test_pending_reservations_are_the_entries_without_runtime_identity() -> None:
    pending = ActiveAllocation(Owner(PodRef("pod-b"), "main", 0, 0), RES)
    held = ActiveAllocation(OWNER, WIDE, Identity(1, 0, "MIG-y"))
    assert pending_of([pending, held]) == frozenset({PendingReservation(OTHER_KEY, RES)})
