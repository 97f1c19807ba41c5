"""Taken-over records and HAMi's files, as ``records verify``, GetState and ``status`` show them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami_format import record_filename, write_record

from sidecar import cli
from sidecar.edge.encode import encode_instance
from sidecar.model.domain import State
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement
from sidecar.store.record_verify import format_report, verify
from sidecar.store.records import RecordStore

GPU = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
MIG = "MIG-5c2f3a9e-1111-2222-3333-444455556666"
OTHER_MIG = "MIG-77777777-1111-2222-3333-444455556666"
BOOT = "7e1f3c2a-0000-4000-8000-000000000001"


def idle(start: int, mig_uuid: str, *, taken_over_from: str = "") -> OwnershipRecord:
    return OwnershipRecord(
        gpu_uuid=GPU,
        profile="1g.10gb",
        gi_profile_id=19,
        ci_profile_id=0,
        placement=Placement(start, 1),
        state=State.IDLE,
        gpu_instance_id=start + 1,
        compute_instance_id=0,
        mig_uuid=mig_uuid,
        cdi_device=f"k8s.hami.io/mig={mig_uuid}",
        boot_id=BOOT,
        since="2026-01-01T00:00:00Z",
        taken_over_from=taken_over_from,
    )


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    with RecordStore(directory) as store:
        store.put(idle(0, MIG, taken_over_from="hami"))
        store.put(idle(1, OTHER_MIG))
    return directory


class TestRecordsVerify:
    def test_a_taken_over_record_is_valid_and_says_so(self, state_dir: Path) -> None:
        report = verify(state_dir, BOOT)
        ours = idle(0, MIG).name
        assert report.taken_over == (ours,)
        text = format_report(report)
        assert f"valid    {ours}: taken over from HAMi\n" in text
        assert f"valid    {idle(1, OTHER_MIG).name}\n" in text
        assert "2 valid (0 stale), 0 corrupt, 1 taken over from HAMi\n" in text

    def test_a_hami_file_of_another_version_is_named_by_its_full_path_with_the_reason(
        self, state_dir: Path
    ) -> None:
        bad = "MIG-99999999-1111-2222-3333-444455556666"
        path = write_record(state_dir, bad, GPU, "1g.10gb", 3, 1, 4, 0, version=2)
        before = path.read_bytes()

        report = verify(state_dir, BOOT)

        assert list(report.hami) == [path.name]
        line = next(x for x in format_report(report).splitlines() if x.startswith("  HAMI"))
        assert line.startswith(f"  HAMI     {path}: not usable (unsupported version 2")
        assert report.corrupt == {}
        assert path.read_bytes() == before

    def test_a_hami_file_that_decodes_is_named_as_not_taken_over(self, state_dir: Path) -> None:
        """A GI ID that does not match the live instance is only known to Recover, which reads the
        hardware; offline, verify names the file and what it claims."""
        other = "MIG-88888888-1111-2222-3333-444455556666"
        path = write_record(state_dir, other, GPU, "1g.10gb", 2, 1, 9, 0)
        text = format_report(verify(state_dir, BOOT))
        assert (
            f"  HAMI     {path}: HAMi's record of {other} (1g.10gb at 2:1 on {GPU}, GI 9, CI 0); "
            "not taken over" in text
        )
        assert "; 1 HAMi record files left (the takeover is not complete)" in text

    def test_a_hami_file_whose_instance_the_sidecar_holds_is_named_as_left_for_the_next_recover(
        self, state_dir: Path
    ) -> None:
        path = write_record(state_dir, MIG, GPU, "1g.10gb", 0, 1, 1, 0)
        text = format_report(verify(state_dir, BOOT))
        assert f"  HAMI     {path}: " in text
        assert (
            f"the sidecar's record {idle(0, MIG).name} holds it, the next Recover removes this file" in text
        )

    def test_no_hami_line_once_none_is_left(self, state_dir: Path) -> None:
        text = format_report(verify(state_dir, BOOT))
        assert "HAMI " not in text
        assert "takeover is not complete" not in text

    def test_hami_files_do_not_fail_the_check_and_the_cli_prints_them(
        self, state_dir: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        write_record(state_dir, OTHER_MIG, GPU, "1g.10gb", 1, 1, 2, 0, version=0)
        assert cli.main(["records", "verify", "--state-dir", str(state_dir), "--boot-id", BOOT]) == 0
        assert f"HAMI     {state_dir / record_filename(OTHER_MIG)}: not usable" in capsys.readouterr().out


class TestStatus:
    def test_getstate_carries_the_mark(self) -> None:
        assert encode_instance(idle(0, MIG, taken_over_from="hami")).taken_over_from == "hami"
        assert encode_instance(idle(0, MIG)).taken_over_from == ""

    def test_the_table_shows_it_under_its_header(self) -> None:
        info = pb.GetInfoResponse(api_version="v1", sidecar_version="0.1.0", backend="simulated")
        gpu = pb.Gpu(index=0, uuid=GPU, model="NVIDIA H100 80GB HBM3", memory_mb=81559)
        instances = [
            encode_instance(idle(0, MIG, taken_over_from="hami")),
            encode_instance(idle(1, OTHER_MIG)),
        ]
        state = pb.GetStateResponse(gpus=[pb.GpuState(gpu=gpu, instances=instances)])
        lines = cli.format_status(info, state).splitlines()
        header = lines[lines.index("INSTANCES") + 1]
        taken, plain = (next(x for x in lines if uuid in x) for uuid in (MIG, OTHER_MIG))
        assert taken.index("hami") == header.index("TAKEN OVER FROM")
        assert "hami" not in plain
        assert plain.split()[-1] == "-"  # the owner column ends the row: nothing taken over, no error
