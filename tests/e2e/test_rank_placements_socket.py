"""RankPlacements through the socket: the contract's fields, best first, and the error reasons."""

from __future__ import annotations

from typing import Any

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import CALL_TIMEOUT_S, Sidecar, allocate_one, failure, gpu_uuid, snapshot_dir


def rank(car: Sidecar, gpu: str, profile: str) -> Any:
    request = pb.RankPlacementsRequest(gpu_uuid=gpu, profile=profile)
    return car.stub.RankPlacements(request, timeout=CALL_TIMEOUT_S).placements


def test_an_idle_instance_ranks_first_for_its_profile_and_as_a_listed_victim_for_a_larger_one(
    sidecar: Sidecar,
) -> None:
    sidecar.recover()
    active = allocate_one(sidecar, "pod-a", 0, "2g.20gb", 0, 2)
    idle = allocate_one(sidecar, "pod-b", 0, "2g.20gb", 4, 2)
    sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=CALL_TIMEOUT_S)
    gpu = gpu_uuid(sidecar, 0)
    before = snapshot_dir(sidecar.state_dir), snapshot_dir(sidecar.cdi_dir), sidecar.hardware()

    two = rank(sidecar, gpu, "2g.20gb")
    three = rank(sidecar, gpu, "3g.40gb")

    assert [(p.placement.start, p.cost) for p in two] == [
        (4, pb.REUSE),
        (2, pb.FREE),
        (0, pb.BLOCKED),
    ]
    assert two[0].idle_mig_uuid == idle.mig_uuid
    assert two[0].free_slices_after == 4  # 2:2 and 6:2; the idle 4:2 is the placement itself
    assert two[-1].blocker == "ACTIVE"
    assert [(p.placement.start, p.cost) for p in three] == [(4, pb.RECLAIM), (0, pb.BLOCKED)]
    [victim] = three[0].reclaim
    assert (victim.gpu_uuid, victim.profile, victim.mig_uuid) == (gpu, "2g.20gb", idle.mig_uuid)
    assert (victim.gpu_instance_id, victim.compute_instance_id) == (
        idle.gpu_instance_id,
        idle.compute_instance_id,
    )
    assert active.mig_uuid not in {v.mig_uuid for p in three for v in p.reclaim}
    assert (snapshot_dir(sidecar.state_dir), snapshot_dir(sidecar.cdi_dir), sidecar.hardware()) == before


def test_bad_requests_name_their_reason(sidecar: Sidecar) -> None:
    gpu = gpu_uuid(sidecar, 0)

    assert failure(lambda: rank(sidecar, gpu, "1g.10gb"))[:2] == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "NOT_RECOVERED",
    )
    sidecar.recover()
    assert failure(lambda: rank(sidecar, "GPU-00000000-0000-0000-0000-000000000000", "1g.10gb"))[:2] == (
        grpc.StatusCode.NOT_FOUND,
        "UNKNOWN_GPU",
    )
    assert failure(lambda: rank(sidecar, gpu, "9g.99gb"))[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "UNKNOWN_PROFILE",
    )
    assert failure(lambda: rank(sidecar, "not-a-gpu", "1g.10gb"))[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_REQUEST",
    )
    assert failure(lambda: rank(sidecar, gpu, ""))[:2] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_REQUEST",
    )
