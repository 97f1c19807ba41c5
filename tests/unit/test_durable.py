"""Replacing a record file in place (as the store does on tmpfs): all or nothing, whatever happens."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from helpers_records import make_record

from sidecar.model.domain import State
from sidecar.model.errors import StateWriteFailed
from sidecar.store import durable
from sidecar.store.record_format import CorruptRecord, encode_record
from sidecar.store.records import RecordStore


def mount_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path``, from /proc/self/mountinfo (longest prefix)."""
    target, best, kind = str(path.resolve()), "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[fields.index("-") + 1]
    return kind


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RecordStore]:
    with RecordStore(tmp_path / "state", in_place=True) as s:
        yield s


class TestTellingTmpfs:
    def test_the_answer_is_the_mount_table_s(self, tmp_path: Path) -> None:
        for directory in (tmp_path, Path("/dev/shm"), Path("/proc")):
            if directory.is_dir():
                assert durable.on_tmpfs(directory) == (mount_type(directory) == "tmpfs"), directory

    def test_a_directory_that_is_not_there_is_not_tmpfs(self, tmp_path: Path) -> None:
        assert durable.on_tmpfs(tmp_path / "nowhere") is False

    def test_a_store_on_tmpfs_rewrites_in_place_and_one_elsewhere_replaces(self, tmp_path: Path) -> None:
        for parent in (tmp_path, Path("/dev/shm")):
            if not parent.is_dir():
                continue
            directory = parent / f"hms-durable-{os.getpid()}"
            try:
                with RecordStore(directory) as s:
                    s.put(make_record(state=State.IDLE))
                    before = s.path(make_record().name).stat().st_ino
                    s.put(make_record(state=State.ACTIVE))
                    after = s.path(make_record().name).stat().st_ino
                assert (before == after) == (mount_type(parent) == "tmpfs")
            finally:
                for f in directory.iterdir() if directory.exists() else ():
                    f.unlink()
                if directory.exists():
                    directory.rmdir()


class TestRewritingInPlace:
    def test_a_shorter_record_is_padded_and_reads_back_exactly(self, store: RecordStore) -> None:
        long = msgspec.structs.replace(make_record(state=State.ERROR), last_error="x" * 200)
        short = make_record(state=State.IDLE)
        store.put(long)
        path = store.path(long.name)
        inode, size = path.stat().st_ino, path.stat().st_size

        store.put(short)

        data = path.read_bytes()
        assert (path.stat().st_ino, len(data)) == (inode, size)
        encoded = encode_record(short)
        assert data == encoded + b" " * (size - len(encoded))
        assert store.load(short.name) == short
        assert store.load_all() == ({short.name: short}, {})

    def test_a_longer_record_grows_the_file_in_place(self, store: RecordStore) -> None:
        short = make_record(state=State.IDLE)
        long = msgspec.structs.replace(make_record(state=State.ERROR), last_error="y" * 300)
        store.put(short)
        path = store.path(short.name)
        inode = path.stat().st_ino

        store.put(long)

        assert (path.stat().st_ino, path.read_bytes()) == (inode, encode_record(long))
        assert store.load(long.name) == long

    def test_a_file_that_would_pass_a_page_is_left_alone(self, tmp_path: Path) -> None:
        path = tmp_path / "f.json"
        path.write_bytes(b"{}")

        assert durable.rewrite_in_place(path, b" " * (mmap.PAGESIZE + 1), b"{}") is None
        assert path.read_bytes() == b"{}"

    def test_a_short_write_leaves_the_new_record_whole(
        self, store: RecordStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        old, new = make_record(state=State.IDLE), make_record(state=State.ACTIVE)
        store.put(old)
        pwrite = os.pwrite
        monkeypatch.setattr(os, "pwrite", lambda fd, data, at: pwrite(fd, data[: len(data) // 2], at))

        store.put(new)

        monkeypatch.undo()
        assert store.load(new.name) == new
        assert store.path(new.name).read_bytes() == encode_record(new)

    def test_a_short_write_that_cannot_be_repaired_forward_puts_the_old_record_back(
        self, store: RecordStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        old, new = make_record(state=State.IDLE), make_record(state=State.ACTIVE)
        store.put(old)
        old_bytes = store.path(old.name).read_bytes()
        pwrite, replace = os.pwrite, durable.atomic_write

        def full_disk_for_the_new(path: Path, data: bytes, mode: int, dir_fd: int | None = None) -> None:
            if data == encode_record(new):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            replace(path, data, mode, dir_fd)

        monkeypatch.setattr(os, "pwrite", lambda fd, data, at: pwrite(fd, data[:10], at))
        # records calls the name it imported from durable, so that is the name to replace.
        monkeypatch.setattr("sidecar.store.records.atomic_write", full_disk_for_the_new)

        with pytest.raises(StateWriteFailed):
            store.put(new)

        monkeypatch.undo()
        assert store.path(old.name).read_bytes() == old_bytes
        assert store.load(old.name) == old

    def test_a_corrupt_file_is_not_rewritten(self, store: RecordStore) -> None:
        rec = make_record(state=State.IDLE)
        store.put(rec)
        path = store.path(rec.name)
        damaged = path.read_bytes().replace(b'"IDLE"', b'"IDLX"')
        path.write_bytes(damaged)

        with pytest.raises(CorruptRecord):
            store.put(msgspec.structs.replace(rec, state=State.ACTIVE))

        assert path.read_bytes() == damaged
