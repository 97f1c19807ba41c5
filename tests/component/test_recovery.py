"""Restart recovery over simulated hardware, in process: real adapter, records, CDI and lifecycle.

A "restart" here is what a killed sidecar leaves behind: the hardware (the simulator) and the files
(records, CDI specs) stay, the in-memory lifecycle is gone. ``restart`` builds a fresh lifecycle on the
same hardware and directories, exactly as the composition root does at startup, and returns its
``Recoverer``. Outcomes are asserted on the hardware layout, the files and later transactions.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import msgspec
import pytest
from lifecycle_world import BOOT_ID, World, active_of, files_cannot_grow_past, gis, restart

from sidecar.lifecycle.reconciler import Reconciler
from sidecar.lifecycle.recover import Recoverer
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Identity, Outcome, State
from sidecar.model.ownership import OwnershipRecord, record_name
from sidecar.model.recovery_plan.plan import plan
from sidecar.nvml.port import NVML_ERROR_UNKNOWN, Placement
from sidecar.nvml.sim.state import SimGpu
from sidecar.store import record_verify

FOREVER = 1000


OTHER_MIG_UUID = "MIG-00000000-0000-5000-8000-000000000000"


def states(world: World) -> dict[tuple[int, str], State]:
    """(GPU index, placement) -> state of every record on disk."""
    index = {g.uuid: g.index for g in world.gpus}
    return {(index[r.gpu_uuid], str(r.placement)): r.state for r in world.record_files().values()}


def refs(items: Iterable[object]) -> set[str]:
    return {str(getattr(r, "reservation", "")) for r in items}


class TestOwnedInstancesSurviveARestart:
    def test_active_allocations_come_back_active_and_released_ones_idle_and_reusable(
        self, world: World
    ) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        b = world.allocate("pod-b", (0, "3g.40gb", 4, 4))
        c = world.allocate("pod-c", (1, "2g.20gb", 0, 2))
        world.lifecycle.release("pod-c")
        before = world.everything()

        report = restart(world).recover([*active_of("pod-a", a), *active_of("pod-b", b)])

        assert world.everything() == before
        assert states(world) == {(0, "0:1"): State.ACTIVE, (0, "4:4"): State.ACTIVE, (1, "0:2"): State.IDLE}
        assert {r.identity for r in report.adopted_active} == {a.devices[0].identity, b.devices[0].identity}
        assert [r.identity for r in report.restored_idle] == [c.devices[0].identity]
        assert report.errors == ()
        assert report.preserved_foreign == ()
        assert report.dropped_stale_records == ()
        world.assert_consistent()
        again = world.allocate("pod-d", (1, "2g.20gb", 0, 2))
        assert again.devices[0].outcome is Outcome.REUSED
        assert again.devices[0].identity == c.devices[0].identity

    def test_the_gate_opens_only_with_a_successful_recovery(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        recovery = restart(world)
        with pytest.raises(errors.NotRecovered):
            world.allocate("pod-b", (0, "1g.10gb", 1, 1))
        recovery.recover([])
        assert world.allocate("pod-b", (0, "1g.10gb", 1, 1)).devices[0].outcome is Outcome.CREATED

    def test_the_generation_never_goes_backwards_across_a_restart(self, world: World) -> None:
        """The highest generation handed out lives in no record: pod-b's release took it, and a
        failed create reclaimed pod-b's instance with its record. Only the durable ceiling has it."""
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (0, "1g.10gb", 2, 1))
        world.lifecycle.release("pod-b")
        world.hw.inject_fault("nvmlDeviceCreateGpuInstanceWithPlacement", NVML_ERROR_UNKNOWN)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-c", (0, "2g.20gb", 2, 2))  # reclaims pod-b's instance, then fails
        generation = world.lifecycle.generation
        [left] = world.record_files().values()
        assert max(left.activated_generation, left.idled_generation) < generation

        restart(world).recover(active_of("pod-a", a))

        assert world.lifecycle.generation >= generation

    def test_recovering_twice_gives_the_same_table_and_destroys_nothing_the_second_time(
        self, world: World
    ) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (0, "1g.10gb", 1, 1))
        world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)
        recovery = restart(world, adopt=True)
        first = recovery.recover(active_of("pod-a", a))
        table = world.lifecycle.instances()
        hardware = world.layout()
        second = recovery.recover(active_of("pod-a", a))
        assert world.lifecycle.instances() == table
        assert world.layout() == hardware
        assert len(first.removed_orphan_gis) == 1
        assert second.removed_orphan_gis == ()
        assert second.dropped_stale_records == ()
        assert second.adopted_active == first.adopted_active


