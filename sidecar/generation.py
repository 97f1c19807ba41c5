"""The generation: the fence of SyncActive, never going back across restarts.

Every activation and every instance going IDLE takes the next generation. SyncActive idles only
what was activated at or before the generation its pod list was taken at, and reactivates only
what went IDLE at or before it. A restarted sidecar must never hand out a number again, so a
durable *ceiling* (the ``generation`` file, see ``records``) stays above every number handed out:
before one past it is handed out, the ceiling moves a block further (hi/lo).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from sidecar.errors import StateWriteFailed
from sidecar.records import CorruptRecord, RecordStore

GENERATION_BLOCK = 1024
"""How far the durable generation ceiling moves at a time: one small file write per this many
activations and idles, and at most this many numbers skipped per restart (they stay readable)."""


class Generations:
    """The current generation and the durable ceiling above it."""

    def __init__(self, records: RecordStore) -> None:
        self.records = records
        self.current = 0
        self._ceiling = 0
        # Serializes raising the ceiling (held across that one small write, nothing else).
        self._lock = threading.Lock()

    def next(self) -> int:
        """The generation of a new activation or idle, durably below the ceiling before anyone sees it.

        StateWriteFailed when the ceiling must rise and cannot: the change then fails (the caller
        undoes its work) rather than hand out a number a restart could hand out again."""
        with self._lock:
            value = self.current + 1
            if value > self._ceiling:
                self._raise_ceiling(value)
            self.current = value
            return value

    def reserve(self, through: int, stored_ceiling: int = 0) -> None:
        """Make every generation up to ``through`` safe to hand out (recovery, before it activates).

        ``stored_ceiling`` is what the ``generation`` file held when recovery read it."""
        with self._lock:
            self._ceiling = max(self._ceiling, stored_ceiling)
            if through > self._ceiling:
                self._raise_ceiling(through)

    def install(self, floors: Iterable[int]) -> None:
        """Move the current generation up to the largest of ``floors`` (never down)."""
        with self._lock:
            self.current = max([self.current, *floors])

    def _raise_ceiling(self, needed: int) -> None:
        """Durably move the ceiling a block past ``needed``. Call with ``_lock`` held."""
        try:
            stored = self.records.raise_generation_ceiling(needed + GENERATION_BLOCK)
        except CorruptRecord as exc:
            raise StateWriteFailed(str(exc), {"file": str(exc.path)}) from exc
        self._ceiling = stored
