"""The idle policy in the reconciler, on a fake clock: each cause destroys exactly the instance it
should, through the recorded teardown (hardware, record and CDI spec all gone), and never an ACTIVE,
ERROR, busy or foreign one."""

from __future__ import annotations

import sys
import time

import pytest
from lifecycle_world import Dev, World, gis

from sidecar.edge.metrics import Metrics
from sidecar.lifecycle.gpu_views import last_used
from sidecar.lifecycle.idle_trim import IdleTrimmer
from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.advice import Cost
from sidecar.model.domain import Identity, Reservation, State
from sidecar.model.idle_policy import BLIND_MIN, IdleSettings
from sidecar.nvml.port import Placement

TTL = 600.0
FAR_FUTURE = 1e12
NVML_ERROR_UNKNOWN = 999


def idle_instance(world: World, pod: str, device: Dev) -> Identity:
    identity = world.allocate(pod, device).devices[0].identity
    world.lifecycle.release(pod)
    return identity


def went_idle_at(world: World, identity: Identity) -> float:
    [record] = [r for r in world.lifecycle.instances() if r.mig_uuid == identity.mig_uuid]
    return last_used(record)


def reconcile(world: World, settings: IdleSettings, now: float, metrics: Metrics | None = None) -> list[str]:
    """One reconciler round with the idle policy at clock ``now``; the MIG UUIDs it trimmed."""
    on_trim = (lambda cause: metrics.idle_trims.labels(cause).inc()) if metrics else (lambda cause: None)
    trimmer = IdleTrimmer(world.ctx, settings, clock=lambda: now, on_trim=on_trim)
    report = Reconciler(world.lifecycle, idle=trimmer).run_once()
    return [r.identity.mig_uuid for r in report.trimmed if r.identity is not None]


def gone(world: World, identity: Identity) -> bool:
    """No GI/CI with its MIG UUID, no record naming it, no CDI spec for it."""
    return (
        identity.mig_uuid not in world.live_mig_uuids()
        and all(r.mig_uuid != identity.mig_uuid for r in world.record_files().values())
        and not any(identity.mig_uuid in name for name in world.cdi_files())
    )


def states(world: World) -> dict[str, State]:
    return {r.mig_uuid or r.name: r.state for r in world.record_files().values()}


