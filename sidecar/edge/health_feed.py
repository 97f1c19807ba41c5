"""``WatchHealth``: each owned instance's health as it stands, then every change, to each watcher.

A stream is an async generator on the edge's event loop (``sidecar.edge.server``): while it waits
for a change it holds no thread, so any number of followers leave the calls and the health Check
their turn. The Xid watcher publishes the records a fault changed (``publish``, from its own
thread) onto the loop; every following stream has its own bounded backlog, so a slow client never
holds up the watcher: when its backlog is full the stream ends with RESOURCE_EXHAUSTED and the
client watches again (it gets the current state first, so it misses nothing). A stream without
``follow`` ends after the current state, like a GetState. A client that goes away cancels its
stream's task, which ends it at once. Shutdown ends every stream (``close``) before the server
stops, as a stream would otherwise last out the grace period.

Followers are bounded as calls are (``admission``): at most ``max_followers`` follow at once, and the
next one is refused at once with ``Overloaded`` (RESOURCE_EXHAUSTED, reason OVERLOADED, metadata
``method`` WatchHealth), which the Go client and the DRA plugin's health service retry with backoff.
Each following stream costs the sidecar about 42 KiB of resident memory with a connection of its own
(its connection, its task, its backlog while empty), so the bound is what keeps a local client that
opens streams without end inside the container's memory limit (``docs/operations.md`` gives the
numbers).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar.edge import encode
from sidecar.edge.wire import Context
from sidecar.model.errors import Overloaded
from sidecar.model.ownership import OwnershipRecord

QUEUE_SIZE = 1024  # updates a following stream may lag behind before it is ended


class _Follower:
    """One following stream's backlog; touched on the loop only."""

    def __init__(self) -> None:
        self.backlog: collections.deque[OwnershipRecord] = collections.deque()
        self.wake = asyncio.Event()
        self.lagged = False
        self.closed = False


class HealthFeed:
    def __init__(self, instances: Callable[[], Sequence[OwnershipRecord]], max_followers: int) -> None:
        self._instances = instances
        self.max_followers = max_followers
        self._followers: set[_Follower] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def following(self) -> int:
        """The streams that follow now."""
        return len(self._followers)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the streams are served on (the server's, once it starts)."""
        self._loop = loop

    def publish(self, changed: Sequence[OwnershipRecord]) -> None:
        """Hand the changed records to every following stream (any thread; never blocks)."""
        if self._loop is None:
            return  # not serving yet: nobody follows
        with contextlib.suppress(RuntimeError):  # the loop closed: the sidecar has stopped
            self._loop.call_soon_threadsafe(self._deliver, tuple(changed))

    def _deliver(self, changed: tuple[OwnershipRecord, ...]) -> None:
        for follower in self._followers:
            if len(follower.backlog) + len(changed) > QUEUE_SIZE:
                follower.lagged = True  # that stream ends at its next look (``serve``)
            else:
                follower.backlog.extend(changed)
            follower.wake.set()

    def close(self) -> None:
        """End every stream (shutdown; on the loop)."""
        self._closed = True
        for follower in self._followers:
            follower.closed = True
            follower.wake.set()

    async def serve(self, follow: bool, context: Context) -> AsyncIterator[pb.InstanceHealthUpdate]:
        """The updates of one ``WatchHealth`` call; ``Overloaded`` before any when ``max_followers``
        streams follow already."""
        follower = _Follower()
        if follow:
            if self._closed:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "WatchHealth: the sidecar is shutting down")
            if len(self._followers) >= self.max_followers:
                raise Overloaded(
                    f"WatchHealth: {self.max_followers} streams follow already; nothing was done,"
                    " retry with backoff",
                    {"method": "WatchHealth", "followers": str(self.max_followers)},
                )
            self._followers.add(follower)
        try:
            for record in sorted(self._instances(), key=lambda r: r.name):
                yield encode.encode_health(record, current=True)
            while follow:
                await follower.wake.wait()
                follower.wake.clear()
                if follower.lagged:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "WatchHealth: the stream fell too far behind; watch again for the current state",
                    )
                while follower.backlog:
                    yield encode.encode_health(follower.backlog.popleft(), current=False)
                if follower.closed:
                    return
        finally:
            self._followers.discard(follower)
