"""``WatchHealth``: each owned instance's health as it stands, then every change, to each watcher.

The Xid watcher publishes the records a fault changed (``publish``); every following stream has its
own bounded queue, so a slow client never holds up the watcher: when its queue is full the stream
ends with RESOURCE_EXHAUSTED and the client watches again (it gets the current state first, so it
misses nothing). A stream without ``follow`` ends after the current state, like a GetState. A stream
does not go through the servicer's in-flight count: shutdown ends every stream (``close``) before
the server drains instead of waiting for it, as a stream would otherwise outlive its grace.
A stream holds one worker thread of the server while it follows.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar.edge import encode
from sidecar.model.ownership import OwnershipRecord

QUEUE_SIZE = 1024  # updates a following stream may lag behind before it is ended
POLL_S = 0.5  # how often a waiting stream looks whether its client has gone
_CLOSED = object()


class HealthFeed:
    def __init__(self, instances: Callable[[], Sequence[OwnershipRecord]]) -> None:
        self._instances = instances
        self._lock = threading.Lock()
        self._queues: set[queue.Queue[object]] = set()
        self._closed = False

    def publish(self, changed: Sequence[OwnershipRecord]) -> None:
        """Hand the changed records to every following stream (never blocks)."""
        with self._lock:
            queues = list(self._queues)
        for q in queues:
            for record in changed:
                try:
                    q.put_nowait(record)
                except queue.Full:
                    break  # that stream ends at its next look (``serve``)

    def close(self) -> None:
        """End every stream (shutdown)."""
        with self._lock:
            self._closed = True
            queues = list(self._queues)
        for q in queues:
            with contextlib.suppress(queue.Full):  # a full one is ended for lagging anyway
                q.put_nowait(_CLOSED)

    def serve(self, follow: bool, context: grpc.ServicerContext) -> Iterator[pb.InstanceHealthUpdate]:
        """The updates of one ``WatchHealth`` call."""
        q: queue.Queue[object] = queue.Queue(QUEUE_SIZE)
        if follow:
            with self._lock:
                if self._closed:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "WatchHealth: the sidecar is shutting down")
                self._queues.add(q)
        try:
            for record in sorted(self._instances(), key=lambda r: r.name):
                yield encode.encode_health(record, current=True)
            while follow and context.is_active():
                if q.full():
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "WatchHealth: the stream fell too far behind; watch again for the current state",
                    )
                try:
                    item = q.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item is _CLOSED:
                    return
                assert isinstance(item, OwnershipRecord)
                yield encode.encode_health(item, current=False)
        finally:
            with self._lock:
                self._queues.discard(q)