class TestTtl:
    def test_only_the_instance_idle_longer_than_the_ttl_is_destroyed(self, world: World) -> None:
        active = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0].identity
        older = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        newer = idle_instance(world, "pod-c", (0, "1g.10gb", 2, 1))
        between = (went_idle_at(world, older) + went_idle_at(world, newer)) / 2

        trimmed = reconcile(world, IdleSettings(ttl_s=TTL), between + TTL)

        assert trimmed == [older.mig_uuid]
        assert gone(world, older)
        assert states(world) == {active.mig_uuid: State.ACTIVE, newer.mig_uuid: State.IDLE}
        assert newer.mig_uuid in world.live_mig_uuids()
        world.assert_consistent()

    def test_the_reconciler_sleeps_only_until_the_next_ttl_ends(self, world: World) -> None:
        identity = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        went_idle = went_idle_at(world, identity)
        now = went_idle + 1.0
        trimmer = IdleTrimmer(world.ctx, IdleSettings(ttl_s=TTL), clock=lambda: now)
        reconciler = Reconciler(world.lifecycle, interval_s=3600.0, idle=trimmer)
        assert trimmer.seconds_until_due() == pytest.approx(went_idle + TTL - now)
        assert reconciler._sleep_s() == pytest.approx(went_idle + TTL - now, abs=0.01)

    def test_an_instance_whose_ttl_ended_after_the_last_round_began_gets_a_round_at_once(
        self, world: World
    ) -> None:
        identity = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        went_idle = went_idle_at(world, identity)
        now = went_idle + TTL - 0.0005  # the round comes just inside the TTL: nothing to trim yet
        trimmer = IdleTrimmer(world.ctx, IdleSettings(ttl_s=TTL), clock=lambda: now)
        assert trimmer.run_once() == []
        now = went_idle + TTL + 0.0005  # the TTL ended while that round ran: the next one is due now
        assert trimmer.seconds_until_due() == 0.0
        assert [t.ref.identity for t in trimmer.run_once()] == [identity]
        assert gone(world, identity)

    def test_an_instance_a_round_saw_past_its_ttl_and_spared_waits_for_the_interval(
        self, world: World
    ) -> None:
        busy = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        world.hw.set_busy(busy.mig_uuid)
        now = went_idle_at(world, busy) + TTL + 1.0
        trimmer = IdleTrimmer(world.ctx, IdleSettings(ttl_s=TTL), clock=lambda: now)
        assert trimmer.run_once() == []  # a process runs on it
        assert trimmer.seconds_until_due() is None
        assert Reconciler(world.lifecycle, interval_s=3600.0, idle=trimmer)._sleep_s() == 3600.0

    def test_an_hour_long_interval_still_trims_when_the_ttl_ends(self, world: World) -> None:
        identity = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        trimmer = IdleTrimmer(world.ctx, IdleSettings(ttl_s=0.05))
        reconciler = Reconciler(world.lifecycle, interval_s=3600.0, idle=trimmer)
        reconciler.start()
        try:
            deadline = time.monotonic() + 30.0
            while not gone(world, identity) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            reconciler.stop()
        assert gone(world, identity)

    def test_without_a_ttl_the_interval_stands(self, world: World) -> None:
        idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        trimmer = IdleTrimmer(world.ctx, IdleSettings(max_idle_per_gpu=4))
        assert trimmer.seconds_until_due() is None
        assert Reconciler(world.lifecycle, interval_s=7.0, idle=trimmer)._sleep_s() == 7.0

    def test_far_past_any_ttl_active_error_busy_and_foreign_instances_all_stay(self, world: World) -> None:
        active = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0].identity
        busy = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        world.hw.set_busy(busy.mig_uuid)
        doomed = idle_instance(world, "pod-c", (0, "1g.10gb", 2, 1))
        world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN, times=1000)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-d", (0, "2g.20gb", 2, 2))  # its reclaim fails: ERROR
        world.hw.clear_faults()
        world.hw.create_instance(1, "3g.40gb", 0, 4)  # foreign, on the other H100
        layout_before = world.layout()
        # The trimmer alone: the reconciler's own ERROR retry would destroy the ERROR instance.
        trimmer = IdleTrimmer(world.ctx, IdleSettings(ttl_s=TTL), clock=lambda: FAR_FUTURE)

        assert trimmer.run_once() == []
        assert states(world) == {
            active.mig_uuid: State.ACTIVE,
            busy.mig_uuid: State.IDLE,
            doomed.mig_uuid: State.ERROR,
        }
        assert world.layout() == layout_before

    def test_with_no_policy_nothing_is_ever_trimmed(self, world: World) -> None:
        idle = idle_instance(world, "pod-a", (0, "1g.10gb", 0, 1))

        assert reconcile(world, IdleSettings(), FAR_FUTURE) == []
        assert idle.mig_uuid in world.live_mig_uuids()


class TestMaxIdlePerGpu:
    def test_the_least_recently_used_beyond_the_cap_is_destroyed(self, world: World) -> None:
        first = idle_instance(world, "pod-a", (0, "1g.10gb", 0, 1))
        second = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        active = world.allocate("pod-c", (0, "1g.10gb", 2, 1)).devices[0].identity
        elsewhere = idle_instance(world, "pod-d", (1, "1g.10gb", 0, 1))  # alone on its GPU: within the cap

        trimmed = reconcile(world, IdleSettings(max_idle_per_gpu=1), went_idle_at(world, elsewhere))

        assert trimmed == [first.mig_uuid]
        assert gone(world, first)
        assert states(world) == {
            second.mig_uuid: State.IDLE,
            active.mig_uuid: State.ACTIVE,
            elsewhere.mig_uuid: State.IDLE,
        }
        world.assert_consistent()


