"""Failures fail closed: all-or-nothing requests, undo of partial creates, ERROR for stuck destroys."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lifecycle_world import BOOT_ID, Dev, World, gis, restart

from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import Identity, Outcome, State
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.recovery_plan.plan import plan
from sidecar.nvml.port import Placement
from sidecar.store import durable

NVML_ERROR_UNKNOWN = 999
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
FOREVER = 1000  # more attempts than any bounded retry makes
ATTEMPTS = 3  # the adapter's bounded retries of a transient code (PynvmlBackend's default)
# A read-back of a new instance that fails: at once (UNKNOWN), or through every retry (TIMEOUT).
READ_BACK_FAILURES = [
    pytest.param(NVML_ERROR_UNKNOWN, 1, id="unknown"),
    pytest.param(NVML_ERROR_TIMEOUT, ATTEMPTS, id="timeout"),
]


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

        # Exactly its reservation, the fault still there: the inline retry fails again, the answer
        # is retryable (UNAVAILABLE), and the instance is still ERROR, not reused.
        with pytest.raises(errors.NvmlFailure) as caught:
            world.allocate("pod-c", (0, "1g.10gb", 4, 1))
        assert (caught.value.metadata["blocker"], caught.value.metadata["mig_uuid"]) == (
            "ERROR",
            idle.identity.mig_uuid,
        )
        assert idle.identity.mig_uuid in world.live_mig_uuids()
        assert [r.state for r in world.record_files().values()] == [State.ERROR]

        world.hw.clear_faults()
        created = world.allocate("pod-c", (0, "1g.10gb", 4, 1))

        [device] = created.devices
        assert device.outcome is Outcome.CREATED
        assert device.identity.mig_uuid != idle.identity.mig_uuid  # destroyed and made anew, never reused
        assert [r.identity for r in created.reclaimed] == [idle.identity]
        assert idle.identity.mig_uuid not in world.live_mig_uuids()
        world.assert_consistent()


class TestATransientNvmlErrorDuringReuseKeepsTheInstanceIdle:
    """Only a real identity mismatch sends an idle instance to ERROR."""

    # The calls of the verification: the lookup by MIG UUID, its processes.
    @pytest.mark.parametrize("op", ["handle-by-uuid", "processes"])
    def test_an_nvml_error_while_verifying_fails_the_request_and_the_instance_stays_reusable(
        self, world: World, op: str
    ) -> None:
        old = world.allocate("pod-old", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-old")
        before = world.everything()
        world.hw.inject_fault(op, NVML_ERROR_UNKNOWN)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-new", (0, "1g.10gb", 0, 1))

        assert world.everything() == before
        assert [r.state for r in world.lifecycle.instances()] == [State.IDLE]
        Reconciler(world.lifecycle).run_once()
        again = world.allocate("pod-new", (0, "1g.10gb", 0, 1)).devices[0]
        assert (again.outcome, again.identity) == (Outcome.REUSED, old.identity)

    def test_an_instance_recreated_behind_the_sidecars_back_still_goes_to_error(self, world: World) -> None:
        world.allocate("pod-old", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-old")
        [idle] = world.record_files().values()
        assert idle.gpu_instance_id is not None
        world.hw.destroy_instance(0, idle.gpu_instance_id)
        world.hw.create_instance(0, "1g.10gb", 0, 1)

        with pytest.raises(errors.UnverifiableState):
            world.allocate("pod-new", (0, "1g.10gb", 0, 1))

        assert world.states() == {idle.name: State.ERROR}


def allocate_past_validation(world: World, gpu: int, device: Dev, meanwhile: Callable[[], None]) -> Any:
    """Allocate ``device`` on GPU ``gpu`` while the GPU's lock is held elsewhere (as a SetMigMode holds
    it); ``meanwhile`` runs once validation is done (the Allocate has claimed its key and waits for
    the GPU lock). Returns the Allocate's result or the exception it raised."""
    world.lifecycle.gpu_info(
        world.uuid(gpu)
    )  # the static GPU list is cached: the next mode read is validation's
    outcome: list[Any] = []

    def allocate() -> None:
        try:
            outcome.append(world.allocate("pod-a", device))
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    with world.ctx.exclusive([world.uuid(gpu)]):
        worker = threading.Thread(target=allocate)
        worker.start()
        give_up = time.monotonic() + 60  # only so that a broken test fails instead of hanging
        while not world.ctx.locks._claimed:
            assert time.monotonic() < give_up, "the allocate never validated"
            time.sleep(0.005)
        meanwhile()
    worker.join()
    [result] = outcome
    return result


