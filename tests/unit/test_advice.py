"""Placement advice (RankPlacements) decided from plain values: classes, blockers, tie-breaks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.model.advice import (
    FOREIGN,
    IN_USE,
    RESERVED,
    Cost,
    GpuView,
    Hold,
    OwnedInstance,
    rank_placements,
)
from sidecar.model.domain import ForeignInstance, Reservation, State
from sidecar.nvml.port import Placement

GPU = "GPU-11111111-2222-3333-4444-555555555555"
OTHER_GPU = "GPU-aaaaaaaa-2222-3333-4444-555555555555"

# The H100-80GB profile table's legal placements (memory slices; the GPU has 8).
H100 = {
    "1g.10gb": tuple(Placement(i, 1) for i in range(7)),
    "1g.20gb": tuple(Placement(i, 2) for i in (0, 2, 4, 6)),
    "2g.20gb": tuple(Placement(i, 2) for i in (0, 2, 4)),
    "3g.40gb": (Placement(0, 4), Placement(4, 4)),
    "4g.40gb": (Placement(0, 4),),
    "7g.80gb": (Placement(0, 8),),
}
_SIZE_OF = {"1g.10gb": 1, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 4, "4g.40gb": 4, "7g.80gb": 8}


def inst(profile: str, start: int, state: State = State.IDLE, *, busy: bool = False) -> OwnedInstance:
    return OwnedInstance(
        profile=profile,
        placement=Placement(start, _SIZE_OF[profile]),
        state=state,
        mig_uuid=f"MIG-00000000-0000-0000-0000-{start:06d}{_SIZE_OF[profile]:06d}",
        busy=busy,
    )


def view(*owned: OwnedInstance, **kw: object) -> GpuView:
    return GpuView(GPU, 8, owned=owned, **kw)  # type: ignore[arg-type]


def rank(profile: str, v: GpuView) -> list[tuple[str, Cost]]:
    return [(str(r.placement), r.cost) for r in rank_placements(profile, H100[profile], v)]


def test_empty_gpu_every_placement_is_free_and_best_fit_keeps_the_longest_free_run() -> None:
    # At k a 1g leaves runs of k and 7-k slices: the edges first, the middle last.
    assert rank("1g.10gb", view()) == [(f"{k}:1", Cost.FREE) for k in (0, 1, 6, 2, 5, 3, 4)]
    # 2:2 and 4:2 both leave a run of 4: the lower start wins.
    assert rank("2g.20gb", view()) == [("0:2", Cost.FREE), ("2:2", Cost.FREE), ("4:2", Cost.FREE)]


def test_free_placement_next_to_an_active_one_packs_against_it() -> None:
    ranked = rank_placements("1g.10gb", H100["1g.10gb"], view(inst("3g.40gb", 0, State.ACTIVE)))
    free = [r for r in ranked if r.cost is Cost.FREE]
    assert [str(r.placement) for r in free] == ["4:1", "5:1", "6:1"]  # runs of 3, 2, 2 left
    assert (free[0].free_run_after, free[0].strict_free_after) == (3, 3)
    assert all(r.cost is Cost.BLOCKED and r.blocker == "ACTIVE" for r in ranked[3:])


def test_idle_instance_of_exactly_the_profile_is_reused_first() -> None:
    idle = inst("1g.10gb", 3)
    ranked = rank_placements("1g.10gb", H100["1g.10gb"], view(idle))
    assert (ranked[0].placement, ranked[0].cost, ranked[0].idle_mig_uuid) == (
        Placement(3, 1),
        Cost.REUSE,
        idle.mig_uuid,
    )
    assert [r.cost for r in ranked[1:]] == [Cost.FREE] * 6


def test_idle_instance_of_another_profile_at_the_same_placement_is_reclaimed_not_reused() -> None:
    other = inst("1g.20gb", 0)
    ranked = {str(r.placement): r for r in rank_placements("2g.20gb", H100["2g.20gb"], view(other))}
    assert ranked["0:2"].cost is Cost.RECLAIM
    assert ranked["0:2"].reclaim == (other,)


def test_reclaim_lists_every_idle_instance_and_ranks_after_free() -> None:
    big = inst("3g.40gb", 0)
    assert rank("1g.10gb", view(big)) == [
        ("4:1", Cost.FREE),
        ("5:1", Cost.FREE),
        ("6:1", Cost.FREE),
        ("0:1", Cost.RECLAIM),  # the reclaimed 3g's slices are free after: a run of 7 is left
        ("1:1", Cost.RECLAIM),
        ("2:1", Cost.RECLAIM),
        ("3:1", Cost.RECLAIM),
    ]
    ranked = rank_placements("1g.10gb", H100["1g.10gb"], view(big))
    assert all(r.reclaim == (big,) for r in ranked if r.cost is Cost.RECLAIM)


def test_reclaim_that_destroys_fewer_instances_ranks_first_whatever_the_free_region() -> None:
    owned = (
        inst("3g.40gb", 4, State.ACTIVE),
        inst("1g.10gb", 0),
        inst("1g.10gb", 1),
        inst("1g.20gb", 2),
    )
    ranked = rank_placements("2g.20gb", H100["2g.20gb"], view(*owned))
    assert [(str(r.placement), r.cost, len(r.reclaim)) for r in ranked] == [
        ("2:2", Cost.RECLAIM, 1),
        ("0:2", Cost.RECLAIM, 2),
        ("4:2", Cost.BLOCKED, 0),
    ]


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        ({"owned": (inst("1g.10gb", 0, State.ACTIVE),)}, "ACTIVE"),
        ({"owned": (inst("1g.10gb", 0, State.ERROR),)}, "ERROR"),
        ({"owned": (inst("1g.10gb", 0, State.CREATING),)}, "CREATING"),
        ({"owned": (inst("1g.10gb", 0, State.DELETING),)}, "DELETING"),
        ({"owned": (inst("1g.10gb", 0, busy=True),)}, IN_USE),
        ({"foreign": (ForeignInstance(GPU, "1g.10gb", Placement(0, 1), 9),)}, FOREIGN),
        ({"holds": (Hold(Placement(0, 1), "corrupt_record", "state/x.json is corrupt"),)}, "corrupt_record"),
        ({"holds": (Hold(Placement(0, 1), "in_flight"),)}, "in_flight"),
        ({"pending": (Reservation(GPU, "1g.10gb", Placement(0, 1)),)}, RESERVED),
    ],
)
def test_anything_but_a_free_idle_instance_blocks_and_is_named(extra: dict[str, object], kind: str) -> None:
    v = GpuView(GPU, 8, **extra)  # type: ignore[arg-type]
    ranked = {str(r.placement): r for r in rank_placements("1g.10gb", H100["1g.10gb"], v)}
    assert ranked["0:1"].cost is Cost.BLOCKED
    assert ranked["0:1"].blocker == kind
    assert len(ranked["0:1"].blockers) == 1
    assert all(r.cost is Cost.FREE for p, r in ranked.items() if p != "0:1")


def test_blocked_beside_idle_stays_blocked_and_names_the_first_blocker_in_slice_order() -> None:
    v = view(inst("1g.10gb", 0), inst("1g.10gb", 1, State.ACTIVE), inst("1g.10gb", 2, State.ERROR))
    ranked = {str(r.placement): r for r in rank_placements("3g.40gb", H100["3g.40gb"], v)}
    assert ranked["0:4"].cost is Cost.BLOCKED
    assert ranked["0:4"].blocker == "ACTIVE"
    assert len(ranked["0:4"].blockers) == 2
    assert ranked["0:4"].reclaim == ()


def test_pending_reservation_protects_the_idle_instance_it_names_and_only_on_its_gpu() -> None:
    idle = inst("1g.10gb", 0)
    mine = GpuView(GPU, 8, owned=(idle,), pending=(Reservation(GPU, "1g.10gb", Placement(0, 1)),))
    first = rank_placements("1g.10gb", H100["1g.10gb"], mine)
    assert all(r.cost is not Cost.REUSE for r in first)
    assert {str(r.placement): r.cost for r in first}["0:1"] is Cost.BLOCKED
    elsewhere = GpuView(GPU, 8, owned=(idle,), pending=(Reservation(OTHER_GPU, "1g.10gb", Placement(0, 1)),))
    assert rank_placements("1g.10gb", H100["1g.10gb"], elsewhere)[0].cost is Cost.REUSE


def test_free_slices_after_counts_idle_slices_as_free_as_the_contract_says() -> None:
    v = view(inst("3g.40gb", 4), inst("1g.10gb", 0, State.ACTIVE))
    ranked = {str(r.placement): r for r in rank_placements("1g.10gb", H100["1g.10gb"], v)}
    assert ranked["1:1"].free_slices_after == 6  # 8 - the ACTIVE one - this one
    assert ranked["1:1"].strict_free_after == 2  # 2:1 and 3:1; the idle 3g stays occupied
    assert ranked["1:1"].free_run_after == 2


def test_duplicate_placements_collapse() -> None:
    assert len(rank_placements("1g.10gb", (Placement(0, 1), Placement(0, 1)), view())) == 1


# -- property: the classes agree with the overlaps ----------------------------------------------------

_STATES = [State.IDLE, State.IDLE, State.IDLE, State.ACTIVE, State.ERROR, State.CREATING, State.DELETING]


@st.composite
def layouts(draw: st.DrawFn) -> GpuView:
    """A GPU whose owned and foreign instances never overlap (as on hardware), with random states."""
    owned: list[OwnedInstance] = []
    foreign: list[ForeignInstance] = []
    taken: list[Placement] = []
    for _ in range(draw(st.integers(0, 6))):
        profile = draw(st.sampled_from(sorted(H100)))
        where = draw(st.sampled_from(H100[profile]))
        if any(where.overlaps(t) for t in taken):
            continue
        taken.append(where)
        if draw(st.integers(0, 9)) == 0:
            foreign.append(ForeignInstance(GPU, profile, where, len(foreign) + 1))
            continue
        state = draw(st.sampled_from(_STATES))
        owned.append(inst(profile, where.start, state, busy=draw(st.integers(0, 9)) == 0))
    pending = tuple(
        Reservation(GPU, o.profile, o.placement)
        for o in owned
        if o.state is State.IDLE and draw(st.booleans())
    )
    return GpuView(GPU, 8, owned=tuple(owned), foreign=tuple(foreign), pending=pending)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(layouts(), st.sampled_from(sorted(H100)))
def test_classes_are_consistent_with_the_overlaps(v: GpuView, profile: str) -> None:
    ranked = rank_placements(profile, H100[profile], v)
    assert sorted(r.placement.start for r in ranked) == sorted(p.start for p in H100[profile])
    assert [r.cost for r in ranked] == sorted(r.cost for r in ranked)
    reserved = {(r.profile, r.placement) for r in v.pending}

    def usable(o: OwnedInstance) -> bool:
        return o.state is State.IDLE and not o.busy and (o.profile, o.placement) not in reserved

    for r in ranked:
        owned_hit = [o for o in v.owned if o.placement.overlaps(r.placement)]
        foreign_hit = [f for f in v.foreign if f.placement.overlaps(r.placement)]
        clear = not foreign_hit and all(usable(o) for o in owned_hit)
        if r.cost is Cost.FREE:
            assert not owned_hit
            assert not foreign_hit
        elif r.cost is Cost.REUSE:
            assert not foreign_hit
            assert len(owned_hit) == 1
            assert usable(owned_hit[0])
            assert (owned_hit[0].profile, owned_hit[0].placement) == (profile, r.placement)
            assert r.idle_mig_uuid == owned_hit[0].mig_uuid
        elif r.cost is Cost.RECLAIM:
            assert clear
            assert owned_hit
            assert set(r.reclaim) == set(owned_hit)
        else:
            assert not clear
            assert r.blocker
            assert r.reclaim == ()
