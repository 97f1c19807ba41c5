"""The idle policy in a real sidecar: a release wakes the background trim, which destroys through the
recorded teardown, so a kill -9 at any point of a trim leaves nothing leaked after Recover."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from helpers_e2e import DELETE_POINTS, assert_converged, wait_until
from sidecar_process import CALL_TIMEOUT_S, SidecarFactory, allocate_one, layouts

from sidecar.lifecycle import crashpoints

# Any instance idle for a millisecond is due, and the round comes only when a release wakes it.
TTL_NOW = ["--idle-ttl", "0.001", "--reconcile-interval", "3600"]


@pytest.mark.parametrize("point", ["before-idle-trim", *DELETE_POINTS])
def test_a_kill_9_during_a_background_trim_leaves_nothing_leaked_after_recover(
    sidecar_factory: SidecarFactory, point: str
) -> None:
    car = sidecar_factory(extra_args=TTL_NOW, env={crashpoints.ENV: point})
    car.recover()
    active = allocate_one(car, "pod-a", 0, "1g.10gb", 0, 1)
    idle = allocate_one(car, "pod-b", 0, "1g.10gb", 4, 1)
    # The release wakes the trim, which may end the process before the answer is out.
    with contextlib.suppress(grpc.RpcError):
        car.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=CALL_TIMEOUT_S)
    assert car.proc is not None
    assert car.proc.wait(timeout=60) == 137

    car.restart(extra_args=[], env={})  # no idle policy: what recovery alone makes of the crash
    active_allocation = pb.ActiveAllocation(
        pod=pb.PodRef(uid="pod-a", namespace="default", name="pod-a"),
        container_name="main",
        gpu_uuid=active.gpu_uuid,
        profile=active.profile,
        placement=active.placement,
        mig_uuid=active.mig_uuid,
        gpu_instance_id=active.gpu_instance_id,
        compute_instance_id=active.compute_instance_id,
    )
    report = car.recover([active_allocation])

    assert list(report.errors) == []
    assert_converged(car)
    live = {ci.mig_uuid for gi in layouts(car)[0].gis for ci in gi.cis}
    assert active.mig_uuid in live
    # Before the destroy began the instance is intact and comes back IDLE; from DELETING on it is gone.
    assert (idle.mig_uuid in live) is (point == "before-idle-trim")


def test_a_release_wakes_the_trim_and_the_instance_is_destroyed_with_its_record_and_cdi_spec(
    sidecar_factory: SidecarFactory,
) -> None:
    car = sidecar_factory(extra_args=TTL_NOW)
    car.recover()
    idle = allocate_one(car, "pod-a", 0, "1g.10gb", 4, 1)

    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=CALL_TIMEOUT_S)
    wait_until("the trim destroyed the idle instance", lambda: car.records() == {})

    assert layouts(car)[0].gis == ()
    assert car.records() == {}
    assert not [name for name in car.cdi_files() if idle.mig_uuid in name]


def test_the_reserve_of_asked_profiles_makes_room_once_an_allocate_asks(
    sidecar_factory: SidecarFactory,
) -> None:
    """``--idle-reserve auto`` on one H100: an ACTIVE 1g.10gb holds 0:4 and an IDLE 2g.20gb 4:4, so
    no 3g.40gb fits. A 3g.40gb Allocate at the held 0:4 is refused, and the round the refusal wakes
    frees 4:4 for the next one, which then creates there. (That nothing is trimmed before a profile
    is asked for is proven on a fake clock in the component tests.)"""
    car = sidecar_factory(
        extra_args=["--idle-reserve", "auto", "--reconcile-interval", "3600"], sim_gpus="h100-80gb:1"
    )
    car.recover()
    allocate_one(car, "pod-a", 0, "1g.10gb", 0, 1)
    blocker = allocate_one(car, "pod-b", 0, "2g.20gb", 4, 2)
    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=CALL_TIMEOUT_S)

    with pytest.raises(grpc.RpcError) as refused:
        allocate_one(car, "pod-c", 0, "3g.40gb", 0, 4)
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    wait_until(
        "the reserve destroyed the idle 2g.20gb",
        lambda: all(blocker.mig_uuid not in name for name in car.cdi_files()) and len(car.records()) == 1,
    )
    assert blocker.mig_uuid not in {ci.mig_uuid for gi in layouts(car)[0].gis for ci in gi.cis}
    made = allocate_one(car, "pod-c", 0, "3g.40gb", 4, 4)
    assert (made.placement.start, made.placement.size) == (4, 4)
