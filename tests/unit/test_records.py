"""Ownership records on disk: the envelope, its checksum, atomic writes, the lock, and ``verify``.

Every test looks at the files the store leaves in a real directory; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from helpers_records import BOOT, GPU, make_record

from sidecar.model.domain import State
from sidecar.model.errors import StateWriteFailed
from sidecar.model.ownership import OwnershipRecord, record_name
from sidecar.nvml.port import Placement
from sidecar.store.record_format import CorruptRecord, RecordNotFound
from sidecar.store.record_verify import format_report, verify
from sidecar.store.records import RecordStore, StateDirLocked

OTHER_GPU = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture(params=[False, True], ids=["replace", "in-place"])
def store(state_dir: Path, request: pytest.FixtureRequest) -> Iterator[RecordStore]:
    """Every test of a store runs with both ways of replacing a record (in place: as on tmpfs)."""
    with RecordStore(state_dir, in_place=request.param) as s:
        yield s


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


class TestRecordNames:
    def test_a_name_is_built_from_the_gpu_uuid_and_the_placement(self) -> None:
        assert record_name(GPU, Placement(4, 2)) == f"mig-{GPU}-4-2"

    @pytest.mark.parametrize(
        ("gpu", "placement"),
        [
            ("../../etc/passwd", Placement(0, 1)),
            ("GPU-x", Placement(0, 1)),
            (f"{GPU}/..", Placement(0, 1)),
            (GPU, Placement(-1, 1)),
            (GPU, Placement(0, 0)),
            (GPU, Placement(True, 1)),
        ],
    )
    def test_invalid_gpu_uuids_and_placements_never_become_names(
        self, gpu: str, placement: Placement
    ) -> None:
        with pytest.raises(ValueError, match="not a"):
            record_name(gpu, placement)

    def test_a_name_already_made_for_slice_1_is_not_handed_to_true(self) -> None:
        assert record_name(GPU, Placement(1, 1)) == f"mig-{GPU}-1-1"  # now remembered
        with pytest.raises(ValueError, match="not a placement"):
            record_name(GPU, Placement(True, 1))
        with pytest.raises(ValueError, match="not a placement"):
            record_name(GPU, Placement(1, True))

    @pytest.mark.parametrize("name", ["../x", "mig-GPU-x-0-1", ".lock", f"mig-{GPU}-0-1.json", ""])
    def test_the_store_refuses_paths_for_names_it_could_not_have_made(
        self, store: RecordStore, name: str
    ) -> None:
        with pytest.raises(ValueError, match="not an ownership record name"):
            store.path(name)


class TestRoundTrip:
    def test_a_record_that_was_put_loads_back_equal(self, store: RecordStore) -> None:
        rec = make_record()
        store.put(rec)
        assert store.load(rec.name) == rec
        assert store.load_all() == ({rec.name: rec}, {})

    def test_the_file_is_a_version_1_envelope_around_the_exact_record_bytes(self, store: RecordStore) -> None:
        rec = make_record()
        store.put(rec)
        data = store.path(rec.name).read_bytes()
        envelope = msgspec.json.decode(data)
        assert envelope["version"] == 1
        record_bytes = msgspec.json.encode(rec)
        assert envelope["checksum"] == "sha256:" + hashlib.sha256(record_bytes).hexdigest()
        assert b'"record":' + record_bytes + b"}" in data

    def test_a_record_written_before_idled_generation_existed_reads_with_zero(
        self, store: RecordStore
    ) -> None:
        """New fields have defaults: a file of an older build still reads, as "never fenced"."""
        rec = make_record()
        fields = msgspec.to_builtins(rec)
        del fields["idled_generation"]
        raw = msgspec.json.encode(fields)
        envelope = b'{"version":1,"checksum":"sha256:%s","record":%s}\n' % (
            hashlib.sha256(raw).hexdigest().encode(),
            raw,
        )
        store.path(rec.name).write_bytes(envelope)
        assert store.load(rec.name) == rec
        assert store.load(rec.name).idled_generation == 0

    def test_a_second_put_replaces_the_first(self, store: RecordStore) -> None:
        store.put(make_record(state=State.ACTIVE))
        store.put(make_record(state=State.IDLE))
        assert store.load(make_record().name).state is State.IDLE

    def test_a_missing_record_is_not_found_not_corrupt(self, store: RecordStore) -> None:
        with pytest.raises(RecordNotFound):
            store.load(make_record().name)

    def test_a_missing_directory_holds_no_records(self, tmp_path: Path) -> None:
        assert RecordStore(tmp_path / "absent").load_all() == ({}, {})

    def test_delete_removes_the_file_and_a_second_delete_is_a_no_op(self, store: RecordStore) -> None:
        rec = make_record()
        store.put(rec)
        store.delete(rec.name)
        store.delete(rec.name)
        assert not store.path(rec.name).exists()
        with pytest.raises(RecordNotFound):
            store.load(rec.name)

    def test_a_record_with_wrong_field_types_is_refused_before_it_reaches_the_disk(
        self, store: RecordStore, state_dir: Path
    ) -> None:
        bad = msgspec.structs.replace(make_record(), gi_profile_id="19")
        with pytest.raises(ValueError, match="would not read back"):
            store.put(bad)
        assert listing(state_dir) == [".lock"]


class TestFilesOnDisk:
    def test_the_directory_is_0750_and_record_files_0600_whatever_the_umask(self, state_dir: Path) -> None:
        old = os.umask(0o077)
        try:
            with RecordStore(state_dir) as s:
                s.put(make_record())
        finally:
            os.umask(old)
        assert stat.S_IMODE(state_dir.stat().st_mode) == 0o750
        assert stat.S_IMODE((state_dir / f"{make_record().name}.json").stat().st_mode) == 0o600

    def test_an_existing_wider_directory_is_narrowed_to_0750(self, state_dir: Path) -> None:
        state_dir.mkdir(mode=0o755)
        state_dir.chmod(0o755)
        with RecordStore(state_dir):
            pass
        assert stat.S_IMODE(state_dir.stat().st_mode) == 0o750

    def test_a_successful_write_leaves_no_temp_file(self, store: RecordStore, state_dir: Path) -> None:
        store.put(make_record(start=0))
        store.put(make_record(start=0, state=State.ACTIVE))
        store.put(make_record(start=1))
        assert listing(state_dir) == [
            ".lock",
            f"{make_record(start=0).name}.json",
            f"{make_record(start=1).name}.json",
        ]

    def test_a_crash_between_temp_write_and_rename_leaves_the_old_record_intact(
        self, store: RecordStore, state_dir: Path
    ) -> None:
        rec = make_record(state=State.IDLE)
        store.put(rec)
        # What an interrupted put leaves behind: a complete or partial temp file that was never renamed.
        (state_dir / f".{rec.name}.tmp-0123456789abcdef").write_bytes(b'{"version":1,"chec')
        assert store.load_all() == ({rec.name: rec}, {})
        assert store.load(rec.name) == rec

    def test_opening_the_store_sweeps_temp_files_left_by_a_crash(self, state_dir: Path) -> None:
        with RecordStore(state_dir) as s:
            s.put(make_record())
        stray = state_dir / f".{make_record().name}.tmp-0123456789abcdef"
        stray.write_bytes(b"partial")
        with RecordStore(state_dir):
            assert not stray.exists()
        assert listing(state_dir) == [".lock", f"{make_record().name}.json"]

    @pytest.mark.parametrize("in_place", [False, True], ids=["replace", "in-place"])
    def test_a_write_that_fails_raises_state_write_failed_and_keeps_the_old_record(
        self, state_dir: Path, in_place: bool
    ) -> None:
        # In place, the file-size limit would cut a pwrite short: the store replaces the file instead.
        store = RecordStore(state_dir, in_place=in_place)
        rec = make_record(state=State.ACTIVE)
        store.put(rec)
        store.close()
        # A file-size limit makes write(2) fail with EFBIG even for root (tests run as root, where
        # permission bits stop nothing). It runs in a child so the limit cannot touch pytest itself.
        script = textwrap.dedent(
            """
            import resource, signal, sys
            from pathlib import Path
            import msgspec
            from sidecar.model.domain import State
            from sidecar.model.errors import StateWriteFailed
            from sidecar.store.records import RecordStore
            store = RecordStore(Path(sys.argv[1]), in_place=sys.argv[3] == "1")
            store.open()
            rec = msgspec.structs.replace(store.load(sys.argv[2]), state=State.IDLE)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
            try:
                store.put(rec)
            except StateWriteFailed as exc:
                print(exc.reason, exc.message)
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", script, str(state_dir), rec.name, "1" if in_place else "0"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.startswith(
            f"STATE_WRITE_FAILED writing ownership record {store.path(rec.name)} failed"
        )
        with RecordStore(state_dir) as reopened:
            assert reopened.load(rec.name) == rec
        assert listing(state_dir) == [".lock", f"{rec.name}.json"]