class TestMigDisabledWhileAnAllocateWaitsForItsGpu:
    """The MIG mode is checked again under the GPU lock, before the first change."""

    def test_an_allocate_that_raced_a_mig_disable_answers_mig_disabled_and_changes_nothing(
        self, world: World
    ) -> None:
        # Validation has seen MIG enabled; the lock is still held elsewhere.
        error = allocate_past_validation(
            world, 1, (1, "1g.10gb", 0, 1), lambda: world.hw.set_mig_mode(1, False)
        )

        assert isinstance(error, errors.MigDisabled)
        assert world.everything() == (set(), {}, set())


class TestAMigModeChangeWhileAnAllocateWaitsForItsGpu:
    def test_the_allocate_renders_its_cdi_spec_with_the_minor_number_the_gpu_has_now(
        self, cdi_world: World
    ) -> None:
        """A mode change may rebind the device under a new minor number; an Allocate validated before
        it must not write a spec naming the old device nodes."""
        world = cdi_world

        def rebind_under_another_minor() -> None:
            with world.hw.store.transaction() as state:
                state.gpus[0].minor = 3
            world.lifecycle.set_mig_mode(world.uuid(0), True)

        result = allocate_past_validation(world, 0, (0, "3g.40gb", 4, 4), rebind_under_another_minor)

        [device] = result.devices
        spec = world.cdi.spec_path(device.identity.mig_uuid).read_text()
        assert "/dev/nvidia3" in spec
        assert "/dev/nvidia0" not in spec


class TestAFailedCreateLeavesNoUnrecordedInstance:
    @pytest.mark.parametrize(("code", "times"), READ_BACK_FAILURES)
    def test_a_gpu_instance_made_by_a_create_that_then_failed_is_destroyed_by_the_undo(
        self, world: World, code: int, times: int
    ) -> None:
        """The driver made the GI, but reading its info failed: the undo must find the bare GI at the
        exact placement instead of leaving it on the GPU without a record, where it would block the
        placement for good."""
        world.hw.inject_fault("nvmlGpuInstanceGetInfo", code, times=times)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "3g.40gb", 4, 4))

        assert world.everything() == (set(), {}, set())
        world.hw.clear_faults()
        assert world.allocate("pod-a", (0, "3g.40gb", 4, 4)).devices[0].identity.gpu_instance_id > 0


class TestARecordDeleteThatFailsAfterTheDestroyIsRetried:
    def test_an_instance_whose_record_could_not_be_deleted_after_its_destroy_is_finished_by_the_reconciler(
        self, world: World, monkeypatch: pytest.MonkeyPatch
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
        seen_on_disk: list[bytes] = []
        destroy_gi = world.port.destroy_gpu_instance

        def destroy_then_take_the_directory_away(gpu_uuid: str, gpu_instance_id: int) -> None:
            # The window between the DELETING record and the record delete: the GI is gone, and the
            # state directory goes away before the sidecar deletes the record.
            destroy_gi(gpu_uuid, gpu_instance_id)
            if not seen_on_disk:
                seen_on_disk.append(record_file.read_bytes())
                state_dir.rename(away)
                state_dir.write_text("not a directory")

        try:
            with monkeypatch.context() as patch:
                patch.setattr(world.port, "destroy_gpu_instance", destroy_then_take_the_directory_away)
                with pytest.raises(errors.StateWriteFailed):
                    world.allocate("pod-a", (0, "3g.40gb", 4, 4))
        finally:
            if away.exists():
                state_dir.unlink()
                away.rename(state_dir)

        [on_disk] = seen_on_disk  # the hook ran once, after the reclaim's destroy of the idle GI
        assert b'"DELETING"' in on_disk  # the reclaim recorded DELETING before its destroy
        assert world.layout() == set()
        report = Reconciler(world.lifecycle).run_once()
        assert [ref.reservation for ref in report.destroyed] == [idle.reservation]
        assert world.everything() == (set(), {}, set())
        assert world.allocate("pod-a", (0, "3g.40gb", 4, 4)).devices[0].outcome is Outcome.CREATED
        world.assert_consistent()


class TestAFailedUndoRecordsTheComputeInstanceItsCreateMade:
    @pytest.mark.parametrize(("code", "times"), READ_BACK_FAILURES)
    def test_a_compute_instance_the_create_never_reported_is_recorded_and_destroyed_by_the_reconciler(
        self, world: World, code: int, times: int
    ) -> None:
        """The driver made the CI, but reading it failed, and the undo's destroy failed too. The ERROR
        record names the CI, so the reconciler destroys the instance instead of refusing it as someone
        else's for good."""
        world.hw.inject_fault("nvmlComputeInstanceGetInfo_v2", code, times=times)
        world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "1g.10gb", 0, 1))

        [(_, gi_id, _, _, ((ci_id, mig_uuid),))] = world.layout()
        [record] = world.record_files().values()
        assert record.state is State.ERROR
        assert record.identity == Identity(gi_id, ci_id, mig_uuid)
        report = Reconciler(world.lifecycle).run_once()
        assert [ref.identity for ref in report.destroyed] == [record.identity]
        assert world.everything() == (set(), {}, set())

    def test_after_a_restart_the_instance_of_such_an_error_record_is_destroyed_too(
        self, world: World
    ) -> None:
        world.hw.inject_fault("nvmlComputeInstanceGetInfo_v2", NVML_ERROR_UNKNOWN)
        world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "1g.10gb", 0, 1))

        restart(world).recover([])
        Reconciler(world.lifecycle).run_once()

        assert world.everything() == (set(), {}, set())


