"""Durable ownership records: one JSON file per owned instance under the state directory.

Architecture section 7, style habits 6-8. The file format is a public API (version 1)::

    {"version":1,"checksum":"sha256:<hex of the exact record bytes>","record":{...OwnershipRecord...}}

The record is encoded once to bytes R; the envelope is written around R verbatim and the checksum is
over R, so verification never depends on re-encoding (a re-encoding that orders or spaces fields
differently would otherwise make a good file look corrupt, or a bad one look good). Reading is
read -> decode the envelope (``record`` kept as ``msgspec.Raw``) -> verify the checksum over those raw
bytes -> strict-decode R (unknown fields rejected) -> check the file name against the record's own
name, so a renamed file can never claim another instance.

Missing and corrupt are different outcomes: ``RecordNotFound`` (start empty) vs ``CorruptRecord``
(stop and surface). A corrupt file is never deleted or overwritten automatically: ``put`` and
``delete`` refuse to touch one, and only an operator removes it.

Versioning: a file whose ``version`` is not ``RECORD_VERSION`` is corrupt for this build. A future
version 2 would keep today's ``OwnershipRecord`` as a frozen ``OwnershipRecordV1`` type, add a
converter ``v1 -> v2``, decode by the envelope's version and always write the newest version. New
fields of a version always get defaults and existing field types never change (style habit 12).

Files in the directory:

- ``<name>.json``: a record; ``<name>`` comes from ``record_name`` (validated values, never request
  strings).
- ``generation``: the generation ceiling, ``{"version":1,"checksum":…,"record":{"ceiling":N}}`` in
  the same envelope as a record (checksum over the exact ``record`` bytes). ``N`` is the highest
  generation the sidecar may have handed out (one per activation and one per instance going IDLE):
  the lifecycle hands out generations up to it and, before it hands out a larger one, durably raises
  it by a block (hi/lo). A restarted sidecar starts counting at ``N`` (or at the newest record, if
  larger), so the generation never goes back across restarts even when the records of the instances
  changed last are gone - a SyncActive fenced with a generation read before the restart can never
  idle an instance activated after it, nor reactivate one idled after it.
  Missing = a first run (the records are all there is); corrupt = recovery refuses to guess
  (UNVERIFIABLE_STATE) and the file is left for the operator. It does not end in ``.json``, so no
  record reader sees it; ``verify`` reports it.
- ``.lock``: the process-wide ``flock`` that keeps a second sidecar out; never unlinked (another
  process could otherwise lock a fresh inode).
- ``.<name>.tmp-<random>``: a write in progress; never ends in ``.json``, ignored by readers and
  swept by ``open()`` (a crash between write and rename leaves one behind and the old record intact).

Permissions: directory 0750, files 0600 (records name pods; nothing outside the node agent needs them).
The sidecar runs as root and trusts these files to say which GPU instances it may destroy, so
``open`` refuses (``UnsafeStateDir``) a directory or record file that another user owns or that is
group- or world-writable, and a lock file that is a symlink, not a regular file, or hard-linked:
anything there could have been planted, and the lock file is truncated on open.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import stat
import threading
import types
from collections.abc import Callable
from pathlib import Path

import msgspec

from sidecar.domain import GPU_UUID_RE, Identity, Owner, Placement, Reservation, State
from sidecar.errors import StateWriteFailed

RECORD_VERSION = 1

BOOT_ID_PATH = Path("sys/kernel/random/boot_id")
"""Under a /proc root: changes on every boot, which is when GI/CI vanish; records store it to tell."""

DIR_MODE = 0o750
FILE_MODE = 0o600
LOCK_NAME = ".lock"
SUFFIX = ".json"
GENERATION_FILE = "generation"
TEMP_MARKER = ".tmp-"
CHECKSUM_PREFIX = "sha256:"

MAX_GENERATION = 2**63 - 1
"""The largest generation a file may hold: a stored value above it is corrupt. Half of uint64 (and
int64's maximum, for a Go reader), so the lifecycle's increments and ceiling blocks past any stored
value still fit the contract's uint64 and never overflow it."""

# The stem ``record_name`` produces; ``path`` accepts nothing else, so no name can escape the directory.
NAME_RE = re.compile(
    r"^mig-GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}-(0|[1-9][0-9]*)-[1-9][0-9]*$"
)


class OwnershipRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the sidecar knows about one owned instance. Field names are the on-disk format."""

    gpu_uuid: str
    profile: str  # full profile name, "1g.10gb+me"
    gi_profile_id: int
    ci_profile_id: int
    placement: Placement
    state: State
    gpu_instance_id: int | None = None  # set once the GI exists
    compute_instance_id: int | None = None  # set once the CI exists
    mig_uuid: str | None = None  # set once the CI exists
    owner: Owner | None = None  # the holder while ACTIVE (and the creator while CREATING)
    activated_generation: int = 0  # the generation at which it last became ACTIVE
    idled_generation: int = 0  # the generation at which it last became IDLE (0: before the field existed)
    cdi_device: str = ""  # qualified CDI name, "" with CDI disabled or before the file exists
    last_error: str = ""
    boot_id: str = ""  # /proc/sys/kernel/random/boot_id when the instance was created
    since: str = ""  # RFC 3339 UTC time of the last state change
    # Set in the record written just before the CI create is issued; cleared once the CI is recorded
    # or the GI has been seen without one. While set, a CI found in this GI without a recorded ID is
    # this record's (its create may have made it and failed to report it).
    ci_create_issued: bool = False

    @property
    def name(self) -> str:
        return record_name(self.gpu_uuid, self.placement)

    @property
    def reservation(self) -> Reservation:
        return Reservation(self.gpu_uuid, self.profile, self.placement)

    @property
    def may_own_unrecorded_ci(self) -> bool:
        """Whether a CI in this record's GI without a recorded CI ID is its own: a CREATING record's, or
        one whose create issued the CI create (an undo that failed leaves it ERROR). Any other record
        without a CI ID stands for a bare GI, and a CI there was made by someone else."""
        return self.state is State.CREATING or self.ci_create_issued

    @property
    def identity(self) -> Identity | None:
        """The live identity, or None while the instance is not complete."""
        if self.gpu_instance_id is None or self.compute_instance_id is None or self.mig_uuid is None:
            return None
        return Identity(self.gpu_instance_id, self.compute_instance_id, self.mig_uuid)


def record_name(gpu_uuid: str, placement: Placement) -> str:
    """The record's file stem, ``mig-<gpu uuid>-<start>-<size>``, from validated values only.

    Two live instances on one GPU never overlap, so (GPU, placement) names one instance at a time.
    Raises ``ValueError`` for a GPU UUID that is not ``GPU-<uuid>`` or a negative/zero-size placement.
    """
    if not isinstance(gpu_uuid, str) or not GPU_UUID_RE.match(gpu_uuid):
        raise ValueError(f"not a GPU UUID: {gpu_uuid!r}")
    start, size = placement.start, placement.size
    # bool is an int subclass; True/False as a slice number is a bug upstream, not a placement.
    if type(start) is not int or type(size) is not int or start < 0 or size <= 0:
        raise ValueError(f"not a placement: start={start!r} size={size!r}")
    return f"mig-{gpu_uuid}-{start}-{size}"


class RecordError(Exception):
    """Base of record read errors."""


class RecordNotFound(RecordError):  # noqa: N818 - the contract's name; "not found" reads better than "Error"
    """No file for that record name: start empty, this is not a failure."""


class CorruptRecord(RecordError):  # noqa: N818 - the contract's name
    """A record file exists but cannot be trusted: truncated, bad checksum, unknown field, wrong version."""

    def __init__(self, name: str, path: Path, why: str) -> None:
        super().__init__(f"ownership record {path} is corrupt: {why}")
        self.name = name
        self.path = path
        self.why = why


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


class _Header(msgspec.Struct):
    """Only the version, decoded leniently first, so a newer format reports "unsupported version"
    rather than whatever its other fields happen to trip over."""

    version: int


class _EnvelopeV1(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    checksum: str
    record: msgspec.Raw  # the exact stored bytes of the record: what the checksum covers


class GenerationCeiling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The payload of the ``generation`` file: the highest generation that may have been handed out."""

    ceiling: int


_HEADER_DECODER = msgspec.json.Decoder(_Header)
_ENVELOPE_DECODER = msgspec.json.Decoder(_EnvelopeV1)
_RECORD_DECODER = msgspec.json.Decoder(OwnershipRecord)  # strict: no int<->str coercion
_CEILING_DECODER = msgspec.json.Decoder(GenerationCeiling)
_ENCODER = msgspec.json.Encoder()


def _checksum(data: bytes) -> str:
    return CHECKSUM_PREFIX + hashlib.sha256(data).hexdigest()


def encode_record(record: OwnershipRecord) -> bytes:
    """The exact file content for ``record``: the envelope around the record bytes, newline-terminated.

    Constructing a Struct does not check field types, so the encoded record is decoded again here;
    a record that would not read back (a str where an int belongs, a bad GPU UUID) raises ValueError
    instead of reaching the disk."""
    raw = _ENCODER.encode(record)
    try:
        _RECORD_DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        raise ValueError(f"ownership record would not read back: {exc}") from exc
    record_name(record.gpu_uuid, record.placement)
    why = _generation_out_of_range(record)
    if why:
        raise ValueError(f"ownership record would not read back: {why}")
    return _envelope(raw)


def encode_generation(ceiling: int) -> bytes:
    """The exact content of the ``generation`` file for ``ceiling`` (a non-negative int)."""
    if type(ceiling) is not int or not 0 <= ceiling <= MAX_GENERATION:
        raise ValueError(f"not a generation ceiling: {ceiling!r}")
    return _envelope(_ENCODER.encode(GenerationCeiling(ceiling=ceiling)))


def decode_generation(path: Path, data: bytes) -> int:
    """The ceiling stored in the bytes of the ``generation`` file; CorruptRecord on any doubt."""
    raw = _verified_payload(GENERATION_FILE, path, data)
    try:
        ceiling = _CEILING_DECODER.decode(raw).ceiling
    except msgspec.DecodeError as exc:
        raise CorruptRecord(GENERATION_FILE, path, f"generation ceiling does not decode: {exc}") from exc
    if not 0 <= ceiling <= MAX_GENERATION:
        raise CorruptRecord(
            GENERATION_FILE, path, f"generation ceiling {ceiling} is out of range 0..{MAX_GENERATION}"
        )
    return ceiling


def _envelope(payload: bytes) -> bytes:
    """The file content around the exact ``payload`` bytes: version, checksum over them, newline."""
    return (
        b'{"version":'
        + str(RECORD_VERSION).encode()
        + b',"checksum":"'
        + _checksum(payload).encode()
        + b'","record":'
        + payload
        + b"}\n"
    )


def _verified_payload(name: str, path: Path, data: bytes) -> bytes:
    """Decode the envelope of a file and verify its checksum; the exact payload bytes or CorruptRecord."""
    try:
        header = _HEADER_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(name, path, f"not a record envelope: {exc}") from exc
    if header.version != RECORD_VERSION:
        raise CorruptRecord(
            name, path, f"unsupported version {header.version} (this build reads {RECORD_VERSION})"
        )
    try:
        envelope = _ENVELOPE_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(name, path, f"not a version {RECORD_VERSION} envelope: {exc}") from exc
    raw = bytes(envelope.record)
    actual = _checksum(raw)
    if envelope.checksum != actual:
        raise CorruptRecord(name, path, f"checksum mismatch: stored {envelope.checksum}, computed {actual}")
    return raw


def decode_record(name: str, path: Path, data: bytes) -> OwnershipRecord:
    """Decode and verify the bytes of the file ``path`` named ``name``; CorruptRecord on any doubt."""
    raw = _verified_payload(name, path, data)
    try:
        record = _RECORD_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(name, path, f"record does not decode: {exc}") from exc
    try:
        own_name = record.name
    except ValueError as exc:
        raise CorruptRecord(name, path, f"record names no valid instance: {exc}") from exc
    if own_name != name:
        raise CorruptRecord(name, path, f"file name does not match the record (it names {own_name})")
    why = _generation_out_of_range(record)
    if why:
        raise CorruptRecord(name, path, why)
    return record


def _generation_out_of_range(record: OwnershipRecord) -> str:
    """Why a generation of ``record`` is outside ``0..MAX_GENERATION`` ("" when none is): such a
    value would overflow the contract's uint64 once the lifecycle counts past it."""
    for field in ("activated_generation", "idled_generation"):
        value = getattr(record, field)
        if not 0 <= value <= MAX_GENERATION:
            return f"{field} {value} is out of range 0..{MAX_GENERATION}"
    return ""


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable (rename alone is atomic, not durable)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory -> fsync -> rename -> fsync dir.

    The temp name ``.<name>.tmp-<random>`` starts with a dot and does not end in ``.json``, so neither
    this module nor a CDI scanner ever reads a half-written file. ``fchmod`` sets ``mode`` exactly,
    whatever the umask. Raises OSError; the temp file is removed on failure."""
    tmp = path.with_name(f".{path.stem}{TEMP_MARKER}{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _is_temp(filename: str) -> bool:
    return filename.startswith(".") and TEMP_MARKER in filename


def _scan(directory: Path) -> tuple[dict[str, OwnershipRecord], dict[str, CorruptRecord]]:
    """Read every ``*.json`` in ``directory`` (dotfiles ignored). Opens nothing for writing.

    Raises FileNotFoundError/NotADirectoryError when ``directory`` is not there."""
    valid: dict[str, OwnershipRecord] = {}
    corrupt: dict[str, CorruptRecord] = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or not entry.name.endswith(SUFFIX):
            continue
        path = Path(entry.path)
        name = entry.name[: -len(SUFFIX)]
        try:
            if not NAME_RE.match(name):
                raise CorruptRecord(name, path, "file name is not a record name")
            valid[name] = _read(name, path)
        except CorruptRecord as exc:
            corrupt[name] = exc
        except RecordNotFound:
            continue  # removed between the listing and the read
    return valid, corrupt


def _read(name: str, path: Path) -> OwnershipRecord:
    return decode_record(name, path, _read_bytes(name, path))


def _read_generation(directory: Path) -> int | None:
    """The stored generation ceiling; None when there is no file (a first run); CorruptRecord."""
    path = directory / GENERATION_FILE
    try:
        return decode_generation(path, _read_bytes(GENERATION_FILE, path))
    except RecordNotFound:
        return None


def _read_bytes(name: str, path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise RecordNotFound(f"no ownership record {path}") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptRecord(name, path, "is a symbolic link, not a record file") from exc
        raise StateWriteFailed(f"reading ownership record {path} failed: {exc}") from exc
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    except IsADirectoryError as exc:
        raise CorruptRecord(name, path, "is a directory, not a record file") from exc
    except OSError as exc:
        raise StateWriteFailed(f"reading ownership record {path} failed: {exc}") from exc
    return data


class RecordStore:
    """The records of one state directory. ``open()`` takes the directory's flock for the process life.

    Every mutation goes through ``_mutate``: one ``threading.Lock`` inside the process-wide flock,
    read the current file (refuse if corrupt), then write or unlink atomically. Reads need neither."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._lock_fd: int | None = None
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
            except OSError as exc:
                os.close(fd)
                raise StateWriteFailed(f"preparing state directory {self.directory} failed: {exc}") from exc
            self._lock_fd = fd

    def close(self) -> None:
        """Release the flock (the lock file stays: unlinking it would let two processes lock two inodes).

        A closed store refuses every mutation until ``open()`` is called again: once the flock is
        released, a successor sidecar may own the directory."""
        with self._lock:
            self._closed = True
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def path(self, name: str) -> Path:
        """The file of record ``name``; ValueError for anything ``record_name`` could not have produced."""
        if not NAME_RE.match(name):
            raise ValueError(f"not an ownership record name: {name!r}")
        return self.directory / f"{name}{SUFFIX}"

    def load(self, name: str) -> OwnershipRecord:
        """Read -> decode envelope -> verify checksum -> decode record. RecordNotFound / CorruptRecord."""
        return _read(name, self.path(name))

    def load_all(self) -> tuple[dict[str, OwnershipRecord], dict[str, CorruptRecord]]:
        """Every record file: (valid by name, corrupt by name). Temp files and the lock are ignored.

        Any other ``*.json`` that is not a valid record (bad name, or a name that differs from the
        record inside) is reported as corrupt under its file stem. A missing directory holds nothing."""
        try:
            return _scan(self.directory)
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

    def load_generation_ceiling(self) -> int | None:
        """The stored generation ceiling; None when there is no ``generation`` file; CorruptRecord."""
        return _read_generation(self.directory)

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
            current = _read_generation(self.directory)
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

        def exists() -> bool:
            try:
                _read(name, path)
            except RecordNotFound:
                return data is not None
            return True

        self._mutate_file(path, exists, data, "ownership record")

    def _mutate_file(self, path: Path, check: Callable[[], bool], data: bytes | None, what: str) -> None:
        """The one function that changes the directory: under the lock, ``check`` reads the current file
        (CorruptRecord propagates: a corrupt file is the operator's to inspect) and says whether a
        change is due; then ``data`` replaces the file atomically, or the file goes (``data`` None).

        A store that was never opened is opened here, so no mutation ever happens outside the flock; a
        closed one raises StateWriteFailed and writes nothing."""
        if self._lock_fd is None and not self._closed:
            self.open()
        with self._lock:
            if self._lock_fd is None:
                raise StateWriteFailed(
                    f"the record store {self.directory} is closed (the sidecar is stopping);"
                    f" {what} {path.name} was not written"
                )
            if not check():
                return
            try:
                if data is None:
                    path.unlink(missing_ok=True)
                    fsync_dir(self.directory)
                else:
                    atomic_write(path, data, FILE_MODE)
            except OSError as exc:
                action = "deleting" if data is None else "writing"
                raise StateWriteFailed(f"{action} {what} {path} failed: {exc}") from exc


class VerifyReport(msgspec.Struct, frozen=True):
    """What ``verify`` found: valid record names, corrupt ones with the reason, stale ones, and ones
    without a boot ID.

    ``stale`` is a subset of ``valid``: records written in another boot (GI/CI do not survive a reboot,
    so their instances are gone; startup recovery drops them). ``no_boot_id`` is another subset of
    ``valid``, never stale: records with an empty ``boot_id``. The sidecar stamps the boot ID in every
    record it writes, so such a record was made or edited by hand; nothing tells which boot it
    belongs to, so startup recovery neither acts on it nor drops it - it keeps it aside, untouched,
    with the instance at its placement foreign - and the operator fixes or removes it."""

    directory: str
    valid: tuple[str, ...] = ()
    corrupt: dict[str, str] = msgspec.field(default_factory=dict)
    stale: tuple[str, ...] = ()
    no_boot_id: tuple[str, ...] = ()
    # The ``generation`` file's ceiling; None when it is missing or corrupt (then it is in ``corrupt``).
    generation_ceiling: int | None = None


def verify(directory: Path, boot_id: str | None) -> VerifyReport:
    """Offline check of a state directory for ``records verify``: opens nothing for writing, takes no lock.

    ``boot_id`` is the current boot id; None skips the staleness check (records without a boot ID are
    reported either way). Raises OSError (for example FileNotFoundError) when the directory cannot be
    listed, so a mistyped path is not reported as "no records, all fine"."""
    valid, corrupt = _scan(directory)
    ceiling: int | None = None
    try:
        ceiling = _read_generation(directory)
    except CorruptRecord as exc:
        corrupt[GENERATION_FILE] = exc
    # The rule startup recovery applies: an empty boot ID is not another boot, it is no boot at all.
    stale = tuple(
        name for name, rec in valid.items() if boot_id is not None and rec.boot_id and rec.boot_id != boot_id
    )
    return VerifyReport(
        directory=str(directory),
        valid=tuple(valid),
        corrupt={name: exc.why for name, exc in corrupt.items()},
        stale=stale,
        no_boot_id=tuple(name for name, rec in valid.items() if not rec.boot_id),
        generation_ceiling=ceiling,
    )


def corrupt_path(report: VerifyReport, name: str) -> Path:
    """The file a corrupt entry of ``report`` stands for: the ``generation`` file or ``<name>.json``."""
    filename = name if name == GENERATION_FILE else f"{name}{SUFFIX}"
    return Path(report.directory) / filename


def format_report(report: VerifyReport) -> str:
    """A human-readable summary of ``report``, one line per record, ending with the counts."""
    lines = [f"ownership records in {report.directory}:"]
    stale, no_boot_id = set(report.stale), set(report.no_boot_id)
    for name in report.valid:
        if name in no_boot_id:
            lines.append(
                f"  NO BOOT  {name}: no boot id; recovery keeps it aside, untouched, its instance foreign"
            )
        else:
            lines.append(f"  stale    {name}" if name in stale else f"  valid    {name}")
    # A corrupt file is the operator's to remove, so it is named by the path to remove, not its stem.
    lines.extend(
        f"  CORRUPT  {corrupt_path(report, name)}: {why}" for name, why in sorted(report.corrupt.items())
    )
    if report.generation_ceiling is not None:
        lines.append(f"  valid    {GENERATION_FILE}: generation ceiling {report.generation_ceiling}")
    elif GENERATION_FILE not in report.corrupt:
        lines.append(f"  missing  {GENERATION_FILE}: no generation ceiling yet (a first run)")
    summary = f"{len(report.valid)} valid ({len(stale)} stale), {len(report.corrupt)} corrupt"
    if no_boot_id:
        summary += f", {len(no_boot_id)} without a boot id"
    lines.append(summary)
    return "\n".join(lines) + "\n"


__all__ = [
    "GENERATION_FILE",
    "MAX_GENERATION",
    "RECORD_VERSION",
    "CorruptRecord",
    "GenerationCeiling",
    "OwnershipRecord",
    "RecordError",
    "RecordNotFound",
    "RecordStore",
    "StateDirLocked",
    "StateWriteFailed",
    "UnsafeStateDir",
    "VerifyReport",
    "atomic_write",
    "decode_generation",
    "decode_record",
    "encode_generation",
    "encode_record",
    "format_report",
    "record_name",
    "verify",
]
