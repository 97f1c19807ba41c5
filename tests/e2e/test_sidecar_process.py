"""The e2e helpers read the state and CDI directories while the sidecar's reconciler works in them.

A background round may delete a record or a spec between a helper's directory listing and its read
of a listed file. Such a file is gone, as it would be had the listing come a moment later: a helper
skips it instead of failing the test that polls it. These tests make the deletion happen exactly in
that window, on every run, with no sidecar process: a listed file is deleted just before its read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sidecar_process import DEFAULT_SIM_GPUS, Sidecar, snapshot_dir

from sidecar.model.domain import State
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement
from sidecar.store.records import RecordStore

GPU = "GPU-00000000-aaaa-4aaa-8aaa-000000000000"


def deleted_just_before_its_read(monkeypatch: pytest.MonkeyPatch, victim: Path) -> None:
    """``victim`` is deleted after it was listed (and seen to be a file), right before it is read."""
    read = Path.read_bytes

    def read_bytes(path: Path) -> bytes:
        if path == victim:
            victim.unlink()
        return read(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


def idle_record(start: int) -> OwnershipRecord:
    return OwnershipRecord(
        gpu_uuid=GPU,
        profile="1g.10gb",
        gi_profile_id=19,
        ci_profile_id=0,
        placement=Placement(start, 1),
        state=State.IDLE,
        gpu_instance_id=start + 1,
        boot_id="boot",
    )


class TestARecordDeletedBetweenTheListingAndTheReadIsSkipped:
    def test_records_returns_the_records_still_there(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        car = Sidecar(tmp_path, (), None, DEFAULT_SIM_GPUS)
        store = RecordStore(car.state_dir)
        store.open()
        kept, deleted = idle_record(0), idle_record(1)
        store.put(kept)
        store.put(deleted)
        store.close()
        deleted_just_before_its_read(monkeypatch, car.state_dir / f"{deleted.name}.json")

        found = car.records()

        assert {name: r["placement"]["start"] for name, r in found.items()} == {kept.name: 0}


class TestAFileDeletedBetweenTheListingAndTheReadIsLeftOutOfTheSnapshot:
    def test_snapshot_dir_holds_the_files_still_there(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        (tmp_path / "a.json").write_bytes(b"spec a")
        (tmp_path / "b.json").write_bytes(b"spec b")
        deleted_just_before_its_read(monkeypatch, tmp_path / "b.json")

        snapshot = snapshot_dir(tmp_path)

        assert snapshot == {"a.json": b"spec a"}