class TestAnUndoThatFailsWhileLookingForTheComputeInstanceItsCreateMade:
    """The driver made the CI and reading it failed; then one more NVML call fails somewhere in the
    undo (here: the n-th GI listing after the fault is armed), so the undo may not even learn the
    CI's ID. The record written before the CI create says it was issued, so whatever the undo left,
    the reconciler (or recovery after a restart) destroys it as ours instead of keeping it foreign."""

    @pytest.mark.parametrize("after", range(20))
    def test_the_reconciler_leaves_nothing_behind(self, world: World, after: int) -> None:
        self.fail_create_and_its_undo(world, after)

        Reconciler(world.lifecycle).run_once()

        assert world.everything() == (set(), {}, set())

    @pytest.mark.parametrize("after", range(20))
    def test_recovery_after_a_restart_leaves_nothing_behind(self, world: World, after: int) -> None:
        self.fail_create_and_its_undo(world, after)

        report = restart(world).recover([])
        Reconciler(world.lifecycle).run_once()

        assert report.preserved_foreign == ()
        assert world.everything() == (set(), {}, set())

    @staticmethod
    def fail_create_and_its_undo(world: World, after: int) -> None:
        world.hw.inject_fault("nvmlComputeInstanceGetInfo_v2", NVML_ERROR_UNKNOWN)
        world.hw.inject_fault("get-gpu-instances", NVML_ERROR_UNKNOWN, after=after)
        with pytest.raises(errors.SidecarError):
            world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.hw.clear_faults()


class TestAFailedUndoThatCouldNotFindItsGpuInstanceKeepsItsRecord:
    """The driver made the GI, reading it failed, and the undo's search for it failed too: the ERROR
    record has no GI ID, yet the GI it stands for is on the GPU. The record goes only with the GI."""

    @staticmethod
    def fail_create_and_undo(world: World) -> str:
        world.hw.inject_fault("nvmlGpuInstanceGetInfo", NVML_ERROR_UNKNOWN, times=2)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "3g.40gb", 4, 4))
        [record] = world.record_files().values()
        assert (record.state, record.gpu_instance_id) == (State.ERROR, None)
        assert gis(world, 0) == {("4:4", 0)}
        return record.name

    def test_the_reconciler_finds_the_gpu_instance_and_destroys_it_with_the_record(
        self, world: World
    ) -> None:
        self.fail_create_and_undo(world)

        report = Reconciler(world.lifecycle).run_once()

        assert [str(ref.reservation.placement) for ref in report.destroyed] == ["4:4"]
        assert world.everything() == (set(), {}, set())
        assert world.allocate("pod-b", (0, "3g.40gb", 4, 4)).devices[0].outcome is Outcome.CREATED

    def test_while_the_gpu_instance_cannot_be_read_the_record_stays_error(self, world: World) -> None:
        name = self.fail_create_and_undo(world)
        world.hw.inject_fault("nvmlGpuInstanceGetInfo", NVML_ERROR_UNKNOWN)

        report = Reconciler(world.lifecycle).run_once()

        assert report.still_failing == (name,)
        assert world.states() == {name: State.ERROR}
        assert gis(world, 0) == {("4:4", 0)}

    def test_a_gpu_instance_completed_by_someone_else_is_left_alone_and_the_record_stays_error(
        self, world: World
    ) -> None:
        name = self.fail_create_and_undo(world)
        [(_, gi_id, _, _, _)] = world.layout()
        world.hw.destroy_instance(0, gi_id)
        world.hw.create_instance(0, "3g.40gb", 4, 4)  # a GI with a CI at exactly that placement
        before = world.layout()

        report = Reconciler(world.lifecycle).run_once()

        assert report.still_failing == (name,)
        assert world.states() == {name: State.ERROR}
        assert world.layout() == before

    def test_after_a_restart_recovery_destroys_the_gpu_instance_with_the_record(self, world: World) -> None:
        self.fail_create_and_undo(world)

        report = restart(world).recover([])

        assert report.preserved_foreign == ()
        assert world.everything() == (set(), {}, set())


