"""An adversarial review of restart recovery: each class pins one finding, decided and fixed.

Every test failed before the fix its class names. They run over the simulated hardware through the
real pynvml adapter, records and CDI code, and assert the NVML layout, the record files, the CDI files,
the recovery report and what later transactions see.
"""

from __future__ import annotations

import json

import pytest
from lifecycle_world import BOOT_ID, World

from sidecar import errors
from sidecar.cdi import CdiSpecs
from sidecar.domain import ActiveAllocation, AllocateResult, Outcome, Owner, Placement, PodRef, State
from sidecar.lifecycle import Lifecycle
from sidecar.records import OwnershipRecord, RecordStore, record_name
from sidecar.recovery import Recovery


def restart(world: World, *, adopt: bool = False) -> Recovery:
    """Forget everything in memory, keep hardware and files; a new lifecycle, not yet recovered."""
    world.records.close()
    records = RecordStore(world.records.directory)
    records.open()
    cdi = CdiSpecs(world.cdi.directory, kind=world.cdi.kind, proc_root=world.cdi.proc_root)
    world.records, world.cdi = records, cdi
    world.lifecycle = Lifecycle(world.port, records, cdi, BOOT_ID)
    return Recovery(world.lifecycle, world.port, records, cdi, BOOT_ID, adopt_existing=adopt)


def recovery_of(world: World, *, adopt: bool = False) -> Recovery:
    """A Recovery over the running lifecycle (a Recover RPC repeated while the sidecar serves)."""
    return Recovery(world.lifecycle, world.port, world.records, world.cdi, BOOT_ID, adopt_existing=adopt)


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


def owners(world: World) -> dict[str, tuple[State, str | None]]:
    """MIG UUID -> (state, owning pod UID) of every record on disk."""
    return {
        r.mig_uuid or r.name: (r.state, r.owner.pod.uid if r.owner is not None else None)
        for r in world.record_files().values()
    }


class TestARepeatedRecoverNeverReownsAnInstanceAnotherPodHoldsNow:
    """Decided: a repeated Recover's pod list may predate a release and a reuse by a newer pod.

    Before the fix the listed (old) key was written over the newer owner: the newer pod's instance
    changed hands, and the old pod's key answered ALREADY_ALLOCATED with a device another pod uses."""

    def test_an_instance_reused_by_a_newer_pod_stays_with_that_pod_and_the_report_names_both_keys(
        self, world: World
    ) -> None:
        first = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        old_pod_list = active_of("pod-a", first)
        world.lifecycle.release("pod-a")
        reused = world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0]
        assert reused.outcome is Outcome.REUSED
        before = world.everything()

        report = recovery_of(world).recover(old_pod_list)

        mig_uuid = first.devices[0].identity.mig_uuid
        assert world.everything() == before
        assert owners(world) == {mig_uuid: (State.ACTIVE, "pod-b")}
        assert report.adopted_active == ()
        assert report.restored_idle == ()
        [line] = report.errors
        assert str(old_pod_list[0].key) in line
        assert "pod-b" in line
        assert mig_uuid in line
        again = world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0]
        assert (again.outcome, again.identity) == (Outcome.ALREADY_ALLOCATED, reused.identity)
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-a", (0, "1g.10gb", 0, 1))

    def test_an_idle_instance_the_old_list_names_is_reactivated_for_the_listed_pod(
        self, world: World
    ) -> None:
        first = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        old_pod_list = active_of("pod-a", first)
        world.lifecycle.release("pod-a")
        generation = world.lifecycle.generation

        report = recovery_of(world).recover(old_pod_list)

        mig_uuid = first.devices[0].identity.mig_uuid
        assert owners(world) == {mig_uuid: (State.ACTIVE, "pod-a")}
        assert [ref.identity for ref in report.adopted_active] == [first.devices[0].identity]
        assert report.errors == ()
        [record] = world.record_files().values()
        assert record.activated_generation > generation
        again = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        assert again.outcome is Outcome.ALREADY_ALLOCATED

    def test_an_idle_instance_is_not_reactivated_for_a_key_that_holds_another_instance_now(
        self, world: World
    ) -> None:
        """Like SyncActive: one key never holds two instances."""
        first = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        old_pod_list = active_of("pod-a", first)
        world.lifecycle.release("pod-a")
        moved = world.allocate("pod-a", (0, "1g.10gb", 1, 1)).devices[0]
        before = world.everything()

        report = recovery_of(world).recover(old_pod_list)

        assert world.everything() == before
        assert owners(world) == {
            first.devices[0].identity.mig_uuid: (State.IDLE, None),
            moved.identity.mig_uuid: (State.ACTIVE, "pod-a"),
        }
        [line] = report.errors
        assert str(old_pod_list[0].key) in line
        assert [ref.identity for ref in report.restored_idle] == [first.devices[0].identity]

    def test_before_the_first_recover_the_listed_key_is_adopted_as_before(self, world: World) -> None:
        """The rule applies to a sidecar that serves; at startup the pod list is the only truth."""
        first = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        old_pod_list = active_of("pod-a", first)
        world.lifecycle.release("pod-a")
        world.allocate("pod-b", (0, "1g.10gb", 0, 1))

        report = restart(world).recover(old_pod_list)

        assert owners(world) == {first.devices[0].identity.mig_uuid: (State.ACTIVE, "pod-a")}
        assert report.errors == ()


def gis(world: World, gpu: int) -> set[tuple[str, int]]:
    """(placement, number of CIs) of every GI on one GPU."""
    return {(placement, len(cis)) for g, _, _, placement, cis in world.layout() if g == gpu}


class TestAnOrphanGiOnAGpuWithAnActiveInstanceIsPreserved:
    """Finding: the orphan rule counted only the listed allocations and processes as "busy", not an
    ACTIVE record. A repeated Recover (whose pod list may predate an Allocate) keeps such an instance
    ACTIVE, and then destroyed an orphan GI beside it: the spec says orphan GIs on busy GPUs are
    always preserved (architecture: ListGpus' busy = an ACTIVE instance or a running process)."""

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
    """Finding: a DELETING record without a CI ID is written only for a GI that had no CI when the
    destroy was decided (an orphan GI being removed with adoption, or a bare GI left by a create).
    Recovery treated any full-size CI in that GI as the record's own, as it rightly does for CREATING
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


class TestRecoverIsIdempotent:
    """Pinned: two Recovers in a row (the second one repeated while serving) give the same table and
    files, report the same instances, and the second one drops and removes nothing."""

    def test_a_mixed_node_recovered_twice_gives_the_same_table_and_files(self, world: World) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (0, "1g.10gb", 1, 1))
        world.lifecycle.release("pod-b")
        world.hw.create_instance(1, "1g.10gb", 0, 1)  # foreign
        world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)  # orphan, adoption off
        first = restart(world).recover(active_of("pod-a", a))
        table, files = sorted(world.lifecycle.instances(), key=lambda r: r.name), world.everything()

        second = recovery_of(world).recover(active_of("pod-a", a))

        assert sorted(world.lifecycle.instances(), key=lambda r: r.name) == table
        assert world.everything() == files
        assert (second.adopted_active, second.restored_idle, second.preserved_foreign) == (
            first.adopted_active,
            first.restored_idle,
            first.preserved_foreign,
        )
        assert (second.dropped_stale_records, second.removed_orphan_gis, second.errors) == ((), (), ())


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
        assert world.cdi.is_current(world.gpus[0].minor, a.devices[0].identity)
        assert report.errors == ()
