"""What the gRPC edge refuses and how it answers: limits on names, bounded errors, generations that
cannot overflow. Each test drives a real in-process sidecar over its Unix socket."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import cast

import grpc
import msgspec
import pytest
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from inprocess_sidecar import CALL_TIMEOUT_S, InProcessSidecar, inprocess_sidecar
from sidecar_process import error_info, failure

from sidecar.edge import decode, limits
from sidecar.model.domain import State
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement
from sidecar.store.record_format import GENERATION_FILE, MAX_GENERATION

pytestmark = pytest.mark.e2e

UINT64_MAX = 2**64 - 1
ERROR_BUDGET = 1024  # bytes: message plus ErrorInfo, what travels in the trailers


@pytest.fixture
def car() -> Iterator[InProcessSidecar]:
    with inprocess_sidecar() as started:
        yield started


def checksummed(payload: bytes) -> bytes:
    digest = hashlib.sha256(payload).hexdigest().encode()
    return b'{"version":1,"checksum":"sha256:' + digest + b'","record":' + payload + b"}\n"


def allocate(car: InProcessSidecar, pod: str, start: int = 0, **fields: object) -> object:
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        devices=[
            pb.DeviceRequest(
                gpu_uuid=car.gpu_uuids()[0], profile="1g.10gb", placement=pb.Placement(start=start, size=1)
            )
        ],
    )
    for name, value in fields.items():
        target = request.pod if name in {"uid", "namespace", "name"} else request
        setattr(target, name, value)
    return car.stub.Allocate(request, timeout=CALL_TIMEOUT_S)


def answers(car: InProcessSidecar) -> None:
    """GetInfo and GetState answer, and the generation they report fits the contract's uint64."""
    info = car.stub.GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S)
    state = car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
    assert info.generation == state.generation <= MAX_GENERATION + 1


class TestGenerationsNeverOverflow:
    def test_a_maximal_generation_ceiling_is_unverifiable_and_get_info_keeps_answering(
        self, car: InProcessSidecar
    ) -> None:
        (car.state_dir / GENERATION_FILE).write_bytes(checksummed(b'{"ceiling":%d}' % UINT64_MAX))
        code, reason, _ = failure(lambda: car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S))
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "UNVERIFIABLE_STATE")
        answers(car)

    def test_a_record_with_a_maximal_idled_generation_is_set_aside_and_activations_still_count(
        self, car: InProcessSidecar
    ) -> None:
        planted = OwnershipRecord(
            gpu_uuid=car.gpu_uuids()[0],
            profile="1g.10gb",
            gi_profile_id=19,
            ci_profile_id=0,
            placement=Placement(6, 1),
            state=State.IDLE,
            idled_generation=UINT64_MAX,
            boot_id="not-this-boot",
        )
        path = car.state_dir / f"{planted.name}.json"
        path.write_bytes(checksummed(msgspec.json.encode(planted)))
        path.chmod(0o600)
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        allocate(car, "pod-a")
        answers(car)
        assert path.exists()  # corrupt: the operator's to inspect, never dropped


def status_size(err: grpc.RpcError) -> int:
    call: object = err
    status = rpc_status.from_call(call)  # type: ignore[arg-type]
    assert status is not None, "the error carries no google.rpc.Status"
    return len(status.SerializeToString())


def refused(call: object) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """``call()`` fails; its (code, reason, metadata), after checking the error stays within budget."""
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    assert status_size(caught.value) <= ERROR_BUDGET
    return error_info(caught.value)


MEGA = "c" * 1_000_000