class TestAFailedCreateLeavesNoCdiFile:
    def test_a_spec_file_in_place_when_its_directory_sync_failed_is_removed_by_the_undo(
        self, cdi_world: World, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The spec is renamed into place before the CDI directory is synced; when that sync fails
        (EIO) the write fails with the file already there. The undo removes it with the instance."""
        world = cdi_world
        sync = durable.fsync_dir

        def cdi_dir_sync_fails(directory: Path) -> None:
            if directory == world.cdi_dir:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(directory))
            sync(directory)

        monkeypatch.setattr(durable, "fsync_dir", cdi_dir_sync_fails)

        with pytest.raises(errors.StateWriteFailed):
            world.allocate("pod-a", (0, "1g.10gb", 0, 1))

        assert world.everything() == (set(), {}, set())


class TestACiMadeLaterInABareGpuInstanceOfOursIsNeverDestroyed:
    """A record whose create issued the CI create owns an unrecorded CI in its GI only until the
    sidecar has seen that GI without a CI: a CI that shows up there afterwards was made by someone
    else, and destroying the instance must stop at it (the GI stays, foreign)."""

    PLACEMENT = Placement(4, 4)

    def test_after_an_undo_that_saw_no_ci_and_failed_to_destroy_the_gi(self, world: World) -> None:
        world.hw.inject_fault("create-ci", NVML_ERROR_INSUFFICIENT_RESOURCES, times=FOREVER)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)
        with pytest.raises(errors.SidecarError):
            world.allocate("pod-a", (1, "3g.40gb", self.PLACEMENT.start, self.PLACEMENT.size))
        world.hw.clear_faults()
        [record] = world.record_files().values()
        assert (record.state, record.compute_instance_id) == (State.ERROR, None)
        assert record.gpu_instance_id is not None
        self.someone_makes_a_ci(world, record.gpu_instance_id)
        layout = world.layout()

        Reconciler(world.lifecycle).run_once()

        assert world.layout() == layout

    def test_after_recovery_saw_the_crashed_creates_gi_bare(self, world: World) -> None:
        record = self.crashed_after_recording_the_gi(world)
        recovery = restart(world)
        decided = plan(recovery.gather([]))
        self.someone_makes_a_ci(world, record.gpu_instance_id)
        layout = world.layout()

        recovery.apply(decided)

        assert world.layout() == layout

    def test_after_recovery_failed_to_destroy_the_crashed_creates_bare_gi(self, world: World) -> None:
        record = self.crashed_after_recording_the_gi(world)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)
        restart(world).recover([])
        world.hw.clear_faults()
        self.someone_makes_a_ci(world, record.gpu_instance_id)
        layout = world.layout()

        Reconciler(world.lifecycle).run_once()

        assert world.layout() == layout

    def crashed_after_recording_the_gi(self, world: World) -> OwnershipRecord:
        """What a crash between recording the new GI and the CI create leaves."""
        gi = world.hw.create_instance(1, "3g.40gb", self.PLACEMENT.start, self.PLACEMENT.size, with_ci=False)
        [profile] = [p for p in world.port.gpu_instance_profiles(world.uuid(1)) if p.name == "3g.40gb"]
        record = OwnershipRecord(
            gpu_uuid=world.uuid(1),
            profile="3g.40gb",
            gi_profile_id=gi.profile_id,
            ci_profile_id=profile.ci_profile_id,
            placement=self.PLACEMENT,
            state=State.CREATING,
            gpu_instance_id=gi.id,
            boot_id=BOOT_ID,
            ci_create_issued=True,
        )
        world.records.put(record)
        return record

    @staticmethod
    def someone_makes_a_ci(world: World, gpu_instance_id: int | None) -> None:
        assert gpu_instance_id is not None
        [profile] = [p for p in world.port.gpu_instance_profiles(world.uuid(1)) if p.name == "3g.40gb"]
        world.port.create_compute_instance(world.uuid(1), gpu_instance_id, profile.ci_profile_id)
