"""Follow-ups of a correctness review: judgement calls, decided and pinned here, one class per finding.

Every test failed before the fix its class names; they run over the simulated hardware through the
real pynvml adapter, records and CDI code, and assert the NVML layout, the record files, the CDI files
and what later transactions see.
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Iterator

import pytest
from lifecycle_world import BOOT_ID, World

from sidecar import errors, records
from sidecar.cdi import CdiSpecs
from sidecar.domain import ActiveAllocation, AllocateResult, Outcome, Owner, PodRef, State
from sidecar.lifecycle import GENERATION_BLOCK, Lifecycle
from sidecar.nvml.port import NVML_ERROR_UNKNOWN
from sidecar.reconciler import Reconciler
from sidecar.records import GENERATION_FILE, RecordStore
from sidecar.recovery import Recovery


def restart(world: World) -> Recovery:
    """Forget everything in memory, keep hardware and files; a new lifecycle, not yet recovered."""
    world.records.close()
    records = RecordStore(world.records.directory)
    records.open()
    cdi = CdiSpecs(world.cdi.directory, kind=world.cdi.kind, proc_root=world.cdi.proc_root)
    world.records, world.cdi = records, cdi
    world.lifecycle = Lifecycle(world.port, records, cdi, BOOT_ID)
    return Recovery(world.lifecycle, world.port, records, cdi, BOOT_ID, adopt_existing=False)


def recovery_of(world: World) -> Recovery:
    """A Recovery over the running lifecycle (a repeated Recover RPC)."""
    return Recovery(world.lifecycle, world.port, world.records, world.cdi, BOOT_ID, adopt_existing=False)


def active_of(pod: str, result: AllocateResult) -> list[ActiveAllocation]:
    """What the plugin reads back from the pod annotation after a successful Allocate."""
    return [
        ActiveAllocation(
            owner=Owner(PodRef(pod, "default", f"name-{pod}"), "main", 0, device.device_index),
            reservation=device.reservation,
            identity=device.identity,
        )
        for device in result.devices
    ]


@contextlib.contextmanager
def files_cannot_grow_past(size: int) -> Iterator[None]:
    """Every file write of this process beyond ``size`` bytes fails (EFBIG), as on a full disk.

    Python ignores SIGXFSZ, so the write returns an error instead of ending the process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def state_of(world: World) -> dict[str, State]:
    return {r.name: r.state for r in world.lifecycle.instances()}


class TestAnInstanceAPodHoldsIsNeverDestroyedBeforeTheFirstSyncActive:
    """Finding A: Recover sets the referenced MIG UUIDs from its own active allocations."""

    def test_an_adopted_instance_whose_record_could_not_be_written_stays_on_the_gpu(
        self, world: World
    ) -> None:
        """The pod's instance verifies live, but writing its record fails during Recover (the record is
        larger than the files that still fit, such as the small generation file): it is ERROR in the
        table. The pod still runs on it, so the reconciler must leave its hardware alone."""
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        [record] = world.record_files().values()
        recovery = restart(world)
        (world.records.directory / f"{record.name}.json").unlink()  # Recover must write it again
        before = world.layout()

        with files_cannot_grow_past(256):
            report = recovery.recover(active_of("pod-a", held))

        assert report.errors
        assert state_of(world) == {record.name: State.ERROR}
        assert world.lifecycle.referenced_mig_uuids == {held.devices[0].identity.mig_uuid}
        Reconciler(world.lifecycle).run_once()
        assert world.layout() == before
        assert state_of(world) == {record.name: State.ERROR}

    def test_once_a_sync_active_no_longer_lists_it_the_reconciler_destroys_it(self, world: World) -> None:
        """The guard is the plugin's latest view: a SyncActive that does not list the MIG UUID ends it."""
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        [record] = world.record_files().values()
        recovery = restart(world)
        (world.records.directory / f"{record.name}.json").unlink()
        with files_cannot_grow_past(256):
            recovery.recover(active_of("pod-a", held))

        world.lifecycle.sync_active(world.lifecycle.generation, [])
        report = Reconciler(world.lifecycle).run_once()

        assert [ref.reservation for ref in report.destroyed] == [record.reservation]
        assert world.everything() == (set(), {}, set())


