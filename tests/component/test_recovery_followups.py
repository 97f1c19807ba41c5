"""Follow-ups of a review of restart recovery: three decided fixes, one class each.

Every test failed before the fix its class names. They run over the simulated hardware through the
real pynvml adapter, records and CDI code, and assert the NVML layout, the record files, the CDI files,
the recovery report and what later transactions see. Where a test must change the hardware between
recovery's gather and its apply (what another actor on the node could do in that window), it calls
the three public phases of ``Recovery`` one after the other instead of ``recover``.
"""

from __future__ import annotations

import json

import pytest
from lifecycle_world import BOOT_ID, World
from test_review_followups import files_cannot_grow_past

from sidecar import errors
from sidecar.cdi import CdiSpecs
from sidecar.domain import Outcome, Placement, State
from sidecar.lifecycle import Lifecycle
from sidecar.nvml.port import NVML_ERROR_UNKNOWN
from sidecar.reconciler import Reconciler
from sidecar.records import OwnershipRecord, RecordStore, record_name
from sidecar.recovery import Recovery, plan

FOREVER = 1000  # more attempts than any bounded retry makes


def restart(world: World, *, adopt: bool = False) -> Recovery:
    """Forget everything in memory, keep hardware and files; a new lifecycle, not yet recovered."""
    world.records.close()
    records = RecordStore(world.records.directory)
    records.open()
    cdi = CdiSpecs(world.cdi.directory, kind=world.cdi.kind, proc_root=world.cdi.proc_root)
    world.records, world.cdi = records, cdi
    world.lifecycle = Lifecycle(world.port, records, cdi, BOOT_ID)
    return Recovery(world.lifecycle, world.port, records, cdi, BOOT_ID, adopt_existing=adopt)


def gis(world: World, gpu: int) -> set[tuple[str, int]]:
    """(placement, number of CIs) of every GI on one GPU."""
    return {(placement, len(cis)) for g, _, _, placement, cis in world.layout() if g == gpu}


def reservations(refs: object) -> set[str]:
    return {str(ref.reservation) for ref in refs}  # type: ignore[attr-defined]


ORPHAN = Placement(4, 4)


