"""Durable ownership records: one JSON file per owned instance under the state directory.

STUB — the interface below is fixed (other modules are written against it); the bodies are filled in
by the records/CDI work. See architecture section 7 and style habits 6-8.

On-disk format (a public API; version 1):

    {"version":1,"checksum":"sha256:<hex of the exact record bytes>","record":{...OwnershipRecord...}}

The record is encoded once to bytes R; the envelope is written around R verbatim and the checksum is
over R, so verification never depends on re-encoding. Decoding is strict (unknown fields rejected).
Missing and corrupt are different outcomes: ``RecordNotFound`` vs ``CorruptRecord``; a corrupt file is
never deleted or overwritten automatically.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from sidecar.domain import Identity, Owner, Placement, Reservation, State
from sidecar.errors import StateWriteFailed

RECORD_VERSION = 1


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
    cdi_device: str = ""  # qualified CDI name, "" with CDI disabled or before the file exists
    last_error: str = ""
    boot_id: str = ""  # /proc/sys/kernel/random/boot_id when the instance was created
    since: str = ""  # RFC 3339 UTC time of the last state change

    @property
    def name(self) -> str:
        return record_name(self.gpu_uuid, self.placement)

    @property
    def reservation(self) -> Reservation:
        return Reservation(self.gpu_uuid, self.profile, self.placement)

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
    raise NotImplementedError


class RecordError(Exception):
    """Base of record read errors."""


class RecordNotFound(RecordError):
    pass


class CorruptRecord(RecordError):
    """A record file exists but cannot be trusted: truncated, bad checksum, unknown field, wrong version."""

    def __init__(self, name: str, path: Path, why: str) -> None:
        super().__init__(f"ownership record {path} is corrupt: {why}")
        self.name = name
        self.path = path
        self.why = why


class StateDirLocked(Exception):
    """Another process holds the state directory's lock (a second sidecar)."""


class RecordStore:
    """The records of one state directory. ``open()`` takes the directory's flock for the process life."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def open(self) -> None:
        """Create the directory (0750) if needed and take an exclusive non-blocking flock on ``.lock``.

        Raises ``StateDirLocked`` if another process holds it. Called before the socket is bound."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def path(self, name: str) -> Path:
        raise NotImplementedError

    def load(self, name: str) -> OwnershipRecord:
        """Read -> decode envelope -> verify checksum -> decode record. RecordNotFound / CorruptRecord."""
        raise NotImplementedError

    def load_all(self) -> tuple[dict[str, OwnershipRecord], dict[str, CorruptRecord]]:
        """Every record file: (valid by name, corrupt by name). Temp files and the lock are ignored."""
        raise NotImplementedError

    def put(self, record: OwnershipRecord) -> None:
        """Atomically write (temp in same dir, fsync, rename, fsync dir; mode 0600).

        Refuses (CorruptRecord) to overwrite a file that exists and is corrupt. OSError -> StateWriteFailed."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Remove a record; a missing one is a no-op; a corrupt one is refused (CorruptRecord).

        OSError -> StateWriteFailed."""
        raise NotImplementedError


__all__ = [
    "RECORD_VERSION",
    "CorruptRecord",
    "OwnershipRecord",
    "RecordError",
    "RecordNotFound",
    "RecordStore",
    "StateDirLocked",
    "StateWriteFailed",
    "record_name",
]
