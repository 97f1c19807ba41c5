"""The lifecycle's locks, taken in the one order that never deadlocks.

1. the allocation keys of a request are *claimed* (``claim``): a second request with one of the
   same keys waits until the first is done, then sees ALREADY_ALLOCATED instead of racing it;
2. the GPU locks of every GPU the operation touches, in sorted UUID order (``gpus``; re-entrant, so
   a helper that takes a GPU lock may be called from inside a transaction);
3. the short table and generation locks (``table``, ``generation``), never held across NVML calls.

The order is checked, not only documented: every acquire looks at the GPU locks its thread already
holds, and taking a key claim while holding a GPU lock, or a GPU lock whose UUID sorts before one the
thread holds (other than itself, re-entrantly), raises ``LockOrderError`` before it blocks. Two
threads that take the same two locks in opposite orders wait for each other forever, with the probe
still answering; the check turns that into a failed call or round the logs name, and makes every
test that takes locks a test of the order. It costs a thread-local lookup per acquire.

A thread that must block for a GPU lock does so inside ``waiting(lock)`` (``Liveness.waiting`` in
the wiring): a reconciler round queued behind healthy creates is waiting, not stuck, while a wait
whose lock has changed hands no time and whose holder has made no progress for the stuck threshold
is (``Liveness.stuck``). Each lock therefore keeps its holder's thread and the ``clock`` time it last
changed hands. The uncontended acquire, nearly every one, costs one non-blocking try more than a
bare lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from sidecar.model.domain import AllocationKey


class LockOrderError(RuntimeError):
    """A lock taken out of the one order: a deadlock waiting for a second thread."""


Waiting = Callable[["GpuLock"], contextlib.AbstractContextManager[object]]


def _no_wait(_lock: GpuLock) -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext()


class Locks:
    """Key claims and per-GPU locks (GPUs proceed in parallel)."""

    def __init__(self, waiting: Waiting = _no_wait, clock: Callable[[], float] = time.monotonic) -> None:
        self.keys = threading.Condition(threading.Lock())
        self._claimed: set[AllocationKey] = set()
        self._gpu_locks: dict[str, GpuLock] = {}
        self._guard = threading.Lock()
        self._waiting = waiting
        self._clock = clock
        self._held = threading.local()  # .gpus: the UUIDs of the GPU locks this thread holds

    def held(self) -> list[str]:
        """The GPU locks the calling thread holds, in the order taken (re-entries repeated)."""
        gpus: list[str] | None = getattr(self._held, "gpus", None)
        if gpus is None:
            gpus = self._held.gpus = []
        return gpus

    def gpu(self, gpu_uuid: str) -> GpuLock:
        """The lock of one GPU (created on first use)."""
        with self._guard:
            lock = self._gpu_locks.get(gpu_uuid)
            if lock is None:
                lock = self._gpu_locks[gpu_uuid] = GpuLock(gpu_uuid, self)
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
        if held := self.held():
            raise LockOrderError(f"allocation keys claimed while holding the GPU lock of {held[-1]}")
        with self.keys:
            while wanted & self._claimed:
                self.keys.wait()
            self._claimed |= wanted

    def _give_back(self, wanted: frozenset[AllocationKey]) -> None:
        with self.keys:
            self._claimed -= wanted
            self.keys.notify_all()


class GpuLock:
    """A re-entrant GPU lock that checks the order, blocks inside ``waiting`` and knows its holder.

    ``owner`` (the holding thread's ident) and ``changed`` (when it last changed hands) are read
    without a lock by ``Liveness``: a stale read only delays a stuck verdict by one probe."""

    __slots__ = ("_lock", "_locks", "changed", "owner", "uuid")

    def __init__(self, uuid: str, locks: Locks) -> None:
        self.uuid = uuid
        self._lock = threading.RLock()
        self._locks = locks
        self.owner: int | None = None
        self.changed = locks._clock()

    def __enter__(self) -> None:
        held = self._locks.held()
        first = self.uuid not in held  # not a re-entry: this thread takes the lock itself
        if first and held and max(held) > self.uuid:
            raise LockOrderError(
                f"GPU lock of {self.uuid} taken while holding that of {max(held)}, which sorts after it"
            )
        if not self._lock.acquire(blocking=False):
            with self._locks._waiting(self):
                self._lock.acquire()
        if first:
            self.owner = threading.get_ident()
            self.changed = self._locks._clock()
        held.append(self.uuid)

    def __exit__(self, *_: object) -> None:
        held = self._locks.held()
        held.pop()
        if self.uuid not in held:  # the thread's outermost hold ends: the lock changes hands
            self.owner = None
            self.changed = self._locks._clock()
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
