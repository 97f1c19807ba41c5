"""KeepFree through the socket: the sidecar, its reserve off, destroys the IDLE instances over a
named placement in the background, so an Allocate there reclaims nothing; bad requests name their
reason and change nothing."""

from __future__ import annotations

import time

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import CALL_TIMEOUT_S, Sidecar, allocate_one, failure, gpu_uuid, snapshot_dir


def keep_free(car: Sidecar, *next_: tuple[str, str, int, int]) -> None:
    request = pb.KeepFreeRequest(
        next=[
            pb.NextPlacement(gpu_uuid=g, profile=p, placement=pb.Placement(start=start, size=size))
            for g, p, start, size in next_
        ]
    )
    car.stub.KeepFree(request, timeout=CALL_TIMEOUT_S)


def idle(car: Sidecar) -> set[str]:
    state = car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
    return {i.mig_uuid for g in state.gpus for i in g.instances if i.state == pb.IDLE}


def test_the_idle_instances_over_a_named_placement_are_destroyed_in_the_background(sidecar: Sidecar) -> None:
    sidecar.recover()
    gpu = gpu_uuid(sidecar, 0)
    over = [allocate_one(sidecar, f"pod-{k}", 0, "1g.10gb", k, 1).mig_uuid for k in (0, 1)]
    elsewhere = allocate_one(sidecar, "pod-2", 0, "1g.10gb", 2, 1).mig_uuid
    for k in (0, 1, 2):
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid=f"pod-{k}"), timeout=CALL_TIMEOUT_S)
    assert idle(sidecar) == {*over, elsewhere}

    keep_free(sidecar, (gpu, "2g.20gb", 0, 2))

    deadline = time.monotonic() + 30.0
    while idle(sidecar) != {elsewhere} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(sidecar) == {elsewhere}
    created = sidecar.stub.Allocate(
        pb.AllocateRequest(
            pod=pb.PodRef(uid="pod-9", namespace="default", name="pod-9"),
            container_name="main",
            devices=[
                pb.DeviceRequest(gpu_uuid=gpu, profile="2g.20gb", placement=pb.Placement(start=0, size=2))
            ],
        ),
        timeout=CALL_TIMEOUT_S,
    )
    assert list(created.reclaimed) == []


def test_bad_requests_name_their_reason_and_change_nothing(sidecar: Sidecar) -> None:
    gpu = gpu_uuid(sidecar, 0)
    assert failure(lambda: keep_free(sidecar, (gpu, "2g.20gb", 0, 2)))[:2] == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "NOT_RECOVERED",
    )
    sidecar.recover()
    allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
    sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=CALL_TIMEOUT_S)
    before = snapshot_dir(sidecar.state_dir), sidecar.hardware()
    twice = ((gpu, "2g.20gb", 0, 2), (gpu, "2g.20gb", 2, 2))
    assert failure(lambda: keep_free(sidecar, *twice))[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_REQUEST",
    )
    assert failure(lambda: keep_free(sidecar, (gpu, "2g.20gb", 1, 2)))[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "ILLEGAL_PLACEMENT",
    )
    missing = pb.KeepFreeRequest(next=[pb.NextPlacement(gpu_uuid=gpu, profile="2g.20gb")])
    assert failure(lambda: sidecar.stub.KeepFree(missing, timeout=CALL_TIMEOUT_S))[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_REQUEST",
    )
    unknown = "GPU-00000000-0000-0000-0000-000000000000"
    for gpus, code, reason in (
        (["not-a-gpu"], grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"),
        ([gpu, gpu], grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"),
        ([gpu, unknown], grpc.StatusCode.NOT_FOUND, "UNKNOWN_GPU"),
    ):
        request = pb.KeepFreeRequest(gpu_uuids=gpus)
        refused = failure(lambda r=request: sidecar.stub.KeepFree(r, timeout=CALL_TIMEOUT_S))
        assert refused[:2] == (code, reason)
    assert (snapshot_dir(sidecar.state_dir), sidecar.hardware()) == before
