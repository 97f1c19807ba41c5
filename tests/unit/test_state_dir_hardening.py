"""A state directory is trusted only as far as it deserves: planted files and values are refused.

Each test plants what an attacker (or a broken tool) could leave in the directory and looks at the
outcome on disk: what the store refuses, what it reports as corrupt, and that the planted thing (and
whatever it points at) is left exactly as it was.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import msgspec
import pytest

from sidecar.model.domain import State
from sidecar.model.errors import StateWriteFailed
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement
from sidecar.store.record_format import GENERATION_FILE, MAX_GENERATION, CorruptRecord
from sidecar.store.record_verify import format_report, verify
from sidecar.store.records import RecordStore, UnsafeStateDir

GPU = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
MIG = "MIG-5c2f3a9e-1111-2222-3333-444455556666"
BOOT = "7e1f3c2a-0000-4000-8000-000000000001"
UINT64_MAX = 2**64 - 1
OTHER_UID = 4242  # a user that owns nothing here


def record(start: int = 0, **changes: object) -> OwnershipRecord:
    base = OwnershipRecord(
        gpu_uuid=GPU,
        profile="1g.10gb",
        gi_profile_id=19,
        ci_profile_id=0,
        placement=Placement(start, 1),
        state=State.IDLE,
        gpu_instance_id=9,
        compute_instance_id=0,
        mig_uuid=MIG,
        activated_generation=3,
        idled_generation=4,
        boot_id=BOOT,
        since="2026-01-01T00:00:00Z",
    )
    return msgspec.structs.replace(base, **changes)


def checksummed(payload: bytes) -> bytes:
    """A well-formed version 1 envelope around ``payload``: only its values can be wrong."""
    digest = hashlib.sha256(payload).hexdigest().encode()
    return b'{"version":1,"checksum":"sha256:' + digest + b'","record":' + payload + b"}\n"


def plant_record(directory: Path, rec: OwnershipRecord) -> Path:
    path = directory / f"{rec.name}.json"
    path.write_bytes(checksummed(msgspec.json.encode(rec)))
    path.chmod(0o600)
    return path


def plant_ceiling(directory: Path, ceiling: int) -> Path:
    path = directory / GENERATION_FILE
    path.write_bytes(checksummed(b'{"ceiling":%d}' % ceiling))
    path.chmod(0o600)
    return path


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o750)
    directory.chmod(0o750)
    return directory


class TestGenerationsOutOfRange:
    """A generation past ``MAX_GENERATION`` would overflow the contract's uint64 once counted on."""

    @pytest.mark.parametrize("ceiling", [UINT64_MAX, MAX_GENERATION + 1, 2**64 + 5])
    def test_a_checksummed_ceiling_out_of_range_is_corrupt(self, state_dir: Path, ceiling: int) -> None:
        path = plant_ceiling(state_dir, ceiling)
        with RecordStore(state_dir) as store, pytest.raises(CorruptRecord) as caught:
            store.load_generation_ceiling()
        assert "out of range" in caught.value.why
        assert caught.value.path == path

    def test_the_largest_ceiling_still_reads(self, state_dir: Path) -> None:
        plant_ceiling(state_dir, MAX_GENERATION)
        with RecordStore(state_dir) as store:
            assert store.load_generation_ceiling() == MAX_GENERATION

    @pytest.mark.parametrize("field", ["activated_generation", "idled_generation"])
    @pytest.mark.parametrize("value", [UINT64_MAX, MAX_GENERATION + 1, -1])
    def test_a_record_with_a_generation_out_of_range_is_corrupt(
        self, state_dir: Path, field: str, value: int
    ) -> None:
        rec = record(**{field: value})
        path = plant_record(state_dir, rec)
        before = path.read_bytes()
        with RecordStore(state_dir) as store:
            valid, corrupt = store.load_all()
            assert valid == {}
            assert field in corrupt[rec.name].why
            with pytest.raises(CorruptRecord):
                store.put(record())  # a corrupt file is the operator's: never overwritten
        assert path.read_bytes() == before

    def test_a_record_with_an_xid_past_32_bits_reads_back_and_one_below_zero_is_corrupt(
        self, state_dir: Path
    ) -> None:
        """NVML's event data is 64 bits: any such Xid is a record's to keep; none is negative."""
        kept, negative = record(xid=UINT64_MAX), record(start=1, xid=-1)
        plant_record(state_dir, kept)
        plant_record(state_dir, negative)
        with RecordStore(state_dir) as store:
            valid, corrupt = store.load_all()
            assert valid[kept.name].xid == UINT64_MAX
            assert "xid -1" in corrupt[negative.name].why

    def test_the_store_never_writes_a_ceiling_past_the_largest_generation(self, state_dir: Path) -> None:
        with RecordStore(state_dir) as store:
            store.raise_generation_ceiling(MAX_GENERATION - 1)
            with pytest.raises(StateWriteFailed, match="largest generation"):
                store.raise_generation_ceiling(MAX_GENERATION + 1)
            assert store.load_generation_ceiling() == MAX_GENERATION - 1

    def test_a_record_with_a_generation_out_of_range_never_reaches_the_disk(self, state_dir: Path) -> None:
        with RecordStore(state_dir) as store:
            with pytest.raises(ValueError, match="out of range"):
                store.put(record(idled_generation=UINT64_MAX))
            assert store.load_all() == ({}, {})

    def test_verify_names_both_files_by_their_full_paths(self, state_dir: Path) -> None:
        bad_record = plant_record(state_dir, record(idled_generation=UINT64_MAX))
        bad_ceiling = plant_ceiling(state_dir, UINT64_MAX)
        report = verify(state_dir, BOOT)
        assert report.valid == ()
        assert report.generation_ceiling is None
        text = format_report(report)
        assert f"CORRUPT  {bad_record}: idled_generation {UINT64_MAX} is out of range" in text
        assert f"CORRUPT  {bad_ceiling}: generation ceiling {UINT64_MAX} is out of range" in text
        assert "0 valid (0 stale), 2 corrupt" in text


