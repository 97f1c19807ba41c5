"""Bounded admission: the worker threads that run the edge's blocking calls, and how many calls they may hold.

The edge's handlers run on one event loop (``sidecar.edge.server``); the lifecycle below them is
blocking code (NVML through ctypes, fsynced record and CDI writes, per-GPU locks a call waits on),
so each call that reaches it runs on a thread of this pool, and the loop stays free for the health
Check, ``GetInfo`` and the ``WatchHealth`` streams. The pool holds at most ``admitted`` calls,
running or waiting for a thread; a call past that is refused at once with ``Overloaded``
(RESOURCE_EXHAUSTED, reason OVERLOADED, nothing done) instead of waiting behind the others without
bound, and the Go client retries it with backoff within the call's deadline. The default room,
four calls a thread, lets every caller of a busy node (the plugin's Allocates, its releases, the
scheduler helper) wait its turn behind a few rounds of GPU work, not behind an unbounded queue.

A call whose caller went away, or which the server's shutdown grace cancelled, is dropped if it
had not started on a thread yet, and otherwise runs to its end there: its steps are crash-safe,
but it must not outlive NVML or the state directory lock, so ``close`` waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import TypeVar

from sidecar.lifecycle.logs import event
from sidecar.model.errors import Overloaded

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 16
ROOM_PER_WORKER = 4  # calls held per worker thread, running or waiting: 64 with the default

_T = TypeVar("_T")


class ShuttingDown(Exception):  # noqa: N818 - a state, not an error of the caller's
    """``run`` after ``close``: the server is stopping (the handler answers UNAVAILABLE)."""


class Admission:
    def __init__(self, workers: int = DEFAULT_WORKERS, admitted: int | None = None) -> None:
        self.workers = workers
        self.admitted = admitted if admitted is not None else workers * ROOM_PER_WORKER
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc")
        self._held = 0
        self._changed = threading.Condition(threading.Lock())
        self._closed = False

    @property
    def held(self) -> int:
        """Calls admitted and not finished (running or waiting for a thread)."""
        with self._changed:
            return self._held

    async def run(self, method: str, work: Callable[[], _T]) -> _T:
        """``work()`` on a worker thread, awaited; ``Overloaded`` at once when the pool is full."""
        with self._changed:
            if self._closed:
                raise ShuttingDown(method)
            if self._held >= self.admitted:
                raise Overloaded(
                    f"{method}: the sidecar holds {self.admitted} calls already; nothing was done,"
                    " retry with backoff",
                    {"method": method, "admitted": str(self.admitted)},
                )
            self._held += 1
        try:
            future = self._pool.submit(work)
        except BaseException:
            self._done(None)
            raise
        # Called when the work ends, or when a cancelled caller drops it before it started.
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def _done(self, _future: futures.Future[_T] | None) -> None:
        with self._changed:
            self._held -= 1
            self._changed.notify_all()

    def close(self) -> None:
        """Refuse calls from now on; return once no admitted call runs any more."""
        with self._changed:
            self._closed = True
            running = self._held
        if running:
            event(log, logging.INFO, "waiting for in-flight calls", calls=running)
        with self._changed:
            self._changed.wait_for(lambda: self._held == 0)
        self._pool.shutdown(wait=True)
