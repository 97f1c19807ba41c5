"""What an Xid event names and what it leaves of a record: pure rules of ``lifecycle.faults``."""

from __future__ import annotations

import msgspec
import pytest

from sidecar.lifecycle.faults import faulted, names
from sidecar.model.domain import State
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement, XidEvent

GPU = "GPU-11111111-2222-3333-4444-555555555555"


def record(state: State, gi: int | None = 3, ci: int | None = 0, xid: int = 0) -> OwnershipRecord:
    return OwnershipRecord(
        gpu_uuid=GPU,
        profile="1g.10gb",
        gi_profile_id=19,
        ci_profile_id=0,
        placement=Placement(2, 1),
        state=state,
        gpu_instance_id=gi,
        compute_instance_id=ci,
        xid=xid,
    )


@pytest.mark.parametrize(
    ("event", "named"),
    [
        (XidEvent(GPU, 79), True),  # the whole GPU
        (XidEvent(GPU, 79, 3), True),  # its GI, every CI
        (XidEvent(GPU, 79, 3, 0), True),
        (XidEvent(GPU, 79, 3, 1), False),  # another CI of its GI
        (XidEvent(GPU, 79, 4), False),
        (XidEvent("GPU-99999999-2222-3333-4444-555555555555", 79), False),
    ],
)
def test_an_event_names_its_gpu_gi_and_ci(event: XidEvent, named: bool) -> None:
    assert names(event, record(State.ACTIVE)) is named


def test_a_record_without_a_gi_is_named_only_by_a_gpu_wide_event() -> None:
    bare = record(State.CREATING, gi=None, ci=None)
    assert names(XidEvent(GPU, 79), bare)
    assert not names(XidEvent(GPU, 79, 3), bare)


def test_active_keeps_its_state_and_gets_the_mark_idle_goes_error() -> None:
    active = faulted(record(State.ACTIVE), 79)
    assert active is not None
    assert (active.state, active.xid) == (State.ACTIVE, 79)
    idle = faulted(record(State.IDLE), 48)
    assert idle is not None
    assert (idle.state, idle.xid) == (State.ERROR, 48)
    assert "Xid 48" in idle.last_error


def test_the_first_xid_stays_and_other_states_are_left_alone() -> None:
    assert faulted(record(State.ACTIVE, xid=79), 48) is None
    idle = faulted(record(State.IDLE, xid=79), 48)
    assert idle is not None
    assert idle.xid == 79
    for state in (State.CREATING, State.DELETING, State.ERROR):
        assert faulted(record(state), 79) is None


def test_a_record_written_before_the_field_existed_reads_as_healthy() -> None:
    old = msgspec.json.encode(record(State.IDLE))
    assert b',"xid":0' in old
    without = msgspec.json.decode(old.replace(b',"xid":0', b""), type=OwnershipRecord)
    assert without.xid == 0
