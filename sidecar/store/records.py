"""Durable ownership records: one JSON file per owned instance under the state directory.

The file format is a public API (version 1), and the files of the directory, the envelope, atomic
writes and permissions are drawn in ``docs/architecture.md``, "The state directory"; what follows is
why this module does them so.

Why the checksum is over the record's exact bytes R, never over a re-encoding: one that orders or
spaces fields differently would make a good file look corrupt, or a bad one look good. Reading keeps
``record`` as ``msgspec.Raw`` for the checksum, then strict-decodes R, then checks the file name
against ``record_name`` (validated values, never request strings).

A missing record raises ``RecordNotFound`` (start empty), a corrupt one ``CorruptRecord`` (stop and
surface); ``put`` and ``delete`` refuse to touch a corrupt file. A future version 2 would
keep today's ``OwnershipRecord`` as a frozen ``OwnershipRecordV1`` type, add a converter ``v1 -> v2``,
decode by the envelope's version and always write the newest version.

The generation ceiling is handed out hi/lo: the lifecycle hands out generations (one per activation
and one per instance going IDLE) up to it and durably raises it by a block before a larger one. The
ceiling outlives the records, so even when the records of the instances changed last are gone, a
SyncActive fenced with a generation read before a restart can never idle an instance activated after
it, nor reactivate one idled after it. A missing file is a first run (the records are all there is);
a corrupt one is left for the operator. It does not end in ``.json``, so no record reader sees it;
``verify`` reports it.

``.lock`` is never unlinked: another process could otherwise lock a fresh inode. A crash between
write and rename leaves a temp file behind and the old record intact; ``open()`` sweeps them. On
tmpfs (``/var/run`` on a node) ``durable.rewrite_in_place`` pads with trailing spaces, all or nothing
too. Records name pods, and nothing outside the node agent needs them (files 0600). The sidecar runs
as root and trusts these files to say which GPU instances it may destroy, so ``open`` refuses
(``UnsafeStateDir``) a directory or record file another user owns or that is group- or
world-writable, and a lock file that is a symlink, not a regular file, or hard-linked: anything there
could have been planted, and the lock file is truncated on open.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import types
from collections.abc import Callable, Sequence
from pathlib import Path

from sidecar.model.errors import StateWriteFailed
from sidecar.model.hami_files import is_record_filename as is_hami_record
from sidecar.model.ownership import OwnershipRecord, is_record_name
from sidecar.store.durable import TEMP_MARKER, ShortWriteError, atomic_write, on_tmpfs, rewrite_in_place
from sidecar.store.record_format import (
    GENERATION_FILE,
    MAX_GENERATION,
    CorruptRecord,
    RecordNotFound,
    decode_generation,
    decode_record,
    encode_generation,
    encode_record,
)

BOOT_ID_PATH = Path("sys/kernel/random/boot_id")
"""Under a /proc root: changes on every boot, which is when GI/CI vanish; records store it to tell."""

DIR_MODE = 0o750
FILE_MODE = 0o600
LOCK_NAME = ".lock"
SUFFIX = ".json"


class StateDirLocked(Exception):  # noqa: N818 - the contract's name
    """Another process holds the state directory's lock (a second sidecar)."""


class UnsafeStateDir(StateWriteFailed):
    """The state directory, its lock file or a record file in it could have been planted or changed by
    someone else (a symlink, a non-regular lock, group/world-writable, another owner): nothing in it
    can be trusted, so the sidecar refuses to start on it. The message names the path."""