def corrupt_variants(good: bytes, rec: OwnershipRecord) -> dict[str, bytes]:
    raw = msgspec.json.encode(rec)
    flipped = raw.replace(b'"profile":"1g.10gb"', b'"profile":"1g.20gb"')
    assert flipped != raw
    reformatted = msgspec.json.format(raw, indent=2)
    with_extra = raw[:-1] + b',"extra":1}'

    def envelope(record_bytes: bytes, version: int = 1) -> bytes:
        digest = hashlib.sha256(record_bytes).hexdigest()
        return b'{"version":%d,"checksum":"sha256:%s","record":%s}' % (version, digest.encode(), record_bytes)

    return {
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "one byte of the record flipped": good.replace(raw, flipped),
        "record reformatted with whitespace": good.replace(raw, reformatted),
        "unknown field with a matching checksum": envelope(with_extra),
        "unknown envelope field": good.replace(b'{"version":1,', b'{"version":1,"note":"x",'),
        "wrong version": envelope(raw, version=2),
        "not json": b"\x00\x01garbage",
    }


class TestCorruptRecords:
    @pytest.fixture
    def written(self, store: RecordStore) -> tuple[OwnershipRecord, Path, bytes]:
        rec = make_record()
        store.put(rec)
        path = store.path(rec.name)
        return rec, path, path.read_bytes()

    @pytest.mark.parametrize(
        "variant",
        [
            "truncated",
            "empty",
            "one byte of the record flipped",
            "record reformatted with whitespace",
            "unknown field with a matching checksum",
            "unknown envelope field",
            "wrong version",
            "not json",
        ],
    )
    def test_a_damaged_file_is_corrupt_and_never_deleted_or_overwritten(
        self, store: RecordStore, written: tuple[OwnershipRecord, Path, bytes], variant: str
    ) -> None:
        rec, path, good = written
        damaged = corrupt_variants(good, rec)[variant]
        path.write_bytes(damaged)

        with pytest.raises(CorruptRecord) as info:
            store.load(rec.name)
        assert info.value.name == rec.name
        assert info.value.path == path
        valid, corrupt = store.load_all()
        assert valid == {}
        assert list(corrupt) == [rec.name]

        with pytest.raises(CorruptRecord):
            store.put(rec)
        with pytest.raises(CorruptRecord):
            store.delete(rec.name)
        assert path.read_bytes() == damaged

    def test_the_reason_names_the_checksum_when_the_bytes_changed(
        self, store: RecordStore, written: tuple[OwnershipRecord, Path, bytes]
    ) -> None:
        rec, path, good = written
        path.write_bytes(corrupt_variants(good, rec)["one byte of the record flipped"])
        with pytest.raises(CorruptRecord, match="checksum mismatch"):
            store.load(rec.name)

    def test_the_reason_names_the_version_when_it_is_not_1(
        self, store: RecordStore, written: tuple[OwnershipRecord, Path, bytes]
    ) -> None:
        rec, path, good = written
        path.write_bytes(corrupt_variants(good, rec)["wrong version"])
        with pytest.raises(CorruptRecord, match="unsupported version 2"):
            store.load(rec.name)

    def test_a_renamed_file_cannot_claim_another_instance(
        self, store: RecordStore, written: tuple[OwnershipRecord, Path, bytes]
    ) -> None:
        _, path, _ = written
        other = make_record(gpu=OTHER_GPU, start=4)
        target = store.path(other.name)
        path.rename(target)
        with pytest.raises(CorruptRecord, match="does not match"):
            store.load(other.name)
        assert store.load_all()[0] == {}
        with pytest.raises(CorruptRecord):
            store.put(other)
        assert target.exists()

    def test_a_json_file_with_a_foreign_name_is_reported_corrupt_by_its_stem(
        self, store: RecordStore, state_dir: Path
    ) -> None:
        store.put(make_record())
        (state_dir / "notes.json").write_text("{}")
        valid, corrupt = store.load_all()
        assert list(valid) == [make_record().name]
        assert list(corrupt) == ["notes"]
        assert (state_dir / "notes.json").exists()

    def test_dotfiles_and_other_suffixes_are_not_records(self, store: RecordStore, state_dir: Path) -> None:
        (state_dir / ".hidden.json").write_text("junk")
        (state_dir / "README").write_text("junk")
        assert store.load_all() == ({}, {})


