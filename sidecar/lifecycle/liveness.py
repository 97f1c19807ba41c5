"""What the liveness probe means: the sidecar is alive while nothing of it has been stuck too long.

Two parts can hang without the process dying: an NVML call (the driver stops answering; a GI create
takes seconds, a hung one never returns) and a reconciler round (its own NVML calls). Each registers
while it runs (``running``); ``stuck`` names the oldest past the threshold, and the health service
answers NOT_SERVING meanwhile, so kubelet restarts the container (crash-safe: records, then recovery).

Only work in flight counts: a round waiting for a GPU lock behind queued, healthy creates is not
stuck. A GPU lock that must block does so inside ``waiting``, whose time is left out of the age of
every call the waiting thread registered; a lock held by a hung NVML call still shows, as that call
is registered and its age grows. A restart there would cancel the healthy queue and fix nothing.

A wait can also never end with no NVML call running at all: two threads each holding the lock the
other waits for (``locks`` refuses the acquires that make such a circle, but a wait that never ends
must be seen whatever its cause). So the waits are kept too, with the lock waited for, and a wait is
stuck when it has lasted past the threshold and nothing along its chain has moved for as long: the
lock has not changed hands, and its holder (or, when the holder itself waits for a lock, that lock's
holder, and so on) has begun or ended no registered call. A queue of healthy creates moves the lock
every few seconds; a holder working through many short NVML calls under one lock makes progress at
each; a circle of waiters, or a holder blocked outside any registered call, makes none.

The threshold (``--stuck-threshold``, 300 s by default) is far above the slowest NVML call a healthy
node makes. ``clock`` is injected so tests move time instead of sleeping.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

PARTS = ("nvml", "reconciler")
_MAX_THREADS = 1024  # progress stamps kept before those older than the threshold are dropped
LOCK_WAIT = "lock-wait"  # the part ``stuck`` names for a wait that never ends


class Waited(Protocol):
    """What a lock waited for tells (``locks.GpuLock``): its holder's thread and when it last moved."""

    @property
    def owner(self) -> int | None: ...

    @property
    def changed(self) -> float: ...


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
        self._progress: dict[int, float] = {}  # thread ident -> when it last began or ended a call
        self._waits: dict[int, tuple[float, Waited]] = {}  # thread ident -> (since, the lock it waits for)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock of the ages, for the locks' ``changed`` stamps."""
        return self._clock

    def running(self, part: str) -> _Running:
        """Register one call of ``part`` ("nvml" or "reconciler") for as long as the block runs.

        A plain context manager, not a generator one: every NVML call of the Allocate path passes
        through it, and a generator-based one costs several times what it guards."""
        return _Running(self, part)

    def waiting(self, lock: Waited | None = None) -> _Waiting:
        """The block waits (for ``lock``) instead of working: its time is not in the age of the calls
        this thread has registered. Nested waits of one thread count once. A wait for a lock is kept
        for ``stuck`` until the block ends."""
        return _Waiting(self, lock)

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
        """(part, seconds) of the oldest call running longer than the threshold, else (``LOCK_WAIT``,
        seconds) of the wait for a lock along whose chain nothing has moved for longer than the
        threshold; None when neither is."""
        part, age = max(self.oldest().items(), key=lambda item: item[1])
        if age > self.threshold_s:
            return (part, age)
        quiet = self.quiet_wait()
        return (LOCK_WAIT, quiet) if quiet > self.threshold_s else None

    def quiet_wait(self) -> float:
        """Seconds the quietest wait for a lock has gone with nothing moving along its chain (module
        docstring): the lesser of how long it has waited and how long since the chain last moved;
        0 when no thread waits for a lock."""
        with self._lock:
            now = self._clock()
            waits = dict(self._waits)
            progress = dict(self._progress)
        quietest = 0.0
        for since, lock in waits.values():
            moved, owner, seen = max(since, lock.changed), lock.owner, set[int]()
            while owner is not None and owner not in seen:
                seen.add(owner)
                moved = max(moved, progress.get(owner, -math.inf))
                next_wait = waits.get(owner)
                if next_wait is None:
                    break
                moved = max(moved, next_wait[0], next_wait[1].changed)
                owner = next_wait[1].owner
            quietest = max(quietest, now - moved)
        return quietest


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
            live._progress[threading.get_ident()] = started

    def __exit__(self, *exc: object) -> None:
        live = self._liveness
        live._tokens_of_thread().remove(self._token)
        with live._lock:
            del live._running[self._token]
            now = live._progress[threading.get_ident()] = live._clock()
            if len(live._progress) > _MAX_THREADS:  # threads come and go: forget the long quiet ones
                for ident in [i for i, t in live._progress.items() if now - t > live.threshold_s]:
                    del live._progress[ident]


class _Waiting:
    """``Liveness.waiting``: pauses the age of the calling thread's registered calls and keeps the
    wait for its lock."""

    __slots__ = ("_kept", "_liveness", "_lock", "_paused")

    def __init__(self, liveness: Liveness, lock: Waited | None) -> None:
        self._liveness = liveness
        self._lock = lock
        self._kept = False
        self._paused: list[_Entry] = []

    def __enter__(self) -> None:
        live = self._liveness
        mine = live._tokens_of_thread()
        if self._lock is None and not mine:
            return
        me = threading.get_ident()
        with live._lock:
            now = live._clock()
            if self._lock is not None and me not in live._waits:
                live._waits[me] = (now, self._lock)
                self._kept = True
            for token in mine:
                entry = live._running.get(token)
                if entry is not None and entry.waiting_since is None:
                    entry.waiting_since = now
                    self._paused.append(entry)

    def __exit__(self, *exc: object) -> None:
        live = self._liveness
        if not self._kept and not self._paused:
            return
        with live._lock:
            if self._kept:
                live._waits.pop(threading.get_ident(), None)
                self._kept = False
            now = live._clock()
            for entry in self._paused:
                if entry.waiting_since is not None:
                    entry.waited += now - entry.waiting_since
                    entry.waiting_since = None
        self._paused.clear()
