"""The generation: the fence of SyncActive, never going back across restarts.

Every activation and every instance going IDLE takes the next generation. SyncActive idles only
what was activated at or before the generation its pod list was taken at, and reactivates only
what went IDLE at or before it. A restarted sidecar must never hand out a number again, so a
durable *ceiling* (the ``generation`` file, see ``records``) stays above every number handed out:
before one past it is handed out, the ceiling moves a block further (hi/lo).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from sidecar.model.errors import StateWriteFailed
from sidecar.store.record_format import CorruptRecord
from sidecar.store.records import RecordStore

_log = logging.getLogger(__name__)

GENERATION_BLOCK = 1024
"""How far the durable generation ceiling moves at a time: one small file write per this many
activations and idles, and at most this many numbers skipped per restart (they stay readable)."""


class Generations:
    """The current generation and the durable ceiling above it.

    No lock that hands out generations is held across the ceiling's write: once half a block is
    left, the caller that notices moves the ceiling a block further while everyone else keeps taking
    numbers below the old one. Only a caller that finds the ceiling reached waits for a write (one
    at a time), and fails with it: a number is never handed out above the durable ceiling."""

    def __init__(self, records: RecordStore) -> None:
        self.records = records
        self.current = 0
        self._ceiling = 0
        self._lock = threading.Lock()  # ``current`` and ``_ceiling``; never held across a write
        self._raising = threading.Lock()  # one ceiling write at a time

    def next(self) -> int:
        """The generation of a new activation or idle, durably below the ceiling before anyone sees it.

        StateWriteFailed when the ceiling must rise and cannot: the change then fails (the caller
        undoes its work) rather than hand out a number a restart could hand out again."""
        while True:
            with self._lock:
                value = self.current + 1
                if value <= self._ceiling:
                    self.current = value
                    refill = self._ceiling - value < GENERATION_BLOCK // 2
                    break
            self._raise_to(value)  # the ceiling is reached: wait for the write (or fail with it)
        if refill:
            self._refill()
        return value

    def reserve(self, through: int, stored_ceiling: int = 0) -> None:
        """Make every generation up to ``through`` safe to hand out (recovery, before it activates).

        ``stored_ceiling`` is what the ``generation`` file held when recovery read it."""
        with self._lock:
            self._ceiling = max(self._ceiling, stored_ceiling)
        self._raise_to(through)

    def install(self, floors: Iterable[int]) -> None:
        """Move the current generation up to the largest of ``floors`` (never down)."""
        with self._lock:
            self.current = max([self.current, *floors])

    def _raise_to(self, needed: int) -> None:
        """Durably move the ceiling a block past ``needed`` unless it is there already."""
        with self._raising:
            with self._lock:
                if needed <= self._ceiling:
                    return  # another caller's write got there meanwhile
            self._store(needed + GENERATION_BLOCK)

    def _refill(self) -> None:
        """Move the ceiling a block further ahead of need; best effort (``next`` still has numbers)."""
        if not self._raising.acquire(blocking=False):
            return  # a write is under way already
        try:
            with self._lock:
                target = self._ceiling + GENERATION_BLOCK
            self._store(target)
        except StateWriteFailed as exc:
            _log.warning("the generation ceiling could not be raised ahead of need (retried later): %s", exc)
        finally:
            self._raising.release()

    def _store(self, ceiling: int) -> None:
        """Write ``ceiling`` durably (call with ``_raising`` held) and adopt what is stored."""
        try:
            stored = self.records.raise_generation_ceiling(ceiling)
        except CorruptRecord as exc:
            raise StateWriteFailed(str(exc), {"file": str(exc.path)}) from exc
        with self._lock:
            self._ceiling = max(self._ceiling, stored)
