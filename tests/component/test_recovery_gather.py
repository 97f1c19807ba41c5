"""Recoverer's gather: profile tables read once per GPU model, GPUs read in parallel (issues 13, 22).

The simulator counts every NVML C call exactly, so the calls a repeated Recover makes are asserted
exactly; a parallel gather must build the same inputs, and so the same plan, as a one-at-a-time one.
"""

from __future__ import annotations

import msgspec
import pytest
from lifecycle_world import World, active_of, recovery_of, restart

from sidecar.lifecycle import recover as apply
from sidecar.model import errors
from sidecar.model.recovery_plan.plan import plan
from sidecar.nvml.port import NVML_ERROR_UNKNOWN

# The C functions that read a GPU's profile table (GI profiles and their possible placements).
PROFILE_TABLE = ("nvmlDeviceGetGpuInstanceProfileInfoV", "nvmlDeviceGetGpuInstancePossiblePlacements_v2")


def counted_recover(world: World) -> dict[str, int]:
    recovery = recovery_of(world)
    world.hw.reset_call_counts()
    recovery.recover([])
    return world.hw.call_counts()


def without_profile_tables(counts: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in counts.items() if name not in PROFILE_TABLE}


def test_a_repeated_recover_reads_no_profile_table(world: World) -> None:
    world.hw.reset_call_counts()
    restart(world).recover([])
    first = world.hw.call_counts()
    assert all(first.get(name, 0) > 0 for name in PROFILE_TABLE)

    again = counted_recover(world)

    assert again == without_profile_tables(first)


def test_a_mig_mode_change_behind_the_sidecar_rereads_no_profile_table(world: World) -> None:
    """The tables are facts of the GPU model, which the adapter reads once per model: a mode change
    made outside the sidecar changes the layout a Recover lists, not them. (A mode change the sidecar
    makes itself drops them, with everything else it knew of the GPU: ``tests/nvml``.)"""
    restart(world).recover([])

    world.hw.set_mig_mode(2, False)
    once = counted_recover(world)
    world.hw.set_mig_mode(2, True)
    back = counted_recover(world)

    assert not set(PROFILE_TABLE) & (set(once) | set(back))
    assert "nvmlDeviceGetGpuInstances" in back  # MIG is on again: its GIs are listed


def test_a_parallel_gather_over_several_gpus_plans_exactly_as_one_gpu_at_a_time(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = world.allocate("pod-a", (0, "3g.40gb", 0, 4), (1, "1g.10gb", 2, 1), (2, "2g.10gb", 0, 2))
    world.allocate("pod-b", (1, "2g.20gb", 4, 2), (2, "1g.5gb", 4, 1))
    world.lifecycle.release("pod-b")
    world.hw.create_instance(0, "1g.10gb", 6, 1)  # foreign, on a GPU with an owned instance
    restarted = restart(world)
    active = active_of("pod-a", held)

    parallel = restarted.gather(active)
    monkeypatch.setattr(apply, "_GATHER_THREADS", 1)
    serial = msgspec.structs.replace(restarted.gather(active), now=parallel.now)

    assert len(parallel.gpus) == 3
    assert [g.info.uuid for g in parallel.gpus] == [g.uuid for g in world.gpus]
    assert parallel == serial
    assert plan(parallel) == plan(serial)


def test_an_nvml_error_on_one_gpu_of_a_parallel_gather_fails_the_recover_and_modifies_nothing(
    world: World,
) -> None:
    world.allocate("pod-a", (0, "1g.10gb", 0, 1), (2, "1g.5gb", 0, 1))
    world.hw.reboot()  # every record is now stale: a recovery that ran would drop them
    before = world.everything()
    recovery = restart(world, boot_id="after-reboot")
    world.hw.inject_fault("get-gpu-instances", NVML_ERROR_UNKNOWN, after=1)  # the second GPU's listing

    with pytest.raises(errors.NvmlFailure):
        recovery.recover([])

    world.hw.clear_faults()
    assert world.everything() == before
    assert not world.lifecycle.recovered
    assert len(recovery.recover([]).dropped_stale_records) == 2
