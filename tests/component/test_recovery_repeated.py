"""Recover more than once: at startup and again while the sidecar serves, with pod lists of any age.

The plugin may call Recover again after a restart of its own, with a pod list read before the latest
Allocate, Release or reuse. A repeated Recover must never take an instance from the pod that holds it
now, never release what it does not list, and never let the allocation generation go backwards. The
tests run over the simulated hardware through the real pynvml adapter, records and CDI code, and assert
the record files, the recovery report and what later transactions see.
"""

from __future__ import annotations

import pytest
from lifecycle_world import BOOT_ID, World, active_of, files_cannot_grow_past, recovery_of, restart

from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Outcome, State
from sidecar.nvml.port import NVML_ERROR_UNKNOWN
from sidecar.store import record_verify
from sidecar.store.generation import GENERATION_BLOCK
from sidecar.store.record_format import GENERATION_FILE


def owners(world: World) -> dict[str, tuple[State, str | None]]:
    """MIG UUID -> (state, owning pod UID) of every record on disk."""
    return {
        r.mig_uuid or r.name: (r.state, r.owner.pod.uid if r.owner is not None else None)
        for r in world.record_files().values()
    }


class TestARepeatedRecoverNeverReownsAnInstanceAnotherPodHoldsNow:
    """A repeated Recover's pod list may predate a release and a reuse by a newer pod.

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

    def test_an_idle_instance_the_old_list_names_stays_idle_and_the_next_pod_reuses_it(
        self, world: World
    ) -> None:
        """Recover carries no generation, so it cannot tell a list taken before the Release from a
        pod that still holds the instance. Reactivating it for the listed (deleted) pod made the next
        pod's Allocate fail PLACEMENT_BUSY; now it stays IDLE and the report says why."""
        first = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        old_pod_list = active_of("pod-a", first)
        world.lifecycle.release("pod-a")
        before = world.everything()

        report = recovery_of(world).recover(old_pod_list)

        mig_uuid = first.devices[0].identity.mig_uuid
        assert world.everything() == before
        assert owners(world) == {mig_uuid: (State.IDLE, None)}
        assert report.adopted_active == ()
        assert [ref.identity for ref in report.restored_idle] == [first.devices[0].identity]
        [line] = report.errors
        assert str(old_pod_list[0].key) in line
        assert mig_uuid in line
        reused = world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0]
        assert (reused.outcome, reused.identity) == (Outcome.REUSED, first.devices[0].identity)

    def test_a_sync_active_listing_the_pod_after_that_recover_reactivates_it(self, world: World) -> None:
        """The fenced path still hands the instance back to a pod that really holds it."""
        first = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        listed = active_of("pod-a", first)
        world.lifecycle.release("pod-a")
        recovery_of(world).recover(listed)

        _, reactivated = world.lifecycle.sync_active(world.lifecycle.generation, listed)

        assert [ref.identity for ref in reactivated] == [first.devices[0].identity]
        assert owners(world) == {first.devices[0].identity.mig_uuid: (State.ACTIVE, "pod-a")}

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


class TestARepeatedRecoverNeverAdoptsAnInstanceWhoseDestroyFailed:
    """The spec keeps an instance that cannot be destroyed in ERROR and never reuses it. A repeated
    Recover whose pod list predates the release of an instance whose reclaim then failed adopted it
    ACTIVE for the gone pod: the reconciler stopped retrying it, a later SyncActive idled it, and the
    next Allocate reused an instance whose destroy had failed. Now it stays ERROR, the report says
    why, and the reconciler keeps retrying it."""

    FOREVER = 1000

    def reclaim_fails(self, world: World) -> tuple[list[ActiveAllocation], str]:
        """pod-a's instance, released; a reclaim of it for pod-b fails to destroy it. Returns the pod
        list taken before the release, and the record name of the instance, now ERROR."""
        first = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        old_pod_list = active_of("pod-a", first)
        world.lifecycle.release("pod-a")
        world.hw.inject_fault("nvmlComputeInstanceDestroy", NVML_ERROR_UNKNOWN, times=self.FOREVER)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-b", (0, "2g.20gb", 0, 2))
        [name] = world.record_files()
        assert world.states() == {name: State.ERROR}
        return old_pod_list, name

    def test_it_stays_error_unchanged_and_the_report_says_why(self, world: World) -> None:
        old_pod_list, name = self.reclaim_fails(world)
        before = world.everything()

        report = recovery_of(world).recover(old_pod_list)

        assert world.everything() == before
        assert world.states() == {name: State.ERROR}
        assert [r.state for r in world.lifecycle.instances()] == [State.ERROR]
        assert report.adopted_active == report.restored_idle == ()
        [line] = report.errors
        assert str(old_pod_list[0].key) in line
        assert old_pod_list[0].identity is not None
        assert old_pod_list[0].identity.mig_uuid in line
        assert "ERROR" in line

    def test_no_sync_active_or_allocate_afterwards_reuses_it(self, world: World) -> None:
        old_pod_list, name = self.reclaim_fails(world)
        recovery_of(world).recover(old_pod_list)

        world.lifecycle.sync_active(world.lifecycle.generation, [])

        assert world.states() == {name: State.ERROR}
        # Each Allocate in its way retries its destroy inline, which fails again (the fault stays):
        # a retryable answer, and the instance is still ERROR, never reused.
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-c", (0, "1g.10gb", 0, 1))
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-b", (0, "2g.20gb", 0, 2))
        assert world.states() == {name: State.ERROR}

    def test_the_reconciler_keeps_retrying_it_and_destroys_it_once_nvml_recovers(self, world: World) -> None:
        """The old list's MIG UUID does not guard it: the table knows that pod released it."""
        old_pod_list, _ = self.reclaim_fails(world)
        recovery_of(world).recover(old_pod_list)
        world.hw.clear_faults()

        Reconciler(world.lifecycle).run_once()

        assert world.everything() == (set(), {}, set())
        created = world.allocate("pod-b", (0, "2g.20gb", 0, 2)).devices[0]
        assert created.outcome is Outcome.CREATED


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


def state_of(world: World) -> dict[str, State]:
    return {r.name: r.state for r in world.lifecycle.instances()}


class TestAnInstanceAPodHoldsIsNeverDestroyedBeforeTheFirstSyncActive:
    """Recover sets the referenced MIG UUIDs from its own active allocations."""

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
    """The generation restarts from a durable ceiling, not from the surviving records."""

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
        good = record_verify.verify(world.records.directory, BOOT_ID)
        assert good.generation_ceiling is not None
        assert good.generation_ceiling >= world.lifecycle.generation
        assert "generation ceiling" in record_verify.format_report(good)

        (world.records.directory / GENERATION_FILE).write_bytes(b"{")
        bad = record_verify.verify(world.records.directory, BOOT_ID)
        assert bad.generation_ceiling is None
        assert bad.corrupt.keys() == {GENERATION_FILE}
        assert "CORRUPT" in record_verify.format_report(bad)


class TestARepeatedRecoverNeverReleases:
    """Once recovered, Recover leaves ACTIVE instances ACTIVE; releases are SyncActive's job."""

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
