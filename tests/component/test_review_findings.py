"""Behaviours a correctness review found unguarded, each pinned by the test that exposed it.

Every test here failed before the fix it names in its docstring; they run over the simulated
hardware through the real pynvml adapter, records and CDI code, and assert the NVML layout, the
record files and the CDI files.
"""

from __future__ import annotations

import threading
import time

import pytest
from lifecycle_world import World

from sidecar import errors
from sidecar.domain import Outcome
from sidecar.reconciler import Reconciler

NVML_ERROR_TIMEOUT = 10
NVML_ERROR_UNKNOWN = 999


class TestAFailedCreateLeavesNoUnrecordedInstance:
    @pytest.mark.parametrize("code", [NVML_ERROR_UNKNOWN, NVML_ERROR_TIMEOUT], ids=["unknown", "timeout"])
    def test_a_gpu_instance_made_by_a_create_that_then_failed_is_destroyed_by_the_undo(
        self, world: World, code: int
    ) -> None:
        """The driver made the GI, but reading its info failed (and a retry of the whole create then
        met the GI it had just made): the undo must find the bare GI at the exact placement instead
        of leaving it on the GPU without a record, where it would block the placement for good."""
        world.hw.inject_fault("nvmlGpuInstanceGetInfo", code, times=1)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "3g.40gb", 4, 4))

        assert world.everything() == (set(), {}, set())
        world.hw.clear_faults()
        assert world.allocate("pod-a", (0, "3g.40gb", 4, 4)).devices[0].identity.gpu_instance_id > 0


class TestARequestThatCannotSucceedDestroysNoIdleInstance:
    def test_a_busy_placement_of_a_later_device_is_refused_before_an_earlier_device_reclaims_idle_cache(
        self, world: World
    ) -> None:
        """Placements are decided for every device before any is touched: the request fails with
        PLACEMENT_BUSY for device 1, so device 0 must not have destroyed the idle instance in its way
        (a rollback can remove what the request created, but not bring a destroyed instance back)."""
        cached = world.allocate("pod-old", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-old")
        world.allocate("pod-holder", (1, "1g.10gb", 0, 1))
        before = world.everything()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-a", (0, "2g.20gb", 0, 2), (1, "1g.10gb", 0, 1))

        assert caught.value.metadata["pod_uid"] == "pod-holder"
        assert world.everything() == before
        reused = world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0]
        assert (reused.outcome, reused.identity) == (Outcome.REUSED, cached.identity)

    def test_a_process_on_an_idle_instance_a_later_device_must_reclaim_fails_the_request_first(
        self, world: World
    ) -> None:
        """INSTANCE_IN_USE for device 1 is known before device 0 reclaims anything."""
        world.allocate("pod-old", (0, "1g.10gb", 0, 1))
        world.allocate("pod-old", (1, "1g.10gb", 0, 1), container_index=1)
        world.lifecycle.release("pod-old")
        busy = next(r for r in world.record_files().values() if r.gpu_uuid == world.uuid(1))
        assert busy.mig_uuid is not None
        world.hw.set_busy(busy.mig_uuid)
        before = world.everything()

        with pytest.raises(errors.InstanceInUse):
            world.allocate("pod-a", (0, "2g.20gb", 0, 2), (1, "2g.20gb", 0, 2))

        assert world.everything() == before


class TestARecordDeleteThatFailsAfterTheDestroyIsRetried:
    def test_an_instance_whose_record_could_not_be_deleted_after_its_destroy_is_finished_by_the_reconciler(
        self, world: World
    ) -> None:
        """The reclaim destroyed the hardware, then deleting the record failed (the state directory
        was unavailable for a moment). The instance must not stay DELETING in the table for the rest
        of the process life, blocking its slices with PLACEMENT_BUSY, which the client never retries:
        it goes to ERROR, and the reconciler finishes the delete once the directory is back."""
        world.allocate("pod-old", (0, "1g.10gb", 4, 1))
        world.lifecycle.release("pod-old")
        [idle] = world.record_files().values()
        state_dir = world.records.directory
        away = state_dir.with_name("state-away")
        record_file = state_dir / f"{idle.name}.json"
        # The simulated driver sleeps after destroying the GI: the window between the DELETING record
        # and the record delete, in which the directory goes away.
        world.hw.set_latency("destroy-gi", 1.0)

        def take_the_directory_away() -> None:
            give_up = time.monotonic() + 60  # only so that a broken test fails instead of hanging
            while b'"DELETING"' not in record_file.read_bytes():
                if time.monotonic() > give_up:
                    return
                time.sleep(0.005)
            state_dir.rename(away)
            state_dir.write_text("not a directory")

        thief = threading.Thread(target=take_the_directory_away)
        thief.start()
        try:
            with pytest.raises(errors.StateWriteFailed):
                world.allocate("pod-a", (0, "3g.40gb", 4, 4))
        finally:
            thief.join()
            world.hw.set_latency("destroy-gi", 0)
            state_dir.unlink()
            away.rename(state_dir)

        assert world.layout() == set()
        report = Reconciler(world.lifecycle).run_once()
        assert [ref.reservation for ref in report.destroyed] == [idle.reservation]
        assert world.everything() == (set(), {}, set())
        assert world.allocate("pod-a", (0, "3g.40gb", 4, 4)).devices[0].outcome is Outcome.CREATED
        world.assert_consistent()
