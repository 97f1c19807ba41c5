"""Release and SyncActive: ACTIVE <-> IDLE, fenced by the generation, never a destruction."""

from __future__ import annotations

import pytest
from lifecycle_world import World, active_of

from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Outcome, Owner, PodRef, State
from sidecar.model.ownership import OwnershipRecord


class TestRelease:
    def test_a_released_pod_leaves_its_instances_idle_and_live(self, world: World) -> None:
        dev = world.allocate("pod-a", (0, "1g.10gb", 0, 1), (1, "2g.20gb", 2, 2)).devices
        before = world.layout(), world.cdi_files()

        released = world.lifecycle.release("pod-a")

        assert {r.identity for r in released} == {d.identity for d in dev}
        assert set(world.states().values()) == {State.IDLE}
        assert all(r.owner is None for r in world.record_files().values())
        assert (world.layout(), world.cdi_files()) == before

    def test_releasing_an_unknown_pod_succeeds_with_nothing(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        before = world.everything()
        assert world.lifecycle.release("pod-nobody") == []
        assert world.everything() == before

    def test_releasing_one_pod_leaves_the_others_active(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        kept = world.allocate("pod-b", (0, "1g.10gb", 1, 1)).devices[0]
        world.lifecycle.release("pod-a")
        states = {r.mig_uuid: r.state for r in world.record_files().values()}
        assert states[kept.identity.mig_uuid] is State.ACTIVE
        assert sorted(states.values()) == [State.ACTIVE, State.IDLE]

    def test_a_record_file_corrupted_under_a_live_instance_is_unverifiable_and_left_as_it_is(
        self, world: World
    ) -> None:
        """No retry clears a corrupt file, so the answer is FAILED_PRECONDITION UNVERIFIABLE_STATE
        (never the retryable STATE_WRITE_FAILED), and the file stays for the operator."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        [name] = world.record_files()
        path = world.records.path(name)
        path.write_bytes(b'{"version":1')
        layout, cdi = world.layout(), world.cdi_files()

        with pytest.raises(errors.UnverifiableState) as caught:
            world.lifecycle.release("pod-a")

        assert caught.value.metadata["file"] == str(path)
        assert path.read_bytes() == b'{"version":1'
        assert (world.layout(), world.cdi_files()) == (layout, cdi)


class TestSyncActive:
    def test_active_instances_missing_from_the_pod_list_become_idle(self, world: World) -> None:
        gone = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        alive = world.allocate("pod-b", (0, "1g.10gb", 1, 1)).devices[0]
        generation = world.lifecycle.generation
        still = ActiveAllocation(Owner(PodRef("pod-b"), "main", 0, 0), alive.reservation, alive.identity)

        idled, reactivated = world.lifecycle.sync_active(generation, [still])

        assert [r.identity for r in idled] == [gone.identity]
        assert reactivated == []
        states = {r.mig_uuid: r.state for r in world.record_files().values()}
        assert states == {gone.identity.mig_uuid: State.IDLE, alive.identity.mig_uuid: State.ACTIVE}
        assert len(world.live_mig_uuids()) == 2  # nothing destroyed

    def test_one_corrupt_record_file_does_not_keep_the_other_instances_from_going_idle(
        self, world: World
    ) -> None:
        """The corrupt file's instance is left for the operator (UNVERIFIABLE_STATE, raised once the
        batch is done); every other instance the pod list no longer names goes IDLE all the same."""
        stuck = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        others = [
            world.allocate("pod-b", (0, "1g.10gb", 1, 1)).devices[0],
            world.allocate("pod-c", (1, "1g.10gb", 0, 1)).devices[0],
        ]
        [stuck_name] = [n for n, r in world.record_files().items() if r.mig_uuid == stuck.identity.mig_uuid]
        generation = world.lifecycle.generation
        path = world.records.path(stuck_name)
        path.write_bytes(b'{"version":1')

        with pytest.raises(errors.UnverifiableState):
            world.lifecycle.sync_active(generation, [])

        valid, corrupt = world.records.load_all()
        assert corrupt.keys() == {stuck_name}
        assert {r.mig_uuid: r.state for r in valid.values()} == {
            d.identity.mig_uuid: State.IDLE for d in others
        }
        assert path.read_bytes() == b'{"version":1'

    def test_a_write_that_may_succeed_later_is_answered_before_a_corrupt_file(
        self, world: World, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """One instance's record file is corrupt (no retry clears it), another's write fails for now:
        the answer is the retryable one, so the client repeats the call and the rest gets done."""
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-b", (1, "1g.10gb", 0, 1))
        by_gpu = {r.gpu_uuid: name for name, r in world.record_files().items()}
        generation = world.lifecycle.generation
        world.records.path(by_gpu[world.uuid(0)]).write_bytes(b'{"version":1')
        put = world.records.put

        def put_failing_on_gpu_1(record: OwnershipRecord) -> None:
            if record.gpu_uuid == world.uuid(1):
                raise errors.StateWriteFailed("the state directory is full, for now")
            put(record)

        monkeypatch.setattr(world.records, "put", put_failing_on_gpu_1)

        with pytest.raises(errors.StateWriteFailed):
            world.lifecycle.sync_active(generation, [])
        monkeypatch.undo()
        with pytest.raises(errors.UnverifiableState):
            world.lifecycle.sync_active(generation, [])

        valid, corrupt = world.records.load_all()
        assert corrupt.keys() == {by_gpu[world.uuid(0)]}
        assert [r.state for r in valid.values()] == [State.IDLE]

    def test_an_allocation_newer_than_the_pod_list_is_not_idled(self, world: World) -> None:
        generation = world.lifecycle.generation  # the client read this before listing pods
        racing = world.allocate("pod-new", (0, "1g.10gb", 0, 1)).devices[0]

        idled, _ = world.lifecycle.sync_active(generation, [])

        assert idled == []
        [record] = world.record_files().values()
        assert record.state is State.ACTIVE
        assert record.mig_uuid == racing.identity.mig_uuid

    def test_an_idle_instance_listed_as_active_becomes_active_again(self, world: World) -> None:
        dev = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-a")
        before = world.lifecycle.generation
        listed_again = ActiveAllocation(Owner(PodRef("pod-a"), "main", 0, 0), dev.reservation, dev.identity)

        idled, reactivated = world.lifecycle.sync_active(before, [listed_again])

        assert idled == []
        assert [r.identity for r in reactivated] == [dev.identity]
        [record] = world.record_files().values()
        assert record.state is State.ACTIVE
        assert record.owner is not None
        assert record.owner.pod.uid == "pod-a"
        assert world.lifecycle.generation == before + 1
        assert record.activated_generation == before + 1

    def test_listed_allocations_that_match_nothing_are_ignored(self, world: World) -> None:
        dev = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0]
        world.lifecycle.release("pod-a")
        before = world.everything()
        other_uuid = ActiveAllocation(
            Owner(PodRef("pod-x"), "main", 0, 0),
            dev.reservation,
            dev.identity.__class__(
                dev.identity.gpu_instance_id,
                dev.identity.compute_instance_id,
                "MIG-00000000-0000-0000-0000-000000000001",
            ),
        )

        assert world.lifecycle.sync_active(world.lifecycle.generation, [other_uuid]) == ([], [])
        assert world.everything() == before


class TestAPodListOlderThanAReleaseReactivatesNothing:
    """Going IDLE bumps the generation too: a SyncActive whose pod list was taken before the release
    still names the dead pod, and must not hand its instance back to it (the slices belong to the
    next pod the scheduler placed there)."""

    def test_an_instance_released_after_the_pod_list_was_taken_stays_idle_for_the_next_pod(
        self, world: World
    ) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        generation = world.lifecycle.generation  # the client reads it, then lists pods: pod-a is alive
        pod_list = active_of("pod-a", a)
        world.lifecycle.release("pod-a")  # pod-a is deleted and its release confirmed meanwhile

        idled, reactivated = world.lifecycle.sync_active(generation, pod_list)

        assert (idled, reactivated) == ([], [])
        [record] = world.record_files().values()
        assert (record.state, record.owner) == (State.IDLE, None)
        assert record.idled_generation == world.lifecycle.generation > generation
        again = world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0]
        assert (again.outcome, again.identity) == (Outcome.REUSED, a.devices[0].identity)

    def test_an_instance_idled_by_a_newer_sync_is_not_reactivated_by_an_older_one(self, world: World) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        old_generation = world.lifecycle.generation
        old_list = active_of("pod-a", a)  # taken while pod-a was alive
        idled, _ = world.lifecycle.sync_active(world.lifecycle.generation, [])  # a newer list without it
        assert [r.identity for r in idled] == [a.devices[0].identity]

        assert world.lifecycle.sync_active(old_generation, old_list) == ([], [])
        assert world.states() == {world.lifecycle.instances()[0].name: State.IDLE}

    def test_a_pod_list_taken_after_the_release_still_reactivates(self, world: World) -> None:
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        generation = world.lifecycle.generation  # read after the release: the list is newer

        _, reactivated = world.lifecycle.sync_active(generation, active_of("pod-a", a))

        assert [r.identity for r in reactivated] == [a.devices[0].identity]
        assert set(world.states().values()) == {State.ACTIVE}


class TestAGenerationNeverHandedOutIsRefused:
    def test_a_sync_active_fenced_with_a_future_generation_is_invalid_and_changes_nothing(
        self, world: World
    ) -> None:
        """Such a fence would idle every instance, the ones an Allocate activated meanwhile too."""
        a = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        current = world.lifecycle.generation
        referenced = world.lifecycle.referenced_mig_uuids
        before = world.everything()

        with pytest.raises(errors.InvalidRequest) as caught:
            world.lifecycle.sync_active(current + 1, active_of("pod-other", a))

        assert caught.value.reason == "INVALID_REQUEST"
        assert caught.value.metadata == {"generation": str(current + 1), "current": str(current)}
        assert world.everything() == before
        assert (world.lifecycle.generation, world.lifecycle.referenced_mig_uuids) == (current, referenced)