class TestFreeReserve:
    def test_the_idle_instance_blocking_the_last_placement_of_a_reserved_profile_is_destroyed(
        self, world: World
    ) -> None:
        """H100: 3g.40gb fits at 0:4 or 4:4. An ACTIVE 1g holds 0:4, an IDLE 2g blocks 4:4: the 2g
        goes so a 3g request finds 4:4 free; the IDLE 1g at 1 blocks nothing that could be freed."""
        active = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0].identity
        aside = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        blocker = idle_instance(world, "pod-c", (0, "2g.20gb", 4, 2))

        per_gpu = IdleSettings(reserve=("3g.40gb",), reserve_per_gpu=True)

        trimmed = reconcile(world, per_gpu, went_idle_at(world, blocker))

        assert trimmed == [blocker.mig_uuid]
        assert gone(world, blocker)
        assert states(world) == {active.mig_uuid: State.ACTIVE, aside.mig_uuid: State.IDLE}
        world.assert_consistent()
        assert reconcile(world, per_gpu, FAR_FUTURE) == []  # the reserve holds

    def test_on_the_node_one_ready_placement_is_enough_and_the_last_one_is_restored(
        self, world: World
    ) -> None:
        """The same GPU 0; the other H100 has 3g.40gb free at first (the A100 has no such profile)."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        blocker = idle_instance(world, "pod-c", (0, "2g.20gb", 4, 2))
        node = IdleSettings(reserve=("3g.40gb",))
        assert reconcile(world, node, FAR_FUTURE) == []
        world.allocate("pod-d", (1, "1g.10gb", 0, 1))
        world.allocate("pod-e", (1, "1g.10gb", 4, 1))  # no 3g.40gb fits on GPU 1 any more

        assert reconcile(world, node, FAR_FUTURE) == [blocker.mig_uuid]
        assert gone(world, blocker)
        world.assert_consistent()

    def test_rounds_between_relistings_make_no_nvml_call_and_the_next_listing_sees_a_foreign_gi(
        self, world: World
    ) -> None:
        """The reconciler runs after every Allocate and Release: a round that trims nothing reuses the
        last GPU listing for ``relist_s`` seconds. GPU 1 fills with foreign GIs meanwhile; the next
        listing finds no 3g.40gb ready on the node and the idle 2g.20gb on GPU 0 goes."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        blocker = idle_instance(world, "pod-c", (0, "2g.20gb", 4, 2))
        clock = [1000.0]
        trimmer = IdleTrimmer(
            world.ctx, IdleSettings(reserve=("3g.40gb",)), clock=lambda: clock[0], relist_s=10
        )
        assert trimmer.run_once() == []  # GPU 1 has 3g.40gb free
        world.hw.create_instance(1, "3g.40gb", 0, 4)
        world.hw.create_instance(1, "3g.40gb", 4, 4)
        world.hw.reset_call_counts()
        clock[0] += 9

        assert trimmer.run_once() == []
        assert world.hw.call_counts() == {}
        clock[0] += 1

        assert [t.ref.identity.mig_uuid for t in trimmer.run_once() if t.ref.identity] == [blocker.mig_uuid]
        assert gone(world, blocker)
        assert {p for p, _ in gis(world, 1)} == {"0:4", "4:4"}  # the foreign GIs stay

    def test_the_reserve_of_asked_profiles_follows_what_allocates_asked_for(self, world: World) -> None:
        """``--idle-reserve auto``: no 3g.40gb is ready on the node (GPU 1 full of 1g, 0:4 on GPU 0
        held), and an IDLE 2g.20gb blocks 4:4 on GPU 0. Nothing is trimmed until an Allocate asks for
        a 3g.40gb (refused here: 0:4 is held), then the 2g goes; an hour later the ask has lapsed."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-d", (1, "1g.10gb", 0, 1))
        world.allocate("pod-e", (1, "1g.10gb", 4, 1))
        blocker = idle_instance(world, "pod-c", (0, "2g.20gb", 4, 2))
        auto = IdleSettings(reserve_asked_within_s=3600.0)
        assert reconcile(world, auto, went_idle_at(world, blocker)) == []
        assert blocker.mig_uuid in world.live_mig_uuids()

        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-f", (0, "3g.40gb", 0, 4))
        asked = world.ctx.last_asked["3g.40gb"]
        assert reconcile(world, auto, asked + 3601.0) == []  # lapsed: as if never asked
        assert reconcile(world, auto, asked + 3600.0) == [blocker.mig_uuid]
        assert gone(world, blocker)
        world.assert_consistent()

    def test_a_reserve_that_only_an_active_instance_blocks_destroys_nothing(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (0, "1g.10gb", 4, 1))
        idle = idle_instance(world, "pod-c", (0, "1g.10gb", 5, 1))

        assert reconcile(world, IdleSettings(reserve=("3g.40gb",), reserve_per_gpu=True), FAR_FUTURE) == []
        assert idle.mig_uuid in world.live_mig_uuids()


class TestInTheWay:
    """``--idle-reserve auto`` against a scheduler that cannot see IDLE instances: the Allocates teach
    the sidecar where it lands, and the reconciler empties that placement before the next one."""

    AUTO = IdleSettings(reserve_asked_within_s=3600.0)

    def test_a_scheduler_that_lands_on_idle_instances_finds_its_next_placement_emptied(
        self, world: World
    ) -> None:
        for n in range(BLIND_MIN):  # 1g at 0:1 and 2g at 0:2 by turns, each over the other's IDLE copy
            for profile, size in (("1g.10gb", 1), ("2g.20gb", 2)):
                landed = world.allocate(f"pod-{profile}-{n}", (0, profile, 0, size))
                assert n + size == 1 or len(landed.reclaimed) == 1  # destroyed inside the Allocate
                world.lifecycle.release(f"pod-{profile}-{n}")
        idle_1g = idle_instance(world, "pod-last", (0, "1g.10gb", 0, 1))

        assert reconcile(world, self.AUTO, went_idle_at(world, idle_1g)) == [idle_1g.mig_uuid]
        assert gone(world, idle_1g)
        world.assert_consistent()
        assert world.allocate("pod-next", (0, "2g.20gb", 0, 2)).reclaimed == ()  # only a create now

    def test_a_scheduler_that_takes_the_idle_copies_keeps_them(self, world: World) -> None:
        for n in range(2 * BLIND_MIN):  # 1g reuses its copy at 0:1, 2g goes beside it
            for profile, where in (("1g.10gb", (0, 1)), ("2g.20gb", (2, 2))):
                world.allocate(f"pod-{profile}-{n}", (0, profile, *where))
                world.lifecycle.release(f"pod-{profile}-{n}")
        idle = {r.mig_uuid for r in world.lifecycle.instances() if r.state is State.IDLE}

        assert reconcile(world, self.AUTO, FAR_FUTURE / 2) == []
        assert {r.mig_uuid for r in world.lifecycle.instances() if r.state is State.IDLE} == idle
        assert len(idle) == 2


class TestMetrics:
    def test_idle_count_and_age_per_gpu_and_trims_by_cause(self, world: World) -> None:
        first = idle_instance(world, "pod-a", (0, "1g.10gb", 0, 1))
        idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        metrics = Metrics()
        now = went_idle_at(world, first) + 100
        metrics.watch(world.lifecycle.instances, world.cdi.pending_removals, clock=lambda: now)
        gpu = {"gpu": world.uuid(0)}

        assert metrics.registry.get_sample_value("hami_mig_sidecar_idle_instances", gpu) == 2
        assert metrics.registry.get_sample_value("hami_mig_sidecar_idle_oldest_age_seconds", gpu) == 100

        reconcile(world, IdleSettings(max_idle_per_gpu=1), now, metrics)

        assert metrics.registry.get_sample_value("hami_mig_sidecar_idle_instances", gpu) == 1
        trims = metrics.registry.get_sample_value("hami_mig_sidecar_idle_trims_total", {"cause": "max_idle"})
        assert trims == 1


class TestLockOrder:
    def test_a_view_forgotten_between_the_decision_and_the_lock_is_not_listed_under_that_lock(
        self, world: World
    ) -> None:
        """A Recover forgets every GPU's layout view. When it does so after the round decided and
        before the trim takes the victim's lock, the decision taken again under that lock must not
        list the other GPUs: one whose lock sorts first would be taken out of order (a deadlock
        against a multi-GPU Allocate or a Recover, refused by ``locks`` as LockOrderError). It is
        decided again outside the lock instead, and the trim still happens in the same round."""
        h100s = sorted((world.uuid(i), i) for i in (0, 1))
        (first_uuid, first), (_, last) = h100s
        world.allocate("pod-a", (first, "1g.10gb", 0, 1))
        world.allocate("pod-b", (first, "3g.40gb", 4, 4))  # no 3g.40gb fits on the first H100
        world.allocate("pod-d", (last, "1g.10gb", 0, 1))
        blocker = idle_instance(world, "pod-c", (last, "2g.20gb", 4, 2))
        forgot: list[bool] = []

        def clock() -> float:
            # Read by each decision after it has gathered its views: the first time outside any
            # GPU lock, a Recover lands there.
            caller = sys._getframe(1).f_code.co_name
            if caller == "_decide" and not world.ctx.locks.held() and not forgot:
                world.ctx.inventory.forget_foreign()
                forgot.append(True)
            return FAR_FUTURE

        trimmer = IdleTrimmer(world.ctx, IdleSettings(reserve=("3g.40gb",)), clock=clock)
        trimmed = trimmer.run_once()

        assert forgot == [True]
        assert [t.ref.identity.mig_uuid for t in trimmed if t.ref.identity] == [blocker.mig_uuid]
        assert gone(world, blocker)
        assert world.ctx.inventory.foreign_view(first_uuid, world.ctx.table.on_gpu(first_uuid)) == ()
        world.assert_consistent()


class TestKeepFree:
    """The placements a client names with KeepFree: their IDLE instances go, whatever the settings."""

    def test_the_idle_instances_over_the_named_placement_go_and_it_is_free(self, world: World) -> None:
        first = idle_instance(world, "pod-a", (0, "1g.10gb", 0, 1))
        second = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        other = idle_instance(world, "pod-c", (0, "1g.10gb", 2, 1))
        world.lifecycle.keep_free([Reservation(world.uuid(0), "2g.20gb", Placement(0, 2))])

        trimmed = reconcile(world, IdleSettings(), FAR_FUTURE)  # every cause of the settings off

        assert sorted(trimmed) == sorted([first.mig_uuid, second.mig_uuid])
        assert gone(world, first)
        assert gone(world, second)
        assert states(world) == {other.mig_uuid: State.IDLE}
        [ranked] = [
            r for r in world.lifecycle.rank_placements(world.uuid(0), "2g.20gb") if r.placement.start == 0
        ]
        assert ranked.cost is Cost.FREE
        # An Allocate there now creates and destroys nothing.
        assert world.allocate_claim("claim-2g", (0, "2g.20gb", 0, 2)).reclaimed == ()
        world.assert_consistent()

    def test_the_reconciler_built_for_the_shipped_settings_trims_them_too(self, world: World) -> None:
        idle = idle_instance(world, "pod-a", (0, "1g.10gb", 4, 1))
        world.lifecycle.keep_free([Reservation(world.uuid(0), "3g.40gb", Placement(4, 4))])
        # The reserve off: the composition root builds the trimmer anyway.
        trimmed = reconcile(world, IdleSettings(ttl_s=None, reserve=()), FAR_FUTURE)
        assert trimmed == [idle.mig_uuid]

    def test_an_instance_that_went_idle_after_the_naming_stays(self, world: World) -> None:
        world.lifecycle.keep_free([Reservation(world.uuid(0), "2g.20gb", Placement(0, 2))])
        later = idle_instance(world, "pod-a", (0, "1g.10gb", 0, 1))
        assert reconcile(world, IdleSettings(), FAR_FUTURE) == []
        assert states(world) == {later.mig_uuid: State.IDLE}
        world.lifecycle.keep_free([Reservation(world.uuid(0), "2g.20gb", Placement(0, 2))])  # named again
        assert reconcile(world, IdleSettings(), FAR_FUTURE) == [later.mig_uuid]

    def test_nothing_goes_when_something_else_holds_the_placement_too(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        idle = idle_instance(world, "pod-b", (0, "1g.10gb", 1, 1))
        copy = idle_instance(world, "pod-c", (0, "2g.20gb", 2, 2))
        world.lifecycle.keep_free(
            [
                Reservation(
                    world.uuid(0), "2g.20gb", Placement(0, 2)
                ),  # ACTIVE at 0: destroying 1 frees nothing
                Reservation(world.uuid(0), "2g.20gb", Placement(2, 2)),  # an IDLE copy of the profile
            ]
        )
        assert reconcile(world, IdleSettings(), FAR_FUTURE) == []
        assert {idle.mig_uuid, copy.mig_uuid} <= set(states(world))

    def test_an_empty_naming_clears_the_last(self, world: World) -> None:
        world.lifecycle.keep_free([Reservation(world.uuid(0), "2g.20gb", Placement(0, 2))])
        world.lifecycle.keep_free([])
        idle_instance(world, "pod-a", (0, "1g.10gb", 0, 1))
        assert reconcile(world, IdleSettings(), FAR_FUTURE) == []

    def test_a_placement_the_profile_does_not_have_is_refused_and_changes_nothing(self, world: World) -> None:
        world.lifecycle.keep_free([Reservation(world.uuid(0), "2g.20gb", Placement(0, 2))])
        with pytest.raises(errors.IllegalPlacement):
            world.lifecycle.keep_free([Reservation(world.uuid(0), "2g.20gb", Placement(1, 2))])
        with pytest.raises(errors.UnknownProfile):
            world.lifecycle.keep_free([Reservation(world.uuid(0), "5g.99gb", Placement(0, 2))])
        idle = idle_instance(world, "pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.keep_free([Reservation(world.uuid(0), "2g.20gb", Placement(0, 2))])
        assert reconcile(world, IdleSettings(), FAR_FUTURE) == [idle.mig_uuid]

    def test_the_reserve_leaves_the_gpus_a_client_allocates_to_that_client(self, world: World) -> None:
        """The node's 3g.40gb reserve would destroy the IDLE 2g.20gb in its way on GPU 0 (GPU 1 is full
        of 1g): not while a KeepFree client names GPU 0 as one its scheduler allocates (it lists that
        instance to its scheduler as warm); once the client no longer does, it goes."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        blocker = idle_instance(world, "pod-c", (0, "2g.20gb", 4, 2))
        world.allocate("pod-d", (1, "1g.10gb", 0, 1))
        world.allocate("pod-e", (1, "1g.10gb", 4, 1))
        node = IdleSettings(reserve=("3g.40gb",))
        world.lifecycle.keep_free([], [world.uuid(0)])

        assert reconcile(world, node, FAR_FUTURE) == []
        assert states(world)[blocker.mig_uuid] is State.IDLE
        with pytest.raises(errors.UnknownGpu):
            world.lifecycle.keep_free([], [world.uuid(0), "GPU-00000000-0000-0000-0000-000000000000"])
        assert reconcile(world, node, FAR_FUTURE) == []  # the refused call changed nothing

        world.lifecycle.keep_free([])
        assert reconcile(world, node, FAR_FUTURE) == [blocker.mig_uuid]
        world.assert_consistent()

    def test_the_ttl_still_applies_on_a_clients_gpus(self, world: World) -> None:
        idle = idle_instance(world, "pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.keep_free([], [world.uuid(0)])
        assert reconcile(world, IdleSettings(ttl_s=60.0), went_idle_at(world, idle) + 61.0) == [idle.mig_uuid]
