"""An adversarial review of restart recovery, over the socket: what the Go plugin sees of each finding.

Each test talks to a real sidecar process on simulated hardware kept in a state file, and checks the
recovery report, GetState, the simulated hardware and the record and CDI files.
"""

from __future__ import annotations

from typing import Any

import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import Sidecar, snapshot_dir

pytestmark = pytest.mark.e2e


def gpu_uuid(car: Sidecar, index: int) -> str:
    return next(g.uuid for g in car.gpus() if g.index == index)


def allocate(  # noqa: PLR0917 - reads like the reservation it requests
    car: Sidecar, pod: str, gpu: int, profile: str, start: int, size: int
) -> Any:
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        devices=[
            pb.DeviceRequest(
                device_index=0,
                gpu_uuid=gpu_uuid(car, gpu),
                profile=profile,
                placement=pb.Placement(start=start, size=size),
            )
        ],
    )
    return car.stub.Allocate(request, timeout=30).devices[0]


def annotation(pod: str, device: Any) -> Any:
    """The ActiveAllocation the plugin reads back from ``hami.io/vgpu-mig-allocations``."""
    return pb.ActiveAllocation(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        device_index=device.device_index,
        gpu_uuid=device.gpu_uuid,
        profile=device.profile,
        placement=device.placement,
        mig_uuid=device.mig_uuid,
        gpu_instance_id=device.gpu_instance_id,
        compute_instance_id=device.compute_instance_id,
    )


def owners(car: Sidecar) -> dict[str, tuple[int, str]]:
    """MIG UUID -> (InstanceState, owning pod UID) of every owned instance, as GetState reports it."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=30)
    return {i.mig_uuid: (i.state, i.owner.pod.uid) for g in state.gpus for i in g.instances}


class TestARepeatedRecoverWithAnOldPodList:
    def test_an_instance_released_and_reused_by_a_newer_pod_stays_with_that_pod(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        first = allocate(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
        old_pod_list = [annotation("pod-a", first)]
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=30)
        reused = allocate(sidecar, "pod-b", 0, "1g.10gb", 0, 1)
        assert (reused.outcome, reused.mig_uuid) == (pb.REUSED, first.mig_uuid)
        files = snapshot_dir(sidecar.state_dir), snapshot_dir(sidecar.cdi_dir)

        report = sidecar.recover(old_pod_list)

        assert owners(sidecar) == {first.mig_uuid: (pb.ACTIVE, "pod-b")}
        assert (snapshot_dir(sidecar.state_dir), snapshot_dir(sidecar.cdi_dir)) == files
        assert list(report.adopted_active) == []
        [line] = report.errors
        assert "pod-a" in line
        assert "pod-b" in line
        assert allocate(sidecar, "pod-b", 0, "1g.10gb", 0, 1).outcome == pb.ALREADY_ALLOCATED
