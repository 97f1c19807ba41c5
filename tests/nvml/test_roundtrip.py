"""Every valid full layout of every model survives a round trip through the adapter.

A full layout is a maximal set of legal, non-overlapping placements within the instance counts: no
further GI of any profile fits. For each one: create every GI with its full-size CI, read the layout
back through the adapter, compare, destroy everything, and find the GPU empty again.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sidecar.nvml import profiles
from sidecar.nvml.port import Placement
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall

Layout = list[tuple[profiles.GiProfile, int]]


def full_layouts(model: profiles.GpuProduct) -> list[Layout]:
    candidates = [(p, s) for p in model.profiles for s in p.starts]

    def fits(chosen: Layout, candidate: tuple[profiles.GiProfile, int]) -> bool:
        p, s = candidate
        if sum(1 for q, _ in chosen if q.id == p.id) >= p.instance_count:
            return False
        return all(s + p.size <= t or t + q.size <= s for q, t in chosen)

    found: list[Layout] = []

    def walk(i: int, chosen: Layout) -> None:
        if i == len(candidates):
            if not any(fits(chosen, c) for c in candidates):
                found.append(list(chosen))
            return
        if fits(chosen, candidates[i]):
            chosen.append(candidates[i])
            walk(i + 1, chosen)
            chosen.pop()
        walk(i + 1, chosen)

    walk(0, [])
    return found


@pytest.fixture
def port_for() -> Iterator[object]:
    ports: list[PynvmlBackend] = []

    def make(key: str) -> tuple[PynvmlBackend, str]:
        install(SimulatedHardware.create([(key, 1)]))  # no /proc tree: keeps thousands of creates cheap
        port = PynvmlBackend(retry_wait=False)
        ports.append(port)
        return port, port.gpus()[0].uuid

    yield make
    for p in ports:
        p.close()
    uninstall()


def test_the_enumeration_finds_the_known_number_of_full_layouts() -> None:
    counts = {key: len(full_layouts(m)) for key, m in profiles.MODELS.items()}
    assert counts == {
        "a100-40gb": 239,
        "a100-80gb": 239,
        "a30": 21,
        "h100-80gb": 239,
        "h100-94gb": 239,
        "h200-141gb": 239,
        "h20": 239,
        "gh200-96gb": 239,
        "gh200-144gb": 239,
        "b200": 239,
        "rtx-pro-6000": 606,  # four 1-slice and two 2-slice variants on a 4-slice axis
    }
    assert [(p.name, s) for p, s in full_layouts(profiles.model("a30"))[-1]] == [("4g.24gb", 0)]


@pytest.mark.parametrize("key", list(profiles.MODELS))
def test_every_full_layout_round_trips_through_the_adapter(port_for: object, key: str) -> None:
    port, gpu = port_for(key)  # type: ignore[operator]
    model = profiles.model(key)
    by_id = {p.id: p for p in port.gpu_instance_profiles(gpu)}
    for layout in full_layouts(model):
        created = {}
        for p, start in layout:
            gi = port.create_gpu_instance(gpu, p.id, Placement(start, p.size))
            ci = port.create_compute_instance(gpu, gi.id, by_id[p.id].ci_profile_id)
            created[gi.id] = (p.id, Placement(start, p.size), ci.mig_uuid)
            assert gi.id == profiles.gpu_instance_id(model.memory_slices, start, p.size)
        live = {}
        for gi in port.gpu_instances(gpu):
            (ci,) = port.compute_instances(gpu, gi.id)
            live[gi.id] = (gi.profile_id, gi.placement, ci.mig_uuid)
        assert live == created, [(p.name, s) for p, s in layout]
        for gi_id in created:
            port.destroy_compute_instance(gpu, gi_id, 0)
            port.destroy_gpu_instance(gpu, gi_id)
        assert port.gpu_instances(gpu) == []
