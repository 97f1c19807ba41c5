"""ReclaimIdle and SetMigMode(reclaim_idle): only IDLE owned instances go, and a refusal destroys nothing."""

from __future__ import annotations

import pytest
from lifecycle_world import World

from sidecar.model import errors
from sidecar.model.domain import State
from sidecar.nvml.port import NVML_ERROR_UNKNOWN

FOREVER = 1000
NOBODY = "MIG-00000000-0000-0000-0000-000000000000"


def idle(world: World, pod: str, gpu: int, start: int, *, profile: str = "1g.10gb", size: int = 1) -> str:
    """An IDLE instance (allocated, then released); its MIG UUID."""
    mig = world.allocate(pod, (gpu, profile, start, size)).devices[0].identity.mig_uuid
    world.lifecycle.release(pod)
    return mig


def active(world: World, pod: str, gpu: int, start: int) -> str:
    return world.allocate(pod, (gpu, "1g.10gb", start, 1)).devices[0].identity.mig_uuid


def by_state(world: World) -> dict[str, State]:
    return {r.mig_uuid or r.name: r.state for r in world.record_files().values()}


class TestReclaimIdle:
    def test_without_names_every_idle_instance_of_that_gpu_goes_and_nothing_else(self, world: World) -> None:
        a, b = idle(world, "pod-a", 0, 0), idle(world, "pod-b", 0, 1)
        held = active(world, "pod-c", 0, 2)
        other_gpu = idle(world, "pod-d", 1, 0)

        reclaimed = world.lifecycle.reclaim_idle(world.uuid(0))

        assert {r.identity.mig_uuid for r in reclaimed if r.identity} == {a, b}
        assert world.live_mig_uuids() == {held, other_gpu}
        assert by_state(world) == {held: State.ACTIVE, other_gpu: State.IDLE}
        if world.cdi.enabled:
            assert world.cdi_files() == {world.cdi.spec_path(m).name for m in (held, other_gpu)}
        world.assert_consistent()

    def test_named_instances_only(self, world: World) -> None:
        a, b = idle(world, "pod-a", 0, 0), idle(world, "pod-b", 0, 1)
        reclaimed = world.lifecycle.reclaim_idle(world.uuid(0), [b])
        assert [r.identity.mig_uuid for r in reclaimed if r.identity] == [b]
        assert by_state(world) == {a: State.IDLE}
        world.assert_consistent()

    def test_a_gpu_without_idle_instances_reclaims_nothing(self, world: World) -> None:
        active(world, "pod-a", 0, 0)
        before = world.everything()
        assert world.lifecycle.reclaim_idle(world.uuid(0)) == []
        assert world.everything() == before

    def test_a_named_active_instance_is_not_idle_and_nothing_is_destroyed(self, world: World) -> None:
        a = idle(world, "pod-a", 0, 0)
        held = active(world, "pod-b", 0, 1)
        before = world.everything()

        with pytest.raises(errors.NotIdle) as caught:
            world.lifecycle.reclaim_idle(world.uuid(0), [a, held])

        assert (caught.value.reason, caught.value.code) == ("NOT_IDLE", errors.Code.FAILED_PRECONDITION)
        assert caught.value.metadata["state"] == "ACTIVE"
        assert world.everything() == before

    def test_a_named_error_instance_is_not_idle(self, world: World) -> None:
        a = idle(world, "pod-a", 0, 0)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)
        with pytest.raises(errors.NvmlFailure):
            world.lifecycle.reclaim_idle(world.uuid(0), [a])
        assert by_state(world) == {a: State.ERROR}
        before = world.everything()
        with pytest.raises(errors.NotIdle):
            world.lifecycle.reclaim_idle(world.uuid(0), [a])
        assert world.everything() == before

    def test_an_unknown_or_foreign_mig_uuid_is_unknown_instance_and_nothing_is_destroyed(
        self, world: World
    ) -> None:
        a = idle(world, "pod-a", 0, 0)
        elsewhere = idle(world, "pod-b", 1, 0)
        foreign = world.hw.create_instance(0, "1g.10gb", 3, 1).cis[0].mig_uuid
        assert foreign is not None
        before = world.everything()

        for wanted in ([a, NOBODY], [elsewhere], [foreign]):
            with pytest.raises(errors.UnknownInstance) as caught:
                world.lifecycle.reclaim_idle(world.uuid(0), wanted)
            assert (caught.value.reason, caught.value.code) == ("UNKNOWN_INSTANCE", errors.Code.NOT_FOUND)

        assert world.everything() == before

    def test_a_process_on_one_idle_instance_refuses_and_nothing_is_destroyed(self, world: World) -> None:
        idle(world, "pod-a", 0, 0)
        busy = idle(world, "pod-b", 0, 1)
        world.hw.set_busy(busy)
        before = world.everything()

        with pytest.raises(errors.InstanceInUse) as caught:
            world.lifecycle.reclaim_idle(world.uuid(0))

        assert caught.value.code is errors.Code.UNAVAILABLE
        assert caught.value.metadata["mig_uuid"] == busy
        assert world.everything() == before

    def test_bad_input_is_refused_and_changes_nothing(self, world: World) -> None:
        idle(world, "pod-a", 0, 0)
        before = world.everything()
        with pytest.raises(errors.UnknownGpu):
            world.lifecycle.reclaim_idle("GPU-00000000-0000-0000-0000-000000000000")
        with pytest.raises(errors.InvalidRequest):
            world.lifecycle.reclaim_idle(world.uuid(0), ["not-a-mig-uuid"])
        assert world.everything() == before

    def test_a_failed_destroy_leaves_error_and_the_other_instances_still_go(self, world: World) -> None:
        a, b = idle(world, "pod-a", 0, 0), idle(world, "pod-b", 0, 1)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=1)

        with pytest.raises(errors.NvmlFailure):
            world.lifecycle.reclaim_idle(world.uuid(0))

        assert by_state(world) == {a: State.ERROR}
        assert b not in world.live_mig_uuids()


