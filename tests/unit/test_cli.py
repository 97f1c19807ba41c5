"""The ``hami-mig-sidecar`` command line, run in-process: usage errors, ``records verify`` over real
record files, and the ``status`` table built from real response messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar import cli
from sidecar.model.domain import State
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement
from sidecar.store.records import RecordStore

GPU = "GPU-4b4ce45e-7021-44ba-8aff-a13c0183670f"
MIG = "MIG-2923e22f-df83-5d8f-88fe-e176c7516c96"
BOOT = "b4e23253-ce5f-40ff-bd37-952c0a155dac"


def write_record(directory: Path, start: int, boot_id: str = BOOT) -> Path:
    store = RecordStore(directory)
    store.open()
    try:
        record = OwnershipRecord(
            gpu_uuid=GPU,
            profile="1g.10gb",
            gi_profile_id=19,
            ci_profile_id=0,
            placement=Placement(start, 1),
            state=State.IDLE,
            gpu_instance_id=7 + start,
            compute_instance_id=0,
            mig_uuid=MIG,
            boot_id=boot_id,
            since="2026-01-01T00:00:00Z",
        )
        store.put(record)
        return store.path(record.name)
    finally:
        store.close()


class TestUsage:
    def test_a_bad_serve_setting_exits_2_naming_the_flag(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert cli.main(["serve", "--backend", "mock"]) == 2
        assert "--backend" in capsys.readouterr().err

    @pytest.mark.parametrize("kind", ["9hami.io/mig", "k8s.hami.io/mig-", "k8s.hami.io/" + "m" * 64])
    def test_a_cdi_kind_against_the_cdi_name_rules_exits_2_naming_the_flag(
        self, kind: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert cli.main(["serve", "--cdi-kind", kind]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hami-mig-sidecar serve: --cdi-kind: ")
        assert "not a CDI kind" in err
        assert "Traceback" not in err

    def test_an_unknown_simulated_gpu_model_exits_2_listing_the_known_models(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        hardware = tmp_path / "hw.json"
        argv = ["serve", "--backend", "simulated", "--sim-state", str(hardware), "--sim-gpus", "h999:1"]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("hami-mig-sidecar serve: --sim-gpus: unknown GPU model 'h999'; known: ")
        assert "h100-80gb" in err
        assert "Traceback" not in err
        assert not hardware.exists()

    def test_sim_init_refuses_an_unknown_model_listing_the_known_models(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        hardware = tmp_path / "hw.json"
        assert cli.main(["sim", "--sim-state", str(hardware), "init", "--gpus", "h999:1"]) == 2
        err = capsys.readouterr().err
        assert "unknown GPU model 'h999'; known: " in err
        assert "h100-80gb" in err
        assert not hardware.exists()

    def test_sim_init_accepts_the_models_serve_accepts(self, tmp_path: Path) -> None:
        hardware = tmp_path / "hw.json"
        assert cli.main(["sim", "--sim-state", str(hardware), "init", "--gpus", "H200-141GB:1,a30"]) == 0
        assert hardware.exists()

    def test_serve_help_names_every_environment_variable(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exited:
            cli.main(["serve", "--help"])
        assert exited.value.code == 0
        text = capsys.readouterr().out
        for name in ("HAMI_MIG_SIDECAR_SOCKET", "HAMI_MIG_SIDECAR_STATE_DIR", "HAMI_MIG_SIDECAR_BACKEND"):
            assert name in text

    def test_status_without_a_socket_exits_1_with_a_clear_message(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert cli.main(["status", "--socket", str(tmp_path / "none.sock")]) == 1
        assert "no sidecar socket" in capsys.readouterr().err

    def test_status_reads_its_socket_from_the_environment(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        monkeypatch.setenv("HAMI_MIG_SIDECAR_SOCKET", str(tmp_path / "from-env.sock"))
        assert cli.main(["status"]) == 1
        assert "from-env.sock" in capsys.readouterr().err


class TestRecordsVerify:
    def test_valid_records_exit_0_and_are_listed(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        write_record(tmp_path, 0)
        write_record(tmp_path, 1)
        assert cli.main(["records", "verify", "--state-dir", str(tmp_path), "--boot-id", BOOT]) == 0
        assert "2 valid (0 stale), 0 corrupt" in capsys.readouterr().out

    def test_records_of_another_boot_are_reported_stale_but_do_not_fail(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        write_record(tmp_path, 0, boot_id="00000000-0000-4000-8000-000000000000")
        assert cli.main(["records", "verify", "--state-dir", str(tmp_path), "--boot-id", BOOT]) == 0
        assert "1 valid (1 stale)" in capsys.readouterr().out

    def test_a_corrupt_record_exits_1_and_stays_on_disk(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        path = write_record(tmp_path, 0)
        path.write_bytes(path.read_bytes().replace(b'"IDLE"', b'"IDLX"'))
        assert cli.main(["records", "verify", "--state-dir", str(tmp_path), "--boot-id", BOOT]) == 1
        assert "CORRUPT" in capsys.readouterr().out
        assert path.exists()

    def test_a_missing_directory_exits_1(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert cli.main(["records", "verify", "--state-dir", str(tmp_path / "nowhere")]) == 1
        assert "cannot read" in capsys.readouterr().err


class TestStatusTable:
    def gpu_state(self) -> tuple[pb.GetInfoResponse, pb.GetStateResponse]:
        info = pb.GetInfoResponse(
            api_version="v1", sidecar_version="0.1.0", backend="simulated", recovered=True
        )
        gpu = pb.Gpu(index=1, uuid=GPU, model="NVIDIA H100 80GB HBM3", memory_mb=81559)
        gpu.mig_mode.current = gpu.mig_mode.pending = True
        instance = pb.Instance(
            gpu_uuid=GPU,
            profile="3g.40gb",
            placement=pb.Placement(start=4, size=4),
            mig_uuid=MIG,
            gpu_instance_id=2,
            compute_instance_id=0,
            state=pb.ACTIVE,
            owner=pb.Owner(
                pod=pb.PodRef(uid="uid-1", namespace="team", name="trainer"),
                container_name="main",
                container_index=0,
                device_index=2,
            ),
        )
        foreign = pb.ForeignInstance(
            profile="1g.10gb", placement=pb.Placement(start=0, size=1), gpu_instance_id=9
        )
        state = pb.GetStateResponse(
            generation=4, gpus=[pb.GpuState(gpu=gpu, instances=[instance], foreign=[foreign])]
        )
        return info, state

    def test_owned_instances_show_state_profile_placement_uuid_and_owner(self) -> None:
        text = cli.format_status(*self.gpu_state())
        row = next(line for line in text.splitlines() if MIG in line)
        assert row.split() == ["1", "ACTIVE", "3g.40gb", "4:4", "2", "0", MIG, "team/trainer[0/2]"]

    def test_foreign_instances_are_listed_apart_without_a_compute_instance(self) -> None:
        lines = cli.format_status(*self.gpu_state()).splitlines()
        foreign = lines[lines.index("FOREIGN (not owned; never touched)") + 2]
        assert foreign.split() == ["1", "1g.10gb", "0:1", "9", "-", "-"]

    def test_columns_are_aligned_under_their_headers(self) -> None:
        lines = cli.format_status(*self.gpu_state()).splitlines()
        header = lines[lines.index("INSTANCES") + 1]
        row = lines[lines.index("INSTANCES") + 2]
        assert row.index(MIG) == header.index("MIG UUID")
        assert row.index("3g.40gb") == header.index("PROFILE")
