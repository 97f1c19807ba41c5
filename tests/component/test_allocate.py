"""Allocate over simulated hardware: create, exact reuse, reclaim of idle cache, and refusals."""

from __future__ import annotations

import contextlib

import pytest
from lifecycle_world import World, restart

from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.inventory import LayoutRecordingPort
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Outcome, Owner, PodRef, Reservation, State
from sidecar.model.ownership import record_name
from sidecar.nvml.port import NVML_ERROR_UNKNOWN, NvmlError, Placement

H100_1G = 19  # GI profile ID of 1g.10gb on H100-80GB


class TestCreate:
    def test_a_new_placement_is_created_with_its_record_and_cdi_file(self, world: World) -> None:
        result = world.allocate("pod-a", (0, "1g.10gb", 3, 1))

        [dev] = result.devices
        assert dev.outcome is Outcome.CREATED
        assert result.reclaimed == ()
        assert world.layout() == {
            (
                0,
                dev.identity.gpu_instance_id,
                H100_1G,
                "3:1",
                ((dev.identity.compute_instance_id, dev.identity.mig_uuid),),
            )
        }
        [record] = world.record_files().values()
        assert record.state is State.ACTIVE
        assert record.mig_uuid == dev.identity.mig_uuid
        assert record.owner is not None
        assert record.owner.pod.uid == "pod-a"
        if world.cdi.enabled:
            assert dev.cdi_device == f"k8s.hami.io/mig={dev.identity.mig_uuid}"
            assert world.cdi_files() == {world.cdi.spec_path(dev.identity.mig_uuid).name}
        else:
            assert dev.cdi_device == ""
        world.assert_consistent()

    def test_every_activation_bumps_the_generation_and_is_recorded(self, world: World) -> None:
        before = world.lifecycle.generation
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (1, "1g.10gb", 0, 1))
        assert world.lifecycle.generation == before + 2
        assert sorted(r.activated_generation for r in world.record_files().values()) == [
            before + 1,
            before + 2,
        ]


class TestExactReuse:
    def test_a_released_instance_is_reused_with_the_same_mig_uuid_and_no_new_instance(
        self, world: World
    ) -> None:
        first = world.allocate("pod-a", (0, "3g.40gb", 4, 4)).devices[0]
        world.lifecycle.release("pod-a")
        before = world.everything()

        again = world.allocate("pod-b", (0, "3g.40gb", 4, 4)).devices[0]

        assert again.outcome is Outcome.REUSED
        assert again.identity == first.identity
        assert world.layout() == before[0]  # no GI/CI was created or destroyed: same IDs, same UUID
        assert world.cdi_files() == before[2]
        [record] = world.record_files().values()
        assert record.state is State.ACTIVE
        assert record.owner is not None
        assert record.owner.pod.uid == "pod-b"

    def test_a_missing_cdi_file_is_rewritten_on_reuse(self, cdi_world: World) -> None:
        first = cdi_world.allocate("pod-a", (0, "1g.10gb", 2, 1)).devices[0]
        cdi_world.lifecycle.release("pod-a")
        cdi_world.cdi.spec_path(first.identity.mig_uuid).unlink()

        again = cdi_world.allocate("pod-b", (0, "1g.10gb", 2, 1)).devices[0]

        assert again.outcome is Outcome.REUSED
        assert cdi_world.cdi_spec_is_current(0, again.identity)

    def test_an_idle_instance_that_vanished_from_the_hardware_goes_to_error_and_is_not_reused(
        self, world: World
    ) -> None:
        first = world.allocate("pod-a", (0, "1g.10gb", 2, 1)).devices[0]
        world.lifecycle.release("pod-a")
        world.port.destroy_compute_instance(
            world.uuid(0), first.identity.gpu_instance_id, first.identity.compute_instance_id
        )

        with pytest.raises(errors.UnverifiableState):
            world.allocate("pod-b", (0, "1g.10gb", 2, 1))

        [record] = world.record_files().values()
        assert record.state is State.ERROR
        assert "reuse verification failed" in record.last_error

    def test_repeating_an_allocation_returns_the_same_instance(self, world: World) -> None:
        first = world.allocate("pod-a", (0, "1g.10gb", 1, 1)).devices[0]
        before = world.everything()

        again = world.allocate("pod-a", (0, "1g.10gb", 1, 1)).devices[0]

        assert again.outcome is Outcome.ALREADY_ALLOCATED
        assert again.identity == first.identity
        assert world.everything() == before

    def test_the_same_key_with_another_reservation_is_a_key_conflict(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 1, 1))
        before = world.everything()

        with pytest.raises(errors.KeyConflict):
            world.allocate("pod-a", (0, "1g.10gb", 2, 1))

        assert world.everything() == before


