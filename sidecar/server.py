"""The gRPC edge: decode request protos into domain values, call the lifecycle, encode the answers.

This is the only module that speaks gRPC (style habit 1). It validates requests before anything else
sees them (a malformed request never reaches the lifecycle, so INVALID_REQUEST wins over the
lifecycle's NOT_RECOVERED gate, which every mutating call meets first thing), and maps every
``SidecarError`` to the contract's error model (architecture section 4): the status code from
``SidecarError.code`` plus a ``google.rpc.ErrorInfo`` (domain ``migsidecar.hami.io``, the error's
``reason`` and metadata) packed in the status details, so the Go client branches on ``reason``
instead of parsing messages. Anything else that escapes a handler is a bug: it is logged with its
traceback and answered INTERNAL.

Also served on the same socket: ``grpc.health.v1.Health`` — service ``""`` is SERVING as soon as the
process listens, service ``hami.migsidecar.v1.MigSidecar`` turns SERVING only once a ``Recover`` has
succeeded — and server reflection, so ``grpcurl -unix`` works without the .proto file.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

import sidecar
from sidecar import domain
from sidecar.domain import (
    GPU_UUID_RE,
    MIG_UUID_RE,
    POD_UID_RE,
    ActiveAllocation,
    AllocateRequest,
    DeviceRequest,
    Identity,
    Owner,
    Placement,
    PodRef,
    Reservation,
)
from sidecar.encode import (
    encode_gpu,
    encode_ranked,
    encode_ref,
    encode_report,
    encode_state,
    error_status,
    internal_status,
    pb_placement,
)
from sidecar.errors import InvalidRequest, SidecarError, UnknownProfile, nvml_errors
from sidecar.lifecycle import Lifecycle
from sidecar.logs import event
from sidecar.metrics import Metrics
from sidecar.recovery.apply import Recovery

log = logging.getLogger(__name__)

API_VERSION = "v1"
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["MigSidecar"].full_name
DEFAULT_WORKERS = 16

_T = TypeVar("_T")


class ServerInfo(msgspec.Struct, frozen=True):
    """The facts ``GetInfo`` reports that do not change while the process lives."""

    backend: str
    boot_id: str
    cdi_enabled: bool
    adopt_existing: bool
    started_at: dt.datetime


# -- decoding (request proto -> domain values), validating at the edge ----------------------------------


def _require(condition: bool, message: str, **metadata: str) -> None:
    if not condition:
        raise InvalidRequest(message, metadata)


def _placement(message: Any, where: str) -> Placement:
    _require(message.HasField("placement"), f"{where}: placement is missing", field=f"{where}.placement")
    placement = Placement(int(message.placement.start), int(message.placement.size))
    _require(placement.size > 0, f"{where}: placement size must be at least 1", field=f"{where}.placement")
    return placement


def _gpu_uuid(value: str, where: str) -> str:
    _require(bool(value), f"{where}: gpu_uuid is missing", field=f"{where}.gpu_uuid")
    _require(
        bool(GPU_UUID_RE.match(value)), f"{where}: {value!r} is not a GPU UUID", field=f"{where}.gpu_uuid"
    )
    return value


def _reservation(message: Any, where: str) -> Reservation:
    gpu_uuid = _gpu_uuid(message.gpu_uuid, where)
    _require(bool(message.profile), f"{where}: profile is missing", field=f"{where}.profile")
    return Reservation(gpu_uuid, message.profile, _placement(message, where))


def _pod(message: Any, has_pod: bool, where: str) -> PodRef:
    _require(has_pod and bool(message.uid), f"{where}: pod uid is missing", field=f"{where}.pod.uid")
    _require(
        bool(POD_UID_RE.match(message.uid)), f"{where}: {message.uid!r} is not a pod UID", field="pod.uid"
    )
    return PodRef(message.uid, message.namespace, message.name)


def decode_allocate(request: Any) -> AllocateRequest:
    pod = _pod(request.pod, request.HasField("pod"), "request")
    _require(len(request.devices) > 0, "request: devices is empty", field="devices")
    devices: list[DeviceRequest] = []
    seen: set[int] = set()
    for position, device in enumerate(request.devices):
        where = f"devices[{position}]"
        _require(device.device_index not in seen, f"{where}: device_index {device.device_index} repeats")
        seen.add(device.device_index)
        devices.append(DeviceRequest(int(device.device_index), _reservation(device, where)))
    return AllocateRequest(pod, request.container_name, int(request.container_index), tuple(devices))


def decode_active(messages: Sequence[Any]) -> list[ActiveAllocation]:
    """ActiveAllocation protos -> domain. An empty ``mig_uuid`` means "no runtime identity known"."""
    active: list[ActiveAllocation] = []
    for position, message in enumerate(messages):
        where = f"active[{position}]"
        pod = _pod(message.pod, message.HasField("pod"), where)
        owner = Owner(pod, message.container_name, int(message.container_index), int(message.device_index))
        identity = None
        if message.mig_uuid:
            _require(
                bool(MIG_UUID_RE.match(message.mig_uuid)),
                f"{where}: {message.mig_uuid!r} is not a MIG UUID",
                field=f"{where}.mig_uuid",
            )
            identity = Identity(
                int(message.gpu_instance_id), int(message.compute_instance_id), message.mig_uuid
            )
        active.append(ActiveAllocation(owner, _reservation(message, where), identity))
    return active


# -- encoding (domain values -> response protos) ---------------------------------------------------------


class MigSidecarServicer(pb_grpc.MigSidecarServicer):  # type: ignore[misc]
    """Implements ``hami.migsidecar.v1.MigSidecar``. Registered by name (gRPC looks methods up)."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        recovery: Recovery,
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
        # The calls inside ``_handle`` right now, so shutdown can wait for them (see ``drain``).
        self._calls = threading.Condition()
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
            self.metrics.rpc_latency.labels(method, code.name).observe(time.perf_counter() - started)

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC method name
        def answer() -> Any:
            message = pb.GetInfoResponse(
                api_version=API_VERSION,
                sidecar_version=sidecar.__version__,
                backend=self.info.backend,
                boot_id=self.info.boot_id,
                recovered=self.lifecycle.recovered,
                cdi_enabled=self.info.cdi_enabled,
                adopt_existing=self.info.adopt_existing,
                generation=self.lifecycle.generation,
            )
            message.started_at.FromDatetime(self.info.started_at)
            return message

        return self._handle("GetInfo", context, answer)

    def ListGpus(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def answer() -> Any:
            with nvml_errors("listing GPUs failed"):
                gpus = self.lifecycle.port.gpus()
            return pb.ListGpusResponse(
                gpus=[encode_gpu(gpu, self.lifecycle.gpu_busy(gpu.uuid)) for gpu in gpus]
            )

        return self._handle("ListGpus", context, answer)

    def DiscoverProfiles(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def answer() -> Any:
            gpu_uuid = _gpu_uuid(request.gpu_uuid, "request")
            profiles = self.lifecycle.profiles(gpu_uuid)
            known = {profile.name for profile in profiles}
            unknown = sorted(set(request.allowed_profiles) - known)
            if unknown:
                raise UnknownProfile(
                    f"GPU {gpu_uuid} has no profile {', '.join(unknown)}",
                    {"gpu_uuid": gpu_uuid, "profile": ",".join(unknown)},
                )
            allowed = set(request.allowed_profiles) or known
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
                        placements=[pb_placement(p) for p in profile.placements],
                    )
                    for profile in profiles
                    if profile.name in allowed
                ]
            )

        return self._handle("DiscoverProfiles", context, answer)

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def answer() -> Any:
            decoded = decode_allocate(request)
            result = self.lifecycle.allocate(decoded)
            reused = sum(device.outcome is domain.Outcome.REUSED for device in result.devices)
            if reused:
                self.metrics.reuse_hits.inc(reused)
            if result.reclaimed:
                self.metrics.reclaims.inc(len(result.reclaimed))
            self.on_change()
            return pb.AllocateResponse(
                devices=[
                    pb.AllocatedDevice(
                        device_index=device.device_index,
                        gpu_uuid=device.reservation.gpu_uuid,
                        profile=device.reservation.profile,
                        placement=pb_placement(device.reservation.placement),
                        mig_uuid=device.identity.mig_uuid,
                        gpu_instance_id=device.identity.gpu_instance_id,
                        compute_instance_id=device.identity.compute_instance_id,
                        cdi_device=device.cdi_device,
                        outcome=device.outcome.value,
                    )
                    for device in result.devices
                ],
                reclaimed=[encode_ref(ref) for ref in result.reclaimed],
            )

        return self._handle("Allocate", context, answer)

    def Release(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def answer() -> Any:
            _require(bool(request.pod_uid), "request: pod_uid is missing", field="pod_uid")
            _require(bool(POD_UID_RE.match(request.pod_uid)), f"{request.pod_uid!r} is not a pod UID")
            released = self.lifecycle.release(request.pod_uid)
            self.on_change()
            return pb.ReleaseResponse(released=[encode_ref(ref) for ref in released])

        return self._handle("Release", context, answer)

    def SyncActive(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def answer() -> Any:
            active = decode_active(request.active)
            idled, reactivated = self.lifecycle.sync_active(int(request.generation), active)
            self.on_change()
            return pb.SyncActiveResponse(
                idled=[encode_ref(ref) for ref in idled], reactivated=[encode_ref(ref) for ref in reactivated]
            )

        return self._handle("SyncActive", context, answer)

    def Recover(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def answer() -> Any:
            active = decode_active(request.active)
            report = self.recovery.recover(active)  # recovery logs its own summary
            self.on_recovered()
            return encode_report(report)

        return self._handle("Recover", context, answer)

    def GetState(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._handle("GetState", context, lambda: encode_state(self.lifecycle.snapshot()))

    def RankPlacements(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def answer() -> Any:
            gpu_uuid = _gpu_uuid(request.gpu_uuid, "request")
            _require(bool(request.profile), "request: profile is missing", field="profile")
            ranked = self.lifecycle.rank_placements(gpu_uuid, request.profile)
            return pb.RankPlacementsResponse(placements=[encode_ranked(gpu_uuid, r) for r in ranked])

        return self._handle("RankPlacements", context, answer)

    def SetMigMode(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        def answer() -> Any:
            gpu_uuid = _gpu_uuid(request.gpu_uuid, "request")
            current, pending, needs_reset = self.lifecycle.set_mig_mode(gpu_uuid, bool(request.enabled))
            return pb.SetMigModeResponse(
                mig_mode=pb.MigMode(current=current, pending=pending), needs_reset=needs_reset
            )

        return self._handle("SetMigMode", context, answer)


class SidecarServer:
    """The gRPC server on one Unix socket: MigSidecar, health and reflection, on a thread pool.

    The thread pool lets GPUs proceed in parallel; the lifecycle serializes per GPU. Socket-file
    housekeeping (directory, stale file, mode) belongs to the composition root, which holds the state
    directory lock while doing it.
    """

    def __init__(self, servicer: MigSidecarServicer, max_workers: int = DEFAULT_WORKERS) -> None:
        self.servicer = servicer
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        )
        pb_grpc.add_MigSidecarServicer_to_server(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

    def mark_recovered(self) -> None:
        self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    def start(self, socket_path: str) -> None:
        """Bind ``unix://socket_path`` and start answering. Raises RuntimeError if the bind fails."""
        self._server.add_insecure_port(f"unix://{socket_path}")
        self._server.start()

    def stop(self, grace_s: float) -> None:
        """Refuse new calls, answer in-flight ones that finish within ``grace_s`` and cancel the rest
        towards their clients; return only once every handler has returned (``drain``)."""
        self.health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
        self.servicer.drain()
