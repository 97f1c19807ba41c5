"""An adversarial review of restart recovery, over the socket: what the Go plugin sees of each finding.

Each test talks to a real sidecar process on simulated hardware kept in a state file, and checks the
recovery report, GetState, the simulated hardware and the record and CDI files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import Sidecar, SidecarFactory, snapshot_dir

from sidecar import crashpoints
from sidecar.nvml.simulated import SimulatedHardware

pytestmark = pytest.mark.e2e

ADOPT = "--adopt-existing-mig-instances"
DESTROY_POINTS = crashpoints.POINTS[crashpoints.POINTS.index("after-record-deleting") :]


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


def hardware(car: Sidecar) -> list[Any]:
    return SimulatedHardware.open(car.sim_state).layouts()


def crash_during(car: Sidecar, call: Callable[[], object]) -> None:
    """``call`` must end the process at its armed crash point (exit 137) instead of answering."""
    with pytest.raises(grpc.RpcError):
        call()
    assert car.proc is not None
    assert car.proc.wait(timeout=30) == 137


def assert_converged(car: Sidecar) -> None:
    """Every live GI has a verified ACTIVE/IDLE record and nothing else is left: no foreign instance,
    no record without its instance, no CDI file without a live owned instance."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=30)
    assert all(not g.foreign for g in state.gpus), "recovery left an instance without a record"
    owned = {(i.gpu_uuid, i.gpu_instance_id): i for g in state.gpus for i in g.instances}
    live = {(g.uuid, gi.id): gi for g in hardware(car) for gi in g.gis}
    assert set(owned) == set(live)
    for key, instance in owned.items():
        assert instance.state in (pb.ACTIVE, pb.IDLE)
        assert [c.mig_uuid for c in live[key].cis] == [instance.mig_uuid]
    assert len(list(car.state_dir.glob("mig-*.json"))) == len(owned)
    for spec in car.cdi_dir.glob("*.json"):
        assert any(i.mig_uuid in spec.name for i in owned.values()), f"stray CDI spec {spec.name}"


class TestAKill9WhileRecoveryItselfDestroysSomethingConverges:
    """Recovery destroys through the same records-first helper as a reclaim; a crash at each of its
    points, then a clean restart and Recover, leaves a node with nothing unowned and nothing stale."""

    @pytest.mark.parametrize("point", DESTROY_POINTS)
    def test_removing_an_orphan_gi_with_adoption(self, sidecar_factory: SidecarFactory, point: str) -> None:
        car = sidecar_factory(extra_args=[ADOPT], env={crashpoints.ENV: point})
        car.sim("create", "--gpu", "1", "--profile", "3g.40gb", "--placement", "4:4", "--no-ci")
        crash_during(car, car.recover)

        car.restart(env={})
        report = car.recover()
        again = car.recover()

        assert list(report.errors) == []
        assert hardware(car)[1].gis == ()
        assert_converged(car)
        assert again == pb.RecoverResponse()

    @pytest.mark.parametrize("point", DESTROY_POINTS)
    def test_undoing_a_create_a_crash_left_behind(self, sidecar_factory: SidecarFactory, point: str) -> None:
        car = sidecar_factory(env={crashpoints.ENV: "after-create-ci"})
        car.recover()
        crash_during(car, lambda: allocate(car, "pod-a", 0, "3g.40gb", 4, 4))
        assert [s["state"] for s in car.records().values()] == ["CREATING"]

        car.restart(env={crashpoints.ENV: point})
        crash_during(car, car.recover)
        car.restart(env={})
        car.recover()

        assert hardware(car)[0].gis == ()
        assert_converged(car)
        assert car.records() == {}
        assert allocate(car, "pod-a", 0, "3g.40gb", 4, 4).outcome == pb.CREATED

    @pytest.mark.parametrize("point", DESTROY_POINTS)
    def test_finishing_a_reclaim_a_crash_left_behind(
        self, sidecar_factory: SidecarFactory, point: str
    ) -> None:
        car = sidecar_factory(env={crashpoints.ENV: "after-record-deleting"})
        car.recover()
        idle = allocate(car, "pod-a", 0, "1g.10gb", 4, 1)
        car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=30)
        crash_during(car, lambda: allocate(car, "pod-b", 0, "3g.40gb", 4, 4))
        assert [s["state"] for s in car.records().values()] == ["DELETING"]

        car.restart(env={crashpoints.ENV: point})
        crash_during(car, car.recover)
        car.restart(env={})
        car.recover()

        assert idle.mig_uuid not in {gi.mig_uuid for gi in hardware(car)[0].gis}
        assert_converged(car)
        assert car.records() == {}
        assert car.cdi_files() == []
