"""What restart recovery may destroy: orphan GPU instances and interrupted removals, and nothing else.

A GI with no record is removed only with adoption, only as a bare GI, and only where nothing runs on
its GPU; a DELETING record owns only what its decision saw. Where a test must change the hardware
between recovery's gather and its apply (what another actor on the node could do in that window), it
calls the three public phases of ``Recoverer`` one after the other instead of ``recover``. Outcomes
are asserted on the NVML layout, the record and CDI files and the recovery report.
"""

from __future__ import annotations

import msgspec
import pytest
from lifecycle_world import BOOT_ID, World, gis, recovery_of, restart

from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import Identity, Outcome, State
from sidecar.model.ownership import OwnershipRecord, record_name
from sidecar.model.recovery_plan.plan import plan
from sidecar.nvml.port import NVML_ERROR_UNKNOWN, Placement

FOREVER = 1000  # more attempts than any bounded retry makes
ORPHAN = Placement(4, 4)


class TestAnOrphanGiOnAGpuWithAnActiveInstanceIsPreserved:
    """The orphan rule counted only the listed allocations and processes as "busy", not an
    ACTIVE record. A repeated Recover (whose pod list may predate an Allocate) keeps such an instance
    ACTIVE, and then destroyed an orphan GI beside it: the spec says orphan GIs on busy GPUs are
    always preserved (ListGpus' busy: an ACTIVE instance or a running process)."""

    def test_a_repeated_recover_with_adoption_and_an_old_pod_list_keeps_the_orphan(
        self, world: World
    ) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.hw.create_instance(0, "3g.40gb", 4, 4, with_ci=False)
        before = world.everything()

        report = recovery_of(world, adopt=True).recover([])

        assert world.everything() == before
        assert ("4:4", 0) in gis(world, 0)
        assert report.removed_orphan_gis == ()
        assert {str(ref.reservation) for ref in report.preserved_foreign} == {f"{world.uuid(0)}/3g.40gb@4:4"}

    def test_an_orphan_on_another_gpu_with_nothing_active_is_still_removed(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)

        report = recovery_of(world, adopt=True).recover([])

        assert gis(world, 1) == set()
        assert len(report.removed_orphan_gis) == 1
        assert world.states() == {record_name(world.uuid(0), Placement(0, 1)): State.ACTIVE}


class TestADeletingRecordOwnsOnlyWhatItsDecisionSaw:
    """A DELETING record without a CI ID is written only for a GI that had no CI when the
    destroy was decided (an orphan GI being removed with adoption, or a bare GI left by a create).
    Recoverer treated any full-size CI in that GI as the record's own, as it rightly does for CREATING
    (a crash between creating the CI and recording it). No transaction of ours creates a CI in a GI
    recorded DELETING, so a CI there now was made by someone else, and recovery destroyed it (and the
    GI it lives in) without ever having verified it as ours."""

    def test_a_ci_made_since_in_the_gi_of_an_interrupted_orphan_removal_is_preserved(
        self, world: World
    ) -> None:
        gi = world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)
        # What removing this orphan records before it destroys anything; then a kill -9.
        interrupted = OwnershipRecord(
            gpu_uuid=world.uuid(1),
            profile="3g.40gb",
            gi_profile_id=gi.profile_id,
            ci_profile_id=2,
            placement=Placement(4, 4),
            state=State.DELETING,
            gpu_instance_id=gi.id,
            boot_id=BOOT_ID,
        )
        world.records.put(interrupted)
        ci = world.port.create_compute_instance(world.uuid(1), gi.id, 2)  # an operator, meanwhile
        layout = world.layout()

        report = restart(world, adopt=True).recover([])

        assert world.layout() == layout
        assert world.record_files() == {interrupted.name: interrupted}
        assert world.lifecycle.instances() == []
        assert [ref.identity.mig_uuid for ref in report.preserved_foreign if ref.identity] == [ci.mig_uuid]
        assert report.dropped_stale_records == ()
        assert any(interrupted.name in line for line in report.errors)

    def test_a_bare_gi_of_an_interrupted_orphan_removal_is_still_destroyed(self, world: World) -> None:
        gi = world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)
        world.records.put(
            OwnershipRecord(
                gpu_uuid=world.uuid(1),
                profile="3g.40gb",
                gi_profile_id=gi.profile_id,
                ci_profile_id=2,
                placement=Placement(4, 4),
                state=State.DELETING,
                gpu_instance_id=gi.id,
                boot_id=BOOT_ID,
            )
        )

        report = restart(world).recover([])

        assert gis(world, 1) == set()
        assert world.record_files() == {}
        assert len(report.dropped_stale_records) == 1