class TestRecoveryModifiesNothingItCannotVerify:
    def test_an_allocation_with_a_foreign_mig_uuid_fails_and_leaves_every_byte_alone(
        self, world: World
    ) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (0, "1g.10gb", 1, 1))
        world.lifecycle.release("pod-b")
        world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)  # an orphan adoption would remove
        (lying,) = active_of("pod-a", a)
        assert lying.identity is not None
        lying = ActiveAllocation(
            lying.owner,
            lying.reservation,
            Identity(lying.identity.gpu_instance_id, lying.identity.compute_instance_id, OTHER_MIG_UUID),
        )
        before = world.everything()
        recovery = restart(world, adopt=True)

        with pytest.raises(errors.UnverifiableState, match="pod-a"):
            recovery.recover([lying])

        assert world.everything() == before
        assert not world.lifecycle.recovered
        with pytest.raises(errors.NotRecovered):
            world.lifecycle.release("pod-a")

    def test_nvml_failing_during_gather_fails_modifies_nothing_and_a_later_recovery_succeeds(
        self, world: World
    ) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.hw.reboot()  # every record is now stale: a recovery that ran would drop them
        before = world.everything()
        recovery = restart(world, boot_id="after-reboot")
        world.hw.inject_fault("get-compute-instances", NVML_ERROR_UNKNOWN, times=FOREVER)
        world.hw.inject_fault("get-gpu-instances", NVML_ERROR_UNKNOWN, times=FOREVER)

        with pytest.raises(errors.NvmlFailure):
            recovery.recover([])

        world.hw.clear_faults()  # before looking: the comparison reads NVML too
        assert world.everything() == before
        assert not world.lifecycle.recovered
        report = recovery.recover([])
        assert len(report.dropped_stale_records) == 1
        assert world.record_files() == {}
        assert world.cdi_files() == set()


class TestForeignInstancesArePreservedUnlessAdopted:
    def test_a_foreign_instance_is_preserved_and_blocks_an_overlapping_request(self, world: World) -> None:
        foreign = world.hw.create_instance(0, "3g.40gb", 0, 4)
        report = restart(world).recover([])
        assert [r.identity for r in report.preserved_foreign] == [
            Identity(foreign.id, 0, foreign.cis[0].mig_uuid)
        ]
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-a", (0, "1g.10gb", 1, 1))
        assert (str(foreign.placement), 1) in gis(world, 0)
        assert world.record_files() == {}

    def test_with_adoption_a_foreign_pair_becomes_idle_and_is_reused(self, world: World) -> None:
        foreign = world.hw.create_instance(0, "3g.40gb", 0, 4)
        report = restart(world, adopt=True).recover([])
        assert [r.identity for r in report.adopted_foreign] == [
            Identity(foreign.id, 0, foreign.cis[0].mig_uuid)
        ]
        assert states(world) == {(0, "0:4"): State.IDLE}
        world.assert_consistent()
        reused = world.allocate("pod-a", (0, "3g.40gb", 0, 4)).devices[0]
        assert (reused.outcome, reused.identity.mig_uuid) == (Outcome.REUSED, foreign.cis[0].mig_uuid)