class TestNamesAreHeldToKubernetesLimits:
    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("uid", "u" * 129),
            ("uid", "u" * 100_000),
            ("namespace", "n" * 64),
            ("namespace", "Not_A_Label"),
            ("namespace", "-leading-dash"),
            ("name", "p" * 254),
            ("container_name", "c" * 64),
            ("container_name", "c" * 100_000),
        ],
        ids=lambda v: v if len(v) < 20 else f"{len(v)} chars",
    )
    def test_a_name_past_its_limit_is_invalid_request_and_changes_nothing(
        self, car: InProcessSidecar, field: str, value: str
    ) -> None:
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        before = car.world()
        code, reason, _ = refused(lambda: allocate(car, "pod-a", 0, **{field: value}))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        assert car.world() == before

    def test_names_at_their_limits_are_accepted(self, car: InProcessSidecar) -> None:
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        uid = "u" * 128
        allocate(car, uid, namespace="n" * 63, name="p" * 253, container_name="c" * 63)
        owners = [i.owner for g in car.stub.GetState(pb.GetStateRequest()).gpus for i in g.instances]
        assert [
            (o.pod.uid, len(o.pod.namespace), len(o.pod.name), len(o.container_name)) for o in owners
        ] == [(uid, 63, 253, 63)]

    def test_a_64_kib_container_name_in_sync_active_is_refused(self, car: InProcessSidecar) -> None:
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        active = pb.ActiveAllocation(
            pod=pb.PodRef(uid="pod-a", namespace="default", name="pod-a"),
            container_name="c" * 65536,
            gpu_uuid=car.gpu_uuids()[0],
            profile="1g.10gb",
            placement=pb.Placement(start=0, size=1),
        )
        request = pb.SyncActiveRequest(generation=0, active=[active])
        code, reason, metadata = refused(lambda: car.stub.SyncActive(request, timeout=CALL_TIMEOUT_S))
        assert (code, reason, metadata) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_REQUEST",
            {"field": "active[0].container_name"},
        )

    def test_a_body_above_the_largest_valid_request_is_resource_exhausted_by_the_transport(
        self, car: InProcessSidecar
    ) -> None:
        """The receive limit is what the largest valid request needs; above it gRPC itself refuses,
        before any handler: RESOURCE_EXHAUSTED without ErrorInfo (the error table of docs/architecture.md)."""
        for name, largest in limits.largest_requests().items():
            assert largest.ByteSize() <= limits.MAX_REQUEST_BYTES, name
        active = pb.ActiveAllocation(
            pod=pb.PodRef(uid="pod-a", namespace="default", name="pod-a"),
            container_name=MEGA,
            gpu_uuid=car.gpu_uuids()[0],
            profile="1g.10gb",
            placement=pb.Placement(start=0, size=1),
        )
        request = pb.SyncActiveRequest(generation=0, active=[active])
        assert request.ByteSize() > limits.MAX_REQUEST_BYTES
        before = car.world()
        with pytest.raises(grpc.RpcError) as caught:
            car.stub.SyncActive(request, timeout=CALL_TIMEOUT_S)
        assert error_info(caught.value) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "", {})
        assert car.world() == before

    def test_the_largest_valid_sync_active_gets_through(self, car: InProcessSidecar) -> None:
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        # cast: largest_requests maps each RPC to its request message, typed as their common base.
        request = cast(pb.SyncActiveRequest, limits.largest_requests()["SyncActive"])
        request.generation = 0
        for a in request.active:
            a.gpu_uuid = car.gpu_uuids()[0]
        before = car.world()
        answer = car.stub.SyncActive(request, timeout=CALL_TIMEOUT_S)  # it names no instance
        assert (list(answer.idled), list(answer.reactivated)) == ([], [])
        assert car.world() == before


class TestErrorsStaySmall:
    def test_ten_thousand_profile_names_are_more_than_a_request_may_name(self, car: InProcessSidecar) -> None:
        names = [f"{n}g.{n}gb" for n in range(10_000)]
        request = pb.DiscoverProfilesRequest(gpu_uuid=car.gpu_uuids()[0], allowed_profiles=names)
        code, reason, metadata = refused(lambda: car.stub.DiscoverProfiles(request, timeout=CALL_TIMEOUT_S))
        assert (code, reason, metadata) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_REQUEST",
            {"field": "allowed_profiles"},
        )

    def test_the_most_unknown_profile_names_give_a_short_unknown_profile(self, car: InProcessSidecar) -> None:
        names = [f"{n}g.{n}gb" for n in range(decode.MAX_ALLOWED_PROFILES)]
        request = pb.DiscoverProfilesRequest(gpu_uuid=car.gpu_uuids()[0], allowed_profiles=names)
        code, reason, metadata = refused(lambda: car.stub.DiscoverProfiles(request, timeout=CALL_TIMEOUT_S))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_PROFILE")
        assert metadata["gpu_uuid"] == car.gpu_uuids()[0]

    def test_a_long_pod_uid_in_release_is_invalid_request_within_budget(self, car: InProcessSidecar) -> None:
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        request = pb.ReleaseRequest(pod_uid="\u00e9" * 50_000)
        code, reason, _ = refused(lambda: car.stub.Release(request, timeout=CALL_TIMEOUT_S))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")


class TestTheWireItself:
    def test_an_undecodable_body_is_invalid_request_with_a_reason(self, car: InProcessSidecar) -> None:
        raw = car.channel.unary_unary(
            "/hami.migsidecar.v1.MigSidecar/Allocate",
            request_serializer=lambda body: body,
            response_deserializer=lambda body: body,
        )
        code, reason, _ = refused(lambda: raw(b"\x0a\xff\xff\xff", timeout=CALL_TIMEOUT_S))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        assert car.stub.GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S).api_version == "v1"

    def test_every_rpc_of_the_contract_is_served(self, car: InProcessSidecar) -> None:
        """Registration walks the service descriptor: an RPC the servicer lacks would answer
        UNIMPLEMENTED, so an empty request to each must get any other answer."""
        for method in pb.DESCRIPTOR.services_by_name["MigSidecar"].methods:
            call = car.channel.unary_unary(
                f"/hami.migsidecar.v1.MigSidecar/{method.name}",
                request_serializer=lambda body: body,
                response_deserializer=lambda body: body,
            )
            codes = []
            try:
                call(b"", timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as err:
                codes.append(err.code())
            assert grpc.StatusCode.UNIMPLEMENTED not in codes, method.name

    def test_an_rpc_the_server_does_not_serve_is_unimplemented(self, car: InProcessSidecar) -> None:
        """Every RPC of the contract is served, so a method name outside it stands for one a newer
        client may call: UNIMPLEMENTED, and the server goes on serving."""
        raw = car.channel.unary_unary(
            "/hami.migsidecar.v1.MigSidecar/NotInTheContract",
            request_serializer=lambda body: body,
            response_deserializer=lambda body: body,
        )
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"", timeout=CALL_TIMEOUT_S)
        assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert car.stub.GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S).api_version == "v1"


