"""What the gRPC edge refuses and how it answers: limits on names, bounded errors, generations that
cannot overflow. Each test drives a real in-process sidecar over its Unix socket."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import grpc
import msgspec
import pytest
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from inprocess_sidecar import CALL_TIMEOUT_S, InProcessSidecar, inprocess_sidecar
from sidecar_process import error_info, failure

from sidecar.domain import Placement, State
from sidecar.records import GENERATION_FILE, MAX_GENERATION, OwnershipRecord

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


_ = error_info  # used by the limit tests below