class TestOrphanGisAreRemovedOnlyWhereNothingRuns:
    def test_with_adoption_an_orphan_on_an_idle_gpu_is_destroyed(self, world: World) -> None:
        world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)
        report = restart(world, adopt=True).recover([])
        assert len(report.removed_orphan_gis) == 1
        assert gis(world, 1) == set()
        assert world.record_files() == {}

    def test_with_adoption_an_orphan_on_a_gpu_with_an_active_allocation_is_preserved(
        self, world: World
    ) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.hw.create_instance(0, "3g.40gb", 4, 4, with_ci=False)
        report = restart(world, adopt=True).recover(active_of("pod-a", a))
        assert ("4:4", 0) in gis(world, 0)
        assert report.removed_orphan_gis == ()
        assert refs(report.preserved_foreign) == {f"{world.uuid(0)}/3g.40gb@4:4"}

    def test_with_adoption_an_orphan_on_a_gpu_running_a_process_is_preserved(self, world: World) -> None:
        world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)
        world.hw.set_busy(world.uuid(1), True)
        restart(world, adopt=True).recover([])
        assert gis(world, 1) == {("4:4", 0)}

    def test_without_adoption_an_orphan_is_preserved(self, world: World) -> None:
        world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)
        restart(world).recover([])
        assert gis(world, 1) == {("4:4", 0)}