class TestAnOrphanRemovalDestroysABareGpuInstanceOnly:
    """Decided: a record without a CI ID that is not CREATING (an orphan GI being removed, a bare GI a
    crashed create left, either of them failed into ERROR) stands for a GI that had no CI when its
    destroy was decided. Before the fix its destroy took *every* CI found in the GI at destroy time as
    its own: a CI someone made between gather and apply, or after a failed removal, was destroyed with
    the GI around it. Now that destroy refuses, nothing is destroyed, the record stays on disk for the
    operator and the instance is foreign, as recovery already decides when it sees such a CI at gather.
    The orphan rule's "no running process on the GPU" is checked again right before the destroy."""

    def test_a_ci_made_between_gather_and_apply_survives_and_the_gi_becomes_foreign(
        self, world: World
    ) -> None:
        gi = world.hw.create_instance(1, "3g.40gb", ORPHAN.start, ORPHAN.size, with_ci=False)
        recovery = restart(world, adopt=True)
        decided = plan(recovery.gather([]))
        assert len(decided.report.removed_orphan_gis) == 1  # what gather saw: a bare orphan
        ci = world.port.create_compute_instance(world.uuid(1), gi.id, 2)  # an operator, meanwhile
        layout = world.layout()

        report = recovery.apply(decided)

        assert world.layout() == layout
        assert world.lifecycle.instances() == []
        name = record_name(world.uuid(1), ORPHAN)
        kept = world.record_files()
        assert set(kept) == {name}
        assert (kept[name].state, kept[name].compute_instance_id) == (State.DELETING, None)
        assert report.removed_orphan_gis == ()
        assert reservations(report.preserved_foreign) == {f"{world.uuid(1)}/3g.40gb@4:4"}
        assert any(name in line and ci.mig_uuid in line for line in report.errors)
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-a", (1, "3g.40gb", ORPHAN.start, ORPHAN.size))

    def test_the_next_recover_keeps_preserving_it_and_the_record(self, world: World) -> None:
        gi = world.hw.create_instance(1, "3g.40gb", ORPHAN.start, ORPHAN.size, with_ci=False)
        recovery = restart(world, adopt=True)
        decided = plan(recovery.gather([]))
        world.port.create_compute_instance(world.uuid(1), gi.id, 2)
        recovery.apply(decided)
        before = world.everything()

        report = restart(world, adopt=True).recover([])

        assert world.everything() == before
        assert world.lifecycle.instances() == []
        assert reservations(report.preserved_foreign) == {f"{world.uuid(1)}/3g.40gb@4:4"}
        assert report.removed_orphan_gis == report.dropped_stale_records == ()

    def test_a_ci_made_in_the_gi_of_a_failed_orphan_removal_survives_the_reconciler(
        self, world: World
    ) -> None:
        gi = world.hw.create_instance(1, "3g.40gb", ORPHAN.start, ORPHAN.size, with_ci=False)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)
        restart(world, adopt=True).recover([])
        name = record_name(world.uuid(1), ORPHAN)
        assert world.states() == {name: State.ERROR}
        world.hw.clear_faults()
        world.port.create_compute_instance(world.uuid(1), gi.id, 2)  # an operator, meanwhile
        layout = world.layout()

        report = Reconciler(world.lifecycle).run_once()

        assert world.layout() == layout
        assert gis(world, 1) == {("4:4", 1)}
        assert report.destroyed == ()
        assert world.lifecycle.instances() == []  # foreign now: never retried, never reused
        assert world.states() == {name: State.ERROR}  # kept for the operator
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-a", (1, "3g.40gb", ORPHAN.start, ORPHAN.size))

    def test_a_process_started_on_the_gpu_between_gather_and_apply_preserves_the_orphan(
        self, world: World
    ) -> None:
        world.hw.create_instance(1, "3g.40gb", ORPHAN.start, ORPHAN.size, with_ci=False)
        recovery = restart(world, adopt=True)
        decided = plan(recovery.gather([]))
        world.hw.set_busy(world.uuid(1), True)

        report = recovery.apply(decided)

        assert gis(world, 1) == {("4:4", 0)}
        assert world.record_files() == {}
        assert world.lifecycle.instances() == []
        assert report.removed_orphan_gis == ()
        assert reservations(report.preserved_foreign) == {f"{world.uuid(1)}/3g.40gb@4:4"}

    def test_an_orphan_on_an_idle_gpu_is_still_removed(self, world: World) -> None:
        world.hw.create_instance(1, "3g.40gb", ORPHAN.start, ORPHAN.size, with_ci=False)

        report = restart(world, adopt=True).recover([])

        assert gis(world, 1) == set()
        assert world.record_files() == {}
        assert len(report.removed_orphan_gis) == 1
        assert report.errors == ()

    def test_a_bare_gi_a_crashed_create_left_without_its_id_is_still_destroyed(self, world: World) -> None:
        """The crash came between creating the GI and recording its ID: recovery finds it by placement."""
        gi = world.hw.create_instance(1, "3g.40gb", ORPHAN.start, ORPHAN.size, with_ci=False)
        world.records.put(self.creating(world, gpu_instance_id=None, gi_profile_id=gi.profile_id))

        report = restart(world).recover([])

        assert gis(world, 1) == set()
        assert world.record_files() == {}
        assert len(report.dropped_stale_records) == 1
        assert report.errors == ()

    def test_a_bare_gi_a_crashed_create_recorded_is_still_destroyed(self, world: World) -> None:
        gi = world.hw.create_instance(1, "3g.40gb", ORPHAN.start, ORPHAN.size, with_ci=False)
        world.records.put(self.creating(world, gpu_instance_id=gi.id, gi_profile_id=gi.profile_id))

        report = restart(world).recover([])

        assert gis(world, 1) == set()
        assert world.record_files() == {}
        assert report.errors == ()

    def test_undo_creating_still_destroys_the_bare_gi_of_a_creating_record(self, world: World) -> None:
        gi = world.hw.create_instance(1, "3g.40gb", ORPHAN.start, ORPHAN.size, with_ci=False)
        record = self.creating(world, gpu_instance_id=None, gi_profile_id=gi.profile_id)
        world.records.put(record)

        world.lifecycle.undo_creating(record)

        assert gis(world, 1) == set()
        assert world.record_files() == {}

    def test_a_create_whose_ci_failed_is_still_undone_completely(self, world: World) -> None:
        world.hw.inject_fault("create-ci", NVML_ERROR_UNKNOWN, times=FOREVER)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (1, "3g.40gb", ORPHAN.start, ORPHAN.size))

        assert gis(world, 1) == set()
        assert world.record_files() == {}
        assert world.cdi_files() == set()

    @staticmethod
    def creating(world: World, *, gpu_instance_id: int | None, gi_profile_id: int) -> OwnershipRecord:
        return OwnershipRecord(
            gpu_uuid=world.uuid(1),
            profile="3g.40gb",
            gi_profile_id=gi_profile_id,
            ci_profile_id=2,
            placement=ORPHAN,
            state=State.CREATING,
            gpu_instance_id=gpu_instance_id,
            boot_id=BOOT_ID,
        )


class TestARecordWriteFailingDuringRestoreLeavesAHealthyInstanceAlone:
    """Decided: restoring a verified live instance writes its record (ACTIVE -> IDLE when no pod holds
    it). When that write failed, the instance went to ERROR, and the reconciler then destroyed a healthy
    instance. Now it is foreign for this process life (preserved, never reused, blocking its
    placement), the record on disk is left as it was, and the report says why; a later Recover with a
    working state directory restores it."""

    def held_then_restarted(self, world: World) -> tuple[Recovery, OwnershipRecord, bytes]:
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


class TestAStrayCdiSpecIsRemovedByThePathItWasFoundAt:
    """Decided: recovery found the spec files of our kind by content and removed strays by the name
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
