"""The ``sim`` commands operate the same state file a running sidecar's adapter reads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from sidecar.nvml.port import NVML_ERROR_IN_USE, NvmlError, Placement
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall
from sidecar.nvml.sim.cli import ENV_SIM_STATE, register


def sim(state: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", "--sim-state", str(state), *argv])
    return int(args.func(args))


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "hw.json"
    assert sim(path, "init", "--gpus", "h100-80gb:1,a30") == 0
    return path


class TestOperatingTheSimulatedNode:
    def test_init_creates_the_gpus_with_mig_enabled(
        self, state: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        capsys.readouterr()
        assert sim(state, "list", "--json") == 0
        doc = json.loads(capsys.readouterr().out)
        assert [(g["model"], g["mig_current"]) for g in doc["gpus"]] == [("h100-80gb", True), ("a30", True)]

    def test_an_unowned_instance_created_by_sim_is_seen_by_the_adapter(self, state: Path) -> None:
        assert sim(state, "create", "--gpu", "0", "--profile", "3g.40gb", "--placement", "4:4") == 0
        assert sim(state, "create", "--gpu", "1", "--profile", "1g.6gb", "--placement", "3:1", "--no-ci") == 0
        install(SimulatedHardware.open(state))
        try:
            port = PynvmlBackend(retry_wait=False)
            h100, a30 = port.gpus()
            assert [(g.id, g.placement) for g in port.gpu_instances(h100.uuid)] == [(2, Placement(4, 4))]
            assert len(port.compute_instances(h100.uuid, 2)) == 1
            assert [(g.id, port.compute_instances(a30.uuid, g.id)) for g in port.gpu_instances(a30.uuid)] == [
                (6, [])
            ]
            port.close()
        finally:
            uninstall()

    def test_an_overlapping_create_is_refused_with_the_driver_s_reason(
        self, state: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        sim(state, "create", "--gpu", "0", "--profile", "1g.10gb", "--placement", "3:1")
        assert sim(state, "create", "--gpu", "0", "--profile", "3g.40gb", "--placement", "0:4") == 1
        assert "overlaps" in capsys.readouterr().err

    def test_busy_and_fault_take_effect_in_a_running_adapter_at_its_next_call(self, state: Path) -> None:
        install(SimulatedHardware.open(state))
        try:
            port = PynvmlBackend(retry_wait=False, attempts=1)
            gpu = port.gpus()[0].uuid
            gi = port.create_gpu_instance(gpu, 19, Placement(0, 1))
            ci = port.create_compute_instance(gpu, gi.id, 0)
            assert sim(state, "busy", "--mig-uuid", ci.mig_uuid, "on") == 0
            assert port.mig_device_processes(ci.mig_uuid) == 1
            assert sim(state, "busy", "--mig-uuid", ci.mig_uuid, "off") == 0
            assert sim(state, "fault", "destroy-ci", "IN_USE", "--times", "1") == 0
            with pytest.raises(NvmlError) as exc:
                port.destroy_compute_instance(gpu, gi.id, ci.id)
            assert exc.value.code == NVML_ERROR_IN_USE
            port.destroy_compute_instance(gpu, gi.id, ci.id)
            port.close()
        finally:
            uninstall()

    def test_destroy_removes_the_compute_instances_and_the_gpu_instance(self, state: Path) -> None:
        sim(state, "create", "--gpu", "0", "--profile", "7g.80gb", "--placement", "0:8")
        assert sim(state, "destroy", "--gpu", "0", "--gi", "0") == 0
        assert SimulatedHardware.open(state).layout(0).gis == ()

    def test_lose_then_reboot_brings_the_gpu_back_without_instances(self, state: Path) -> None:
        sim(state, "create", "--gpu", "1", "--profile", "4g.24gb", "--placement", "0:4")
        assert sim(state, "lose", "--gpu", "1") == 0
        assert SimulatedHardware.open(state).layout(1).lost
        boot = SimulatedHardware.open(state).boot_id
        assert sim(state, "reboot") == 0
        hw = SimulatedHardware.open(state)
        assert (hw.layout(1).lost, hw.layout(1).gis, hw.boot_id == boot) == (False, (), False)

    def test_faults_can_be_listed_and_cleared(self, state: Path, capsys: pytest.CaptureFixture[str]) -> None:
        sim(state, "fault", "create-gi", "23", "--after", "2", "--times", "3")
        capsys.readouterr()
        assert sim(state, "faults") == 0
        assert "create-gi -> code 23, after 2 call(s), 3 time(s)" in capsys.readouterr().out
        assert sim(state, "faults", "--clear") == 0
        assert SimulatedHardware.open(state).faults() == []

    def test_an_unknown_operation_or_code_is_refused(self, state: Path) -> None:
        assert sim(state, "fault", "make-coffee", "IN_USE") == 1
        assert sim(state, "fault", "create-gi", "NO_SUCH_CODE") == 1

    @pytest.mark.parametrize("seconds", ["nan", "-5", "inf"])
    def test_a_latency_that_is_not_a_finite_number_at_least_0_is_refused_and_changes_nothing(
        self, state: Path, capsys: pytest.CaptureFixture[str], seconds: str
    ) -> None:
        assert sim(state, "latency", "create-gi", "2") == 0
        capsys.readouterr()
        assert sim(state, "latency", "create-gi", seconds) == 1
        assert capsys.readouterr().err.splitlines() == [
            f"sim latency: a latency is a finite number of seconds >= 0, not {float(seconds)!r}"
        ]
        assert SimulatedHardware.open(state).state().latency == {"create-gi": 2.0}

    def test_an_xid_past_64_bits_is_refused(self, state: Path) -> None:
        assert sim(state, "xid", "--gpu", "0", str(2**64)) == 1
        assert sim(state, "xid", "--gpu", "0", str(2**64 - 1)) == 0

    def test_the_state_file_can_come_from_the_environment(
        self, state: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(ENV_SIM_STATE, str(state))
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["sim", "lose", "--gpu", "0"])
        assert args.func(args) == 0
        assert SimulatedHardware.open(state).layout(0).lost


def test_init_takes_the_newer_models_and_lists_them_in_its_help(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "new.json"
    assert sim(path, "init", "--gpus", "b200:1,h20:1,gh200-144gb:1,rtx-pro-6000:1,gh200-96gb:1") == 0
    names = [g.name for g in SimulatedHardware.open(path).layouts()]
    assert names == [
        "NVIDIA B200",
        "NVIDIA H20",
        "NVIDIA GH200 144G HBM3e",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        "NVIDIA GH200 480GB",
    ]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        sim(path, "init", "--help")
    assert "b200, rtx-pro-6000" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")