def reservations(refs: object) -> set[str]:
    return {str(ref.reservation) for ref in refs}  # type: ignore[attr-defined]


class TestAnOrphanRemovalDestroysABareGpuInstanceOnly:
    """A record without a CI ID that is not CREATING (an orphan GI being removed, a bare GI a
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
        assert report.removed_orphan_gis == ()
        assert report.dropped_stale_records == ()

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


class TestARecordFromAnEarlierBootNeverClaimsAnInstanceMadeSinceTheReboot:
    """Where ``/var/run`` is not tmpfs, records outlive a reboot, and the driver numbers GIs the same
    way again: a GI someone makes after the reboot at a record's placement gets the record's GI ID.
    A record of an earlier boot without a MIG UUID (a create interrupted before its CI was recorded)
    matched such a GI by placement, profile and GI ID, and recovery destroyed it as an interrupted
    create. Now such a record is stale unless a live CI in its GI has exactly its MIG UUID: it is
    dropped, and the GI is foreign (or adopted, with adoption on)."""

    def interrupted_create_then_reboot(self, world: World, *, with_ci: bool) -> tuple[OwnershipRecord, int]:
        """A create killed after recording its GI (and, ``with_ci``, making its CI), then a reboot and a
        GI made by someone else at the same placement. Returns the record and that GI's ID."""
        world.allocate("pod-a", (0, "3g.40gb", 0, 4))
        [record] = world.record_files().values()
        interrupted = msgspec.structs.replace(
            record,
            state=State.CREATING,
            compute_instance_id=None,
            mig_uuid=None,
            cdi_device="",
            activated_generation=0,
        )
        world.records.put(interrupted)
        world.hw.reboot()
        made = world.hw.create_instance(0, "3g.40gb", 0, 4, with_ci=with_ci)
        assert made.id == record.gpu_instance_id  # what makes the record look like its own
        return interrupted, made.id

    @pytest.mark.parametrize("with_ci", [True, False], ids=["complete", "bare GI"])
    def test_the_instance_made_after_the_reboot_survives_and_is_foreign(
        self, world: World, with_ci: bool
    ) -> None:
        interrupted, gi_id = self.interrupted_create_then_reboot(world, with_ci=with_ci)
        layout = world.layout()

        report = restart(world, boot_id=world.hw.boot_id).recover([])

        assert world.layout() == layout
        assert world.record_files() == {}
        assert world.cdi_files() == set()
        assert world.lifecycle.instances() == []
        assert report.dropped_stale_records == (interrupted.name,)
        assert [ref.reservation.placement for ref in report.preserved_foreign] == [Placement(0, 4)]
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-b", (0, "3g.40gb", 0, 4))
        assert (0, gi_id) in {(g, i) for g, i, *_ in world.layout()}

    def test_the_dropped_record_stays_reported_when_removing_the_gi_at_its_placement_is_skipped(
        self, world: World
    ) -> None:
        """The drop and the orphan removal at the same placement share a record name. The report
        filtered dropped records by the name of a step left foreign, so the drop, which happened,
        vanished from it. Each step now carries its own report entry."""
        interrupted, gi_id = self.interrupted_create_then_reboot(world, with_ci=False)
        recovery = restart(world, adopt=True, boot_id=world.hw.boot_id)
        decided = plan(recovery.gather([]))
        assert len(decided.report.removed_orphan_gis) == 1
        world.hw.set_busy(world.uuid(0), True)  # a process starts before the orphan's destroy

        report = recovery.apply(decided)

        assert world.record_files() == {}
        assert (0, gi_id) in {(g, i) for g, i, *_ in world.layout()}
        assert report.dropped_stale_records == (interrupted.name,)
        assert report.removed_orphan_gis == ()
        assert [ref.reservation.placement for ref in report.preserved_foreign] == [Placement(0, 4)]

    def test_with_adoption_a_complete_one_is_adopted_and_reused(self, world: World) -> None:
        interrupted, gi_id = self.interrupted_create_then_reboot(world, with_ci=True)
        [(*_, ((ci_id, mig_uuid),))] = world.layout()

        report = restart(world, adopt=True, boot_id=world.hw.boot_id).recover([])

        assert report.dropped_stale_records == (interrupted.name,)
        assert [ref.identity for ref in report.adopted_foreign] == [Identity(gi_id, ci_id, mig_uuid)]
        [adopted] = world.record_files().values()
        assert (adopted.state, adopted.boot_id) == (State.IDLE, world.hw.boot_id)
        reused = world.allocate("pod-b", (0, "3g.40gb", 0, 4)).devices[0]
        assert (reused.outcome, reused.identity.mig_uuid) == (Outcome.REUSED, mig_uuid)