class TestSingleWriter:
    def test_a_second_process_cannot_open_a_locked_state_directory(
        self, store: RecordStore, state_dir: Path
    ) -> None:
        script = textwrap.dedent(
            """
            import sys
            from pathlib import Path
            from sidecar.store.records import RecordStore, StateDirLocked
            try:
                RecordStore(Path(sys.argv[1])).open()
            except StateDirLocked:
                print("locked")
            else:
                print("opened")
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", script, str(state_dir)], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "locked"

    def test_the_lock_is_released_by_close(self, state_dir: Path) -> None:
        first = RecordStore(state_dir)
        first.open()
        first.close()
        second = RecordStore(state_dir)
        second.open()
        second.close()
        assert (state_dir / ".lock").exists()

    def test_open_and_close_leave_no_descriptor_of_the_directory_behind(self, state_dir: Path) -> None:
        def open_in_state_dir() -> list[str]:
            fds = Path("/proc/self/fd")
            targets = []
            for fd in fds.iterdir():
                with contextlib.suppress(OSError):
                    targets.append(str(fd.readlink()))
            return sorted(t for t in targets if t.startswith(str(state_dir)))

        for _ in range(3):
            s = RecordStore(state_dir)
            s.put(make_record())
            assert open_in_state_dir() == sorted([str(state_dir), str(state_dir / ".lock")])
            s.close()
            assert open_in_state_dir() == []

    def test_a_second_store_in_the_same_process_is_kept_out_too(
        self, store: RecordStore, state_dir: Path
    ) -> None:
        # flock belongs to the open file description, so a second open() conflicts even in one process.
        with pytest.raises(StateDirLocked):
            RecordStore(state_dir).open()

    def test_a_store_that_was_not_opened_takes_the_lock_on_its_first_write(self, state_dir: Path) -> None:
        s = RecordStore(state_dir)
        s.put(make_record())
        try:
            with pytest.raises(StateDirLocked):
                RecordStore(state_dir).open()
        finally:
            s.close()

    def test_a_closed_store_writes_nothing_and_leaves_the_lock_to_a_successor(self, state_dir: Path) -> None:
        first = RecordStore(state_dir)
        first.put(make_record(start=0))
        first.close()
        successor = RecordStore(state_dir)
        successor.open()
        try:
            with pytest.raises(StateWriteFailed, match="closed"):
                first.put(make_record(start=1))
            with pytest.raises(StateWriteFailed, match="closed"):
                first.delete(make_record(start=0).name)
            assert sorted(p.name for p in state_dir.glob("*.json")) == [f"{make_record(start=0).name}.json"]
        finally:
            successor.close()


class TestVerify:
    def test_verify_reports_valid_corrupt_and_stale_records_and_changes_nothing(
        self, store: RecordStore, state_dir: Path
    ) -> None:
        current = make_record(start=0)
        old_boot = make_record(start=1, boot_id="00000000-0000-4000-8000-000000000000")
        store.put(current)
        store.put(old_boot)
        broken = make_record(start=2)
        store.put(broken)
        store.path(broken.name).write_bytes(b'{"version":1')
        before = {p.name: p.read_bytes() for p in state_dir.iterdir()}

        report = verify(state_dir, BOOT)

        assert report.valid == (current.name, old_boot.name)
        assert report.stale == (old_boot.name,)
        assert list(report.corrupt) == [broken.name]
        assert {p.name: p.read_bytes() for p in state_dir.iterdir()} == before
        text = format_report(report)
        assert f"CORRUPT  {store.path(broken.name)}: " in text
        assert f"stale    {old_boot.name}" in text
        assert "2 valid (1 stale), 1 corrupt" in text

    def test_verify_without_a_boot_id_reports_nothing_stale(
        self, store: RecordStore, state_dir: Path
    ) -> None:
        store.put(make_record(boot_id="another-boot"))
        report = verify(state_dir, None)
        assert report.stale == ()
        assert report.corrupt == {}

    @pytest.mark.parametrize("boot_id", [BOOT, None], ids=["with the boot id", "without"])
    def test_verify_lists_a_record_without_a_boot_id_apart_never_as_stale(
        self, store: RecordStore, state_dir: Path, boot_id: str | None
    ) -> None:
        """Recoverer keeps such a record aside (nothing tells its boot); verify agrees and says so."""
        current = make_record(start=0)
        unstamped = make_record(start=1, boot_id="")
        store.put(current)
        store.put(unstamped)

        report = verify(state_dir, boot_id)

        assert report.valid == (current.name, unstamped.name)
        assert report.no_boot_id == (unstamped.name,)
        assert report.stale == ()
        text = format_report(report)
        assert f"NO BOOT  {unstamped.name}" in text
        assert f"valid    {current.name}" in text
        assert "2 valid (0 stale), 0 corrupt, 1 without a boot id" in text

    def test_verify_does_not_need_the_lock_and_takes_none(self, store: RecordStore, state_dir: Path) -> None:
        store.put(make_record())
        assert verify(state_dir, BOOT).valid == (make_record().name,)

    def test_verify_of_a_missing_directory_is_an_error_not_an_empty_report(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError):
            verify(tmp_path / "typo", BOOT)