class TestReclaim:
    def test_only_the_overlapping_idle_instance_is_destroyed(self, world: World) -> None:
        in_way = world.allocate("pod-a", (0, "1g.10gb", 5, 1)).devices[0]
        elsewhere = world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-a")
        world.lifecycle.release("pod-b")

        result = world.allocate("pod-c", (0, "3g.40gb", 4, 4))

        assert [r.identity for r in result.reclaimed] == [in_way.identity]
        live = world.live_mig_uuids()
        assert in_way.identity.mig_uuid not in live
        assert elsewhere.identity.mig_uuid in live
        assert result.devices[0].identity.mig_uuid in live
        states = {r.mig_uuid: r.state for r in world.record_files().values()}
        assert states == {
            elsewhere.identity.mig_uuid: State.IDLE,
            result.devices[0].identity.mig_uuid: State.ACTIVE,
        }
        if world.cdi.enabled:
            assert world.cdi.spec_path(in_way.identity.mig_uuid).name not in world.cdi_files()
            assert world.cdi.spec_path(elsewhere.identity.mig_uuid).name in world.cdi_files()
        world.assert_consistent()

    def test_an_idle_instance_with_a_running_process_is_in_use_and_nothing_is_destroyed(
        self, world: World
    ) -> None:
        busy = world.allocate("pod-a", (0, "1g.10gb", 5, 1)).devices[0]
        world.allocate("pod-b", (0, "1g.10gb", 4, 1))
        world.lifecycle.release("pod-a")
        world.lifecycle.release("pod-b")
        world.hw.set_busy(busy.identity.mig_uuid, True)
        before = world.everything()

        with pytest.raises(errors.InstanceInUse) as caught:
            world.allocate("pod-c", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["mig_uuid"] == busy.identity.mig_uuid
        assert world.everything() == before  # the idle one without processes was not destroyed either


class TestBlockers:
    def test_an_active_instance_blocks_an_overlapping_request(self, world: World) -> None:
        active = world.allocate("pod-a", (0, "1g.10gb", 6, 1)).devices[0]
        before = world.everything()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-b", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["blocker"] == "ACTIVE"
        assert caught.value.metadata["mig_uuid"] == active.identity.mig_uuid
        assert caught.value.metadata["owner"] == "pod-a/0/0"
        assert world.everything() == before

    def test_an_error_instance_whose_inline_retry_fails_again_answers_unavailable(self, world: World) -> None:
        stuck = world.allocate("pod-a", (0, "1g.10gb", 6, 1)).devices[0]
        world.lifecycle.release("pod-a")
        world.hw.inject_fault("destroy-ci", 999, times=1000)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-b", (0, "3g.40gb", 4, 4))
        layout, _, cdi = world.everything()

        with pytest.raises(errors.NvmlFailure) as caught:
            world.allocate("pod-c", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["blocker"] == "ERROR"
        assert caught.value.metadata["mig_uuid"] == stuck.identity.mig_uuid
        assert world.layout() == layout
        assert world.cdi_files() == cdi
        [record] = world.record_files().values()
        assert (record.state, record.mig_uuid) == (State.ERROR, stuck.identity.mig_uuid)

    def test_an_error_instance_a_live_pod_holds_blocks_an_overlapping_request(self, world: World) -> None:
        stuck = world.allocate("pod-a", (0, "1g.10gb", 6, 1)).devices[0]
        world.lifecycle.release("pod-a")
        world.hw.inject_fault("destroy-ci", 999, times=1)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-b", (0, "3g.40gb", 4, 4))
        held = ActiveAllocation(
            Owner(PodRef("pod-a"), "main", 0, 0),
            Reservation(world.gpus[0].uuid, "1g.10gb", Placement(6, 1)),
            stuck.identity,
        )
        world.lifecycle.sync_active(world.lifecycle.generation, [held])
        before = world.everything()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-c", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["blocker"] == "ERROR"
        assert caught.value.metadata["mig_uuid"] == stuck.identity.mig_uuid
        assert caught.value.metadata["guarded_by"].startswith("a live pod holds it")
        assert world.everything() == before

    def test_a_foreign_instance_blocks_an_overlapping_request(self, world: World) -> None:
        world.hw.create_instance(0, "1g.10gb", 5, 1)
        world.allocate("pod-a", (0, "1g.10gb", 4, 1))
        world.lifecycle.release("pod-a")
        before = world.everything()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-b", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["blocker"] == "foreign"
        assert caught.value.metadata["placement"] == "5:1"
        assert world.everything() == before  # the overlapping idle one was not reclaimed either

    @pytest.mark.parametrize("corrupt_at", [Placement(4, 4), Placement(6, 1)], ids=["exact", "overlapping"])
    def test_a_corrupt_record_file_blocks_an_overlapping_request_before_anything_is_reclaimed(
        self, world: World, corrupt_at: Placement
    ) -> None:
        """A corrupt file is the operator's to inspect and is never overwritten: a create at its
        placement could not write its record, and must not reclaim idle instances first."""
        world.allocate("pod-a", (0, "1g.10gb", 4, 1))
        world.lifecycle.release("pod-a")
        corrupt = world.records.path(record_name(world.uuid(0), corrupt_at))
        corrupt.write_bytes(b'{"version":1,"checksum":"sha256:00","record":{}}')
        restart(world).recover([])  # Allocate never scans the directory: recovery finds the file
        before = world.layout(), world.cdi_files(), world.lifecycle.instances()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-b", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["blocker"] == "corrupt_record"
        assert caught.value.metadata["file"] == str(corrupt)
        assert (world.layout(), world.cdi_files(), world.lifecycle.instances()) == before
        assert corrupt.read_bytes() == b'{"version":1,"checksum":"sha256:00","record":{}}'

    def test_a_record_file_corrupted_while_serving_is_refused_at_its_write_and_blocks_from_then_on(
        self, world: World
    ) -> None:
        corrupt = world.records.path(record_name(world.uuid(0), Placement(4, 4)))
        corrupt.write_bytes(b"{")

        with pytest.raises(errors.UnverifiableState):
            world.allocate("pod-a", (0, "3g.40gb", 4, 4))
        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-b", (0, "1g.10gb", 6, 1))

        assert caught.value.metadata["blocker"] == "corrupt_record"
        assert corrupt.read_bytes() == b"{"
        assert world.layout() == set()  # the GI of the refused create never came to be

    @pytest.mark.parametrize(
        ("profile", "start", "size", "with_ci"),
        [("1g.10gb", 5, 1, True), ("3g.40gb", 4, 4, False)],
        ids=["overlapping", "bare-at-exactly-the-placement"],
    )
    def test_a_foreign_instance_the_records_do_not_know_is_named_after_the_driver_refuses(
        self, world: World, profile: str, start: int, size: int, with_ci: bool
    ) -> None:
        """No record overlaps, so the create goes ahead without a listing; the driver's refusal is met
        by one listing that names the blocker. A bare foreign GI of the same profile at exactly the
        placement is not taken for one this create made: it is left alone."""
        world.hw.create_instance(0, profile, start, size, with_ci=with_ci)
        before = world.everything()

        with pytest.raises(errors.PlacementBusy) as caught:
            world.allocate("pod-a", (0, "3g.40gb", 4, 4))

        assert caught.value.metadata["blocker"] == "foreign"
        assert caught.value.metadata["placement"] == f"{start}:{size}"
        assert world.everything() == before
        assert world.lifecycle.instances() == []

    def test_a_corrupt_record_file_elsewhere_blocks_nothing(self, world: World) -> None:
        world.records.path(record_name(world.uuid(0), Placement(0, 1))).write_bytes(b"{")
        world.records.path(record_name(world.uuid(1), Placement(4, 4))).write_bytes(b"{")

        device = world.allocate("pod-a", (0, "3g.40gb", 4, 4)).devices[0]

        assert device.outcome is Outcome.CREATED

    def test_a_foreign_instance_is_listed_in_the_snapshot(self, world: World) -> None:
        world.hw.create_instance(1, "2g.20gb", 2, 2)
        snapshot = world.lifecycle.snapshot()
        [foreign] = snapshot.gpus[1].foreign
        assert (foreign.profile, str(foreign.placement)) == ("2g.20gb", "2:2")
        assert foreign.mig_uuid is not None

    def test_a_lost_gpu_costs_the_snapshot_that_gpu_only(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (1, "1g.10gb", 0, 1))
        world.hw.create_instance(0, "2g.20gb", 2, 2)
        world.lifecycle.snapshot()  # the GPUs are listed once while all answer
        world.hw.lose_gpu(1)

        snapshot = world.lifecycle.snapshot()

        healthy, lost, other = snapshot.gpus
        assert (healthy.unreadable, other.unreadable) == ("", "")
        assert [str(f.placement) for f in healthy.foreign] == ["2:2"]
        assert [str(r.placement) for r in healthy.instances] == ["0:1"]
        assert lost.gpu.uuid == world.uuid(1)
        assert "GPU is lost" in lost.unreadable
        assert lost.foreign == ()
        assert [(r.gpu_uuid, str(r.placement)) for r in lost.instances] == [(world.uuid(1), "0:1")]


class TestValidation:
    def test_an_unknown_gpu_is_refused(self, world: World) -> None:
        request = world.request("pod-a", (0, "1g.10gb", 0, 1))
        bad = request.devices[0].reservation.__class__(
            "GPU-00000000-0000-0000-0000-000000000000", "1g.10gb", request.devices[0].reservation.placement
        )
        with pytest.raises(errors.UnknownGpu):
            world.lifecycle.allocate(
                request.__class__(request.pod, "main", 0, (request.devices[0].__class__(0, bad),))
            )

    @pytest.mark.parametrize(
        ("device", "error"),
        [
            ((0, "1g.11gb", 0, 1), errors.UnknownProfile),
            ((0, "3g.40gb", 2, 4), errors.IllegalPlacement),
            ((0, "1g.10gb", 7, 1), errors.IllegalPlacement),
            ((2, "1g.20gb", 0, 2), errors.UnknownProfile),  # an A100-40GB has no 1g.20gb
        ],
    )
    def test_an_invalid_second_device_touches_nothing(
        self, world: World, device: tuple[int, str, int, int], error: type[Exception]
    ) -> None:
        before = world.everything()
        with pytest.raises(error):
            world.allocate("pod-a", (1, "1g.10gb", 0, 1), device)
        assert world.everything() == before

    def test_two_overlapping_devices_in_one_request_are_invalid(self, world: World) -> None:
        with pytest.raises(errors.InvalidRequest):
            world.allocate("pod-a", (0, "3g.40gb", 0, 4), (0, "1g.10gb", 3, 1))
        assert world.everything() == (set(), {}, set())

    def test_mig_disabled_on_the_gpu_is_refused(self, world: World) -> None:
        _, pending, _ = world.lifecycle.set_mig_mode(world.uuid(2), False)
        assert pending is False
        with pytest.raises(errors.MigDisabled):
            world.allocate("pod-a", (2, "1g.5gb", 0, 1))

    def test_a_reuse_on_a_gpu_whose_mig_disable_is_pending_is_mig_disabled(self, world: World) -> None:
        """The mode read and the instance's lookup are one port call for a reuse: the pending mode
        still refuses it, and nothing changes (the IDLE instance stays as it was)."""
        gpu = world.uuid(1)
        world.allocate("pod-a", (1, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        with contextlib.suppress(NvmlError):  # made outside the sidecar: refused while instances exist
            world.port.set_mig_mode(gpu, False)
        live = world.port.gpu(gpu)
        assert (live.mig_current, live.mig_pending) == (True, False)
        before = world.everything()

        with pytest.raises(errors.MigDisabled):
            world.allocate("pod-b", (1, "1g.10gb", 0, 1))

        assert world.everything() == before

    def test_a_mig_mode_change_that_needs_a_reset_succeeds_and_says_so(self, world: World) -> None:
        assert world.lifecycle.set_mig_mode(world.uuid(2), False) == (True, False, True)  # A100: reset

    def test_a_mig_mode_change_refused_while_a_process_runs_is_instance_in_use(self, world: World) -> None:
        gpu = world.uuid(0)
        world.hw.set_busy(gpu)  # a process runs on the GPU (not on a MIG device of ours)

        with pytest.raises(errors.InstanceInUse) as caught:
            world.lifecycle.set_mig_mode(gpu, False)

        assert caught.value.metadata["gpu_uuid"] == gpu
        assert "process" in caught.value.message
        # The driver recorded the refused disable as pending; the sidecar withdrew it, so the GPU
        # keeps serving allocations as before.
        after = world.port.gpu(gpu)
        assert (after.mig_current, after.mig_pending) == (True, True)
        assert caught.value.metadata["mig_pending"] == "true"
        world.hw.set_busy(gpu, False)
        assert world.lifecycle.set_mig_mode(gpu, False) == (False, False, False)  # H100: at once

    @pytest.mark.parametrize("enabled", [True, False], ids=["enable", "disable"])
    def test_a_refused_repeat_keeps_the_change_pending_from_before(self, world: World, enabled: bool) -> None:
        """An A100 records a mode change as pending until a reset. A repeat refused with IN_USE (a
        process started meanwhile) must leave that earlier, accepted change pending."""
        gpu = world.uuid(2)
        if enabled:
            world.hw.set_mig_mode(2, False)
        assert world.lifecycle.set_mig_mode(gpu, enabled) == (not enabled, enabled, True)
        world.hw.set_busy(gpu)

        with pytest.raises(errors.InstanceInUse):
            world.lifecycle.set_mig_mode(gpu, enabled)

        after = world.port.gpu(gpu)
        assert (after.mig_current, after.mig_pending) == (not enabled, enabled)

    def test_after_a_mig_mode_change_the_gpu_facts_are_read_afresh(self, world: World) -> None:
        gpu = world.uuid(0)
        assert world.lifecycle.gpu_info(gpu).mig_current  # cached now

        world.lifecycle.set_mig_mode(gpu, False)

        assert not world.lifecycle.gpu_info(gpu).mig_current

    def test_mig_cannot_be_disabled_while_instances_exist(self, world: World) -> None:
        world.allocate("pod-a", (1, "1g.10gb", 0, 1))
        with pytest.raises(errors.PlacementBusy):
            world.lifecycle.set_mig_mode(world.uuid(1), False)
        assert world.port.gpu(world.uuid(1)).mig_pending

    def test_nothing_is_allocated_before_recovery(self, world: World) -> None:
        fresh = Lifecycle(LifecycleContext(LayoutRecordingPort(world.port), world.records, world.cdi, "boot"))
        with pytest.raises(errors.NotRecovered):
            fresh.allocate(world.request("pod-a", (0, "1g.10gb", 0, 1)))
        with pytest.raises(errors.NotRecovered):
            fresh.release("pod-a")
        assert world.everything() == (set(), {}, set())


class TestReuseWaitsUntilNoProcessRunsOnTheIdleInstance:
    """A pod in its grace period may still run on an idle instance; it is not shared."""

    def test_an_idle_instance_with_a_running_process_is_refused_as_in_use_and_stays_idle(
        self, world: World
    ) -> None:
        old = world.allocate("pod-old", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-old")
        world.hw.set_busy(old.identity.mig_uuid)
        before = world.everything()

        with pytest.raises(errors.InstanceInUse) as caught:
            world.allocate("pod-new", (0, "1g.10gb", 0, 1))

        assert caught.value.metadata["mig_uuid"] == old.identity.mig_uuid
        assert world.everything() == before
        assert set(world.states().values()) == {State.IDLE}
        world.hw.set_busy(old.identity.mig_uuid, False)
        again = world.allocate("pod-new", (0, "1g.10gb", 0, 1)).devices[0]
        assert (again.outcome, again.identity) == (Outcome.REUSED, old.identity)

    def test_an_nvml_error_while_counting_its_processes_fails_the_request_and_keeps_it_idle(
        self, world: World
    ) -> None:
        old = world.allocate("pod-old", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-old")
        before = world.everything()
        world.hw.inject_fault("processes", NVML_ERROR_UNKNOWN)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-new", (0, "1g.10gb", 0, 1))

        assert world.everything() == before
        again = world.allocate("pod-new", (0, "1g.10gb", 0, 1)).devices[0]
        assert (again.outcome, again.identity) == (Outcome.REUSED, old.identity)

    def test_a_busy_instance_a_later_device_would_reuse_fails_the_request_before_an_earlier_one_reclaims(
        self, world: World
    ) -> None:
        """Device 0 must reclaim an idle instance, device 1 would reuse one that still runs a process:
        the request fails INSTANCE_IN_USE and the idle instance in device 0's way is still there."""
        world.allocate("pod-old", (0, "1g.10gb", 0, 1))
        busy = world.allocate("pod-old", (1, "1g.10gb", 0, 1), container_index=1).devices[0]
        world.lifecycle.release("pod-old")
        world.hw.set_busy(busy.identity.mig_uuid)
        before = world.everything()

        with pytest.raises(errors.InstanceInUse):
            world.allocate("pod-new", (0, "2g.20gb", 0, 2), (1, "1g.10gb", 0, 1))

        assert world.everything() == before


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