class TestStaleAndBrokenRecords:
    def test_after_a_reboot_every_record_and_cdi_file_is_dropped(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1), (1, "7g.80gb", 0, 8))
        world.hw.reboot()
        report = restart(world, boot_id=world.hw.boot_id).recover([])
        assert len(report.dropped_stale_records) == 2
        assert world.record_files() == {}
        assert world.cdi_files() == set()

    def test_a_corrupt_record_is_never_deleted_and_its_instance_is_foreign(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        path = world.records.path(record_name(world.uuid(0), Placement(0, 1)))
        broken = path.read_bytes().rstrip()[:-7]  # into the JSON, whatever padding follows it
        path.write_bytes(broken)
        report = restart(world, adopt=True).recover([])
        assert path.read_bytes() == broken
        assert refs(report.preserved_foreign) == {f"{world.uuid(0)}/1g.10gb@0:1"}
        assert report.adopted_foreign == ()
        assert any(path.stem in e for e in report.errors)
        assert world.lifecycle.instances() == []
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-b", (0, "1g.10gb", 0, 1))

    def test_a_record_contradicting_the_hardware_is_kept_and_the_instance_never_reused(
        self, world: World
    ) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        (record,) = world.record_files().values()
        assert record.gpu_instance_id is not None
        # Someone else re-created the instance behind our back: same place, same IDs, new MIG UUID.
        world.hw.destroy_instance(0, record.gpu_instance_id)
        world.hw.create_instance(0, "1g.10gb", 0, 1)
        report = restart(world).recover([])
        assert world.record_files() == {record.name: record}
        assert world.lifecycle.instances() == []
        assert any("kept for the operator" in e for e in report.errors)
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-b", (0, "1g.10gb", 0, 1))


class TestARecordWithoutABootIdIsKeptAside:
    """Every record the sidecar writes carries the boot ID, so one without it was made or edited by
    hand. Recoverer judged it as this boot's (a CREATING one had the instance at its placement
    destroyed) while ``records verify`` called it stale; now recovery never acts on it, and verify
    lists it apart."""

    def test_its_instance_survives_as_foreign_and_every_file_stays(self, world: World) -> None:
        world.allocate("pod-a", (0, "3g.40gb", 0, 4))
        world.lifecycle.release("pod-a")
        [record] = world.record_files().values()
        world.records.put(msgspec.structs.replace(record, state=State.CREATING, boot_id=""))
        before = world.everything()

        report = restart(world, adopt=True).recover([])

        assert world.everything() == before
        assert world.lifecycle.instances() == []
        assert refs(report.preserved_foreign) == {f"{world.uuid(0)}/3g.40gb@0:4"}
        assert report.dropped_stale_records == ()
        assert report.adopted_foreign == ()
        [line] = report.errors
        assert record.name in line
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-b", (0, "3g.40gb", 0, 4))
        assert world.everything() == before

    def test_records_verify_lists_it_apart_not_as_stale(self, world: World) -> None:
        world.allocate("pod-a", (0, "3g.40gb", 0, 4))
        [record] = world.record_files().values()
        world.records.put(msgspec.structs.replace(record, boot_id=""))

        found = record_verify.verify(world.records.directory, BOOT_ID)

        assert (found.valid, found.no_boot_id, found.stale) == ((record.name,), (record.name,), ())
        assert f"NO BOOT  {record.name}" in record_verify.format_report(found)


class TestInterruptedTransactionsAreFinished:
    def test_a_creating_record_with_a_bare_gi_is_undone(self, world: World) -> None:
        gi = world.hw.create_instance(0, "3g.40gb", 0, 4, with_ci=False)
        creating = OwnershipRecord(
            gpu_uuid=world.uuid(0),
            profile="3g.40gb",
            gi_profile_id=gi.profile_id,
            ci_profile_id=2,
            placement=Placement(0, 4),
            state=State.CREATING,
            gpu_instance_id=gi.id,
            boot_id=BOOT_ID,
        )
        world.records.put(creating)
        report = restart(world).recover([])
        assert report.dropped_stale_records == (creating.name,)
        assert gis(world, 0) == set()
        assert world.record_files() == {}

    def test_a_deleting_record_whose_destroy_keeps_failing_goes_to_error_and_recovery_succeeds(
        self, world: World
    ) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        (record,) = world.record_files().values()
        world.records.put(msgspec.structs.replace(record, state=State.DELETING))
        world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
        report = restart(world).recover([])
        assert world.lifecycle.recovered
        assert states(world) == {(0, "0:1"): State.ERROR}
        assert [r.state for r in world.lifecycle.instances()] == [State.ERROR]
        assert any("finish deleting" in e for e in report.errors)
        assert a.devices[0].identity.mig_uuid in world.live_mig_uuids()


class TestCdiSpecsAreRepairedAtStartup:
    def test_a_missing_spec_of_an_idle_instance_is_rewritten_and_a_stray_one_removed(
        self, cdi_world: World
    ) -> None:
        world = cdi_world
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        mig_uuid = a.devices[0].identity.mig_uuid
        spec = world.cdi.spec_path(mig_uuid)
        spec.unlink()
        gone = "MIG-" + "1" * 8 + "-1111-1111-1111-" + "1" * 12
        stray = world.cdi.spec_path(gone)
        stray.write_text(
            json.dumps({"cdiVersion": "0.5.0", "kind": world.cdi.kind, "devices": [{"name": gone}]})
        )
        restart(world).recover([])
        assert world.cdi_files() == {spec.name}
        assert world.cdi_spec_is_current(0, a.devices[0].identity)


class TestTheCdiStepAtStartup:
    """Pinned: live owned instances get their spec, stray specs of our kind go, other kinds stay."""

    def test_specs_of_other_kinds_are_never_touched_and_strays_of_ours_are_removed(
        self, cdi_world: World
    ) -> None:
        world = cdi_world
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        spec = world.cdi.spec_path(a.devices[0].identity.mig_uuid)
        spec.unlink()
        gone = "MIG-" + "2" * 8 + "-2222-2222-2222-" + "2" * 12
        world.cdi.spec_path(gone).write_text(
            json.dumps({"cdiVersion": "0.5.0", "kind": world.cdi.kind, "devices": [{"name": gone}]})
        )
        other = world.cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json"
        other_text = json.dumps(
            {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"name": gone}, {"name": "all"}]}
        )
        other.write_text(other_text)

        report = restart(world).recover(active_of("pod-a", a))

        assert world.cdi_files() == {spec.name, other.name}
        assert other.read_text() == other_text
        assert world.cdi_spec_is_current(0, a.devices[0].identity)
        assert report.errors == ()


