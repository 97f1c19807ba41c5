"""Which Allocates wake the reconciler: a valid one (its refusal too), never one refused for bad input.

A round costs the node GPU locks and NVML calls while good calls wait, so a flood of malformed
Allocates must not buy one. ``Reconciler.kicks`` counts the requests for an early round as they
are made (synchronously, in the call) and ``rounds`` the rounds run; both are read from the
application served in this process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from inprocess_sidecar import CALL_TIMEOUT_S, InProcessSidecar, inprocess_sidecar

from sidecar.model.idle_policy import IdleSettings

pytestmark = pytest.mark.e2e

WAIT_S = 60.0  # a bound on waiting for a round, never a measured duration


@pytest.fixture
def car() -> Iterator[InProcessSidecar]:
    with inprocess_sidecar("h100-80gb:1", idle=IdleSettings(reserve=("1g.10gb",))) as started:
        started.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        yield started


def allocate(gpu_uuid: str, profile: str, pod: str = "pod-1", start: int = 0) -> Any:
    return pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        devices=[
            pb.DeviceRequest(
                device_index=0,
                gpu_uuid=gpu_uuid,
                profile=profile,
                placement=pb.Placement(start=start, size=1),
            )
        ],
    )


def refused_for_bad_input(car: InProcessSidecar) -> list[Any]:
    """Allocates each refused before the lifecycle changes anything, for what they carry."""
    gpu = car.gpu_uuids()[0]
    no_pod = allocate(gpu, "1g.10gb")
    no_pod.ClearField("pod")
    no_devices = allocate(gpu, "1g.10gb")
    del no_devices.devices[:]
    return [
        no_pod,
        no_devices,
        allocate("not-a-uuid", "1g.10gb"),
        allocate("GPU-00000000-0000-0000-0000-000000000000", "1g.10gb"),  # no such GPU
        allocate(gpu, "9g.999gb"),  # no such profile
        allocate(gpu, "1g.10gb", start=5_000),  # no such placement
    ]


def test_a_flood_of_malformed_allocates_never_wakes_the_reconciler(car: InProcessSidecar) -> None:
    reconciler = car.app.reconciler
    kicks, rounds = reconciler.kicks, reconciler.rounds
    raw = car.channel.unary_unary(
        "/hami.migsidecar.v1.MigSidecar/Allocate",
        request_serializer=lambda body: body,
        response_deserializer=lambda body: body,
    )
    bad = refused_for_bad_input(car)
    for _ in range(50):
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\x0a\xff\xff\xff", timeout=CALL_TIMEOUT_S)  # refused before decoding
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        for request in bad:
            with pytest.raises(grpc.RpcError) as caught:
                car.stub.Allocate(request, timeout=CALL_TIMEOUT_S)
            assert caught.value.code() in {
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
            }
    assert (reconciler.kicks, reconciler.rounds) == (kicks, rounds)

    # A valid Allocate does wake it: the counters move when they should.
    car.stub.Allocate(allocate(car.gpu_uuids()[0], "1g.10gb"), timeout=CALL_TIMEOUT_S)
    assert reconciler.kicks == kicks + 1
    deadline = time.monotonic() + WAIT_S
    while reconciler.rounds == rounds:
        assert time.monotonic() < deadline, "the valid Allocate's round never ran"
        time.sleep(0.01)
    assert reconciler.rounds == rounds + 1
