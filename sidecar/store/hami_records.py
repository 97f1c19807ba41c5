"""HAMi's ownership record files in the state directory: listed, and removed once taken over.

The bytes are decoded by ``hami_files`` (pure); this module does the I/O, and its one mutation goes
through the record store's lock (``RecordStore.remove_if``), as every change of the directory does.
"""

from __future__ import annotations

import os
from pathlib import Path

from sidecar.model import hami_files
from sidecar.model.errors import StateWriteFailed
from sidecar.store.record_format import RecordNotFound
from sidecar.store.records import RecordStore


def record_files(directory: Path) -> list[tuple[str, bytes]]:
    """(file name, bytes) of every HAMi record file in ``directory``; a missing directory has none.

    A file that cannot be read is listed with no bytes, so that it is kept (undecodable), not skipped.
    StateWriteFailed when the directory cannot be listed."""
    try:
        names = sorted(e.name for e in os.scandir(directory) if hami_files.is_record_filename(e.name))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StateWriteFailed(f"listing state directory {directory} failed: {exc}") from exc
    found: list[tuple[str, bytes]] = []
    for name in names:
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                found.append((name, f.read()))
        except FileNotFoundError:
            continue
        except OSError:
            found.append((name, b""))
    return found


def remove_taken_over(store: RecordStore, filename: str, record_name: str, mig_uuid: str) -> None:
    """Remove HAMi's record ``filename`` of ``mig_uuid`` - only while the sidecar's own record
    ``record_name`` is on disk for that very instance and the file still decodes as HAMi's record of
    it. Otherwise StateWriteFailed and the file stays: HAMi's file never goes before ours exists.

    Both are read again under the store's lock, right before the unlink. A missing file is done."""
    if not hami_files.is_record_filename(filename) or "/" in filename:
        raise ValueError(f"not a HAMi ownership record file name: {filename!r}")
    path = store.directory / filename

    def taken_over() -> bool:
        ours = store.load(record_name)
        if ours.mig_uuid != mig_uuid:
            raise StateWriteFailed(f"record {record_name} holds {ours.mig_uuid}, not {mig_uuid}")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return False
        try:
            theirs = hami_files.decode_record(filename, data)
        except hami_files.HamiRecordError as exc:
            raise StateWriteFailed(f"{path} changed: {exc.why}") from exc
        if theirs.mig_uuid != mig_uuid:
            raise StateWriteFailed(f"{path} now names {theirs.mig_uuid}")
        return True

    try:
        store.remove_if(filename, taken_over, "HAMi ownership record")
    except RecordNotFound as exc:
        raise StateWriteFailed(f"record {record_name} is not on disk; {path} stays") from exc