class TestAStrayCdiSpecIsRemovedByThePathItWasFoundAt:
    """Recoverer found the spec files of our kind by content and removed strays by the name
    derived from their MIG UUID, so a stray of our kind under another file name stayed forever (and
    kept publishing a device no instance backs). Now the file that was found is removed."""

    def test_a_stray_of_our_kind_under_an_odd_name_goes_and_other_kinds_stay(self, cdi_world: World) -> None:
        world = cdi_world
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-a")
        owned_spec = world.cdi.spec_path(held.identity.mig_uuid)
        gone = "MIG-" + "2" * 8 + "-2222-2222-2222-" + "2" * 12
        stray = world.cdi_dir / "hami-mig-stray.json"
        stray.write_text(
            json.dumps({"cdiVersion": "0.3.0", "kind": world.cdi.kind, "devices": [{"name": gone}]})
        )
        other = world.cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json"
        other_text = json.dumps(
            {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"name": gone}, {"name": "all"}]}
        )
        other.write_text(other_text)

        report = restart(world).recover([])

        assert world.cdi_files() == {owned_spec.name, other.name}
        assert other.read_text() == other_text
        assert world.cdi.pending_removals() == []
        assert [ref.identity for ref in report.restored_idle] == [held.identity]
        assert report.errors == ()


