"""A state file shared by processes stays the truth although each process keeps the state it decoded."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pynvml as nv
import pytest

from sidecar.nvml.port import NVML_ERROR_IN_USE, Placement
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall
from sidecar.nvml.sim.state import SimError
from sidecar.nvml.sim.store import FileStore


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

    def test_a_file_renamed_over_the_state_by_hand_is_seen_at_the_next_call(self, state: Path) -> None:
        """What an editor does: write a new file beside the state and rename it over."""
        hw = SimulatedHardware.open(state)
        install(hw)
        try:
            nv.nvmlInit()
            nv.nvmlDeviceGetHandleByIndex(0)
            assert not hw.layout(0).lost
            doc = json.loads(state.read_bytes())
            doc["gpus"][0]["lost"] = True
            edited = state.with_name("edited.json")
            edited.write_text(json.dumps(doc))
            edited.replace(state)
            with pytest.raises(nv.NVMLError_GpuIsLost):
                nv.nvmlDeviceGetHandleByIndex(0)
        finally:
            uninstall()
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


class TestAForkedChild:
    def test_takes_a_lock_of_its_own_so_that_parent_and_child_exclude_each_other(self, state: Path) -> None:
        """A descriptor inherited over fork shares the parent's flock: with it, the child's lock would
        not keep the parent out. The probe is a non-blocking flock on the parent's own descriptor."""
        hw = SimulatedHardware.open(state)
        store = hw.store
        assert isinstance(store, FileStore)
        hw.layout(0)  # the parent's lock file is open from here on
        locked_r, locked_w = os.pipe()
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child holds the state's lock until the parent has probed it
            code = 1
            try:
                with store.transaction():
                    os.write(locked_w, b"x")
                    os.read(done_r, 1)
                code = 0
            finally:
                os._exit(code)
        try:
            assert os.read(locked_r, 1) == b"x"
            with pytest.raises(BlockingIOError):
                fcntl.flock(store._lock_file(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.write(done_w, b"x")
            _, status = os.waitpid(pid, 0)
            for fd in (locked_r, locked_w, done_r, done_w):
                os.close(fd)
        assert os.waitstatus_to_exitcode(status) == 0
