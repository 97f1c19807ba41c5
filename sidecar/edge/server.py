"""The gRPC edge: decode request protos into domain values, call the lifecycle, encode the answers.

This is the only module that speaks gRPC; ``decode`` and ``encode`` hold the pure
proto <-> domain translations it uses. It validates requests before anything else
sees them (a malformed request never reaches the lifecycle, so INVALID_REQUEST wins over the
lifecycle's NOT_RECOVERED gate, which every mutating call meets first thing), and maps every
``SidecarError`` to the contract's error model (``docs/architecture.md``, "Errors"): the status code from
``SidecarError.code`` plus a ``google.rpc.ErrorInfo`` (domain ``migsidecar.hami.io``, the error's
``reason`` and metadata) packed in the status details, so the Go client branches on ``reason``
instead of parsing messages. Anything else that escapes a handler is a bug: it is logged with its
traceback and answered INTERNAL.

Also served on the same socket: ``grpc.health.v1.Health`` — service ``""`` is SERVING as soon as the
process listens, service ``hami.migsidecar.v1.MigSidecar`` turns SERVING only once a ``Recover`` has
succeeded; both answer NOT_SERVING while an NVML call or a reconciler round has worked longer than the
stuck threshold (its waits for GPU locks behind healthy calls left out; ``sidecar.lifecycle.liveness``;
evaluated at every Check, which is what the probes call), and SERVING again once it returned — and
server reflection, so ``grpcurl`` works without the .proto file.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import NoReturn, TypeVar

import grpc
import msgspec
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb

import sidecar
from sidecar.edge import decode, encode
from sidecar.edge.health_feed import HealthFeed
from sidecar.edge.limits import MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES, bounded_metadata, truncate_utf8
from sidecar.edge.metrics import Metrics
from sidecar.edge.wire import Undecodable, register
from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.liveness import Liveness
from sidecar.lifecycle.logs import event
from sidecar.lifecycle.recover import Recoverer
from sidecar.model.domain import AllocationKey
from sidecar.model.errors import InvalidRequest, SidecarError, UnknownGpu, UnknownProfile, nvml_errors

log = logging.getLogger(__name__)

ERROR_DOMAIN = "migsidecar.hami.io"
API_VERSION = "v1"
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MigSidecar"].full_name
DEFAULT_WORKERS = 16
UNKNOWN_SHOWN = 8  # unknown profile names quoted in an UNKNOWN_PROFILE error; the rest are counted

_T = TypeVar("_T")
_Request = TypeVar("_Request", bound=Message)
_Response = TypeVar("_Response")  # a response message, or an iterator of them for a stream


class ServerInfo(msgspec.Struct, frozen=True):
    """The facts ``GetInfo`` reports that do not change while the process lives."""

    backend: str
    boot_id: str
    cdi_enabled: bool
    adopt_existing: bool
    started_at: dt.datetime


# -- errors -------------------------------------------------------------------------------------------


def error_status(err: SidecarError) -> status_pb2.Status:
    """The ``google.rpc.Status`` for a domain error: code, message, ErrorInfo(reason, domain, metadata).

    Message and metadata are bounded so an error stays near 1 KB whatever a request repeated into
    them: gRPC carries both in the trailers, and a client's header limit (8 KB in grpcio) would turn
    a longer one into RESOURCE_EXHAUSTED without a reason."""
    code = grpc.StatusCode[err.code.name]
    info = error_details_pb2.ErrorInfo(
        reason=err.reason, domain=ERROR_DOMAIN, metadata=bounded_metadata(err.metadata)
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    message = truncate_utf8(err.message, MAX_MESSAGE_BYTES)
    return status_pb2.Status(code=code.value[0], message=message, details=[detail])


def internal_status(method: str) -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(reason="INTERNAL", domain=ERROR_DOMAIN, metadata={"method": method})
    detail = any_pb2.Any()
    detail.Pack(info)
    message = f"{method}: internal error in the sidecar (see its log)"
    return status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=message, details=[detail])


# -- the servicer ------------------------------------------------------------------------------------------


class MigSidecarServicer:
    """Implements ``hami.migsidecar.v1.MigSidecar``. Registered by name (gRPC looks methods up)."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        recovery: Recoverer,
        info: ServerInfo,
        metrics: Metrics,
        on_recovered: Callable[[], None] = lambda: None,
    ) -> None:
        self.lifecycle = lifecycle
        self.recovery = recovery
        self.info = info
        self.metrics = metrics
        self.on_recovered = on_recovered
        # Called after an Allocate, Release or SyncActive (the composition root wakes the idle policy).
        self.on_change: Callable[[], None] = lambda: None
        # Called with a GPU whose MIG mode a SetMigMode left enabled (the Xid watcher watches it too).
        self.on_mig_enabled: Callable[[str], None] = lambda _gpu_uuid: None
        self.health_feed = HealthFeed(lifecycle.instances)  # WatchHealth's streams
        # The calls inside ``_handle`` right now, so shutdown can wait for them (see ``drain``).
        self._calls = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._draining = False

    def drain(self) -> None:
        """Refuse calls from now on and return once no call is inside a handler any more.

        gRPC's ``stop(grace)`` stops answering after the grace period but does not stop handler
        threads: a call past it still creates GI/CI and writes records. Shutdown waits here before it
        closes NVML and releases the state directory lock, so no handler outlives either. No bound of
        our own: the pod's termination grace period kills the process, and every step is crash-safe."""
        with self._calls:
            self._draining = True
            running = self._in_flight
        if running:
            event(log, logging.INFO, "waiting for in-flight calls", calls=running)
        with self._calls:
            self._calls.wait_for(lambda: self._in_flight == 0)

    def refusing_undecodable(
        self, method: str, behaviour: Callable[[_Request, grpc.ServicerContext], _Response]
    ) -> Callable[[_Request | Undecodable, grpc.ServicerContext], _Response]:
        """``behaviour``, answering INVALID_REQUEST for a body that did not decode (``Undecodable``)."""

        def call(request: _Request | Undecodable, context: grpc.ServicerContext) -> _Response:
            if not isinstance(request, Undecodable):
                return behaviour(request, context)
            why = request.why

            def refuse() -> NoReturn:
                raise InvalidRequest(
                    f"{method}: the request body does not decode: {decode.quote_clipped(why, 200)}",
                    {"field": ""},
                )

            return self._handle(method, context, refuse)

        return call

    # Every RPC goes through here: one place for error mapping, the INTERNAL fallback and latency.
    def _handle(self, method: str, context: grpc.ServicerContext, call: Callable[[], _T]) -> _T:
        with self._calls:
            refused = self._draining
            if not refused:
                self._in_flight += 1
        if refused:
            # Only a call that reached its thread as the server stopped gets here; gRPC answers the
            # others itself, with this same status, which the client takes as "sidecar restarting".
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: the sidecar is shutting down")
        try:
            return self._answer(method, context, call)
        finally:
            with self._calls:
                self._in_flight -= 1
                if self._draining:  # only ``drain`` waits, and only once it has set ``_draining``
                    self._calls.notify_all()

    def _answer(self, method: str, context: grpc.ServicerContext, call: Callable[[], _T]) -> _T:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            try:
                return call()
            except SidecarError as err:
                code = grpc.StatusCode[err.code.name]
                event(log, logging.INFO, "rpc failed", method=method, reason=err.reason, error=err.message)
                status = error_status(err)
            except Exception:  # noqa: BLE001 - the last line of defence: a bug must answer, not hang
                code = grpc.StatusCode.INTERNAL
                event(log, logging.ERROR, "rpc crashed", method=method, exc_info=True)
                status = internal_status(method)
            context.abort_with_status(rpc_status.to_status(status))
        finally:
            self.metrics.observe_rpc(method, code.name, time.perf_counter() - started)

    def GetInfo(  # noqa: N802 - gRPC method name
        self, request: pb.GetInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetInfoResponse:
        def answer() -> pb.GetInfoResponse:
            message = pb.GetInfoResponse(
                api_version=API_VERSION,
                sidecar_version=sidecar.__version__,
                backend=self.info.backend,
                boot_id=self.info.boot_id,
                recovered=self.lifecycle.recovered,
                cdi_enabled=self.info.cdi_enabled,
                adopt_existing=self.info.adopt_existing,
                generation=self.lifecycle.generation,
                revision=self.lifecycle.revision,
            )
            message.started_at.FromDatetime(self.info.started_at)
            return message

        return self._handle("GetInfo", context, answer)

    def ListGpus(  # noqa: N802
        self, request: pb.ListGpusRequest, context: grpc.ServicerContext
    ) -> pb.ListGpusResponse:
        def answer() -> pb.ListGpusResponse:
            with nvml_errors("listing GPUs failed"):
                gpus = self.lifecycle.gpus()
            return pb.ListGpusResponse(
                gpus=[encode.encode_gpu(gpu, self.lifecycle.gpu_busy(gpu.uuid)) for gpu in gpus]
            )

        return self._handle("ListGpus", context, answer)

    def DiscoverProfiles(  # noqa: N802
        self, request: pb.DiscoverProfilesRequest, context: grpc.ServicerContext
    ) -> pb.DiscoverProfilesResponse:
        def answer() -> pb.DiscoverProfilesResponse:
            gpu_uuid = decode.gpu_uuid(request.gpu_uuid, "request")
            requested = decode.allowed_profiles(request.allowed_profiles)
            profiles = self.lifecycle.profiles(gpu_uuid)
            known = {profile.name for profile in profiles}
            unknown = sorted(set(requested) - known)
            if unknown:
                listed = ", ".join(decode.quote_clipped(name) for name in unknown[:UNKNOWN_SHOWN])
                more = f" and {len(unknown) - UNKNOWN_SHOWN} more" if len(unknown) > UNKNOWN_SHOWN else ""
                raise UnknownProfile(
                    f"GPU {gpu_uuid} has no profile {listed}{more}",
                    {"gpu_uuid": gpu_uuid, "profile": ",".join(unknown[:UNKNOWN_SHOWN])},
                )
            allowed = set(requested) or known
            max_sms = max((profile.multiprocessor_count for profile in profiles), default=0)
            return pb.DiscoverProfilesResponse(
                profiles=[
                    pb.Profile(
                        name=profile.name,
                        gi_profile_id=profile.id,
                        ci_profile_id=profile.ci_profile_id,
                        slice_count=profile.slice_count,
                        memory_mb=profile.memory_mb,
                        # HAMi's own formula (register.go): ceil(SMs*100 / max SMs of the GPU's profiles).
                        core_percent=math.ceil(profile.multiprocessor_count * 100 / max_sms)
                        if max_sms
                        else 0,
                        instance_count=profile.instance_count,
                        placements=[encode.pb_placement(p) for p in profile.placements],
                    )
                    for profile in profiles
                    if profile.name in allowed
                ]
            )

        return self._handle("DiscoverProfiles", context, answer)

    def Allocate(  # noqa: N802
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        def answer() -> pb.AllocateResponse:
            started = time.perf_counter()
            result = None
            bad_input = False
            try:
                decoded = decode.allocate(request)
                result = self.lifecycle.allocate(decoded)
            except (InvalidRequest, UnknownGpu):
                bad_input = True
                raise
            finally:
                self.metrics.observe_allocate(result, time.perf_counter() - started)
                # A refusal too: what it asked for may be what the reserve keeps ready. Not one for
                # bad input, which asked for nothing: a flood of those must not keep the reconciler
                # busy and its GPU locks taken while good calls wait.
                if not bad_input:
                    self.on_change()
            message = encode.encode_allocated(result)
            message.generation = self.lifecycle.generation
            return message

        return self._handle("Allocate", context, answer)

    def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseResponse:
        def answer() -> pb.ReleaseResponse:
            decode.pod_uid(request.pod_uid, "request", "pod_uid")
            released = self.lifecycle.release(request.pod_uid)
            self.on_change()
            return pb.ReleaseResponse(released=[encode.encode_ref(ref) for ref in released])

        return self._handle("Release", context, answer)

    def SyncActive(  # noqa: N802
        self, request: pb.SyncActiveRequest, context: grpc.ServicerContext
    ) -> pb.SyncActiveResponse:
        def answer() -> pb.SyncActiveResponse:
            active = decode.active(request.active)
            idled, reactivated = self.lifecycle.sync_active(int(request.generation), active)
            self.on_change()
            return pb.SyncActiveResponse(
                idled=[encode.encode_ref(ref) for ref in idled],
                reactivated=[encode.encode_ref(ref) for ref in reactivated],
                generation=self.lifecycle.generation,
            )

        return self._handle("SyncActive", context, answer)

    def Recover(  # noqa: N802
        self, request: pb.RecoverRequest, context: grpc.ServicerContext
    ) -> pb.RecoverResponse:
        def answer() -> pb.RecoverResponse:
            active = decode.active(request.active)
            report = self.recovery.recover(active)  # recovery logs its own summary
            self.on_recovered()
            return encode.encode_report(report)

        return self._handle("Recover", context, answer)

    def WatchHealth(  # noqa: N802
        self, request: pb.WatchHealthRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.InstanceHealthUpdate]:
        """Not through ``_handle``: a following stream lives as long as its client, and shutdown
        ends it (``HealthFeed.close``) instead of waiting for it."""
        return self.health_feed.serve(bool(request.follow), context)

    def GetState(  # noqa: N802
        self, request: pb.GetStateRequest, context: grpc.ServicerContext
    ) -> pb.GetStateResponse:
        return self._handle("GetState", context, lambda: encode.encode_state(self.lifecycle.snapshot()))

    def RankPlacements(  # noqa: N802
        self, request: pb.RankPlacementsRequest, context: grpc.ServicerContext
    ) -> pb.RankPlacementsResponse:
        def answer() -> pb.RankPlacementsResponse:
            gpu_uuid = decode.gpu_uuid(request.gpu_uuid, "request")
            profile = decode.profile_name(request.profile, "request", "profile")
            ranked = self.lifecycle.rank_placements(gpu_uuid, profile)
            return pb.RankPlacementsResponse(placements=[encode.encode_ranked(gpu_uuid, r) for r in ranked])

        return self._handle("RankPlacements", context, answer)

    def SetMigMode(  # noqa: N802
        self, request: pb.SetMigModeRequest, context: grpc.ServicerContext
    ) -> pb.SetMigModeResponse:
        def answer() -> pb.SetMigModeResponse:
            gpu_uuid = decode.gpu_uuid(request.gpu_uuid, "request")
            current, pending, needs_reset = self.lifecycle.set_mig_mode(
                gpu_uuid,
                bool(request.enabled),
                reclaim_idle=bool(request.reclaim_idle),
                force=bool(request.force),
            )
            if current:
                self.on_mig_enabled(gpu_uuid)
            return pb.SetMigModeResponse(
                mig_mode=pb.MigMode(current=current, pending=pending), needs_reset=needs_reset
            )

        return self._handle("SetMigMode", context, answer)

    def UndoAllocate(  # noqa: N802
        self, request: pb.UndoAllocateRequest, context: grpc.ServicerContext
    ) -> pb.UndoAllocateResponse:
        def answer() -> pb.UndoAllocateResponse:
            pod_uid = decode.pod_uid(request.pod_uid, "request", "pod_uid")
            destroyed, idled = self.lifecycle.undo_allocate(pod_uid, int(request.container_index))
            return pb.UndoAllocateResponse(
                destroyed=[encode.encode_ref(ref) for ref in destroyed],
                idled=[encode.encode_ref(ref) for ref in idled],
            )

        return self._handle("UndoAllocate", context, answer)

    def UndoDevice(  # noqa: N802
        self, request: pb.UndoDeviceRequest, context: grpc.ServicerContext
    ) -> pb.UndoDeviceResponse:
        def answer() -> pb.UndoDeviceResponse:
            mig_uuid = decode.mig_uuid(request.mig_uuid, "request.mig_uuid")
            owner = AllocationKey(
                decode.pod_uid(request.pod_uid, "request", "pod_uid"),
                int(request.container_index),
                int(request.device_index),
            )
            done = self.lifecycle.undo_device(mig_uuid, owner)
            if done.destroyed is not None or done.idled is not None:
                self.on_change()
            return encode.encode_device_undo(done, self.lifecycle.generation)

        return self._handle("UndoDevice", context, answer)

    def ReclaimIdle(  # noqa: N802
        self, request: pb.ReclaimIdleRequest, context: grpc.ServicerContext
    ) -> pb.ReclaimIdleResponse:
        def answer() -> pb.ReclaimIdleResponse:
            gpu_uuid = decode.gpu_uuid(request.gpu_uuid, "request")
            mig_uuids = decode.mig_uuids(request.mig_uuids, "mig_uuids")
            done = self.lifecycle.reclaim_idle(gpu_uuid, mig_uuids, force=bool(request.force))
            return pb.ReclaimIdleResponse(
                reclaimed=[encode.encode_ref(ref) for ref in done.reclaimed],
                kept=[encode.encode_ref(ref) for ref in done.kept],
            )

        return self._handle("ReclaimIdle", context, answer)


class _CheckedHealth(health.HealthServicer):
    """grpc's health servicer, with the statuses brought up to date before each Check answers."""

    def __init__(self, refresh: Callable[[], None]) -> None:
        super().__init__(experimental_non_blocking=True)
        self._refresh = refresh

    def Check(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self._refresh()
        return super().Check(request, context)


class SidecarServer:
    """The gRPC server on one Unix socket: MigSidecar, health and reflection, on a thread pool.

    The thread pool lets GPUs proceed in parallel; the lifecycle serializes per GPU. Socket-file
    housekeeping (directory, stale file, mode) belongs to the composition root, which holds the state
    directory lock while doing it.
    """

    def __init__(
        self,
        servicer: MigSidecarServicer,
        max_workers: int = DEFAULT_WORKERS,
        liveness: Liveness | None = None,
    ) -> None:
        self.servicer = servicer
        self.liveness = liveness
        self._recovered = False
        self._stuck: tuple[str, float] | None = None
        self._health_lock = threading.Lock()
        self.health = _CheckedHealth(self.refresh_health)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
            # Exactly what the largest valid request needs (``limits``); above it the transport
            # answers RESOURCE_EXHAUSTED before any handler runs.
            options=[("grpc.max_receive_message_length", MAX_REQUEST_BYTES)],
        )
        register(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

    def mark_recovered(self) -> None:
        self._recovered = True
        self.refresh_health()

    def refresh_health(self) -> None:
        """Set both health services from recovery and liveness (logged when liveness changes)."""
        stuck = self.liveness.stuck() if self.liveness is not None else None
        with self._health_lock:
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
            self.health.set("", not_serving if stuck else serving)
            self.health.set(SERVICE_NAME, serving if self._recovered and not stuck else not_serving)

    def start(self, socket_path: str) -> None:
        """Bind ``unix://socket_path`` and start answering. Raises RuntimeError if the bind fails."""
        self._server.add_insecure_port(f"unix://{socket_path}")
        self._server.start()

    def stop(self, grace_s: float) -> None:
        """Refuse new calls, answer in-flight ones that finish within ``grace_s`` and cancel the rest
        towards their clients; return only once every handler has returned (``drain``)."""
        self.health.enter_graceful_shutdown()
        self.servicer.health_feed.close()  # following WatchHealth streams end now, not at the grace
        self._server.stop(grace_s).wait()
        self.servicer.drain()
