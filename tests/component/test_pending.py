"""Pending reservations (allocations without runtime identity) guard the instance at exactly their spot."""

from __future__ import annotations

import pytest
from lifecycle_world import World, restart

from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Outcome, Owner, PodRef, Reservation, State
from sidecar.nvml.port import Placement

NVML_ERROR_UNKNOWN = 999
FOREVER = 1000


def pending(world: World, pod: str, profile: str, start: int, size: int) -> ActiveAllocation:
    """What the plugin lists for a pod the scheduler reserved a spot for, before its Allocate."""
    reservation = Reservation(world.gpus[0].uuid, profile, Placement(start, size))
    return ActiveAllocation(Owner(PodRef(pod, "default", f"name-{pod}"), "main", 0, 0), reservation)


def make_error_instance(world: World) -> str:
    """pod-a's 1g at 4:1, released, whose reclaim's destroy fails: ERROR. The fault is cleared."""
    idle = world.allocate("pod-a", (0, "1g.10gb", 4, 1)).devices[0]
    world.lifecycle.release("pod-a")
    world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
    with pytest.raises(errors.NvmlFailure):
        world.allocate("pod-b", (0, "3g.40gb", 4, 4))
    world.hw.clear_faults()
    return idle.identity.mig_uuid


class TestTheReconcilersRetry:
    """HAMi's TestMIGCleanupRetryPreservesActiveReservation."""

    def test_spares_an_error_instance_at_a_pending_reservation_until_it_leaves_the_list(
        self, world: World
    ) -> None:
        mig = make_error_instance(world)
        world.lifecycle.sync_active(world.lifecycle.generation, [pending(world, "pod-q", "1g.10gb", 4, 1)])

        spared = Reconciler(world.lifecycle).run_once()

        assert (spared.destroyed, spared.still_failing) == ((), ())
        assert mig in world.live_mig_uuids()
        assert [r.state for r in world.record_files().values()] == [State.ERROR]

        world.lifecycle.sync_active(world.lifecycle.generation, [])
        assert len(Reconciler(world.lifecycle).run_once().destroyed) == 1
        assert world.everything() == (set(), {}, set())

    def test_a_pending_reservation_of_another_profile_at_the_same_spot_spares_nothing(
        self, world: World
    ) -> None:
        make_error_instance(world)
        world.lifecycle.sync_active(world.lifecycle.generation, [pending(world, "pod-q", "2g.20gb", 4, 2)])
        assert len(Reconciler(world.lifecycle).run_once().destroyed) == 1


class TestAllocate:
    def test_placement_pressure_never_reclaims_the_idle_instance_at_a_pending_reservation(
        self, world: World
    ) -> None:
        idle = world.allocate("pod-a", (0, "1g.10gb", 4, 1)).devices[0]
        world.lifecycle.release("pod-a")
        world.lifecycle.sync_active(world.lifecycle.generation, [pending(world, "pod-q", "1g.10gb", 4, 1)])
        before = world.everything()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-x", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["blocker"] == "IDLE"
        assert caught.value.metadata["guarded_by"] == "pending reservation of pod-q/0/0"
        assert world.everything() == before
        reused = world.allocate("pod-q", (0, "1g.10gb", 4, 1)).devices[0]  # the reservation's own Allocate
        assert (reused.outcome, reused.identity) == (Outcome.REUSED, idle.identity)

    def test_the_inline_error_retry_spares_another_pods_pending_reservation(self, world: World) -> None:
        mig = make_error_instance(world)
        world.lifecycle.sync_active(world.lifecycle.generation, [pending(world, "pod-q", "1g.10gb", 4, 1)])
        before = world.everything()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-x", (0, "3g.40gb", 4, 4))

        assert (caught.value.metadata["blocker"], caught.value.metadata["mig_uuid"]) == ("ERROR", mig)
        assert world.everything() == before

    def test_the_reservations_own_allocate_retries_the_error_instance_and_consumes_it(
        self, world: World
    ) -> None:
        mig = make_error_instance(world)
        world.lifecycle.sync_active(world.lifecycle.generation, [pending(world, "pod-q", "1g.10gb", 4, 1)])

        created = world.allocate("pod-q", (0, "1g.10gb", 4, 1))

        assert created.devices[0].outcome is Outcome.CREATED
        assert [r.identity.mig_uuid for r in created.reclaimed if r.identity] == [mig]
        # It came: the reservation guards nothing now, so a release and a larger request reclaim it.
        world.lifecycle.release("pod-q")
        assert len(world.allocate("pod-x", (0, "3g.40gb", 4, 4)).reclaimed) == 1


class TestRecover:
    def test_accepts_a_pending_reservation_and_it_guards_the_error_instance_at_it(self, world: World) -> None:
        mig = make_error_instance(world)
        recovery = restart(world)

        report = recovery.recover([pending(world, "pod-q", "1g.10gb", 4, 1)])

        assert list(report.adopted_active) == []
        assert world.states() == {next(iter(world.record_files())): State.ERROR}
        assert Reconciler(world.lifecycle).run_once().destroyed == ()
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-x", (0, "3g.40gb", 4, 4))
        assert mig in world.live_mig_uuids()
        assert world.allocate("pod-q", (0, "1g.10gb", 4, 1)).devices[0].outcome is Outcome.CREATED
