"""The state machine: legal edges pass, anything else raises IllegalTransition."""

from __future__ import annotations

import pytest

from sidecar.model.domain import State
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.states import (
    RECOVERY_TRANSITIONS,
    TRANSITIONS,
    IllegalTransition,
    enter,
    is_legal,
    transition,
)
from sidecar.nvml.port import Placement

GPU = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"


def rec(state: State) -> OwnershipRecord:
    return OwnershipRecord(
        gpu_uuid=GPU,
        profile="1g.10gb",
        gi_profile_id=19,
        ci_profile_id=0,
        placement=Placement(0, 1),
        state=state,
    )


@pytest.mark.parametrize(("before", "after"), [(State.DELETING, State.IDLE), (State.ERROR, State.IDLE)])
def test_an_illegal_transition_raises_and_returns_nothing(before: State, after: State) -> None:
    with pytest.raises(IllegalTransition, match=f"{before} -> {after}"):
        transition(rec(before), after, since="now")


def test_a_recovery_edge_is_illegal_outside_recovery() -> None:
    with pytest.raises(IllegalTransition):
        transition(rec(State.DELETING), State.ACTIVE, since="now")
    assert transition(rec(State.DELETING), State.ACTIVE, since="t", recovery=True).state is State.ACTIVE


def test_only_creating_may_start_outside_recovery() -> None:
    assert enter(rec(State.CREATING)).state is State.CREATING
    for state in (State.ACTIVE, State.IDLE, State.DELETING, State.ERROR):
        with pytest.raises(IllegalTransition):
            enter(rec(state))


def test_every_state_can_fail_into_error_and_nothing_goes_back_to_creating() -> None:
    for state in State:
        assert is_legal(state, State.ERROR)
        assert not is_legal(state, State.CREATING, recovery=True)
    assert set(TRANSITIONS).isdisjoint(RECOVERY_TRANSITIONS)


def test_a_transition_stamps_since_and_applies_the_changes() -> None:
    moved = transition(rec(State.ACTIVE), State.IDLE, since="2030-01-01T00:00:00.000000Z", idled_generation=3)
    assert (moved.state, moved.since, moved.idled_generation) == (
        State.IDLE,
        "2030-01-01T00:00:00.000000Z",
        3,
    )
