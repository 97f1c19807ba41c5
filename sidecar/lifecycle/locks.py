"""The lifecycle's locks, taken in the one order that never deadlocks.

1. the allocation keys of a request are *claimed* (``claim``): a second request with one of the
   same keys waits until the first is done, then sees ALREADY_ALLOCATED instead of racing it;
2. the GPU locks of every GPU the operation touches, in sorted UUID order (``gpus``; re-entrant, so
   a helper that takes a GPU lock may be called from inside a transaction);
3. the short table and generation locks (``table``, ``generation``), never held across NVML calls.

A thread that must block for a GPU lock does so inside ``waiting`` (``Liveness.waiting`` in the
wiring): a reconciler round queued behind healthy creates is waiting, not stuck. The uncontended
acquire, nearly every one, costs one non-blocking try more than a bare lock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from sidecar.model.domain import AllocationKey


class Locks:
    """Key claims and per-GPU locks (GPUs proceed in parallel)."""

    def __init__(
        self, waiting: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
    ) -> None:
        self.keys = threading.Condition(threading.Lock())
        self._claimed: set[AllocationKey] = set()
        self._gpu_locks: dict[str, GpuLock] = {}
        self._guard = threading.Lock()
        self._waiting = waiting

    def gpu(self, gpu_uuid: str) -> GpuLock:
        """The lock of one GPU (created on first use)."""
        with self._guard:
            lock = self._gpu_locks.get(gpu_uuid)
            if lock is None:
                lock = self._gpu_locks[gpu_uuid] = GpuLock(self._waiting)
            return lock

    def gpus(self, gpu_uuids: Iterable[str]) -> contextlib.AbstractContextManager[object]:
        """Take the locks of several GPUs in sorted UUID order, the one global order (no deadlock).

        Nearly every call names one GPU: its lock is the context manager then, without the stack."""
        ordered = sorted(set(gpu_uuids))
        if len(ordered) == 1:
            return self.gpu(ordered[0])
        return self._in_order(ordered)

    @contextlib.contextmanager
    def _in_order(self, ordered: Sequence[str]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for uuid in ordered:
                stack.enter_context(self.gpu(uuid))
            yield

    @contextlib.contextmanager
    def every_gpu(self, gpu_uuids: Iterable[str] = ()) -> Iterator[None]:
        """Hold the lock of every GPU seen so far and of ``gpu_uuids``: no transaction runs meanwhile."""
        with self._guard:
            known = list(self._gpu_locks)
        with self.gpus([*known, *gpu_uuids]):
            yield

    def claim(self, keys: Sequence[AllocationKey]) -> _Claim:
        """Claim allocation keys for one request; waits while another request holds any of them."""
        return _Claim(self, frozenset(keys))

    def _take(self, wanted: frozenset[AllocationKey]) -> None:
        with self.keys:
            while wanted & self._claimed:
                self.keys.wait()
            self._claimed |= wanted

    def _give_back(self, wanted: frozenset[AllocationKey]) -> None:
        with self.keys:
            self._claimed -= wanted
            self.keys.notify_all()


class GpuLock:
    """A re-entrant GPU lock whose blocking acquire runs inside ``waiting``."""

    __slots__ = ("_lock", "_waiting")

    def __init__(self, waiting: Callable[[], contextlib.AbstractContextManager[object]]) -> None:
        self._lock = threading.RLock()
        self._waiting = waiting

    def __enter__(self) -> None:
        if self._lock.acquire(blocking=False):
            return
        with self._waiting():
            self._lock.acquire()

    def __exit__(self, *_: object) -> None:
        self._lock.release()


class _Claim:
    """``Locks.claim`` as a plain context manager (every Allocate, Release and Undo takes one)."""

    __slots__ = ("_locks", "_wanted")

    def __init__(self, locks: Locks, wanted: frozenset[AllocationKey]) -> None:
        self._locks, self._wanted = locks, wanted

    def __enter__(self) -> None:
        self._locks._take(self._wanted)

    def __exit__(self, *_: object) -> None:
        self._locks._give_back(self._wanted)
