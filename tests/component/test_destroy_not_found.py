"""NOT_FOUND from a destroy is not proof that the instance is gone.

``nvmlGpuInstanceDestroy``, ``nvmlComputeInstanceDestroy`` and the by-ID lookups inside them can
answer NOT_FOUND while the instance is still there. Taken as "already gone", the record and the CDI
spec were deleted and the GI lived on as foreign, blocking its placement for good. Every destroy path
(a reclaim, the undo of a create, the reconciler's ERROR retry, recovery finishing a CREATING or
DELETING record) now lists the GPU again after a NOT_FOUND: only an instance that is really absent is
gone; otherwise the record is ERROR and the call fails with NVML_ERROR (UNAVAILABLE).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from lifecycle_world import World, gis, restart

from sidecar.lifecycle.reconciler import Reconciler
from sidecar.lifecycle.teardown import destroy_hardware
from sidecar.model import errors
from sidecar.model.domain import Outcome, State
from sidecar.model.errors import Code
from sidecar.nvml.port import NVML_ERROR_NOT_FOUND, NVML_ERROR_UNKNOWN, NvmlError

FOREVER = 1000
# Every NVML call a reclaim's destroy makes that can answer NOT_FOUND for a live instance. The GI is
# looked up by ID once, in the CI destroy; the GI destroy takes that handle, and one that answers
# anything but a transient error is looked up by ID again (so "destroy-gi" meets the lookup too). (The
# reclaim destroys by ID: its process count found the instance by MIG UUID, so it lists no CIs.)
NOT_FOUND_AT = [
    pytest.param("destroy-gi", 0, id="destroy-gi"),
    pytest.param("destroy-ci", 0, id="destroy-ci"),
    pytest.param("get-compute-instance", 0, id="ci-lookup"),
    pytest.param("get-gpu-instance", 0, id="gi-lookup"),
]


def reclaim_with_not_found(world: World, op: str, after: int) -> str:
    """The reported case: an idle 1g.10gb at 4:1, then a 3g.40gb at 4:4 that must reclaim it.

    The fault stays: the reclaim destroys by ID (its process count found the instance by its MIG
    UUID), and a NOT_FOUND there is judged on a fresh listing, which retries the destroy of what is
    still listed; a NOT_FOUND that passed would let that retry succeed, and the instance would be
    gone for real."""
    idle = world.allocate("pod-a", (0, "1g.10gb", 4, 1)).devices[0]
    world.lifecycle.release("pod-a")
    world.hw.inject_fault(op, NVML_ERROR_NOT_FOUND, after=after, times=FOREVER)
    with pytest.raises(errors.NvmlFailure) as caught:
        world.allocate("pod-b", (0, "3g.40gb", 4, 4))
    assert caught.value.code is Code.UNAVAILABLE
    assert caught.value.metadata["nvml_code"] == str(NVML_ERROR_NOT_FOUND)
    world.hw.clear_faults()  # so that the test can read the layout; nothing retries in between
    return idle.identity.mig_uuid


class TestAReclaimThatMeetsNotFound:
    @pytest.mark.parametrize(("op", "after"), NOT_FOUND_AT)
    def test_keeps_an_error_record_for_the_gpu_instance_that_is_still_there(
        self, world: World, op: str, after: int
    ) -> None:
        mig_uuid = reclaim_with_not_found(world, op, after)

        world.assert_consistent()  # every live GI still has its record
        [record] = world.record_files().values()
        assert record.state is State.ERROR
        assert record.mig_uuid == mig_uuid
        assert gis(world, 0) in ({("4:1", 0)}, {("4:1", 1)})

    @pytest.mark.parametrize(("op", "after"), NOT_FOUND_AT)
    def test_the_reconciler_destroys_it_once_the_fault_clears_and_the_placement_is_free_again(
        self, world: World, op: str, after: int
    ) -> None:
        reclaim_with_not_found(world, op, after)
        world.hw.clear_faults()

        report = Reconciler(world.lifecycle).run_once()

        assert len(report.destroyed) == 1
        assert world.everything() == (set(), {}, set())
        assert world.allocate("pod-b", (0, "3g.40gb", 4, 4)).devices[0].outcome is Outcome.CREATED


class TestTheOtherDestroyPaths:
    def test_an_undo_whose_gpu_instance_destroy_answers_not_found_keeps_error(self, world: World) -> None:
        world.hw.inject_fault("create-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_NOT_FOUND)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "2g.20gb", 2, 2))

        world.assert_consistent()
        [record] = world.record_files().values()
        assert (record.state, str(record.placement)) == (State.ERROR, "2:2")
        assert gis(world, 0) == {("2:2", 0)}

    def test_the_reconciler_retry_that_meets_not_found_stays_error(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 4, 1))
        world.lifecycle.release("pod-a")
        world.hw.inject_fault("destroy-gi", NVML_ERROR_UNKNOWN, times=FOREVER)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-b", (0, "3g.40gb", 4, 4))
        world.hw.clear_faults()
        world.hw.inject_fault("destroy-gi", NVML_ERROR_NOT_FOUND)

        report = Reconciler(world.lifecycle).run_once()

        assert (report.destroyed, len(report.still_failing)) == ((), 1)
        world.assert_consistent()
        assert list(world.states().values()) == [State.ERROR]
        assert Reconciler(world.lifecycle).run_once().destroyed != ()
        assert world.everything() == (set(), {}, set())

    @pytest.mark.parametrize("interrupted", [State.CREATING, State.DELETING])
    def test_recovery_finishing_an_interrupted_record_keeps_error(
        self, world: World, interrupted: State
    ) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 4, 1))
        world.lifecycle.release("pod-a")
        [record] = world.record_files().values()
        # What a kill -9 inside a create (CREATING) or a reclaim (DELETING) of this instance leaves.
        world.records.put(msgspec.structs.replace(record, state=interrupted, owner=None))
        recovery = restart(world)
        world.hw.inject_fault("destroy-gi", NVML_ERROR_NOT_FOUND)

        report = recovery.recover([])

        world.assert_consistent()
        assert list(world.states().values()) == [State.ERROR]
        assert report.errors
        world.hw.clear_faults()
        Reconciler(world.lifecycle).run_once()
        assert world.everything() == (set(), {}, set())


class _VanishesThenNotFound:
    """A port whose GI destroy meets a GI someone else destroyed an instant before: NOT_FOUND, and
    really gone (the race a real node can have; the simulator alone answers NOT_FOUND only for
    what is absent at the call)."""

    def __init__(self, world: World) -> None:
        self._world = world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._world.port, name)

    def destroy_gpu_instance(self, gpu_uuid: str, gpu_instance_id: int) -> None:
        index = next(g.index for g in self._world.gpus if g.uuid == gpu_uuid)
        self._world.hw.destroy_instance(index, gpu_instance_id)
        raise NvmlError(f"destroy GPU instance {gpu_instance_id}", NVML_ERROR_NOT_FOUND, "Not Found")


class TestNotFoundForWhatIsReallyGone:
    def test_counts_as_destroyed(self, world: World) -> None:
        world.allocate("pod-a", (0, "1g.10gb", 4, 1))
        world.lifecycle.release("pod-a")
        [record] = world.record_files().values()

        destroy_hardware(_VanishesThenNotFound(world), record)

        assert gis(world, 0) == set()
