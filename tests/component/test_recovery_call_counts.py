"""What a Recover costs in NVML calls on a full node, counted by the simulator per C function.

The static tables (GI profile info, possible placements, CI profile info) are read once per GPU model,
not once per GPU; beyond them a Recover costs a bounded number of calls per instance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest
from lifecycle_world import BOOT_ID, World, active_of

from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.inventory import LayoutRecordingPort
from sidecar.lifecycle.recover import Recoverer
from sidecar.model.domain import ActiveAllocation
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall
from sidecar.store.cdi import CdiSpecs
from sidecar.store.records import RecordStore

GI_PROFILE_INFO = "nvmlDeviceGetGpuInstanceProfileInfoV"
PLACEMENTS = "nvmlDeviceGetGpuInstancePossiblePlacements_v2"
CI_PROFILE_INFO = "nvmlGpuInstanceGetComputeInstanceProfileInfoV"
H100_GI_PROFILES = 7
PER_INSTANCE = 12


def _world(tmp_path: Path, gpus: list[tuple[str, int]]) -> World:
    hw = SimulatedHardware.create(gpus, proc_root=tmp_path / "proc")
    install(hw)
    port = PynvmlBackend(retry_wait=False)
    records = RecordStore(tmp_path / "state", in_place=True)
    records.open()
    cdi = CdiSpecs(tmp_path / "cdi", proc_root=tmp_path / "proc")
    ctx = LifecycleContext(LayoutRecordingPort(port), records, cdi, BOOT_ID)
    ctx.install([], 0)
    return World(hw, port, records, cdi, tmp_path / "cdi", ctx, Lifecycle(ctx), port.gpus())


def _fill(world: World, profile: str, starts: range) -> list[ActiveAllocation]:
    active: list[ActiveAllocation] = []
    for g in range(len(world.gpus)):
        for s in starts:
            pod = f"pod-{g}-{s}"
            active += active_of(pod, world.allocate(pod, (g, profile, s, 1)))
    return active


def _restarted_recover(world: World, active: list[ActiveAllocation]) -> tuple[int, dict[str, int]]:
    """A new sidecar process: a fresh adapter (nothing cached), records and hardware as they were."""
    world.port.close()
    world.records.close()
    port = PynvmlBackend(retry_wait=False)
    records = RecordStore(world.records.directory, in_place=True)
    records.open()
    cdi = CdiSpecs(world.cdi.directory, proc_root=world.cdi.proc_root)
    ctx = LifecycleContext(LayoutRecordingPort(port), records, cdi, BOOT_ID)
    world.port, world.records, world.cdi, world.ctx, world.lifecycle = port, records, cdi, ctx, Lifecycle(ctx)
    world.hw.reset_call_counts()
    report = Recoverer(ctx, adopt_existing=False).recover(active)
    return len(report.adopted_active), world.hw.call_counts()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[World]:
    world = _world(tmp_path, [("h100-80gb", 8)])
    try:
        yield world
    finally:
        world.records.close()
        uninstall()


def test_recover_of_eight_h100s_with_seven_active_instances_each(node: World) -> None:
    active = _fill(node, "1g.10gb", range(7))
    adopted, calls = _restarted_recover(node, active)
    assert adopted == 8 * 7
    static = {
        GI_PROFILE_INFO: pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT,
        PLACEMENTS: 2 * H100_GI_PROFILES,  # the count query, then the array
        CI_PROFILE_INFO: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT,  # of the one GI profile there is
    }
    assert {name: calls.get(name, 0) for name in static} == static  # one model's tables, once
    assert sum(calls.values()) <= 8 * 7 * PER_INSTANCE + sum(static.values())
    assert {r.name for r in node.lifecycle.instances()} == set(node.record_files())


def test_each_gpu_model_reads_its_own_tables(tmp_path: Path) -> None:
    world = _world(tmp_path, [("h100-80gb", 2), ("a100-40gb", 2)])
    try:
        active: list[ActiveAllocation] = []
        for g, profile in enumerate(("1g.10gb", "1g.10gb", "1g.5gb", "1g.5gb")):
            pod = f"pod-{g}"
            active += active_of(pod, world.allocate(pod, (g, profile, 0, 1)))
        adopted, calls = _restarted_recover(world, active)
        assert adopted == 4
        assert calls[GI_PROFILE_INFO] == 2 * pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
        assert calls[CI_PROFILE_INFO] == 2 * pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
    finally:
        world.records.close()
        uninstall()