def _check_owned(path: Path, st: os.stat_result, what: str) -> None:
    """Refuse ``path`` unless this process's user owns it and nobody else may write it."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeStateDir(
            f"{what} {path} is owned by uid {st.st_uid}, not by this sidecar's uid {uid};"
            " refusing to trust it (chown it or use another --state-dir)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeStateDir(
            f"{what} {path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):04o}), so anyone"
            " could have planted or changed what is in it; refusing to trust it (chmod go-w it)"
        )


def _open_lock_file(path: Path) -> int:
    """Open (creating) the lock file without following a symlink; refuse anything but a regular file
    of ours with one link: ``open`` truncates it, which must never reach a planted target."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeStateDir(f"lock file {path} is a symbolic link; refusing to open it") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeStateDir(f"lock file {path} is not a regular file; refusing to use it")
        if st.st_nlink != 1:
            raise UnsafeStateDir(f"lock file {path} has {st.st_nlink} hard links; refusing to use it")
        _check_owned(path, st, "lock file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_files_owned(directory: Path) -> None:
    """Refuse to start on record or generation files someone else owns or may write. Symlinks and
    other non-regular entries are not followed here: reading reports them corrupt, never trusted."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if _is_temp(entry.name) or not (entry.name.endswith(SUFFIX) or entry.name == GENERATION_FILE):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the listing (a running sidecar's delete)
            if stat.S_ISREG(st.st_mode):
                _check_owned(Path(entry.path), st, "state file")


def _is_temp(filename: str) -> bool:
    return filename.startswith(".") and TEMP_MARKER in filename


def scan(directory: Path) -> tuple[dict[str, OwnershipRecord], dict[str, CorruptRecord]]:
    """Read every ``*.json`` in ``directory`` (dotfiles ignored). Opens nothing for writing.

    Raises FileNotFoundError/NotADirectoryError when ``directory`` is not there."""
    valid: dict[str, OwnershipRecord] = {}
    corrupt: dict[str, CorruptRecord] = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or not entry.name.endswith(SUFFIX) or is_hami_record(entry.name):
            continue
        path = Path(entry.path)
        name = entry.name[: -len(SUFFIX)]
        try:
            if not is_record_name(name):
                raise CorruptRecord(name, path, "file name is not a record name")
            valid[name] = _read(name, path)
        except CorruptRecord as exc:
            corrupt[name] = exc
        except RecordNotFound:
            continue  # removed between the listing and the read
    return valid, corrupt


def _read(name: str, path: Path) -> OwnershipRecord:
    return decode_record(name, path, _read_bytes(name, path))


def read_generation(directory: Path) -> int | None:
    """The stored generation ceiling; None when there is no file (a first run); CorruptRecord."""
    path = directory / GENERATION_FILE
    try:
        return decode_generation(path, _read_bytes(GENERATION_FILE, path))
    except RecordNotFound:
        return None


_READ_CHUNK = 1 << 16


def _read_bytes(name: str, path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise RecordNotFound(f"no ownership record {path}") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptRecord(name, path, "is a symbolic link, not a record file") from exc
        raise StateWriteFailed(f"reading ownership record {path} failed: {exc}") from exc
    chunks: list[bytes] = []  # plain reads: a buffered file object costs more than the read itself
    try:
        while chunk := os.read(fd, _READ_CHUNK):
            chunks.append(chunk)
            if len(chunk) < _READ_CHUNK:
                break  # a short read of a regular file is its end: no second read to learn that
    except IsADirectoryError as exc:
        raise CorruptRecord(name, path, "is a directory, not a record file") from exc
    except OSError as exc:
        raise StateWriteFailed(f"reading ownership record {path} failed: {exc}") from exc
    finally:
        os.close(fd)
    return b"".join(chunks)


class RecordStore:
    """The records of one state directory. ``open()`` takes the directory's flock for the process life.

    Every mutation goes through ``_mutate``: under the lock of that one file, inside the process-wide
    flock, read the current file (refuse if corrupt), then write or unlink atomically. Reads need
    neither. No lock shared between files is held across an fsync, so GPUs write in parallel.

    A record file that still holds the bytes this store last wrote to it is known sound: it is not
    decoded again before it is replaced (reading it is cheap, decoding and verifying it is not)."""

    def __init__(self, directory: Path, in_place: bool | None = None) -> None:
        """``in_place``: rewrite sound record files in place (None: when the directory is on tmpfs)."""
        self.directory = directory
        self._want_in_place = in_place
        self._in_place = False
        self._lock = threading.Lock()  # the fd, ``_closed``, ``_writing``, ``_file_locks``; no fsync under it
        self._idle = threading.Condition(self._lock)  # close() waits on it for ``_writing`` mutations
        self._writing = 0
        self._file_locks: dict[Path, threading.Lock] = {}
        self._paths: dict[str, Path] = {}  # record name -> its file (``path``)
        self._written: dict[Path, bytes] = {}  # path -> the bytes this store last wrote there
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None  # the directory, open for its fsyncs while the flock is held
        self._closed = False  # after close(): the flock may be another process's now

    def __enter__(self) -> RecordStore:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> None:
        """Create the directory (0750) if needed and take an exclusive non-blocking flock on ``.lock``.

        Raises ``StateDirLocked`` if another process holds it, ``UnsafeStateDir`` when the directory,
        the lock file or a record file could have been planted by someone else (see the class). Called
        before the socket is bound.
        Once locked, leftover temp files of writes that a crash interrupted are removed (no other
        writer can exist now). OSError -> StateWriteFailed. Opening an open store is a no-op."""
        with self._lock:
            if self._lock_fd is not None:
                return
            self._closed = False
            try:
                self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
                # A directory others may write is refused, not narrowed: what is in it may be planted.
                _check_owned(self.directory, self.directory.stat(), "state directory")
                # mkdir's mode passes through the umask, and an existing hostPath may be readable wider.
                self.directory.chmod(DIR_MODE)
                _check_files_owned(self.directory)  # before the lock file is created or truncated
                fd = _open_lock_file(self.directory / LOCK_NAME)
            except OSError as exc:
                raise StateWriteFailed(f"opening state directory {self.directory} failed: {exc}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                os.close(fd)
                raise StateDirLocked(
                    f"state directory {self.directory} is locked by another process (a second sidecar?)"
                ) from exc
            except OSError as exc:
                os.close(fd)
                raise StateWriteFailed(f"locking {self.directory / LOCK_NAME} failed: {exc}") from exc
            try:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())  # informational only
                for entry in os.scandir(self.directory):
                    if _is_temp(entry.name) and entry.is_file(follow_symlinks=False):
                        Path(entry.path).unlink(missing_ok=True)
                dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as exc:
                os.close(fd)
                raise StateWriteFailed(f"preparing state directory {self.directory} failed: {exc}") from exc
            self._lock_fd, self._dir_fd = fd, dir_fd
            want = self._want_in_place
            self._in_place = on_tmpfs(self.directory) if want is None else want

    def close(self) -> None:
        """Release the flock (the lock file stays: unlinking it would let two processes lock two inodes).

        A closed store refuses every mutation until ``open()`` is called again: once the flock is
        released, a successor sidecar may own the directory."""
        with self._lock:
            self._closed = True
            while self._writing:
                self._idle.wait()
            if self._dir_fd is not None:
                os.close(self._dir_fd)
                self._dir_fd = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def path(self, name: str) -> Path:
        """The file of record ``name``; ValueError for anything ``record_name`` could not have produced.

        Remembered per name: every write asks, and the check and the ``Path`` cost more than the
        write's own system calls on tmpfs."""
        path = self._paths.get(name)
        if path is None:
            if not is_record_name(name):
                raise ValueError(f"not an ownership record name: {name!r}")
            path = self._paths[name] = self.directory / f"{name}{SUFFIX}"
        return path

    def load(self, name: str) -> OwnershipRecord:
        """Read -> decode envelope -> verify checksum -> decode record. RecordNotFound / CorruptRecord."""
        return _read(name, self.path(name))

    def load_all(self) -> tuple[dict[str, OwnershipRecord], dict[str, CorruptRecord]]:
        """Every record file: (valid by name, corrupt by name). Temp files and the lock are ignored.

        Any other ``*.json`` that is not a valid record (bad name, or a name that differs from the
        record inside) is reported as corrupt under its file stem. A missing directory holds nothing."""
        try:
            return scan(self.directory)
        except FileNotFoundError:
            return {}, {}
        except OSError as exc:
            raise StateWriteFailed(f"listing state directory {self.directory} failed: {exc}") from exc

    def put(self, record: OwnershipRecord) -> None:
        """Atomically write (temp in same dir, fsync, rename, fsync dir; mode 0600).
        Refuses (CorruptRecord) to overwrite a file that exists and is corrupt.
        OSError -> StateWriteFailed."""
        self._mutate(record.name, encode_record(record))

    def delete(self, name: str) -> None:
        """Remove a record; a missing one is a no-op; a corrupt one is refused (CorruptRecord).
        OSError -> StateWriteFailed."""
        self._mutate(name, None)

    def remove_if(self, filename: str, check: Callable[[], bool], what: str) -> None:
        """Remove another file here (HAMi's records) under the one lock when ``check`` says so."""
        self._mutate_file(self.directory / Path(filename).name, check, None, what)

    def load_generation_ceiling(self) -> int | None:
        """The stored generation ceiling; None when there is no ``generation`` file; CorruptRecord."""
        return read_generation(self.directory)

    def raise_generation_ceiling(self, ceiling: int) -> int:
        """Durably store ``ceiling`` unless the stored one is already at least that; returns the stored.

        Never lowers the ceiling, and refuses (CorruptRecord) to overwrite a corrupt file.
        OSError -> StateWriteFailed; a ceiling past ``MAX_GENERATION`` -> StateWriteFailed (the
        generation space is spent: refusing the change beats handing out a number that overflows)."""
        if ceiling > MAX_GENERATION:
            raise StateWriteFailed(
                f"generation ceiling {ceiling} would pass the largest generation {MAX_GENERATION};"
                " the change that needs it is refused"
            )
        data = encode_generation(ceiling)
        stored: list[int] = []

        def keep_higher() -> bool:
            current = read_generation(self.directory)
            if current is not None and current >= ceiling:
                stored.append(current)
                return False
            stored.append(ceiling)
            return True

        self._mutate_file(self.directory / GENERATION_FILE, keep_higher, data, "generation ceiling")
        return stored[0]

    def _mutate(self, name: str, data: bytes | None) -> None:
        """Write ``data`` as record ``name``, or delete it (``data`` None), through ``_mutate_file``."""
        path = self.path(name)

        sound: list[bytes] = []  # the content of the sound file ``exists`` read, when there is one

        def exists() -> bool:
            try:
                current = _read_bytes(name, path)
                if current != self._written.get(path):
                    decode_record(name, path, current)
            except RecordNotFound:
                return data is not None
            sound.append(current)
            return True

        self._mutate_file(path, exists, data, "ownership record", sound)

    def _mutate_file(
        self,
        path: Path,
        check: Callable[[], bool],
        data: bytes | None,
        what: str,
        sound: Sequence[bytes] = (),
    ) -> None:
        """The one function that changes the directory: under the file's lock, ``check`` reads the
        current file (CorruptRecord propagates: a corrupt file is the operator's to inspect) and says
        whether a change is due; then ``data`` replaces the file atomically, or it goes (``data`` None).
        On tmpfs a sound file ``check`` read (``sound``: its content) is rewritten in place instead
        (``durable.rewrite_in_place``: the same all-or-nothing, in one system call).

        A store that was never opened is opened here, so no mutation ever happens outside the flock; a
        closed one raises StateWriteFailed and writes nothing (``close`` waits for the writes in flight)."""
        if self._lock_fd is None and not self._closed:
            self.open()
        with self._lock:
            dir_fd = self._dir_fd  # open whenever the flock is held; closed only once no write runs
            if dir_fd is None or self._closed:
                raise StateWriteFailed(
                    f"the record store {self.directory} is closed (the sidecar is stopping);"
                    f" {what} {path.name} was not written"
                )
            self._writing += 1
            file_lock = self._file_locks.setdefault(path, threading.Lock())
        try:
            with file_lock:
                if not check():
                    return
                try:
                    self._written.pop(path, None)
                    if data is None:
                        path.unlink(missing_ok=True)
                        os.fsync(dir_fd)
                    else:
                        self._written[path] = self._replace(path, data, dir_fd, sound)
                except OSError as exc:
                    action = "deleting" if data is None else "writing"
                    raise StateWriteFailed(f"{action} {what} {path} failed: {exc}") from exc
        finally:
            with self._lock:
                self._writing -= 1
                if self._closed:  # only ``close`` waits on it, and only once it has set ``_closed``
                    self._idle.notify_all()

    def _replace(self, path: Path, data: bytes, dir_fd: int, sound: Sequence[bytes]) -> bytes:
        """Make ``data`` the content of ``path`` (OSError, the old content kept); the bytes the file
        holds afterwards."""
        torn = False  # a short write in place left the file neither old nor new
        if self._in_place and sound:
            try:
                padded = rewrite_in_place(path, data, sound[0])
            except ShortWriteError:
                torn = True
            else:
                if padded is not None:
                    return padded
        try:
            atomic_write(path, data, FILE_MODE, dir_fd)
        except OSError:
            if torn:
                atomic_write(path, sound[0], FILE_MODE, dir_fd)  # the old record whole again
            raise
        return data