def listing(directory: Path) -> dict[str, bytes | str]:
    """Name -> bytes (regular files) or link target (symlinks): what a refusal must leave alone."""
    found: dict[str, bytes | str] = {}
    for path in sorted(directory.iterdir()):
        found[path.name] = str(path.readlink()) if path.is_symlink() else path.read_bytes()
    return found


class TestThePlantedLockFile:
    def test_a_symlinked_lock_is_refused_and_its_target_is_untouched(
        self, state_dir: Path, tmp_path: Path
    ) -> None:
        target = tmp_path / "precious"
        target.write_bytes(b"do not truncate me\n")
        (state_dir / ".lock").symlink_to(target)
        with pytest.raises(UnsafeStateDir, match="symbolic link") as caught:
            RecordStore(state_dir).open()
        assert str(state_dir / ".lock") in str(caught.value)
        assert target.read_bytes() == b"do not truncate me\n"

    def test_a_lock_hard_linked_to_another_file_is_refused_and_that_file_is_untouched(
        self, state_dir: Path, tmp_path: Path
    ) -> None:
        target = tmp_path / "precious"
        target.write_bytes(b"keep\n")
        target.chmod(0o600)
        os.link(target, state_dir / ".lock")
        with pytest.raises(UnsafeStateDir, match="hard links"):
            RecordStore(state_dir).open()
        assert target.read_bytes() == b"keep\n"

    def test_a_lock_that_is_a_fifo_is_refused(self, state_dir: Path) -> None:
        os.mkfifo(state_dir / ".lock", 0o600)
        with pytest.raises(UnsafeStateDir, match="not a regular file"):
            RecordStore(state_dir).open()

    def test_a_lock_owned_by_another_user_is_refused(self, state_dir: Path) -> None:
        lock = state_dir / ".lock"
        lock.write_bytes(b"")
        lock.chmod(0o600)
        os.chown(lock, OTHER_UID, -1)
        with pytest.raises(UnsafeStateDir, match="owned by uid"):
            RecordStore(state_dir).open()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
class TestAStateDirectoryOthersCouldWrite:
    @pytest.mark.parametrize("mode", [0o770, 0o757, 0o777])
    def test_a_group_or_world_writable_directory_is_refused_not_narrowed(
        self, state_dir: Path, mode: int
    ) -> None:
        plant_record(state_dir, record())
        state_dir.chmod(mode)
        before = listing(state_dir)
        with pytest.raises(UnsafeStateDir, match="group- or world-writable") as caught:
            RecordStore(state_dir).open()
        assert str(state_dir) in str(caught.value)
        assert stat.S_IMODE(state_dir.stat().st_mode) == mode
        assert listing(state_dir) == before

    def test_a_directory_owned_by_another_user_is_refused(self, state_dir: Path) -> None:
        os.chown(state_dir, OTHER_UID, -1)
        with pytest.raises(UnsafeStateDir, match="owned by uid 4242"):
            RecordStore(state_dir).open()

    @pytest.mark.parametrize("planted", ["record", "generation"])
    @pytest.mark.parametrize("how", ["group-writable", "world-writable", "foreign-owned"])
    def test_a_state_file_others_could_have_written_is_refused_by_name(
        self, state_dir: Path, planted: str, how: str
    ) -> None:
        path = plant_record(state_dir, record()) if planted == "record" else plant_ceiling(state_dir, 7)
        if how == "foreign-owned":
            os.chown(path, OTHER_UID, -1)
        else:
            path.chmod(0o620 if how == "group-writable" else 0o602)
        before = listing(state_dir)
        with pytest.raises(UnsafeStateDir) as caught:
            RecordStore(state_dir).open()
        assert str(path) in str(caught.value)
        assert listing(state_dir) == before
        # Nothing was taken: once the operator fixes the file, the store opens.
        os.chown(path, os.geteuid(), -1)
        path.chmod(0o600)
        with RecordStore(state_dir) as store:
            assert store.load_all()[1] == {}

    def test_a_symlinked_record_stays_corrupt_and_its_target_is_never_read_as_a_record(
        self, state_dir: Path, tmp_path: Path
    ) -> None:
        elsewhere = plant_record(tmp_path, record())
        (state_dir / elsewhere.name).symlink_to(elsewhere)
        with RecordStore(state_dir) as store:
            valid, corrupt = store.load_all()
        assert valid == {}
        assert "symbolic link" in corrupt[record().name].why
