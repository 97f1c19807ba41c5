"""The exact NVML calls of each Allocate decision, counted by the simulator per C function.

The counts are exact and deterministic: they depend on the code path, never on timing. Each safety
check costs a call here: the MIG mode read once under the GPU lock, the MIG UUID lookup that proves
an instance live before it is handed out or destroyed, its process count."""

from __future__ import annotations

from lifecycle_world import World

from sidecar.model.domain import Outcome

MODE = {"nvmlDeviceGetMigMode": 1}
# Look up by MIG UUID, its processes: the instance is live (the UUID proves its CI and GI) and unused.
PROVE = {
    "nvmlDeviceGetHandleByUUID": 1,
    "nvmlDeviceGetComputeRunningProcesses_v3": 1,
}
# GI create and its read-back; CI create (with the GI's handle) and its read-back; the MIG UUID proof.
CREATE = {
    "nvmlDeviceCreateGpuInstanceWithPlacement": 1,
    "nvmlGpuInstanceGetInfo": 1,
    "nvmlGpuInstanceCreateComputeInstance": 1,
    "nvmlComputeInstanceGetInfo_v2": 1,
    "nvmlDeviceGetUUID": 1,
    "nvmlDeviceGetGpuInstanceId": 1,
    "nvmlDeviceGetComputeInstanceId": 1,
}
# By ID: the GI looked up once, for the CI destroy; the GI destroy takes the same handle.
DESTROY = {
    "nvmlDeviceGetGpuInstanceById": 1,
    "nvmlGpuInstanceGetComputeInstanceById": 1,
    "nvmlComputeInstanceDestroy": 1,
    "nvmlGpuInstanceDestroy": 1,
}


def total(*parts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for name, n in part.items():
            out[name] = out.get(name, 0) + n
    return out


def counted(world: World, pod: str, profile: str, start: int, size: int) -> tuple[Outcome, dict[str, int]]:
    world.hw.reset_call_counts()
    outcome = world.allocate(pod, (0, profile, start, size)).devices[0].outcome
    return outcome, world.hw.call_counts()


def test_each_decision_makes_exactly_its_calls(world: World) -> None:
    world.allocate("pod-z", (0, "7g.80gb", 0, 8))
    world.lifecycle.release("pod-z")  # an idle instance over the whole GPU

    assert counted(world, "pod-w", "1g.10gb", 0, 1) == (Outcome.CREATED, total(MODE, PROVE, DESTROY, CREATE))
    assert counted(world, "pod-c", "1g.10gb", 1, 1) == (Outcome.CREATED, total(MODE, CREATE))
    assert counted(world, "pod-c", "1g.10gb", 1, 1) == (Outcome.ALREADY_ALLOCATED, {})
    world.lifecycle.release("pod-c")
    assert counted(world, "pod-r", "1g.10gb", 1, 1) == (Outcome.REUSED, total(MODE, PROVE))
    world.assert_consistent()


def test_a_reuse_costs_the_same_whatever_else_is_on_the_gpu(world: World) -> None:
    world.allocate("pod-a", (0, "1g.10gb", 0, 1))
    world.lifecycle.release("pod-a")
    for i, start in enumerate((1, 2, 3, 4, 5, 6)):
        world.allocate(f"pod-n{i}", (0, "1g.10gb", start, 1))

    assert counted(world, "pod-b", "1g.10gb", 0, 1) == (Outcome.REUSED, total(MODE, PROVE))


# One listing of an H100's GIs: one GetGpuInstances per GI profile (7), one GetInfo per GI found.
def listing(gis: int) -> dict[str, int]:
    return {"nvmlDeviceGetGpuInstances": 7, "nvmlGpuInstanceGetInfo": gis}


def five_on_one_gpu(world: World) -> None:
    """G = 5 on GPU 0: four ACTIVE 1g.10gb at 0-3 and an IDLE 1g.10gb at 4:1."""
    for start in range(4):
        world.allocate(f"pod-a{start}", (0, "1g.10gb", start, 1))
    world.allocate("pod-i", (0, "1g.10gb", 4, 1))
    world.lifecycle.release("pod-i")


class TestFiveInstancesOnTheGpu:
    def test_a_reclaim_that_needs_a_listing_lists_gpu_instances_only(self, world: World) -> None:
        """The IDLE 1g.10gb at 4:1 covers half of 2g.20gb at 4:2: one GI listing judges the rest. The
        process count finds the IDLE instance by its MIG UUID, so it is destroyed by ID without a
        listing of its compute instances."""
        five_on_one_gpu(world)
        outcome, calls = counted(world, "pod-b", "2g.20gb", 4, 2)
        assert (outcome, calls) == (Outcome.CREATED, total(MODE, listing(5), PROVE, DESTROY, CREATE))
        assert sum(calls.values()) == 26
        world.assert_consistent()

    def test_a_reclaim_the_idle_instance_covers_needs_no_listing(self, world: World) -> None:
        """1g.10gb+me at 4:1 is not the IDLE 1g.10gb there (another profile), but its slices are."""
        five_on_one_gpu(world)
        outcome, calls = counted(world, "pod-b", "1g.10gb+me", 4, 1)
        assert (outcome, calls) == (Outcome.CREATED, total(MODE, PROVE, DESTROY, CREATE))
        assert sum(calls.values()) == 14
        world.assert_consistent()

    def test_create_reuse_and_already_allocated_cost_what_they_cost_on_an_empty_gpu(
        self, world: World
    ) -> None:
        five_on_one_gpu(world)
        assert counted(world, "pod-c", "1g.10gb", 5, 1) == (Outcome.CREATED, total(MODE, CREATE))
        assert counted(world, "pod-c", "1g.10gb", 5, 1) == (Outcome.ALREADY_ALLOCATED, {})
        assert counted(world, "pod-r", "1g.10gb", 4, 1) == (Outcome.REUSED, total(MODE, PROVE))
        assert sum(total(MODE, CREATE).values()) <= 8
        assert sum(total(MODE, PROVE).values()) <= 3
        world.assert_consistent()
