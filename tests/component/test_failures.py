"""Failures fail closed: all-or-nothing requests, undo of partial creates, ERROR for stuck destroys."""

from __future__ import annotations

import pytest
from lifecycle_world import World

from sidecar import errors
from sidecar.domain import Outcome, State

NVML_ERROR_UNKNOWN = 999
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
FOREVER = 1000  # more attempts than any bounded retry makes


class TestAllOrNothing:
    def test_a_failing_second_device_destroys_what_the_first_created(self, world: World) -> None:
        world.hw.inject_fault("create-gi", NVML_ERROR_INSUFFICIENT_RESOURCES, after=1, times=FOREVER)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "1g.10gb", 0, 1), (1, "1g.10gb", 0, 1))

        assert world.everything() == (set(), {}, set())

    def test_a_failing_second_device_puts_a_reused_first_device_back_to_idle(self, world: World) -> None:
        cached = world.allocate("pod-old", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-old")
        before = world.everything()
        world.hw.inject_fault("create-gi", NVML_ERROR_INSUFFICIENT_RESOURCES, times=FOREVER)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "1g.10gb", 0, 1), (1, "1g.10gb", 0, 1))

        layout, records, cdi = world.everything()
        assert (layout, cdi) == (before[0], before[2])
        [record] = records.values()
        assert record.state is State.IDLE
        assert record.owner is None
        assert record.mig_uuid == cached.identity.mig_uuid
        world.hw.clear_faults()
        assert world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0].outcome is Outcome.REUSED

    def test_a_device_already_allocated_is_untouched_by_a_failing_retry(self, world: World) -> None:
        first = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        world.hw.inject_fault("create-gi", NVML_ERROR_INSUFFICIENT_RESOURCES, times=FOREVER)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "1g.10gb", 0, 1), (1, "1g.10gb", 0, 1))

        [record] = world.record_files().values()
        assert (record.state, record.mig_uuid) == (State.ACTIVE, first.identity.mig_uuid)


class TestFaultAtEveryMutation:
    @pytest.mark.parametrize("op", ["create-gi", "create-ci"])
    def test_a_fault_while_creating_leaves_no_instance_and_no_record(self, world: World, op: str) -> None:
        world.allocate("pod-keep", (0, "1g.10gb", 0, 1))
        world.hw.inject_fault(op, NVML_ERROR_UNKNOWN, times=FOREVER)

        with pytest.raises(errors.NvmlFailure) as caught:
            world.allocate("pod-a", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["nvml_code"] == str(NVML_ERROR_UNKNOWN)
        world.assert_consistent()
        assert len(world.record_files()) == 1

    @pytest.mark.parametrize("op", ["destroy-ci", "destroy-gi"])
    def test_a_fault_while_reclaiming_leaves_an_error_record_for_what_is_still_there(
        self, world: World, op: str
    ) -> None:
        idle = world.allocate("pod-a", (0, "1g.10gb", 4, 1)).devices[0]
        world.lifecycle.release("pod-a")
        world.hw.inject_fault(op, NVML_ERROR_UNKNOWN, times=FOREVER)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-b", (0, "3g.40gb", 4, 4))

        world.assert_consistent()
        [record] = world.record_files().values()
        assert record.state is State.ERROR
        assert record.mig_uuid == idle.identity.mig_uuid
        assert record.last_error

    def test_an_undo_that_fails_too_leaves_error_with_the_gi_it_knows(self, world: World) -> None:
        world.hw.inject_fault("create-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "2g.20gb", 2, 2))

        world.assert_consistent()
        [record] = world.record_files().values()
        assert record.state is State.ERROR
        assert record.gpu_instance_id is not None
        assert "undo failed" in record.last_error


class TestStuckDestroy:
    def test_an_instance_that_cannot_be_destroyed_is_kept_in_error_and_never_reused(
        self, world: World
    ) -> None:
        idle = world.allocate("pod-a", (0, "1g.10gb", 4, 1)).devices[0]
        world.lifecycle.release("pod-a")
        world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-b", (0, "3g.40gb", 4, 4))
        world.hw.clear_faults()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-c", (0, "1g.10gb", 4, 1))  # exactly its reservation: still not reused

        assert caught.value.metadata["blocker"] == "ERROR"
        assert idle.identity.mig_uuid in world.live_mig_uuids()
