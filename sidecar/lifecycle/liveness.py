"""What the liveness probe means: the sidecar is alive while nothing of it has been stuck too long.

Two parts can hang without the process dying: an NVML call (the driver stops answering; a GI create
takes seconds, a hung one never returns) and a reconciler round (its own NVML calls). Each registers
while it runs (``running``); ``stuck`` names the oldest past the threshold, and the health service
answers NOT_SERVING meanwhile, so kubelet restarts the container (crash-safe: records, then recovery).

Only work in flight counts: a round waiting for a GPU lock behind queued, healthy creates is not
stuck. A GPU lock that must block does so inside ``waiting``, whose time is left out of the age of
every call the waiting thread registered; a lock held by a hung NVML call still shows, as that call
is registered and its age grows. A restart there would cancel the healthy queue and fix nothing.

The threshold (``--stuck-threshold``, 300 s by default) is far above the slowest NVML call a healthy
node makes. ``clock`` is injected so tests move time instead of sleeping.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

PARTS = ("nvml", "reconciler")


class _Entry:
    """One registered call: its part, when it started, and how long its thread waited for locks."""

    __slots__ = ("part", "started", "waited", "waiting_since")

    def __init__(self, part: str, started: float) -> None:
        self.part = part
        self.started = started
        self.waited = 0.0
        self.waiting_since: float | None = None

    def age(self, now: float) -> float:
        waiting = now - self.waiting_since if self.waiting_since is not None else 0.0
        return now - self.started - self.waited - waiting


class Liveness:
    """The NVML calls and reconciler rounds running now, and since when."""

    def __init__(self, threshold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold_s = threshold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._running: dict[int, _Entry] = {}
        self._mine = threading.local()  # the tokens this thread has registered, innermost last

    def running(self, part: str) -> _Running:
        """Register one call of ``part`` ("nvml" or "reconciler") for as long as the block runs.

        A plain context manager, not a generator one: every NVML call of the Allocate path passes
        through it, and a generator-based one costs several times what it guards."""
        return _Running(self, part)

    def waiting(self) -> _Waiting:
        """The block waits (for a lock) instead of working: its time is not in the age of the calls
        this thread has registered. Nested waits of one thread count once."""
        return _Waiting(self)

    def oldest(self) -> dict[str, float]:
        """Seconds the oldest running call of each part has worked, its waits for locks left out
        (0 for a part with none running)."""
        ages = dict.fromkeys(PARTS, 0.0)
        with self._lock:
            now = self._clock()
            for entry in self._running.values():
                ages[entry.part] = max(ages.get(entry.part, 0.0), entry.age(now))
        return ages

    def waiting_count(self) -> int:
        """How many registered calls wait for a lock now."""
        with self._lock:
            return sum(1 for entry in self._running.values() if entry.waiting_since is not None)

    def _tokens_of_thread(self) -> list[int]:
        mine: list[int] | None = getattr(self._mine, "tokens", None)
        if mine is None:
            mine = self._mine.tokens = []
        return mine

    def stuck(self) -> tuple[str, float] | None:
        """(part, seconds) of the oldest call running longer than the threshold; None when none is."""
        part, age = max(self.oldest().items(), key=lambda item: item[1])
        return (part, age) if age > self.threshold_s else None


class _Running:
    """One registered call of a part, from ``__enter__`` to ``__exit__``."""

    __slots__ = ("_liveness", "_part", "_token")

    def __init__(self, liveness: Liveness, part: str) -> None:
        self._liveness = liveness
        self._part = part
        self._token = 0

    def __enter__(self) -> None:
        live = self._liveness
        self._token = token = next(live._tokens)
        live._tokens_of_thread().append(token)
        started = live._clock()
        with live._lock:
            live._running[token] = _Entry(self._part, started)

    def __exit__(self, *exc: object) -> None:
        live = self._liveness
        live._tokens_of_thread().remove(self._token)
        with live._lock:
            del live._running[self._token]


class _Waiting:
    """``Liveness.waiting``: pauses the age of the calling thread's registered calls."""

    __slots__ = ("_liveness", "_paused")

    def __init__(self, liveness: Liveness) -> None:
        self._liveness = liveness
        self._paused: list[_Entry] = []

    def __enter__(self) -> None:
        live = self._liveness
        mine = live._tokens_of_thread()
        if not mine:
            return
        with live._lock:
            now = live._clock()
            for token in mine:
                entry = live._running.get(token)
                if entry is not None and entry.waiting_since is None:
                    entry.waiting_since = now
                    self._paused.append(entry)

    def __exit__(self, *exc: object) -> None:
        if not self._paused:
            return
        live = self._liveness
        with live._lock:
            now = live._clock()
            for entry in self._paused:
                if entry.waiting_since is not None:
                    entry.waited += now - entry.waiting_since
                    entry.waiting_since = None
        self._paused.clear()