class TestSetMigModeReclaimIdle:
    def test_disabling_a_gpu_with_only_idle_instances_destroys_them_first(self, world: World) -> None:
        a = idle(world, "pod-a", 1, 0)
        b = idle(world, "pod-b", 1, 2, profile="2g.20gb", size=2)
        kept = idle(world, "pod-c", 0, 0)

        current, pending, _ = world.lifecycle.set_mig_mode(world.uuid(1), False, reclaim_idle=True)

        assert (current, pending) == (False, False)  # H100: at once
        assert not world.port.gpu(world.uuid(1)).mig_current
        assert {a, b} & world.live_mig_uuids() == set()
        assert by_state(world) == {kept: State.IDLE}
        world.assert_consistent()

    def test_without_reclaim_idle_it_still_refuses(self, world: World) -> None:
        idle(world, "pod-a", 1, 0)
        before = world.everything()
        with pytest.raises(errors.PlacementBusy):
            world.lifecycle.set_mig_mode(world.uuid(1), False)
        assert world.everything() == before

    @pytest.mark.parametrize("blocker", ["ACTIVE", "ERROR", "foreign", "process"])
    def test_anything_but_idle_instances_refuses_and_nothing_is_destroyed(
        self, world: World, blocker: str
    ) -> None:
        a = idle(world, "pod-a", 1, 0)
        if blocker == "ACTIVE":
            active(world, "pod-b", 1, 1)
        elif blocker == "ERROR":
            b = idle(world, "pod-b", 1, 1)
            world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)
            with pytest.raises(errors.NvmlFailure):
                world.lifecycle.reclaim_idle(world.uuid(1), [b])
            world.hw.clear_faults()
        elif blocker == "foreign":
            world.hw.create_instance(1, "1g.10gb", 1, 1)
        else:
            world.hw.set_busy(a)
        before = world.everything()

        with pytest.raises((errors.PlacementBusy, errors.InstanceInUse)) as caught:
            world.lifecycle.set_mig_mode(world.uuid(1), False, reclaim_idle=True)

        if blocker == "process":
            assert isinstance(caught.value, errors.InstanceInUse)
        else:
            assert isinstance(caught.value, errors.PlacementBusy)
            assert caught.value.metadata["blocker"] == blocker
        assert world.everything() == before
        assert world.port.gpu(world.uuid(1)).mig_current
