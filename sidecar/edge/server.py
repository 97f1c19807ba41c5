"""The gRPC server on the sidecar's Unix socket: how the edge serves, starts, stops and answers its health.

The MigSidecar service itself (decode, call the lifecycle, encode, map errors) is ``servicer``.

How it serves, so that the work of one caller cannot take another's turn: grpcio's asyncio server,
its handlers on one event loop in a thread of its own (``SidecarServer``). What answers from memory
runs on the loop itself and never waits for a thread: the health Check (the liveness probe's),
``GetInfo`` and the ``WatchHealth`` streams, which hold no thread while they follow
(``health_feed``). Every other call does blocking work (NVML, fsynced writes, per-GPU locks) and
goes through ``admission``: a fixed pool of worker threads that holds a bounded number of calls and
refuses the next one RESOURCE_EXHAUSTED (reason OVERLOADED) at once, which the Go client retries
with backoff. One pool of threads for everything, as before, let 16 following streams take every
thread, and let a busy node's Allocates queue the probe's Check past its deadline.

The loop shares the interpreter lock with those threads, and the health Check stays on it: timed at
its handler, a Check takes about 50 us idle and under a busy node's load alike, the rest of its
time is grpc.aio's own path, and its p99 under that load stays near that of grpcio's bare asyncio
health server checked in the same turns (``bench/edge_load.py`` prints both). A loop or thread of
its own for the health service, or a shorter interpreter switch interval (tried: 0.5 ms), would win
nothing measurable and cost a second server or more lock handovers.

Also served on the same socket: ``grpc.health.v1.Health`` — service ``""`` is SERVING as soon as the
process listens, service ``hami.migsidecar.v1.MigSidecar`` turns SERVING only once a ``Recover`` has
succeeded; both answer NOT_SERVING while an NVML call or a reconciler round has worked longer than the
stuck threshold (its waits for GPU locks behind healthy calls left out; ``sidecar.lifecycle.liveness``;
evaluated at every Check, which is what the probes call), and SERVING again once it returned — and
server reflection, so ``grpcurl`` works without the .proto file.

The health service is served a second time, alone, by a second server on the same loop with the
same servicer, on a socket of its own where the probes ask: each socket holds a bounded number of
connections, so that a flood of them on the main socket never leaves the probe without a place or a
file descriptor (``descriptors``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TypeVar

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar.edge.descriptors import HEALTH_CONNECTIONS
from sidecar.edge.limits import MAX_REQUEST_BYTES
from sidecar.edge.servicer import MigSidecarServicer
from sidecar.edge.wire import Context, register
from sidecar.lifecycle.liveness import Liveness
from sidecar.lifecycle.logs import event

log = logging.getLogger(__name__)

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MigSidecar"].full_name
HEALTH_REQUEST_BYTES = 1024  # a HealthCheckRequest is a service name; the health listener reads no more

_T = TypeVar("_T")


class _CheckedHealth(health_aio.HealthServicer):
    """grpc's asyncio health servicer, with the statuses brought up to date before each Check answers."""

    def __init__(self, refresh: Callable[[], Awaitable[None]]) -> None:
        super().__init__()
        self._refresh = refresh

    async def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        await self._refresh()
        answer: health_pb2.HealthCheckResponse = await super().Check(request, context)
        return answer


class SidecarServer:
    """The gRPC server on the Unix socket, MigSidecar, health and reflection, and the health listener
    beside it, on an event loop.

    The loop runs on a thread of its own (the main thread waits for signals, ``sidecar.app``); the
    servicer's admission lets GPUs proceed in parallel, and the lifecycle serializes per GPU.
    Socket-file housekeeping (directory, stale file, mode) belongs to the composition root, which
    holds the state directory lock while doing it.
    """

    def __init__(self, servicer: MigSidecarServicer, liveness: Liveness | None = None) -> None:
        self.servicer = servicer
        self.liveness = liveness
        self._recovered = False
        self._stuck: tuple[str, float] | None = None
        self.health = _CheckedHealth(self._refresh_health)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None

    def mark_recovered(self) -> None:
        """Health follows recovery from now on (called from a worker thread, by ``Recover``)."""
        self._recovered = True
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._refresh_health(), self._loop).result()

    async def _refresh_health(self) -> None:
        """Set both health services from recovery and liveness (logged when liveness changes)."""
        stuck = self.liveness.stuck() if self.liveness is not None else None
        was, self._stuck = self._stuck, stuck
        if (was is None) != (stuck is None):
            if stuck is not None:
                part, age = stuck
                event(log, logging.ERROR, "stuck: health NOT_SERVING", part=part, seconds=round(age, 1))
            else:
                event(log, logging.INFO, "no longer stuck: health SERVING")
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        await self.health.set("", not_serving if stuck else serving)
        await self.health.set(SERVICE_NAME, serving if self._recovered and not stuck else not_serving)

    def _on_loop(self, work: Coroutine[object, None, _T]) -> _T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def start(self, socket_path: str, health_socket_path: str, max_connections: int) -> None:
        """Bind ``unix://socket_path``, holding at most ``max_connections`` connections, and the health
        listener on ``unix://health_socket_path``, and start answering. RuntimeError if a bind fails."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="edge", daemon=True)
        self._thread.start()
        try:
            self._on_loop(self._start(socket_path, health_socket_path, max_connections))
        except BaseException:
            self._on_loop(self._discard())
            self._end_loop()
            raise

    async def _start(self, socket_path: str, health_socket_path: str, max_connections: int) -> None:
        loop = asyncio.get_running_loop()
        self.servicer.health_feed.bind(loop)
        self._server = grpc.aio.server(
            options=[
                # Exactly what the largest valid request needs (``limits``); above it the transport
                # answers RESOURCE_EXHAUSTED before any handler runs.
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                # Past it grpc closes a new connection as soon as it has accepted it (``descriptors``).
                ("grpc.max_allowed_incoming_connections", max_connections),
            ],
        )
        register(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self._health_server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", HEALTH_REQUEST_BYTES),
                ("grpc.max_allowed_incoming_connections", HEALTH_CONNECTIONS),
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        await self._refresh_health()
        self._health_server.add_insecure_port(f"unix://{health_socket_path}")
        self._server.add_insecure_port(f"unix://{socket_path}")
        await self._health_server.start()
        await self._server.start()

    async def _discard(self) -> None:
        """Stop what a failed start made (a server may hold a bound socket before it starts)."""
        for server in (self._server, self._health_server):
            if server is not None:
                await server.stop(None)
        self._server = self._health_server = None

    def stop(self, grace_s: float) -> None:
        """Refuse new calls, answer in-flight ones that finish within ``grace_s`` and cancel the rest
        towards their clients; return only once no admitted call runs any more (``Admission.close``)."""
        if self._loop is None:
            return
        self._on_loop(self._stop(grace_s))
        self.servicer.admission.close()
        self._end_loop()

    async def _stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        self.servicer.health_feed.close()  # following WatchHealth streams end now, not at the grace
        servers = [server for server in (self._server, self._health_server) if server is not None]
        await asyncio.gather(*(server.stop(grace_s) for server in servers))

    def _end_loop(self) -> None:
        assert self._loop is not None
        assert self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._loop = None