class TestTheGenerationNeverGoesBackAcrossARestart:
    """Finding B: the generation restarts from a durable ceiling, not from the surviving records."""

    def test_a_sync_active_fenced_before_a_restart_does_not_idle_an_instance_activated_after_it(
        self, world: World
    ) -> None:
        """The instance activated last was reclaimed (its record is gone), so the records alone would
        restart the count below what the plugin already read; its fenced SyncActive would then take
        the new pod's instance for a release."""
        world.allocate("pod-b", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-b")
        world.hw.inject_fault("nvmlDeviceCreateGpuInstanceWithPlacement", NVML_ERROR_UNKNOWN)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-c", (0, "2g.20gb", 0, 2))  # reclaims pod-b's instance, then fails
        assert world.everything() == (set(), {}, set())
        read_by_the_plugin = world.lifecycle.generation

        restart(world).recover([])
        world.allocate("pod-d", (0, "1g.10gb", 4, 1))
        idled, _ = world.lifecycle.sync_active(read_by_the_plugin, [])  # a pod list from before pod-d

        assert idled == []
        assert set(world.states().values()) == {State.ACTIVE}
        assert world.lifecycle.generation > read_by_the_plugin

    def test_generations_stay_small_numbers(self, world: World) -> None:
        """The ceiling moves in blocks; nothing seeds it from the clock."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        restart(world).recover([])
        world.allocate("pod-b", (0, "1g.10gb", 1, 1))

        assert 2 <= world.lifecycle.generation <= 2 * GENERATION_BLOCK + 2

    def test_a_corrupt_generation_file_stops_recovery_and_modifies_nothing(self, world: World) -> None:
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        recovery = restart(world)
        generation_file = world.records.directory / GENERATION_FILE
        generation_file.write_bytes(b'{"version":1,"checksum":"sha256:00","record":{"ceiling":7}}\n')
        before = world.everything()

        with pytest.raises(errors.UnverifiableState) as caught:
            recovery.recover(active_of("pod-a", held))

        assert GENERATION_FILE in str(caught.value)
        assert not world.lifecycle.recovered
        assert world.everything() == before
        assert generation_file.read_bytes().startswith(b'{"version":1,"checksum":"sha256:00"')

    def test_without_a_generation_file_recovery_starts_from_the_records(self, world: World) -> None:
        """A first run after an upgrade: the records are all there is, and they are enough."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (0, "1g.10gb", 1, 1))
        newest = max(r.activated_generation for r in world.record_files().values())
        recovery = restart(world)
        (world.records.directory / GENERATION_FILE).unlink()

        recovery.recover([])

        assert world.lifecycle.generation >= newest
        world.lifecycle.release("pod-a")
        assert world.allocate("pod-c", (0, "1g.10gb", 0, 1)).devices[0].outcome is Outcome.REUSED
        assert world.lifecycle.generation > newest

    def test_records_verify_reports_the_generation_file(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        good = records.verify(world.records.directory, BOOT_ID)
        assert good.generation_ceiling is not None
        assert good.generation_ceiling >= world.lifecycle.generation
        assert "generation ceiling" in records.format_report(good)

        (world.records.directory / GENERATION_FILE).write_bytes(b"{")
        bad = records.verify(world.records.directory, BOOT_ID)
        assert bad.generation_ceiling is None
        assert bad.corrupt.keys() == {GENERATION_FILE}
        assert "CORRUPT" in records.format_report(bad)


class TestARepeatedRecoverNeverReleases:
    """Finding C: once recovered, Recover leaves ACTIVE instances ACTIVE; releases are SyncActive's job."""

    def test_a_recover_with_a_pod_list_older_than_an_allocate_keeps_that_instance_active(
        self, world: World
    ) -> None:
        old_pod_list: list[ActiveAllocation] = []
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        before = world.everything()

        report = recovery_of(world).recover(old_pod_list)

        assert report.restored_idle == ()
        assert world.everything() == before
        [record] = world.lifecycle.instances()
        assert record.state is State.ACTIVE
        assert record.owner is not None
        assert record.owner.pod.uid == "pod-a"
        again = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        assert (again.outcome, again.identity) == (Outcome.ALREADY_ALLOCATED, held.devices[0].identity)

    def test_a_repeated_recover_still_restores_idle_instances_and_repairs_their_cdi_files(
        self, cdi_world: World
    ) -> None:
        world = cdi_world
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (0, "1g.10gb", 1, 1))
        world.lifecycle.release("pod-b")
        before = world.everything()
        for spec in world.cdi_dir.iterdir():
            spec.unlink()

        report = recovery_of(world).recover([])

        assert len(report.restored_idle) == 1
        assert world.everything() == before
        assert sorted(r.state for r in world.lifecycle.instances()) == [State.ACTIVE, State.IDLE]

    def test_the_first_recover_after_a_restart_still_restores_unlisted_instances_as_idle(
        self, world: World
    ) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))

        restart(world).recover([])

        assert set(world.states().values()) == {State.IDLE}