def _devices(gpu: str) -> list[pb.DeviceRequest]:
    return [pb.DeviceRequest(gpu_uuid=gpu, profile="1g.10gb", placement=pb.Placement(start=0, size=1))]


NL_MIG = "MIG-00000000-0000-0000-0000-000000000000\n"
# (name, the call with one value ending in a newline, the ErrorInfo field it names): every value
# the edge checks against a pattern. A pattern ending in ``$`` let each of these through.
NEWLINE_CASES: list[tuple[str, object, str]] = [
    (
        "Allocate pod uid",
        lambda car, gpu: car.stub.Allocate(
            pb.AllocateRequest(pod=pb.PodRef(uid="nl\n"), container_name="main", devices=_devices(gpu)),
            timeout=CALL_TIMEOUT_S,
        ),
        "request.pod.uid",
    ),
    (
        "Allocate namespace",
        lambda car, gpu: car.stub.Allocate(
            pb.AllocateRequest(
                pod=pb.PodRef(uid="pod-a", namespace="default\n"),
                container_name="main",
                devices=_devices(gpu),
            ),
            timeout=CALL_TIMEOUT_S,
        ),
        "request.pod.namespace",
    ),
    (
        "Allocate GPU UUID",
        lambda car, gpu: car.stub.Allocate(
            pb.AllocateRequest(
                pod=pb.PodRef(uid="pod-a"), container_name="main", devices=_devices(gpu + "\n")
            ),
            timeout=CALL_TIMEOUT_S,
        ),
        "devices[0].gpu_uuid",
    ),
    (
        "Release pod uid",
        lambda car, gpu: car.stub.Release(pb.ReleaseRequest(pod_uid="nl\n"), timeout=CALL_TIMEOUT_S),
        "pod_uid",
    ),
    (
        "UndoAllocate pod uid",
        lambda car, gpu: car.stub.UndoAllocate(
            pb.UndoAllocateRequest(pod_uid="nl\n"), timeout=CALL_TIMEOUT_S
        ),
        "pod_uid",
    ),
    (
        "UndoDevice MIG UUID",
        lambda car, gpu: car.stub.UndoDevice(
            pb.UndoDeviceRequest(mig_uuid=NL_MIG, pod_uid="pod-a"), timeout=CALL_TIMEOUT_S
        ),
        "request.mig_uuid",
    ),
    (
        "SyncActive MIG UUID",
        lambda car, gpu: car.stub.SyncActive(
            pb.SyncActiveRequest(
                active=[
                    pb.ActiveAllocation(
                        pod=pb.PodRef(uid="pod-a"),
                        gpu_uuid=gpu,
                        profile="1g.10gb",
                        placement=pb.Placement(start=0, size=1),
                        mig_uuid=NL_MIG,
                    )
                ]
            ),
            timeout=CALL_TIMEOUT_S,
        ),
        "active[0].mig_uuid",
    ),
    (
        "ReclaimIdle MIG UUID",
        lambda car, gpu: car.stub.ReclaimIdle(
            pb.ReclaimIdleRequest(gpu_uuid=gpu, mig_uuids=[NL_MIG]), timeout=CALL_TIMEOUT_S
        ),
        "mig_uuids[0]",
    ),
    (
        "DiscoverProfiles GPU UUID",
        lambda car, gpu: car.stub.DiscoverProfiles(
            pb.DiscoverProfilesRequest(gpu_uuid=gpu + "\n"), timeout=CALL_TIMEOUT_S
        ),
        "request.gpu_uuid",
    ),
]


class TestAValueIsCheckedWhole:
    """A pattern's ``$`` also matches before a final newline: every value is matched whole
    (``fullmatch``), so ``"nl\\n"`` is no pod UID and ``"MIG-...\\n"`` no MIG UUID."""

    @pytest.mark.parametrize(
        ("call", "field"), [c[1:] for c in NEWLINE_CASES], ids=[c[0] for c in NEWLINE_CASES]
    )
    def test_a_trailing_newline_is_invalid_request_and_changes_nothing(
        self, car: InProcessSidecar, call: object, field: str
    ) -> None:
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        allocate(car, "pod-a", 1)  # something a wrongly accepted call could change
        gpu = car.gpu_uuids()[0]
        before = car.world()
        code, reason, metadata = refused(lambda: call(car, gpu))  # type: ignore[operator]
        assert (code, reason, metadata.get("field")) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_REQUEST",
            field,
        )
        assert car.world() == before
