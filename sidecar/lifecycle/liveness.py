"""What the liveness probe means: the sidecar is alive while nothing of it has been stuck too long.

Two parts can hang without the process dying: an NVML call (the driver stops answering; on real
hardware a GI create takes seconds, a hung one never returns) and a reconciler round (it waits on a GPU
lock an NVML call holds, or on the call itself). Each registers while it runs (``running``); ``stuck``
names the oldest one past the threshold. The health service answers NOT_SERVING while ``stuck`` is
not None, so kubelet restarts the container, the remedy for a hung driver call: a restart is
crash-safe (records, then recovery).

The threshold (``--stuck-threshold``, 300 s by default) is far above the slowest NVML call a healthy
node makes; a round of the reconciler that trims many instances makes several, which the default
still covers. ``clock`` is injected so tests move time instead of sleeping.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

PARTS = ("nvml", "reconciler")


class Liveness:
    """The NVML calls and reconciler rounds running now, and since when."""

    def __init__(self, threshold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold_s = threshold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._running: dict[int, tuple[str, float]] = {}

    def running(self, part: str) -> _Running:
        """Register one call of ``part`` ("nvml" or "reconciler") for as long as the block runs.

        A plain context manager, not a generator one: every NVML call of the Allocate path passes
        through it, and a generator-based one costs several times what it guards."""
        return _Running(self, part)

    def oldest(self) -> dict[str, float]:
        """Seconds the oldest running call of each part has run (0 for a part with none running)."""
        now = self._clock()
        ages = dict.fromkeys(PARTS, 0.0)
        with self._lock:
            running = list(self._running.values())
        for part, started in running:
            ages[part] = max(ages.get(part, 0.0), now - started)
        return ages

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
        self._token = next(live._tokens)
        started = live._clock()
        with live._lock:
            live._running[self._token] = (self._part, started)

    def __exit__(self, *exc: object) -> None:
        live = self._liveness
        with live._lock:
            del live._running[self._token]
