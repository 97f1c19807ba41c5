"""A state file shared by processes stays the truth although each process keeps the state it decoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.domain import Placement
from sidecar.nvml.port import NVML_ERROR_IN_USE
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall
from sidecar.nvml.sim.state import SimError


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "hw.json"
    SimulatedHardware.init_file(path, [("h100-80gb", 1)])
    return path


class TestEveryCallSeesTheFile:
    def test_a_change_by_another_user_of_the_file_is_seen_at_the_next_call(self, state: Path) -> None:
        mine, theirs = SimulatedHardware.open(state), SimulatedHardware.open(state)
        assert mine.layout(0).gis == ()
        theirs.create_instance(0, "2g.20gb", 2, 2)
        assert [gi.placement for gi in mine.layout(0).gis] == [Placement(2, 2)]
        theirs.destroy_instance(0, mine.layout(0).gis[0].id)
        assert mine.layout(0).gis == ()

    def test_an_edit_of_the_file_by_hand_is_seen_at_the_next_call(self, state: Path) -> None:
        hw = SimulatedHardware.open(state)
        assert not hw.layout(0).lost
        doc = json.loads(state.read_bytes())
        doc["gpus"][0]["lost"] = True
        state.write_text(json.dumps(doc))
        assert hw.layout(0).lost

    def test_a_deleted_state_file_is_reported_not_served_from_memory(self, state: Path) -> None:
        hw = SimulatedHardware.open(state)
        hw.layout(0)
        state.unlink()
        with pytest.raises(FileNotFoundError, match="does not exist"):
            hw.layout(0)


class TestARefusedChangeLeavesNoTrace:
    def test_a_destroy_refused_half_way_keeps_every_compute_instance_it_had_not_destroyed(
        self, state: Path
    ) -> None:
        """``sim destroy`` removes the first CI in memory, then the busy second one refuses: nothing is
        written, and the next call must not see the half-done change this process made in memory."""
        hw = SimulatedHardware.open(state)
        gi = hw.create_instance(0, "3g.40gb", 4, 4, with_ci=False)
        install(hw)
        try:
            port = PynvmlBackend(retry_wait=False)
            gpu = port.gpus()[0].uuid
            cis = [port.create_compute_instance(gpu, gi.id, 0) for _ in range(2)]
            port.close()
        finally:
            uninstall()
        hw.set_busy(cis[1].mig_uuid)
        with pytest.raises(SimError) as refused:
            hw.destroy_instance(0, gi.id)
        assert refused.value.code == NVML_ERROR_IN_USE
        assert [ci.mig_uuid for ci in hw.layout(0).gis[0].cis] == [c.mig_uuid for c in cis]
        assert [ci.mig_uuid for ci in SimulatedHardware.open(state).layout(0).gis[0].cis] == [
            c.mig_uuid for c in cis
        ]