class TestReuseWaitsUntilNoProcessRunsOnTheIdleInstance:
    """Finding D: a pod in its grace period may still run on an idle instance; it is not shared."""

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


class TestATransientNvmlErrorDuringReuseKeepsTheInstanceIdle:
    """Finding E: only a real identity mismatch sends an idle instance to ERROR."""

    @pytest.mark.parametrize("op", ["get-gpu-instances", "get-compute-instances"])
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


def rename_the_legacy_way(world: World, gpu_index: int, gi_id: int) -> str:
    """What an R450/R460 driver reports for the CI of a GI: ``MIG-GPU-<uuid>/<gi>/<ci>``.

    That form is built from IDs the driver reuses, so it stays the same across a re-creation and
    cannot prove "same instance". The simulator only makes the modern form; its state is edited."""
    with world.hw.store.transaction() as state:
        gpu = state.gpus[gpu_index]
        gi = next(g for g in gpu.gis if g.id == gi_id)
        ci = gi.cis[0]
        ci.mig_uuid = f"MIG-{gpu.uuid}/{gi.id}/{ci.id}"
        return ci.mig_uuid


class TestALegacyMigUuidIsUnverifiable:
    """Finding G: legacy MIG UUIDs fail closed with a domain error, never INTERNAL."""

    @pytest.mark.parametrize("adopt", [False, True], ids=["preserve", "adopt"])
    def test_recover_answers_unverifiable_state_naming_the_instance_and_modifies_nothing(
        self, world: World, adopt: bool
    ) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        foreign = world.hw.create_instance(1, "1g.10gb", 4, 1)
        legacy = rename_the_legacy_way(world, 1, foreign.id)
        recovery = restart(world)
        recovery.adopt_existing = adopt
        before = world.everything()

        with pytest.raises(errors.UnverifiableState) as caught:
            recovery.recover([])

        assert legacy in str(caught.value)
        assert caught.value.metadata["mig_uuid"] == legacy
        assert world.everything() == before
        assert not world.lifecycle.recovered


class TestMigDisabledWhileAnAllocateWaitsForItsGpu:
    """Finding H: the MIG mode is checked again under the GPU lock, before the first change."""

    def test_an_allocate_that_raced_a_mig_disable_answers_mig_disabled_and_changes_nothing(
        self, world: World
    ) -> None:
        gpu = world.uuid(1)
        world.lifecycle.gpu_info(gpu)  # the static GPU list is cached: the next mode read is validation's
        outcome: list[BaseException | None] = []

        def allocate() -> None:
            try:
                world.allocate("pod-a", (1, "1g.10gb", 0, 1))
                outcome.append(None)
            except Exception as exc:  # noqa: BLE001 - handed to the test thread
                outcome.append(exc)

        with world.lifecycle.exclusive([gpu]):  # what a SetMigMode holds while it disables MIG
            reads = world.hw.call_counts().get("nvmlDeviceGetMigMode", 0)
            worker = threading.Thread(target=allocate)
            worker.start()
            give_up = time.monotonic() + 60  # only so that a broken test fails instead of hanging
            while world.hw.call_counts().get("nvmlDeviceGetMigMode", 0) == reads:
                assert time.monotonic() < give_up, "the allocate never validated"
                time.sleep(0.005)
            world.hw.set_mig_mode(1, False)  # validation has seen MIG enabled; the lock is still ours
        worker.join()

        [error] = outcome
        assert isinstance(error, errors.MigDisabled)
        assert world.everything() == (set(), {}, set())