class TestARecordWriteFailingDuringRestoreLeavesAHealthyInstanceAlone:
    """Restoring a verified live instance writes its record (ACTIVE -> IDLE when no pod holds
    it). When that write failed, the instance went to ERROR, and the reconciler then destroyed a healthy
    instance. Now it is foreign for this process life (preserved, never reused, blocking its
    placement), the record on disk is left as it was, and the report says why; a later Recover with a
    working state directory restores it."""

    def held_then_restarted(self, world: World) -> tuple[Recoverer, OwnershipRecord, bytes]:
        """An instance a pod held when the sidecar stopped; the pod is gone by the restart."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        [record] = world.record_files().values()
        assert record.state is State.ACTIVE
        return restart(world), record, world.records.path(record.name).read_bytes()

    def test_the_instance_is_foreign_its_record_untouched_and_the_report_says_why(self, world: World) -> None:
        recovery, record, on_disk = self.held_then_restarted(world)
        before = world.layout()

        with files_cannot_grow_past(256):
            report = recovery.recover([])

        assert world.layout() == before
        assert world.lifecycle.instances() == []
        assert world.records.path(record.name).read_bytes() == on_disk
        assert report.restored_idle == ()
        assert [ref.identity for ref in report.preserved_foreign] == [record.identity]
        assert any(record.name in line for line in report.errors)

    def test_the_reconciler_leaves_it_alone_and_nothing_reuses_it(self, world: World) -> None:
        recovery, record, _ = self.held_then_restarted(world)
        with files_cannot_grow_past(256):
            recovery.recover([])
        before = world.layout()

        Reconciler(world.lifecycle).run_once()

        assert world.layout() == before
        assert world.states() == {record.name: State.ACTIVE}
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-b", (0, "1g.10gb", 0, 1))
        assert world.layout() == before

    def test_a_later_recover_with_a_working_state_directory_restores_it(self, world: World) -> None:
        recovery, record, _ = self.held_then_restarted(world)
        with files_cannot_grow_past(256):
            recovery.recover([])

        report = restart(world).recover([])

        assert [ref.identity for ref in report.restored_idle] == [record.identity]
        assert world.states() == {record.name: State.IDLE}
        reused = world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0]
        assert (reused.outcome, reused.identity) == (Outcome.REUSED, record.identity)


class TestAnAdoptionOrRestoreWhoseRecordCannotBeWrittenPublishesNothing:
    """An adoption whose record write failed was still reported in ``adopted_foreign`` and got its
    CDI spec, and a restore whose write failed got its spec too: the CDI steps ran apart from the
    record steps, whatever became of them. The instance is foreign then (no record of ours, not in
    the table), so nothing may publish it. Now the spec is written in the record's own step, after
    the record, and the report moves the instance to ``preserved_foreign``.

    The write fails because the record file turns corrupt between gather and apply: the store
    refuses to overwrite a corrupt file, and only the record write meets it."""

    @staticmethod
    def garble(world: World, name: str) -> bytes:
        garbage = b'{"version":1,"checksum":"sha256:00","record":{}}\n'
        world.records.path(name).write_bytes(garbage)
        return garbage

    def test_a_failed_adoption_is_reported_foreign_and_gets_no_cdi_spec(self, cdi_world: World) -> None:
        world = cdi_world
        foreign = world.hw.create_instance(0, "3g.40gb", 0, 4)
        mig_uuid = foreign.cis[0].mig_uuid
        recovery = restart(world, adopt=True)
        decided = plan(recovery.gather([]))
        assert [ref.identity for ref in decided.report.adopted_foreign] == [Identity(foreign.id, 0, mig_uuid)]
        name = record_name(world.uuid(0), Placement(0, 4))
        garbage = self.garble(world, name)

        report = recovery.apply(decided)

        assert report.adopted_foreign == ()
        assert [ref.identity for ref in report.preserved_foreign] == [Identity(foreign.id, 0, mig_uuid)]
        assert any(name in line for line in report.errors)
        assert world.cdi_files() == set()
        assert world.lifecycle.instances() == []
        assert world.records.path(name).read_bytes() == garbage
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-b", (0, "3g.40gb", 0, 4))

    def test_a_failed_restore_gets_no_cdi_spec_written(self, cdi_world: World) -> None:
        world = cdi_world
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        recovery = restart(world)
        spec = world.cdi.spec_path(held.identity.mig_uuid)
        spec.unlink()  # the restore would write it again
        decided = plan(recovery.gather([]))  # the pod is gone: ACTIVE -> IDLE, a record write
        self.garble(world, record_name(world.uuid(0), Placement(0, 1)))

        report = recovery.apply(decided)

        assert report.restored_idle == ()
        assert [ref.identity for ref in report.preserved_foreign] == [held.identity]
        assert not spec.exists()
        assert world.lifecycle.instances() == []

    def test_a_cdi_spec_that_cannot_be_written_leaves_a_verified_instance_as_recovered(
        self, cdi_world: World
    ) -> None:
        """The spec write comes after the record write in the same step; a failure there is reported
        and changes nothing else (a reuse or the next Recover writes the spec again)."""
        world = cdi_world
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        recovery = restart(world)
        world.cdi.spec_path(held.devices[0].identity.mig_uuid).unlink()
        proc_devices = world.cdi.proc_root / "devices"
        kept = proc_devices.read_bytes()
        proc_devices.unlink()  # the device majors cannot be read: no spec can be rendered

        report = recovery.recover(active_of("pod-a", held))

        assert world.states() == {record_name(world.uuid(0), Placement(0, 1)): State.ACTIVE}
        assert [r.state for r in world.lifecycle.instances()] == [State.ACTIVE]
        assert [ref.identity for ref in report.adopted_active] == [held.devices[0].identity]
        assert any("CDI" in line for line in report.errors)
        proc_devices.write_bytes(kept)
        assert restart(world).recover(active_of("pod-a", held)).errors == ()
        assert world.cdi_spec_is_current(0, held.devices[0].identity)


class TestTheReportNamesOnlyWhatHappened:
    """A step that failed into ERROR was still listed as done: an orphan whose destroy failed in
    ``removed_orphan_gis``, an interrupted create whose undo failed in ``dropped_stale_records``, an
    adoption whose record could not be written in ``adopted_active``. Now the report lists what
    actually happened; the failure is in ``errors`` and the instance is ERROR, never reused."""

    def test_an_orphan_whose_destroy_fails_is_error_and_not_reported_removed(self, world: World) -> None:
        world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)
        world.hw.inject_fault("nvmlGpuInstanceDestroy", NVML_ERROR_UNKNOWN, times=FOREVER)

        report = restart(world, adopt=True).recover([])

        name = record_name(world.uuid(1), Placement(4, 4))
        assert gis(world, 1) == {("4:4", 0)}
        assert world.states() == {name: State.ERROR}
        assert report.removed_orphan_gis == ()
        assert any(name in line and "ERROR" in line for line in report.errors)

    def test_an_undo_whose_destroy_fails_is_error_and_not_reported_dropped(self, world: World) -> None:
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        [record] = world.record_files().values()
        world.records.put(msgspec.structs.replace(record, state=State.CREATING))
        world.hw.inject_fault("nvmlComputeInstanceDestroy", NVML_ERROR_UNKNOWN, times=FOREVER)

        report = restart(world).recover([])

        assert world.states() == {record.name: State.ERROR}
        assert held.identity.mig_uuid in world.live_mig_uuids()
        assert report.dropped_stale_records == ()
        assert any(record.name in line and "ERROR" in line for line in report.errors)

    def test_an_adoption_whose_record_cannot_be_written_is_not_reported_adopted(self, world: World) -> None:
        """The store refuses to overwrite a record file that turned corrupt between gather and apply."""
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")  # IDLE on disk: adopting it ACTIVE writes the record
        recovery = restart(world)
        decided = plan(recovery.gather(active_of("pod-a", held)))
        assert [ref.identity for ref in decided.report.adopted_active] == [held.devices[0].identity]
        name = record_name(world.uuid(0), Placement(0, 1))
        world.records.path(name).write_bytes(b'{"version":1,"checksum":"sha256:00","record":{}}\n')

        report = recovery.apply(decided)

        assert [r.state for r in world.lifecycle.instances()] == [State.ERROR]
        assert report.adopted_active == ()
        assert any(name in line for line in report.errors)


def unplug_the_last_gpu(world: World) -> SimGpu:
    """NVML stops listing the last GPU (the others keep their indexes); ``plug_back`` returns it."""
    with world.hw.store.transaction() as state:
        return state.gpus.pop()


def plug_back(world: World, gpu: SimGpu) -> None:
    with world.hw.store.transaction() as state:
        state.gpus.append(gpu)


class TestRecordsOnAGpuNvmlNoLongerListsAreKept:
    """A GPU missing from NVML's list may be hidden only and come back with its instances. Its
    records were dropped with their CDI specs: ownership given up without verification, so the
    instances came back foreign. Now they stay on disk untouched (out of the table), the report
    says so, the other GPUs recover as usual, and the Recover that sees the GPU again restores them."""

    def test_they_stay_with_their_cdi_specs_and_come_back_when_the_gpu_does(self, world: World) -> None:
        hidden = world.allocate("pod-a", (2, "1g.5gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-a")
        held = world.allocate("pod-b", (0, "1g.10gb", 0, 1))
        name = record_name(world.uuid(2), Placement(0, 1))
        on_disk = world.records.path(name).read_bytes()
        cdi_before = world.cdi_files()
        recovery = restart(world)
        gpu = unplug_the_last_gpu(world)

        report = recovery.recover(active_of("pod-b", held))

        assert world.records.path(name).read_bytes() == on_disk
        assert world.cdi_files() == cdi_before
        assert [r.gpu_uuid for r in world.lifecycle.instances()] == [world.uuid(0)]
        assert [ref.identity for ref in report.adopted_active] == [held.devices[0].identity]
        assert report.dropped_stale_records == ()
        assert report.restored_idle == ()
        [line] = report.errors
        assert f"GPU {world.uuid(2)} is not visible; record kept" in line

        plug_back(world, gpu)
        again = restart(world).recover(active_of("pod-b", held))

        assert [ref.identity for ref in again.restored_idle] == [hidden.identity]
        assert again.errors == ()
        reused = world.allocate("pod-c", (2, "1g.5gb", 0, 1)).devices[0]
        assert (reused.outcome, reused.identity) == (Outcome.REUSED, hidden.identity)


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
    """Legacy MIG UUIDs fail closed with a domain error, never INTERNAL."""

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
