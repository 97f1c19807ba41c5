"""UndoAllocate: created instances destroyed, reused ones IDLE again, fenced to the exact key."""

from __future__ import annotations

import pytest
from lifecycle_world import World, active_of, restart

from sidecar.lifecycle import crashpoints, undo
from sidecar.lifecycle.faults import apply_xid
from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, AllocationKey, Outcome, State
from sidecar.model.ownership import Origin
from sidecar.nvml.port import NVML_ERROR_UNKNOWN, XidEvent

FOREVER = 1000


def reuse_and_create(world: World) -> tuple[str, str]:
    """pod-b reuses pod-a's released instance at 0:1 and creates one at 1:1; their MIG UUIDs."""
    world.allocate("pod-a", (0, "1g.10gb", 0, 1))
    world.lifecycle.release("pod-a")
    devices = world.allocate("pod-b", (0, "1g.10gb", 0, 1), (0, "1g.10gb", 1, 1)).devices
    assert [d.outcome for d in devices] == [Outcome.REUSED, Outcome.CREATED]
    return devices[0].identity.mig_uuid, devices[1].identity.mig_uuid


class TestUndoAllocate:
    def test_the_created_instance_is_destroyed_and_the_reused_one_goes_idle(self, world: World) -> None:
        reused, created = reuse_and_create(world)
        origins = {r.mig_uuid: r.origin for r in world.record_files().values()}
        assert origins == {reused: Origin.REUSED, created: Origin.CREATED}

        destroyed, idled = world.lifecycle.undo_allocate("pod-b", 0)

        assert [r.identity.mig_uuid for r in destroyed if r.identity] == [created]
        assert [r.identity.mig_uuid for r in idled if r.identity] == [reused]
        assert world.live_mig_uuids() == {reused}
        [record] = world.record_files().values()
        assert (record.mig_uuid, record.state, record.owner) == (reused, State.IDLE, None)
        if world.cdi.enabled:
            assert world.cdi_files() == {world.cdi.spec_path(reused).name}
        world.assert_consistent()

    def test_repeating_it_changes_nothing(self, world: World) -> None:
        reuse_and_create(world)
        world.lifecycle.undo_allocate("pod-b", 0)
        before = world.everything()
        assert world.lifecycle.undo_allocate("pod-b", 0) == ([], [])
        assert world.everything() == before

    def test_an_unknown_key_is_ok_and_changes_nothing(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.allocate("pod-a", (0, "1g.10gb", 1, 1), container_index=1)
        before = world.everything()
        assert world.lifecycle.undo_allocate("pod-nobody", 0) == ([], [])
        assert world.lifecycle.undo_allocate("pod-a", 7) == ([], [])
        assert world.everything() == before

    def test_only_the_named_container_is_undone(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        kept = world.allocate("pod-a", (0, "1g.10gb", 1, 1), container_index=1).devices[0]
        world.lifecycle.undo_allocate("pod-a", 0)
        assert {r.mig_uuid: r.state for r in world.record_files().values()} == {
            kept.identity.mig_uuid: State.ACTIVE
        }

    def test_an_instance_released_since_is_untouched(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        before = world.everything()
        assert world.lifecycle.undo_allocate("pod-a", 0) == ([], [])
        assert world.everything() == before

    def test_an_instance_handed_to_another_key_since_is_untouched(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        world.lifecycle.release("pod-a")
        taken = world.allocate("pod-c", (0, "1g.10gb", 0, 1)).devices[0]
        assert taken.outcome is Outcome.REUSED
        before = world.everything()

        assert world.lifecycle.undo_allocate("pod-a", 0) == ([], [])

        assert world.everything() == before
        [record] = world.record_files().values()
        assert record.state is State.ACTIVE
        assert record.owner is not None
        assert record.owner.pod.uid == "pod-c"

    def test_what_it_created_survives_a_restart_and_is_still_destroyed(self, world: World) -> None:
        result = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        restart(world).recover(active_of("pod-a", result))
        assert [r.origin for r in world.record_files().values()] == [Origin.CREATED]

        destroyed, idled = world.lifecycle.undo_allocate("pod-a", 0)

        assert (len(destroyed), idled) == (1, [])
        assert world.layout() == set()
        assert world.record_files() == {}

    def test_an_instance_recovery_adopts_without_a_record_is_given_back_not_destroyed(
        self, world: World
    ) -> None:
        """Recoverer cannot know how the pod got it, so it counts as REUSED: kept IDLE, reclaimable."""
        result = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        [name] = world.record_files()
        world.records.path(name).unlink()
        restart(world).recover(active_of("pod-a", result))
        [adopted] = world.record_files().values()
        assert (adopted.state, adopted.origin) == (State.ACTIVE, Origin.REUSED)

        destroyed, idled = world.lifecycle.undo_allocate("pod-a", 0)

        assert (destroyed, len(idled)) == ([], 1)
        assert world.live_mig_uuids() == {result.devices[0].identity.mig_uuid}
        assert [r.state for r in world.record_files().values()] == [State.IDLE]

    def test_a_failed_destroy_leaves_error_answers_nvml_error_and_the_reconciler_finishes(
        self, world: World
    ) -> None:
        reused, created = reuse_and_create(world)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)

        with pytest.raises(errors.NvmlFailure) as caught:
            world.lifecycle.undo_allocate("pod-b", 0)

        assert caught.value.code is errors.Code.UNAVAILABLE
        states = {r.mig_uuid: r.state for r in world.record_files().values()}
        assert states == {reused: State.IDLE, created: State.ERROR}
        assert world.lifecycle.undo_allocate("pod-b", 0) == ([], [])  # ERROR is not undone twice
        world.hw.clear_faults()
        Reconciler(world.lifecycle).run_once()
        assert world.live_mig_uuids() == {reused}
        world.assert_consistent()

    def test_a_process_on_a_created_instance_refuses_and_changes_nothing(self, world: World) -> None:
        _, created = reuse_and_create(world)
        world.hw.set_busy(created)
        before = world.everything()

        with pytest.raises(errors.InstanceInUse) as caught:
            world.lifecycle.undo_allocate("pod-b", 0)

        assert caught.value.metadata["mig_uuid"] == created
        assert world.everything() == before

    def test_a_malformed_pod_uid_is_invalid_and_changes_nothing(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        before = world.everything()
        with pytest.raises(errors.InvalidRequest):
            world.lifecycle.undo_allocate("../pod-a", 0)
        assert world.everything() == before

    def test_before_recovery_it_is_refused(self, world: World) -> None:
        result = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        before = world.everything()
        restart(world)
        with pytest.raises(errors.NotRecovered):
            world.lifecycle.undo_allocate("pod-a", 0)
        assert world.everything() == before
        assert result.devices[0].identity.mig_uuid in world.live_mig_uuids()


def key(pod: str, container: int = 0, device: int = 0) -> AllocationKey:
    return AllocationKey(pod, container, device)


class TestUndoDevice:
    """The device-level undo: one MIG UUID, only while the named owner holds it."""

    def test_it_undoes_one_device_and_leaves_the_containers_other_device_as_it_was(
        self, world: World
    ) -> None:
        reused, created = reuse_and_create(world)

        done = world.lifecycle.undo_device(created, key("pod-b", device=1))

        assert done.destroyed is not None
        assert done.destroyed.identity is not None
        assert (done.destroyed.identity.mig_uuid, done.idled, done.skipped) == (created, None, None)
        [record] = world.record_files().values()
        assert (record.mig_uuid, record.state, record.owner is not None) == (reused, State.ACTIVE, True)
        assert record.owner is not None
        assert record.owner.key == key("pod-b", device=0)
        assert world.live_mig_uuids() == {reused}
        world.assert_consistent()

        done = world.lifecycle.undo_device(reused, key("pod-b", device=0))
        assert done.idled is not None
        assert done.destroyed is None
        assert [(r.state, r.owner) for r in world.record_files().values()] == [(State.IDLE, None)]

    def test_a_repeat_is_a_no_op_that_says_why_even_once_another_pod_holds_it(self, world: World) -> None:
        reused, _ = reuse_and_create(world)
        world.lifecycle.undo_device(reused, key("pod-b"))
        before = world.everything()

        again = world.lifecycle.undo_device(reused, key("pod-b"))
        assert (again.skipped, again.destroyed, again.idled) == (undo.Skip.NOT_ACTIVE, None, None)
        assert world.everything() == before

        taken = world.allocate("pod-c", (0, "1g.10gb", 0, 1)).devices[0]
        assert (taken.outcome, taken.identity.mig_uuid) == (Outcome.REUSED, reused)
        before = world.everything()
        late = world.lifecycle.undo_device(reused, key("pod-b"))
        assert late.skipped is undo.Skip.OTHER_OWNER
        assert "pod-c" in late.detail
        assert world.everything() == before

    def test_a_stale_container_or_device_index_changes_nothing(self, world: World) -> None:
        _, created = reuse_and_create(world)
        before = world.everything()
        for stale in (key("pod-b", device=0), key("pod-b", container=1, device=1), key("pod-x", device=1)):
            assert world.lifecycle.undo_device(created, stale).skipped is undo.Skip.OTHER_OWNER
        assert world.everything() == before

    def test_an_unknown_mig_uuid_changes_nothing_and_bad_input_is_invalid(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        before = world.everything()
        nobody = "MIG-00000000-0000-0000-0000-000000000000"
        assert world.lifecycle.undo_device(nobody, key("pod-a")).skipped is undo.Skip.UNKNOWN_INSTANCE
        for mig, owner in (("MIG-nope", key("pod-a")), (nobody, key("../pod-a"))):
            with pytest.raises(errors.InvalidRequest):
                world.lifecycle.undo_device(mig, owner)
        assert world.everything() == before

    def test_a_process_on_the_created_instance_refuses_and_changes_nothing(self, world: World) -> None:
        _, created = reuse_and_create(world)
        world.hw.set_busy(created)
        before = world.everything()
        with pytest.raises(errors.InstanceInUse):
            world.lifecycle.undo_device(created, key("pod-b", device=1))
        assert world.everything() == before

    def test_a_failed_destroy_leaves_error_and_the_reconciler_finishes(self, world: World) -> None:
        reused, created = reuse_and_create(world)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)
        with pytest.raises(errors.NvmlFailure):
            world.lifecycle.undo_device(created, key("pod-b", device=1))
        states = {r.mig_uuid: r.state for r in world.record_files().values()}
        assert states == {reused: State.ACTIVE, created: State.ERROR}
        assert world.lifecycle.undo_device(created, key("pod-b", device=1)).skipped is undo.Skip.NOT_ACTIVE
        world.hw.clear_faults()
        Reconciler(world.lifecycle).run_once()
        assert world.live_mig_uuids() == {reused}
        world.assert_consistent()

    @pytest.mark.parametrize("point", ["after-record-deleting", "after-destroy-gi", "after-undo-destroy-one"])
    def test_a_crash_in_the_destroy_leaves_nothing_behind_after_recovery(
        self, world: World, point: str
    ) -> None:
        reused, created = reuse_and_create(world)
        held = next(r for r in world.record_files().values() if r.mig_uuid == reused)
        assert held.owner is not None
        still = ActiveAllocation(owner=held.owner, reservation=held.reservation, identity=held.identity)
        with crashpoints.raising_at(point), pytest.raises(crashpoints.Crashed):
            world.lifecycle.undo_device(created, key("pod-b", device=1))
        restart(world).recover([still])
        assert world.live_mig_uuids() == {reused}
        assert {r.mig_uuid: r.state for r in world.record_files().values()} == {reused: State.ACTIVE}
        world.assert_consistent()

    def test_before_recovery_it_is_refused(self, world: World) -> None:
        mig = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0].identity.mig_uuid
        restart(world)
        with pytest.raises(errors.NotRecovered):
            world.lifecycle.undo_device(mig, key("pod-a"))


class TestAnUndoNeverGivesBackAFaultedInstance:
    """A reused instance an Xid named while ACTIVE is destroyed by the undo, not put back IDLE: an
    undo is a release, and a faulted instance is never handed to the next pod."""

    @staticmethod
    def fault(world: World, mig_uuid: str) -> None:
        [record] = [r for r in world.record_files().values() if r.mig_uuid == mig_uuid]
        event = XidEvent(record.gpu_uuid, 79, record.gpu_instance_id, record.compute_instance_id)
        assert apply_xid(world.ctx, event, frozenset()).faulted

    def test_undo_allocate_destroys_it(self, world: World) -> None:
        reused, created = reuse_and_create(world)
        self.fault(world, reused)

        destroyed, idled = world.lifecycle.undo_allocate("pod-b", 0)

        assert {r.identity.mig_uuid for r in destroyed if r.identity} == {reused, created}
        assert idled == []
        assert world.record_files() == {}
        assert world.live_mig_uuids() == set()
        world.assert_consistent()

    def test_undo_device_destroys_it(self, world: World) -> None:
        reused, created = reuse_and_create(world)
        self.fault(world, reused)

        done = world.lifecycle.undo_device(reused, key("pod-b"))

        assert done.destroyed is not None
        assert done.destroyed.identity is not None
        assert (done.destroyed.identity.mig_uuid, done.idled) == (reused, None)
        assert world.live_mig_uuids() == {created}
        assert [r.mig_uuid for r in world.record_files().values()] == [created]
        world.assert_consistent()
