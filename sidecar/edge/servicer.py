"""The MigSidecar service: decode each request into domain values, call the lifecycle, encode the answer.

This and ``server`` are the only modules that speak gRPC; ``decode`` and ``encode`` hold the pure
proto <-> domain translations used here. A request is validated before anything else sees it (a
malformed request never reaches the lifecycle, so INVALID_REQUEST wins over the lifecycle's
NOT_RECOVERED gate, which every mutating call meets first thing), and every ``SidecarError`` is
mapped to the contract's error model (``docs/architecture.md``, "Errors"): the status code from
``SidecarError.code`` plus a ``google.rpc.ErrorInfo`` (domain ``migsidecar.hami.io``, the error's
``reason`` and metadata) packed in the status details, so the Go client branches on ``reason``
instead of parsing messages. Anything else that escapes a handler is a bug: it is logged with its
traceback and answered INTERNAL.

What answers from memory (``GetInfo``, ``WatchHealth``) runs on the server's event loop; every other
call goes through ``admission`` (``sidecar.edge.server`` says why).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import NoReturn, TypeVar

import grpc
import msgspec
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb

import sidecar
from sidecar.edge import decode, encode
from sidecar.edge.admission import DEFAULT_WORKERS, Admission, ShuttingDown
from sidecar.edge.health_feed import HealthFeed
from sidecar.edge.limits import MAX_MESSAGE_BYTES, bounded_metadata, truncate_utf8
from sidecar.edge.metrics import Metrics
from sidecar.edge.wire import Context
from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.logs import event
from sidecar.lifecycle.recover import Recoverer
from sidecar.model.domain import AllocationKey
from sidecar.model.errors import (
    InvalidRequest,
    Overloaded,
    SidecarError,
    UnknownGpu,
    UnknownProfile,
    nvml_errors,
)
from sidecar.model.names import quote_clipped

log = logging.getLogger(__name__)

ERROR_DOMAIN = "migsidecar.hami.io"
API_VERSION = "v1"
UNKNOWN_SHOWN = 8  # unknown profile names quoted in an UNKNOWN_PROFILE error; the rest are counted

_T = TypeVar("_T")


class ServerInfo(msgspec.Struct, frozen=True):
    """The facts ``GetInfo`` reports that do not change while the process lives."""

    backend: str
    boot_id: str
    cdi_enabled: bool
    adopt_existing: bool
    started_at: dt.datetime
    # The driver's CDI device(s), named in every Allocate answer that hands out a device.
    driver_cdi_devices: tuple[str, ...] = ()


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
        *,
        max_followers: int,
        workers: int = DEFAULT_WORKERS,
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
        self.health_feed = HealthFeed(lifecycle.instances, max_followers)  # WatchHealth's streams
        self.admission = Admission(workers)  # the threads the blocking calls run on, and their bound

    async def refuse_undecodable(self, method: str, why: str, context: Context) -> NoReturn:
        """Answer INVALID_REQUEST for a body that did not decode (``wire.Undecodable``)."""

        def refuse() -> NoReturn:
            raise InvalidRequest(
                f"{method}: the request body does not decode: {quote_clipped(why, 200)}",
                {"field": ""},
            )

        await self._handle(method, context, refuse, blocking=False)
        raise AssertionError("unreachable: _handle aborts the call")  # pragma: no cover

    # Every RPC goes through here: one place for admission, error mapping, the INTERNAL fallback
    # and latency. ``blocking=False`` runs ``call`` on the loop: only for what answers from memory.
    async def _handle(
        self, method: str, context: Context, call: Callable[[], _T], *, blocking: bool = True
    ) -> _T:
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            try:
                return await self.admission.run(method, call) if blocking else call()
            except ShuttingDown:
                # Only a call that reached its handler as the server stopped gets here; gRPC answers
                # the others itself, with this same status, which the client takes as "sidecar restarting".
                code = grpc.StatusCode.UNAVAILABLE
                await context.abort(code, f"{method}: the sidecar is shutting down")
            except SidecarError as err:
                code = grpc.StatusCode[err.code.name]
                event(log, logging.INFO, "rpc failed", method=method, reason=err.reason, error=err.message)
                status = error_status(err)
            except Exception:  # noqa: BLE001 - the last line of defence: a bug must answer, not hang
                code = grpc.StatusCode.INTERNAL
                event(log, logging.ERROR, "rpc crashed", method=method, exc_info=True)
                status = internal_status(method)
            await context.abort_with_status(rpc_status.to_status(status))
        finally:
            self.metrics.observe_rpc(method, code.name, time.perf_counter() - started)

    async def GetInfo(  # noqa: N802 - gRPC method name
        self, request: pb.GetInfoRequest, context: Context
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

        return await self._handle("GetInfo", context, answer, blocking=False)

    async def ListGpus(  # noqa: N802
        self, request: pb.ListGpusRequest, context: Context
    ) -> pb.ListGpusResponse:
        def answer() -> pb.ListGpusResponse:
            with nvml_errors("listing GPUs failed"):
                gpus = self.lifecycle.gpus()
            return pb.ListGpusResponse(
                gpus=[encode.encode_gpu(gpu, self.lifecycle.gpu_busy(gpu.uuid)) for gpu in gpus]
            )

        return await self._handle("ListGpus", context, answer)

    async def DiscoverProfiles(  # noqa: N802
        self, request: pb.DiscoverProfilesRequest, context: Context
    ) -> pb.DiscoverProfilesResponse:
        def answer() -> pb.DiscoverProfilesResponse:
            gpu_uuid = decode.gpu_uuid(request.gpu_uuid, "request")
            requested = decode.allowed_profiles(request.allowed_profiles)
            profiles = self.lifecycle.profiles(gpu_uuid)
            known = {profile.name for profile in profiles}
            unknown = sorted(set(requested) - known)
            if unknown:
                listed = ", ".join(quote_clipped(name) for name in unknown[:UNKNOWN_SHOWN])
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

        return await self._handle("DiscoverProfiles", context, answer)

    async def Allocate(  # noqa: N802
        self, request: pb.AllocateRequest, context: Context
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
            if result.devices:
                message.driver_cdi_devices.extend(self.info.driver_cdi_devices)
            return message

        return await self._handle("Allocate", context, answer)

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: Context
    ) -> pb.ReleaseResponse:
        def answer() -> pb.ReleaseResponse:
            uid, kind = decode.release(request)
            released = self.lifecycle.release(uid, kind)
            self.on_change()
            return pb.ReleaseResponse(released=[encode.encode_ref(ref) for ref in released])

        return await self._handle("Release", context, answer)

    async def SyncActive(  # noqa: N802
        self, request: pb.SyncActiveRequest, context: Context
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

        return await self._handle("SyncActive", context, answer)

    async def Recover(  # noqa: N802
        self, request: pb.RecoverRequest, context: Context
    ) -> pb.RecoverResponse:
        def answer() -> pb.RecoverResponse:
            active = decode.active(request.active)
            report = self.recovery.recover(active)  # recovery logs its own summary
            self.on_recovered()
            return encode.encode_report(report)

        return await self._handle("Recover", context, answer)

    async def WatchHealth(  # noqa: N802
        self, request: pb.WatchHealthRequest, context: Context
    ) -> AsyncIterator[pb.InstanceHealthUpdate]:
        """Not through ``_handle``: a following stream lives as long as its client, holds no worker
        thread, and shutdown ends it (``HealthFeed.close``) instead of waiting for it. A follower past
        the bound is refused as a call past admission is (OVERLOADED), with its ErrorInfo."""
        try:
            async for update in self.health_feed.serve(bool(request.follow), context):
                yield update
        except Overloaded as err:
            self.metrics.observe_rpc("WatchHealth", grpc.StatusCode.RESOURCE_EXHAUSTED.name, 0.0)
            event(log, logging.INFO, "rpc failed", method="WatchHealth", reason=err.reason, error=err.message)
            await context.abort_with_status(rpc_status.to_status(error_status(err)))

    async def GetState(  # noqa: N802
        self, request: pb.GetStateRequest, context: Context
    ) -> pb.GetStateResponse:
        return await self._handle("GetState", context, lambda: encode.encode_state(self.lifecycle.snapshot()))

    async def RankPlacements(  # noqa: N802
        self, request: pb.RankPlacementsRequest, context: Context
    ) -> pb.RankPlacementsResponse:
        def answer() -> pb.RankPlacementsResponse:
            gpu_uuid = decode.gpu_uuid(request.gpu_uuid, "request")
            profile = decode.profile_name(request.profile, "request", "profile")
            ranked = self.lifecycle.rank_placements(gpu_uuid, profile)
            return pb.RankPlacementsResponse(placements=[encode.encode_ranked(gpu_uuid, r) for r in ranked])

        return await self._handle("RankPlacements", context, answer)

    async def SetMigMode(  # noqa: N802
        self, request: pb.SetMigModeRequest, context: Context
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

        return await self._handle("SetMigMode", context, answer)

    async def UndoAllocate(  # noqa: N802
        self, request: pb.UndoAllocateRequest, context: Context
    ) -> pb.UndoAllocateResponse:
        def answer() -> pb.UndoAllocateResponse:
            pod_uid = decode.pod_uid(request.pod_uid, "request", "pod_uid")
            destroyed, idled = self.lifecycle.undo_allocate(pod_uid, int(request.container_index))
            return pb.UndoAllocateResponse(
                destroyed=[encode.encode_ref(ref) for ref in destroyed],
                idled=[encode.encode_ref(ref) for ref in idled],
            )

        return await self._handle("UndoAllocate", context, answer)

    async def UndoDevice(  # noqa: N802
        self, request: pb.UndoDeviceRequest, context: Context
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

        return await self._handle("UndoDevice", context, answer)

    async def KeepFree(  # noqa: N802
        self, request: pb.KeepFreeRequest, context: Context
    ) -> pb.KeepFreeResponse:
        def answer() -> pb.KeepFreeResponse:
            next_ = decode.next_placements(request.next)
            self.lifecycle.keep_free(next_, decode.gpu_uuids(request.gpu_uuids))
            self.on_change()  # the idle trim frees them now, not at its next interval
            return pb.KeepFreeResponse()

        return await self._handle("KeepFree", context, answer)

    async def ReclaimIdle(  # noqa: N802
        self, request: pb.ReclaimIdleRequest, context: Context
    ) -> pb.ReclaimIdleResponse:
        def answer() -> pb.ReclaimIdleResponse:
            gpu_uuid = decode.gpu_uuid(request.gpu_uuid, "request")
            mig_uuids = decode.mig_uuids(request.mig_uuids, "mig_uuids")
            done = self.lifecycle.reclaim_idle(gpu_uuid, mig_uuids, force=bool(request.force))
            return pb.ReclaimIdleResponse(
                reclaimed=[encode.encode_ref(ref) for ref in done.reclaimed],
                kept=[encode.encode_ref(ref) for ref in done.kept],
            )

        return await self._handle("ReclaimIdle", context, answer)
