"""The idle policy's decision with a fake clock: TTL, the per-GPU cap and the free reserve; and
against a scheduler that cannot see IDLE instances, what ``Choices`` learns from the Allocates and
which IDLE instances ``in_the_way`` destroys ahead of the next one."""

from __future__ import annotations

from sidecar.model.advice import GpuView, OwnedInstance
from sidecar.model.domain import ForeignInstance, Reservation, State
from sidecar.model.idle_policy import BLIND_MIN, Cause, Choices, Trim, in_the_way, node_reserve, trim
from sidecar.nvml.port import Placement

GPU = "GPU-11111111-2222-3333-4444-555555555555"
GPU2 = "GPU-22222222-2222-3333-4444-555555555555"
_SIZE_OF = {"1g.10gb": 1, "1g.20gb": 2, "2g.20gb": 2, "3g.40gb": 4}
TWO_G = (Placement(0, 2), Placement(2, 2), Placement(4, 2))


class FakeClock:
    """Seconds that only move when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def inst(
    profile: str, start: int, state: State = State.IDLE, *, used: float, busy: bool = False
) -> OwnedInstance:
    return OwnedInstance(
        profile=profile,
        placement=Placement(start, _SIZE_OF[profile]),
        state=state,
        mig_uuid=f"MIG-00000000-0000-0000-0000-{start:012d}",
        last_used=used,
        busy=busy,
    )


def chosen(trims: list[Trim]) -> list[tuple[str, str, Cause]]:
    assert all(t.instance.state is State.IDLE for t in trims), "only IDLE instances are ever trimmed"
    return [(t.gpu_uuid, str(t.instance.placement), t.cause) for t in trims]


def test_nothing_is_trimmed_with_every_policy_off() -> None:
    clock = FakeClock()
    old = inst("1g.10gb", 0, used=clock.now)
    clock.advance(10**6)
    assert trim([GpuView(GPU, 8, owned=(old,))], clock.now) == []


def test_ttl_expiry_trims_exactly_the_instance_idle_longer_than_the_ttl() -> None:
    clock = FakeClock()
    active = inst("1g.10gb", 0, State.ACTIVE, used=clock.now)  # as old as the expired one
    expired = inst("1g.10gb", 1, used=clock.now)
    clock.advance(50)
    fresh = inst("1g.10gb", 2, used=clock.now)
    views = [GpuView(GPU, 8, owned=(active, expired, fresh))]
    clock.advance(50)
    assert trim(views, clock.now, ttl_s=100) == []  # exactly the TTL is not longer than it
    clock.advance(1)
    assert chosen(trim(views, clock.now, ttl_s=100)) == [(GPU, "1:1", Cause.TTL)]
    clock.advance(50)
    assert chosen(trim(views, clock.now, ttl_s=100)) == [(GPU, "1:1", Cause.TTL), (GPU, "2:1", Cause.TTL)]


def test_cap_overflow_trims_the_least_recently_used_and_counts_untrimmable_idle_ones() -> None:
    clock = FakeClock()
    busy = inst("1g.10gb", 0, used=clock.now, busy=True)  # oldest, but a process runs on it
    lru = inst("1g.10gb", 1, used=clock.advance(10))
    mid = inst("1g.10gb", 3, used=clock.advance(10))
    recent = inst("1g.10gb", 2, used=clock.advance(10))
    active = inst("3g.40gb", 4, State.ACTIVE, used=0.0)
    views = [GpuView(GPU, 8, owned=(recent, active, busy, mid, lru))]
    assert chosen(trim(views, clock.now, max_idle_per_gpu=3)) == [(GPU, "1:1", Cause.MAX_IDLE)]
    assert chosen(trim(views, clock.now, max_idle_per_gpu=2)) == [
        (GPU, "1:1", Cause.MAX_IDLE),
        (GPU, "3:1", Cause.MAX_IDLE),
    ]
    assert trim(views, clock.now, max_idle_per_gpu=4) == []


def test_cap_is_per_gpu() -> None:
    clock = FakeClock()
    a = GpuView(GPU, 8, owned=(inst("1g.10gb", 0, used=clock.now),))
    b = GpuView(
        GPU2, 8, owned=(inst("1g.10gb", 0, used=clock.advance(1)), inst("1g.10gb", 1, used=clock.advance(1)))
    )
    assert chosen(trim([a, b], clock.now, max_idle_per_gpu=1)) == [(GPU2, "0:1", Cause.MAX_IDLE)]


def reserve_gpu(clock: FakeClock, *, busy_lru: bool = False) -> tuple[GpuView, OwnedInstance, OwnedInstance]:
    """No FREE 2g.20gb placement: 0:2 under an ACTIVE 1g, 2:2 and 4:2 each under one IDLE 1g.20gb."""
    lru = inst("1g.20gb", 4, used=clock.now, busy=busy_lru)
    newer = inst("1g.20gb", 2, used=clock.advance(30))
    owned = (
        inst("1g.10gb", 0, State.ACTIVE, used=0.0),
        newer,
        lru,
        inst("1g.20gb", 6, State.ACTIVE, used=0.0),
    )
    return GpuView(GPU, 8, owned=owned), lru, newer


def test_reserve_trims_the_least_recently_used_blocker_of_a_profile_with_no_free_placement() -> None:
    clock = FakeClock()
    view, lru, _ = reserve_gpu(clock)
    trims = trim([view], clock.now, reserve={GPU: {"2g.20gb": TWO_G}})
    assert chosen(trims) == [(GPU, "4:2", Cause.RESERVE)]
    assert trims[0].instance == lru
    assert trims[0].profile == "2g.20gb"


def test_reserve_skips_a_busy_or_reserved_blocker_and_takes_the_other() -> None:
    clock = FakeClock()
    view, _, newer = reserve_gpu(clock, busy_lru=True)
    assert chosen(trim([view], clock.now, reserve={GPU: {"2g.20gb": TWO_G}})) == [(GPU, "2:2", Cause.RESERVE)]
    view, lru, newer = reserve_gpu(FakeClock())
    pending = {Reservation(GPU, lru.profile, lru.placement)}
    trims = trim([view], clock.now, reserve={GPU: {"2g.20gb": TWO_G}}, pending=pending)
    assert [t.instance for t in trims] == [newer]


def test_reserve_does_nothing_while_a_placement_is_free_or_reusable() -> None:
    clock = FakeClock()
    free = GpuView(GPU, 8, owned=(inst("1g.20gb", 2, used=clock.now), inst("1g.20gb", 4, used=clock.now)))
    assert trim([free], clock.now, reserve={GPU: {"2g.20gb": TWO_G}}) == []  # 0:2 is FREE
    view, _, _ = reserve_gpu(clock)
    # The ACTIVE 1g at 0:1 replaced by an IDLE 2g.20gb at 0:2: a REUSE placement is ready.
    owned = tuple(o for o in view.owned if o.placement != Placement(0, 1))
    reusable = GpuView(GPU, 8, owned=(*owned, inst("2g.20gb", 0, used=clock.now)))
    assert trim([reusable], clock.now, reserve={GPU: {"2g.20gb": TWO_G}}) == []


def test_reserve_sees_the_ttl_trims_first_and_never_trims_twice() -> None:
    clock = FakeClock()
    view, _, _ = reserve_gpu(clock)
    clock.advance(1000)
    trims = trim([view], clock.now, ttl_s=500, reserve={GPU: {"2g.20gb": TWO_G}})
    assert chosen(trims) == [(GPU, "4:2", Cause.TTL), (GPU, "2:2", Cause.TTL)]


def test_never_active_error_in_flight_busy_reserved_or_foreign_even_with_everything_on() -> None:
    clock = FakeClock()
    untouchable = (
        inst("1g.10gb", 0, State.ACTIVE, used=0.0),
        inst("1g.10gb", 1, State.ERROR, used=0.0),
        inst("1g.10gb", 2, State.CREATING, used=0.0),
        inst("1g.10gb", 3, State.DELETING, used=0.0),
        inst("1g.10gb", 4, used=0.0, busy=True),
        inst("1g.10gb", 5, used=0.0),  # protected by the pending reservation below
    )
    free_idle = inst("1g.10gb", 6, used=0.0)
    view = GpuView(
        GPU,
        8,
        owned=(*untouchable, free_idle),
        foreign=(ForeignInstance(GPU, "1g.10gb", Placement(7, 1), 14),),
        pending=(Reservation(GPU, "1g.10gb", Placement(5, 1)),),
    )
    clock.advance(10**6)
    reserve = {GPU: {"1g.10gb": tuple(Placement(i, 1) for i in range(7)), "2g.20gb": TWO_G}}
    trims = trim([view], clock.now, ttl_s=0, max_idle_per_gpu=0, reserve=reserve)
    assert [t.instance for t in trims] == [free_idle]


THREE_G = (Placement(0, 4), Placement(4, 4))


class TestNodeReserve:
    def test_one_ready_placement_anywhere_on_the_node_is_enough(self) -> None:
        blocked = GpuView(
            GPU, 8, owned=(inst("1g.10gb", 0, State.ACTIVE, used=1), inst("2g.20gb", 4, used=2))
        )
        empty = GpuView(GPU2, 8)
        reserve = {GPU: {"3g.40gb": THREE_G}, GPU2: {"3g.40gb": THREE_G}}

        assert node_reserve([blocked, empty], reserve) == []

    def test_with_no_ready_placement_the_oldest_victims_on_the_node_go(self) -> None:
        newer = GpuView(GPU, 8, owned=(inst("1g.10gb", 0, State.ACTIVE, used=1), inst("2g.20gb", 4, used=50)))
        older = GpuView(GPU2, 8, owned=(inst("1g.10gb", 0, State.ACTIVE, used=1), inst("1g.10gb", 5, used=9)))
        reserve = {GPU: {"3g.40gb": THREE_G}, GPU2: {"3g.40gb": THREE_G}}

        assert chosen(node_reserve([newer, older], reserve)) == [(GPU2, "5:1", Cause.RESERVE)]

    def test_a_pending_reservation_protects_its_idle_instance(self) -> None:
        view = GpuView(GPU, 8, owned=(inst("1g.10gb", 0, State.ACTIVE, used=1), inst("2g.20gb", 4, used=2)))
        pending = [Reservation(GPU, "2g.20gb", Placement(4, 2))]

        assert node_reserve([view], {GPU: {"3g.40gb": THREE_G}}, pending=pending) == []

    def test_the_victim_whose_profile_keeps_other_idle_copies_goes_before_an_older_last_copy(self) -> None:
        """Both GPUs need one idle instance gone for a 3g.40gb. GPU's victim is the node's only idle
        2g.20gb (and the least recently used); GPU2's is one of two idle 1g.10gb: that one goes, since
        the next 1g.10gb request still reuses the other copy."""
        last_2g = GpuView(
            GPU, 8, owned=(inst("1g.10gb", 0, State.ACTIVE, used=1), inst("2g.20gb", 4, used=2))
        )
        one_of_two = GpuView(
            GPU2,
            8,
            owned=(
                inst("1g.10gb", 0, State.ACTIVE, used=1),
                inst("1g.10gb", 1, used=5),  # blocks nothing a 3g.40gb could use (0:4 is ACTIVE)
                inst("1g.10gb", 5, used=9),
            ),
        )
        reserve = {GPU: {"3g.40gb": THREE_G}, GPU2: {"3g.40gb": THREE_G}}

        assert chosen(node_reserve([last_2g, one_of_two], reserve)) == [(GPU2, "5:1", Cause.RESERVE)]

    def test_copies_under_a_pending_reservation_do_not_count(self) -> None:
        """The second idle 1g.10gb is promised to a pod: it is no copy a request could reuse, so both
        victims are last copies and the least recently used one goes."""
        last_2g = GpuView(
            GPU, 8, owned=(inst("1g.10gb", 0, State.ACTIVE, used=1), inst("2g.20gb", 4, used=2))
        )
        one_of_two = GpuView(
            GPU2,
            8,
            owned=(
                inst("1g.10gb", 0, State.ACTIVE, used=1),
                inst("1g.10gb", 1, used=5),
                inst("1g.10gb", 5, used=9),
            ),
            pending=(Reservation(GPU2, "1g.10gb", Placement(1, 1)),),
        )
        reserve = {GPU: {"3g.40gb": THREE_G}, GPU2: {"3g.40gb": THREE_G}}

        assert chosen(node_reserve([last_2g, one_of_two], reserve)) == [(GPU, "4:2", Cause.RESERVE)]


def test_per_gpu_reserve_prefers_the_victim_whose_profile_keeps_a_copy() -> None:
    """2g.20gb fits at 0:2, 2:2, 4:2. 0:2 is ACTIVE; 2:2 holds the GPU's only idle 1g.20gb (least
    recently used), 4:2 one of two idle 1g.10gb: the 1g.10gb at 4 goes."""
    view = GpuView(
        GPU,
        8,
        owned=(
            inst("2g.20gb", 0, State.ACTIVE, used=1),
            inst("1g.20gb", 2, used=2),
            inst("1g.10gb", 4, used=8),
            inst("1g.10gb", 6, used=9),
        ),
    )
    assert chosen(trim([view], 10.0, reserve={GPU: {"2g.20gb": TWO_G}})) == [(GPU, "4:1", Cause.RESERVE)]


# -- a scheduler blind to IDLE instances ----------------------------------------------------------

GPU_A = "GPU-aaaaaaaa-2222-3333-4444-555555555555"
GPU_B = "GPU-bbbbbbbb-2222-3333-4444-555555555555"
ONE_G = tuple(Placement(s, 1) for s in range(7))
PLACEMENTS = {"1g.10gb": ONE_G, "2g.20gb": TWO_G}
RESERVE = {GPU_A: PLACEMENTS, GPU_B: PLACEMENTS}


def view(gpu: str, *owned: OwnedInstance, pending: tuple[Reservation, ...] = ()) -> GpuView:
    return GpuView(gpu, 8, owned=owned, pending=pending)


def teach(
    choices: Choices, views: list[GpuView], gpu: str, profile: str, start: int, *, times: int = 1
) -> None:
    placements = {v.gpu_uuid: PLACEMENTS[profile] for v in views}
    for _ in range(times):
        choices.observe(profile, gpu, Placement(start, _SIZE_OF[profile]), views, placements)


def blind_first_fit() -> Choices:
    """A scheduler that places 1g at slice 0 and 2g at slices 0-1 of the least held GPU, landing on the
    IDLE 1g instance at 0 of that GPU when it asks for 2g."""
    choices = Choices()
    idle_at_0 = [
        view(GPU_A, inst("1g.10gb", 0, used=0.0)),
        view(GPU_B, inst("1g.10gb", 4, State.ACTIVE, used=0.0)),
    ]
    teach(choices, idle_at_0, GPU_A, "2g.20gb", 0, times=BLIND_MIN)
    teach(choices, idle_at_0, GPU_A, "1g.10gb", 0, times=BLIND_MIN)
    return choices


def in_the_way_of(
    choices: Choices, views: list[GpuView], **kw: object
) -> list[tuple[str, Placement, Cause, str]]:
    out = in_the_way(views, choices, RESERVE, **kw)  # type: ignore[arg-type]
    assert all(t.instance.state is State.IDLE for t in out), "only IDLE instances are ever trimmed"
    return [(t.gpu_uuid, t.instance.placement, t.cause, t.profile) for t in out]


def test_a_scheduler_that_takes_the_idle_copies_is_not_blind_and_nothing_is_destroyed() -> None:
    choices = Choices()
    views = [view(GPU_A, inst("1g.10gb", 0, used=0.0), inst("2g.20gb", 4, used=0.0)), view(GPU_B)]
    teach(choices, views, GPU_A, "1g.10gb", 0, times=BLIND_MIN)
    teach(choices, views, GPU_A, "2g.20gb", 4, times=BLIND_MIN)
    teach(choices, views, GPU_A, "2g.20gb", 2, times=BLIND_MIN)  # free, beside the IDLE instances
    assert not choices.blind
    assert in_the_way_of(choices, views) == []


def test_a_blind_scheduler_finds_its_next_placement_empty_on_the_gpu_it_would_choose() -> None:
    choices = blind_first_fit()
    assert choices.blind
    idle_1g, idle_2g = inst("1g.10gb", 1, used=0.0), inst("2g.20gb", 4, used=0.0)
    views = [
        view(GPU_A, idle_1g, idle_2g),
        view(GPU_B, inst("1g.10gb", 5, State.ACTIVE, used=0.0), inst("1g.10gb", 0, used=0.0)),
    ]
    # GPU_A holds nothing for pods: the least held, where 1g (slice 0) and 2g (slices 0-1) go next.
    # The IDLE 1g at slice 1 is in 2g's way; the one at GPU_B's slice 0 is not, as GPU_B is not chosen.
    assert in_the_way_of(choices, views) == [(GPU_A, Placement(1, 1), Cause.IN_THE_WAY, "2g.20gb")]


def test_an_idle_copy_at_the_expected_placement_is_kept_for_its_profile() -> None:
    choices = Choices()
    views = [
        view(GPU_A, inst("1g.10gb", 3, used=0.0)),
        view(GPU_B, inst("1g.10gb", 0, State.ACTIVE, used=0.0)),
    ]
    teach(choices, views, GPU_A, "1g.10gb", 2, times=BLIND_MIN)  # lands beside it: no verdict from this
    landing = [
        view(GPU_A, inst("1g.10gb", 2, used=0.0)),
        view(GPU_B, inst("1g.10gb", 0, State.ACTIVE, used=0.0)),
    ]
    teach(choices, landing, GPU_A, "2g.20gb", 2, times=BLIND_MIN)
    assert choices.blind
    exact = [
        view(GPU_A, inst("1g.10gb", 2, used=0.0)),
        view(GPU_B, inst("1g.10gb", 0, State.ACTIVE, used=0.0)),
    ]
    # 1g goes to slice 2 and finds its copy there; only 2g at slices 2-3 needs it gone, and does.
    assert in_the_way_of(choices, exact) == [(GPU_A, Placement(2, 1), Cause.IN_THE_WAY, "2g.20gb")]
    only_1g = {GPU_A: {"1g.10gb": ONE_G}, GPU_B: {"1g.10gb": ONE_G}}
    assert in_the_way(exact, choices, only_1g) == []


def test_the_gpu_follows_the_policy_the_scheduler_showed() -> None:
    least_first, most_first = Choices(), Choices()
    views = [view(GPU_A, inst("1g.10gb", 0, State.ACTIVE, used=0.0)), view(GPU_B)]
    teach(least_first, views, GPU_B, "1g.10gb", 0, times=3)
    teach(most_first, views, GPU_A, "1g.10gb", 1, times=3)
    assert [v.gpu_uuid for v in least_first.targets(views, dict.fromkeys(RESERVE, ONE_G))] == [GPU_B]
    assert [v.gpu_uuid for v in most_first.targets(views, dict.fromkeys(RESERVE, ONE_G))] == [GPU_A]
    assert len(Choices().targets(views, dict.fromkeys(RESERVE, ONE_G))) == 2  # nothing learned: any


def test_the_placement_learned_is_the_one_that_beat_the_others_left_open() -> None:
    choices = Choices()
    empty = [view(GPU_A)]
    teach(choices, empty, GPU_A, "2g.20gb", 4, times=2)
    teach(choices, [view(GPU_A, inst("2g.20gb", 4, State.ACTIVE, used=0.0))], GPU_A, "2g.20gb", 0)
    assert choices.expected("2g.20gb", TWO_G) == Placement(4, 2)
    assert choices.expected("2g.20gb", TWO_G[:2]) == Placement(0, 2)
    assert choices.expected("1g.10gb", ONE_G) is None  # never asked for: no guess, nothing destroyed
    assert choices.expected("1g.10gb", ONE_G[:1]) == Placement(0, 1)  # the only one left


def test_landing_where_an_instance_was_cleared_keeps_the_verdict() -> None:
    cleared, not_cleared = blind_first_fit(), blind_first_fit()
    for _ in range(4 * BLIND_MIN):
        cleared.cleared(GPU_A, Placement(0, 1))
        for choices in (cleared, not_cleared):
            teach(choices, [view(GPU_A, inst("1g.10gb", 5, used=0.0)), view(GPU_B)], GPU_A, "2g.20gb", 0)
    assert cleared.blind
    assert not not_cleared.blind  # a window of Allocates that all found their placement empty


def test_a_busy_or_reserved_idle_instance_is_never_destroyed() -> None:
    choices = blind_first_fit()
    busy = [
        view(GPU_A, inst("1g.10gb", 1, used=0.0, busy=True)),
        view(GPU_B, inst("1g.10gb", 0, State.ACTIVE, used=0.0)),
    ]
    assert in_the_way_of(choices, busy) == []
    kept = inst("1g.10gb", 1, used=0.0)
    held = Reservation(GPU_A, "1g.10gb", Placement(1, 1))
    reserved = [view(GPU_A, kept, pending=(held,)), view(GPU_B, inst("1g.10gb", 0, State.ACTIVE, used=0.0))]
    assert in_the_way_of(choices, reserved) == []
    assert in_the_way_of(choices, reserved[:1] + reserved[1:], pending=[held]) == []
