"""The reconciler destroys ERROR instances once NVML lets it, hardware first, and retries CDI removals."""

from __future__ import annotations

import threading

import pytest
from lifecycle_world import World

from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Outcome, Owner, PodRef, State
from sidecar.store import cdi as cdi_module

NVML_ERROR_UNKNOWN = 999
FOREVER = 1000


def make_error_instance(world: World) -> str:
    """An IDLE 1g at 4:1 whose reclaim fails: it ends in ERROR. Returns its MIG UUID."""
    idle = world.allocate("pod-a", (0, "1g.10gb", 4, 1)).devices[0]
    world.lifecycle.release("pod-a")
    world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
    with pytest.raises(errors.NvmlFailure):
        world.allocate("pod-b", (0, "3g.40gb", 4, 4))
    return idle.identity.mig_uuid


class TestErrorInstances:
    def test_while_the_fault_lasts_the_instance_its_record_and_cdi_file_all_stay(self, world: World) -> None:
        mig = make_error_instance(world)
        before = world.everything()

        report = Reconciler(world.lifecycle).run_once()

        assert report.destroyed == ()
        assert len(report.still_failing) == 1
        assert world.everything()[0] == before[0]
        assert world.everything()[2] == before[2]
        [record] = world.record_files().values()
        assert (record.state, record.mig_uuid) == (State.ERROR, mig)
        assert "destroy" in record.last_error

    def test_once_the_fault_clears_the_hardware_then_the_cdi_file_and_record_are_removed(
        self, world: World
    ) -> None:
        mig = make_error_instance(world)
        world.hw.clear_faults()

        report = Reconciler(world.lifecycle).run_once()

        assert [r.identity.mig_uuid for r in report.destroyed if r.identity] == [mig]
        assert world.everything() == (set(), {}, set())
        assert world.allocate("pod-c", (0, "3g.40gb", 4, 4)).devices[0].outcome is Outcome.CREATED

    def test_an_error_instance_a_live_pod_still_holds_is_left_alone(self, world: World) -> None:
        mig = make_error_instance(world)
        world.hw.clear_faults()
        [record] = world.record_files().values()
        assert record.identity is not None
        held = ActiveAllocation(Owner(PodRef("pod-a"), "main", 0, 0), record.reservation, record.identity)
        world.lifecycle.sync_active(world.lifecycle.generation, [held])

        report = Reconciler(world.lifecycle).run_once()

        assert report.destroyed == ()
        assert mig in world.live_mig_uuids()

    def test_the_background_loop_does_the_same_and_stops_on_request(self, world: World) -> None:
        make_error_instance(world)
        world.hw.clear_faults()
        reconciler = Reconciler(world.lifecycle, interval_s=0.01)
        pause = threading.Event()
        reconciler.start()
        try:
            for _ in range(2000):
                if not world.record_files():
                    break
                pause.wait(0.01)
        finally:
            reconciler.stop()
        assert world.everything() == (set(), {}, set())


class TestQueuedCdiRemovals:
    def test_a_cdi_removal_that_fails_is_queued_and_done_later(
        self, cdi_world: World, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        world = cdi_world
        idle = world.allocate("pod-a", (0, "1g.10gb", 4, 1)).devices[0]
        world.lifecycle.release("pod-a")
        path = world.cdi.spec_path(idle.identity.mig_uuid)
        # The file system refuses to unlink the spec for now (a directory at the path would not
        # do: it is not this sidecar's spec, so it would never be removed nor queued).
        stuck = {path}
        real_unlink = cdi_module._unlink
        monkeypatch.setattr(cdi_module, "_unlink", lambda p: p not in stuck and real_unlink(p))

        result = world.allocate("pod-b", (0, "3g.40gb", 4, 4))

        assert [r.identity for r in result.reclaimed] == [idle.identity]  # the request did not fail
        assert path.exists()
        assert world.lifecycle.snapshot().pending_cdi_removals == (str(path),)
        assert Reconciler(world.lifecycle).run_once().cdi_removed == ()

        stuck.clear()  # the stale file is removable again
        report = Reconciler(world.lifecycle).run_once()

        assert report.cdi_removed == (str(path),)
        assert not path.exists()
        assert world.lifecycle.snapshot().pending_cdi_removals == ()
