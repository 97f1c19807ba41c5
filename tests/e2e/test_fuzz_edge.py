"""Property-based fuzz of every implemented RPC at the gRPC edge (hypothesis, deterministic).

One real sidecar runs in this process on simulated GPUs, recovered, with an ACTIVE and an IDLE
instance. Each RPC is called with generated requests, from well-formed to hostile (names past
every limit, control characters, foreign UUIDs, zero sizes, huge generations), and with raw
bodies that may not decode at all. The property, for every call:

- an answer is OK, or a gRPC error with a ``google.rpc.ErrorInfo`` reason, never INTERNAL or a
  reasonless status, and the error stays within about 1 KB;
- a refused call changes nothing: GetState, the record and CDI files byte for byte and the
  simulated hardware's layout are as they were before it.

Requests that could change state partially and legitimately (an Allocate of several devices whose
second one loses its placement to the first) are kept out: multi-device requests are only generated
malformed. A new RPC is one line in ``RPCS``: its request class and a strategy of its requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inprocess_sidecar import CALL_TIMEOUT_S, InProcessSidecar, inprocess_sidecar
from sidecar_process import error_info

pytestmark = pytest.mark.e2e

EXAMPLES = 40
ERROR_BUDGET = 1024
FUZZ = settings(
    derandomize=True,
    database=None,
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Every reason the contract names (the proto's error reasons): anything else is a bug.
REASONS = {
    "INVALID_REQUEST",
    "UNKNOWN_PROFILE",
    "ILLEGAL_PLACEMENT",
    "UNKNOWN_GPU",
    "NOT_RECOVERED",
    "PLACEMENT_BUSY",
    "KEY_CONFLICT",
    "MIG_DISABLED",
    "INSTANCE_IN_USE",
    "NVML_ERROR",
    "STATE_WRITE_FAILED",
    "UNVERIFIABLE_STATE",
    "NOT_IDLE",
    "UNKNOWN_INSTANCE",
}

# -- the node the fuzz runs against ---------------------------------------------------------------------

GPUS: list[str] = []  # filled by the fixture: the simulated GPUs' UUIDs, index order


@pytest.fixture(scope="module")
def car() -> Iterator[InProcessSidecar]:
    with inprocess_sidecar("h100-80gb:1,a100-40gb:1") as started:
        started.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        GPUS[:] = started.gpu_uuids()
        for pod, start in (("fuzz-held", 0), ("fuzz-gone", 1)):
            request = pb.AllocateRequest(
                pod=pb.PodRef(uid=pod, namespace="default", name=pod),
                container_name="main",
                devices=[
                    pb.DeviceRequest(
                        gpu_uuid=GPUS[0], profile="1g.10gb", placement=pb.Placement(start=start, size=1)
                    )
                ],
            )
            started.stub.Allocate(request, timeout=CALL_TIMEOUT_S)
        started.stub.Release(pb.ReleaseRequest(pod_uid="fuzz-gone"), timeout=CALL_TIMEOUT_S)
        yield started


# -- strategies -----------------------------------------------------------------------------------------

UUID_HEX = st.text("0123456789abcdef", min_size=32, max_size=32)


def _uuid(prefix: str) -> st.SearchStrategy[str]:
    return UUID_HEX.map(lambda h: f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")


def long_text(limit: int) -> st.SearchStrategy[str]:
    """Strings just past ``limit`` and far past it: the shapes that broke the edge before."""
    return st.sampled_from([limit + 1, 4 * limit, 100_000]).map(lambda n: "x" * n)


def names(limit: int, valid: str) -> st.SearchStrategy[str]:
    return st.one_of(st.just(valid), st.just(""), st.text(max_size=24), long_text(limit))


def gpu_uuids() -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from([0, 1]).map(lambda i: GPUS[i]),
        _uuid("GPU"),
        st.just(""),
        st.text(max_size=40),
        long_text(64),
    )


PROFILES = st.one_of(
    st.sampled_from(["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.10gb+me"]),
    st.text(max_size=20),
    long_text(64),
)
MIG_UUIDS = st.one_of(st.just(""), _uuid("MIG"), st.text(max_size=40), long_text(64))
POD_UIDS = st.one_of(
    st.from_regex(r"\Afz-[a-z0-9]{1,12}\Z"), st.just(""), st.text(max_size=30), long_text(128)
)
SMALL = st.integers(min_value=0, max_value=9)
UINT32 = st.one_of(SMALL, st.integers(min_value=0, max_value=2**32 - 1))


@st.composite
def placements(draw: st.DrawFn) -> Any:
    return pb.Placement(start=draw(SMALL), size=draw(st.one_of(SMALL, st.integers(0, 2**32 - 1))))


@st.composite
def pods(draw: st.DrawFn) -> Any:
    return pb.PodRef(
        uid=draw(POD_UIDS), namespace=draw(names(63, "default")), name=draw(names(253, "trainer"))
    )


@st.composite
def claims(draw: st.DrawFn) -> Any:
    return pb.ClaimRef(
        uid=draw(POD_UIDS), namespace=draw(names(63, "default")), name=draw(names(253, "train-gpu"))
    )


# DRA request names: valid ones, a subrequest, and the shapes just outside the rule.
REQUESTS = st.one_of(st.sampled_from(["gpu", "gpu/small", "GPU", "gpu/", "a/b/c"]), names(127, "gpu"))


@st.composite
def devices(draw: st.DrawFn, index: int = 0) -> Any:
    message = pb.DeviceRequest(device_index=index, gpu_uuid=draw(gpu_uuids()), profile=draw(PROFILES))
    if draw(st.integers(0, 9)):  # now and then without a placement
        message.placement.CopyFrom(draw(placements()))
    if draw(st.booleans()):  # a claim's device names its request; a pod's none
        message.request = draw(REQUESTS)
    return message


@st.composite
def allocate_requests(draw: st.DrawFn) -> Any:
    request = pb.AllocateRequest(container_name=draw(names(63, "main")), container_index=draw(SMALL))
    owner = draw(st.integers(0, 9))  # 0: neither pod nor claim; 1-5: a pod; 6-8: a claim; 9: both
    if 1 <= owner <= 5 or owner == 9:
        request.pod.CopyFrom(draw(pods()))
    if owner >= 6:
        request.claim.CopyFrom(draw(claims()))
        if draw(st.booleans()):  # a claim's Allocate names no container: mostly left out
            request.ClearField("container_name")
            request.ClearField("container_index")
    if draw(st.booleans()):
        request.devices.append(draw(devices()))
    else:
        # Several devices only malformed: a repeated index, or one without a placement.
        first = draw(devices())
        second = draw(devices(index=draw(st.sampled_from([0, 1]))))
        if second.device_index == 1:
            second.ClearField("placement")
        request.devices.extend([first, second])
    return request


@st.composite
def active_allocations(draw: st.DrawFn) -> Any:
    message = pb.ActiveAllocation(
        container_name=draw(names(63, "main")),
        container_index=draw(SMALL),
        device_index=draw(SMALL),
        gpu_uuid=draw(gpu_uuids()),
        profile=draw(PROFILES),
        mig_uuid=draw(MIG_UUIDS),
        gpu_instance_id=draw(UINT32),
        compute_instance_id=draw(UINT32),
    )
    if draw(st.integers(0, 9)):
        message.pod.CopyFrom(draw(pods()))
    message.placement.CopyFrom(draw(placements()))
    return message


ACTIVE_LISTS = st.lists(active_allocations(), max_size=3)
GENERATIONS = st.one_of(SMALL, st.integers(0, 2**64 - 1))
EMPTY = st.just(None)

RPCS: dict[str, tuple[Callable[..., Any], st.SearchStrategy[Any]]] = {
    "GetInfo": (pb.GetInfoRequest, EMPTY.map(lambda _: pb.GetInfoRequest())),
    "ListGpus": (pb.ListGpusRequest, EMPTY.map(lambda _: pb.ListGpusRequest())),
    "GetState": (pb.GetStateRequest, EMPTY.map(lambda _: pb.GetStateRequest())),
    "DiscoverProfiles": (
        pb.DiscoverProfilesRequest,
        st.builds(
            pb.DiscoverProfilesRequest, gpu_uuid=gpu_uuids(), allowed_profiles=st.lists(PROFILES, max_size=4)
        ),
    ),
    "Allocate": (pb.AllocateRequest, allocate_requests()),
    "Release": (
        pb.ReleaseRequest,
        st.one_of(
            st.builds(pb.ReleaseRequest, pod_uid=POD_UIDS),
            st.builds(pb.ReleaseRequest, claim_uid=POD_UIDS),
            st.builds(pb.ReleaseRequest, pod_uid=POD_UIDS, claim_uid=POD_UIDS),
        ),
    ),
    "SyncActive": (
        pb.SyncActiveRequest,
        st.builds(pb.SyncActiveRequest, generation=GENERATIONS, active=ACTIVE_LISTS),
    ),
    "Recover": (pb.RecoverRequest, st.builds(pb.RecoverRequest, active=ACTIVE_LISTS)),
    "SetMigMode": (
        pb.SetMigModeRequest,
        st.builds(pb.SetMigModeRequest, gpu_uuid=gpu_uuids(), enabled=st.just(True)),
    ),
    "UndoAllocate": (
        pb.UndoAllocateRequest,
        st.builds(pb.UndoAllocateRequest, pod_uid=POD_UIDS, container_index=UINT32),
    ),
    "ReclaimIdle": (
        pb.ReclaimIdleRequest,
        st.builds(pb.ReclaimIdleRequest, gpu_uuid=gpu_uuids(), mig_uuids=st.lists(MIG_UUIDS, max_size=3)),
    ),
    "KeepFree": (
        pb.KeepFreeRequest,
        st.builds(
            pb.KeepFreeRequest,
            next=st.lists(
                st.builds(pb.NextPlacement, gpu_uuid=gpu_uuids(), profile=PROFILES, placement=placements()),
                max_size=3,
            ),
            gpu_uuids=st.lists(gpu_uuids(), max_size=3),
        ),
    ),
    "RankPlacements": (
        pb.RankPlacementsRequest,
        st.builds(pb.RankPlacementsRequest, gpu_uuid=gpu_uuids(), profile=PROFILES),
    ),
    "UndoDevice": (
        pb.UndoDeviceRequest,
        st.builds(
            pb.UndoDeviceRequest,
            mig_uuid=MIG_UUIDS,
            pod_uid=POD_UIDS,
            container_index=UINT32,
            device_index=UINT32,
        ),
    ),
}


# -- the property ---------------------------------------------------------------------------------------


def raw_call(car: InProcessSidecar, rpc: str) -> Callable[..., Any]:
    return car.channel.unary_unary(
        f"/hami.migsidecar.v1.MigSidecar/{rpc}",
        request_serializer=lambda body: body,
        response_deserializer=lambda body: body,
    )


def check(car: InProcessSidecar, call: Callable[[], Any]) -> None:
    """``call()`` answers, or fails with a reason of the contract within budget and changes nothing."""
    before = car.world()
    try:
        call()
    except grpc.RpcError as err:
        code, reason, _ = error_info(err)
        assert reason in REASONS, f"{code.name} without a contract reason: {reason!r}"
        assert code not in {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
        assert status is not None
        assert len(status.SerializeToString()) <= ERROR_BUDGET
        assert car.world() == before, f"a refused call ({reason}) changed the state"


@pytest.mark.parametrize("rpc", sorted(RPCS))
def test_every_rejected_request_has_a_reason_and_changes_nothing(car: InProcessSidecar, rpc: str) -> None:
    method = getattr(car.stub, rpc)

    @FUZZ
    @given(request=RPCS[rpc][1])
    def run(request: Any) -> None:
        check(car, lambda: method(request, timeout=CALL_TIMEOUT_S))

    run()


@pytest.mark.parametrize("rpc", sorted(RPCS))
def test_every_raw_body_is_answered_or_refused_with_a_reason(car: InProcessSidecar, rpc: str) -> None:
    call = raw_call(car, rpc)
    good = RPCS[rpc][0]().SerializeToString()

    @FUZZ
    @given(body=st.one_of(st.binary(max_size=64), st.binary(max_size=16).map(lambda tail: good + tail)))
    def run(body: bytes) -> None:
        check(car, lambda: call(body, timeout=CALL_TIMEOUT_S))

    run()
