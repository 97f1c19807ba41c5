"""Every modelled GPU through the lifecycle: a full GPU of each profile is created, released, reused and
reclaimed; and an instance whose MIG UUID cannot be proven leaves nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lifecycle_world import BOOT_ID, World

from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.inventory import LayoutRecordingPort
from sidecar.model.domain import Outcome
from sidecar.model.errors import SidecarError
from sidecar.nvml import profiles
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall
from sidecar.store.cdi import CdiSpecs
from sidecar.store.records import RecordStore


def _world(tmp_path: Path, key: str) -> World:
    hw = SimulatedHardware.create([(key, 1)], proc_root=tmp_path / "proc")
    install(hw)
    port = PynvmlBackend(retry_wait=False)
    records = RecordStore(tmp_path / "state")
    records.open()
    cdi = CdiSpecs(tmp_path / "cdi", proc_root=tmp_path / "proc")
    ctx = LifecycleContext(LayoutRecordingPort(port), records, cdi, BOOT_ID)
    ctx.install([], 0)
    return World(hw, port, records, cdi, tmp_path / "cdi", ctx, Lifecycle(ctx), port.gpus())


@pytest.fixture
def world_of(tmp_path: Path) -> Iterator[object]:
    worlds: list[World] = []

    def make(key: str, name: str = "node") -> World:
        worlds.append(_world(tmp_path / name, key))
        return worlds[-1]

    yield make
    for w in worlds:
        w.records.close()
    uninstall()


def _fill(model: profiles.GpuProduct, p: profiles.GiProfile) -> list[int]:
    """As many instances of ``p`` as fit side by side, lowest starts first."""
    starts: list[int] = []
    for s in p.starts:
        if len(starts) < p.instance_count and all(s + p.size <= t or t + p.size <= s for t in starts):
            starts.append(s)
    return starts


@pytest.mark.parametrize("key", list(profiles.MODELS))
def test_a_full_gpu_of_every_profile_round_trips(world_of: object, key: str) -> None:
    model = profiles.model(key)
    biggest = max(model.profiles, key=lambda p: (p.size, p.slice_count, -p.index))
    for p in model.profiles:
        w: World = world_of(key, p.name)  # type: ignore[operator]
        devices = [(0, p.name, s, p.size) for s in _fill(model, p)]
        first = w.allocate("pod-a", *devices)
        assert {d.outcome for d in first.devices} == {Outcome.CREATED}
        assert {c.profile_id for g in w.hw.layout(0).gis for c in g.cis} == {p.full_ci_profile_id}
        w.assert_consistent()
        w.lifecycle.release("pod-a")
        again = w.allocate("pod-b", *devices)
        assert {d.outcome for d in again.devices} == {Outcome.REUSED}
        assert {d.identity.mig_uuid for d in again.devices} == {d.identity.mig_uuid for d in first.devices}
        w.lifecycle.release("pod-b")
        other = biggest if p is not biggest else model.profiles[0]
        taken = w.allocate("pod-c", (0, other.name, other.starts[0], other.size))
        assert taken.reclaimed, f"{p.name}: {other.name} reclaimed nothing"
        assert {d.outcome for d in taken.devices} == {Outcome.CREATED}
        w.assert_consistent()
        w.records.close()
        uninstall()


def test_an_unprovable_mig_uuid_fails_the_allocate_and_leaves_nothing(world_of: object) -> None:
    w: World = world_of("h100-80gb")  # type: ignore[operator]
    before = w.everything()
    w.hw.set_ci_info_device(parent=True)
    w.hw.inject_fault("nvmlDeviceGetMigDeviceHandleByIndex", "NOT_FOUND", times=1000)
    with pytest.raises(SidecarError):
        w.allocate("pod-a", (0, "1g.10gb", 0, 1))
    w.hw.clear_faults()
    assert w.everything() == before
    assert w.hw.layout(0).gis == ()
    w.hw.set_ci_info_device(parent=True)
    result = w.allocate("pod-a", (0, "1g.10gb", 0, 1))  # the walk proves it once it may
    assert result.devices[0].identity.mig_uuid == w.hw.layout(0).gis[0].cis[0].mig_uuid
