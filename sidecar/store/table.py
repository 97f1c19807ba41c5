"""The in-memory table of owned instances (record name -> record), written disk first.

The table mirrors the record files: every change goes through the ``RecordStore`` *before* the
table changes, so a crash never leaves the table ahead of the disk. One deliberate exception
(``fail``): when an instance must go to ERROR and the record write fails too, the table still says
ERROR. Failing closed matters more than the mirror: the instance keeps blocking its placement and
the reconciler rewrites the record on its next attempt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from sidecar.model.domain import AllocationKey, State
from sidecar.model.errors import StateWriteFailed, UnverifiableState
from sidecar.model.ownership import OwnershipRecord, hardware_fields
from sidecar.model.states import now_rfc3339, transition
from sidecar.store.record_format import CorruptRecord
from sidecar.store.records import RecordStore

_log = logging.getLogger(__name__)


def corrupt_in_the_way(name: str, exc: CorruptRecord) -> UnverifiableState:
    """A record file that became corrupt under a live record: the operator's to inspect, never
    overwritten or deleted. UNVERIFIABLE_STATE (FAILED_PRECONDITION), not STATE_WRITE_FAILED
    (UNAVAILABLE): no retry clears it, so the client must not wait for one."""
    return UnverifiableState(
        f"ownership record {exc.path} is corrupt ({exc.why}); it is left for the operator to inspect"
        " and nothing was written over it",
        {"record": name, "file": str(exc.path)},
    )


class RecordTable:
    """Owned instances by record name, plus the MIG UUIDs live pods hold (``referenced``)."""

    def __init__(self, records: RecordStore) -> None:
        self.records = records
        self._rows: dict[str, OwnershipRecord] = {}
        self._lock = threading.Lock()
        # Moves with every change of the table (GetInfo's revision): what a client polls to learn of
        # changes that hand out no generation (trims, reclaims, destroys, faults).
        self.revision = 0
        # MIG UUIDs held by live pods: the last SyncActive's list (before the first: the last
        # Recover's). They guard ERROR instances from the reconciler.
        self.referenced: frozenset[str] = frozenset()
        # Record files on disk that are not in the table (recovery left them aside, or a destroy or
        # undo left them behind), valid and corrupt by name. Kept here so that Allocate never scans
        # the record directory: recovery fills it from its one scan, and every path that leaves a
        # file behind or drops one updates it.
        self.aside: dict[str, OwnershipRecord] = {}
        self.corrupt: dict[str, CorruptRecord] = {}

    def instances(self) -> list[OwnershipRecord]:
        """A copy of the table."""
        with self._lock:
            return list(self._rows.values())

    def on_gpu(self, gpu_uuid: str) -> list[OwnershipRecord]:
        return [r for r in self.instances() if r.gpu_uuid == gpu_uuid]

    def get(self, name: str) -> OwnershipRecord | None:
        with self._lock:
            return self._rows.get(name)

    def held_by(self, key: AllocationKey) -> OwnershipRecord | None:
        """The instance ``key`` holds (ACTIVE, or CREATING for it), if any."""
        for r in self.instances():
            if r.state in (State.ACTIVE, State.CREATING) and r.owner is not None and r.owner.key == key:
                return r
        return None

    def put(self, record: OwnershipRecord) -> None:
        """Disk first, then the table. A corrupt file in the way is never overwritten."""
        try:
            self.records.put(record)
        except CorruptRecord as exc:
            self._found_corrupt(exc)
            raise corrupt_in_the_way(record.name, exc) from exc
        with self._lock:
            self._rows[record.name] = record
            self.aside.pop(record.name, None)
            self.revision += 1

    def delete(self, name: str) -> None:
        """Disk first, then the table; see ``teardown.delete_after_destroy`` for when this is due."""
        try:
            self.records.delete(name)
        except CorruptRecord as exc:
            self._found_corrupt(exc)
            raise corrupt_in_the_way(name, exc) from exc
        with self._lock:
            self._rows.pop(name, None)
            self.aside.pop(name, None)
            self.revision += 1

    def forget(self, name: str) -> None:
        """Drop an entry from memory only (the instance is foreign now, or its record is left behind):
        its file stays on disk, so it joins ``aside``."""
        with self._lock:
            row = self._rows.pop(name, None)
            if row is not None:
                self.aside[name] = row
                self.revision += 1

    def left_aside(self) -> tuple[dict[str, OwnershipRecord], dict[str, CorruptRecord]]:
        """Copies of the record files on disk outside the table: (valid, corrupt) by name."""
        with self._lock:
            return dict(self.aside), dict(self.corrupt)

    def _found_corrupt(self, exc: CorruptRecord) -> None:
        with self._lock:
            self.corrupt[exc.name] = exc

    def fail(self, record: OwnershipRecord, message: str) -> None:
        """Put an instance in ERROR: kept, never reused, blocking its placement, retried later."""
        failed = transition(record, State.ERROR, since=now_rfc3339(), last_error=message)
        # The hardware-change line of lifecycle.logs (its JSON formatter reads this attribute).
        fields = {"action": "ERROR", **hardware_fields(failed), "error": message}
        _log.error("MIG instance ERROR", extra={"sidecar_fields": fields})
        try:
            self.records.put(failed)
        except (StateWriteFailed, CorruptRecord) as exc:
            _log.error("cannot record ERROR for %s: %s (kept in memory)", record.name, exc)
        with self._lock:
            self._rows[record.name] = failed
            self.revision += 1

    def replace(self, records: Sequence[OwnershipRecord], referenced: Iterable[str]) -> None:
        """Install recovered records (already on disk) and the MIG UUIDs their pods hold, and learn the
        record files left outside the table from one scan of the directory (StateWriteFailed)."""
        valid, corrupt = self.records.load_all()
        with self._lock:
            self._rows = {r.name: r for r in records}
            self.referenced = frozenset(referenced)
            self.aside = {n: r for n, r in valid.items() if n not in self._rows}
            self.corrupt = corrupt
            self.revision += 1
