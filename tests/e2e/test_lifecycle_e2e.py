"""The instance lifecycle over the socket: a real ``serve`` process on simulated GPUs.

The hardware knobs (a foreign instance, a fault) are turned on the shared simulated state file, the
way ``sim`` commands do it; the sidecar sees them at its next NVML call.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest
from conftest import SidecarFactory
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import Sidecar, error_info

from sidecar.nvml.simulated import SimulatedHardware

pytestmark = pytest.mark.e2e

NVML_ERROR_UNKNOWN = 999
FOREVER = 1000


def h100(car: Sidecar, n: int = 0) -> str:
    return [g.uuid for g in car.gpus() if "H100" in g.model][n]


def allocate(car: Sidecar, pod: str, *devices: tuple[str, str, int, int]) -> Any:
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        devices=[
            pb.DeviceRequest(
                device_index=i, gpu_uuid=gpu, profile=profile, placement=pb.Placement(start=start, size=size)
            )
            for i, (gpu, profile, start, size) in enumerate(devices)
        ],
    )
    return car.stub.Allocate(request, timeout=30)


def release(car: Sidecar, pod: str) -> Any:
    return car.stub.Release(pb.ReleaseRequest(pod_uid=pod), timeout=30)


def seen(car: Sidecar) -> tuple[Any, ...]:
    """Hardware (instances and foreign ones as GetState shows them), record files and CDI files."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=30)
    hardware = sorted(
        (g.gpu.uuid, i.mig_uuid, i.gpu_instance_id, i.compute_instance_id, i.state, i.placement.start)
        for g in state.gpus
        for i in g.instances
    ) + sorted((g.gpu.uuid, f.gpu_instance_id, f.placement.start) for g in state.gpus for f in g.foreign)
    records = sorted(p.name for p in car.state_dir.glob("*.json"))
    cdi = sorted(p.name for p in car.cdi_dir.glob("*.json")) if car.cdi_dir.exists() else []
    return hardware, records, cdi


@pytest.fixture
def car(sidecar: Sidecar) -> Sidecar:
    sidecar.recover()
    return sidecar


class TestReuseAndReclaim:
    def test_create_release_and_the_same_reservation_again_reuses_the_mig_uuid(self, car: Sidecar) -> None:
        gpu = h100(car)
        first = allocate(car, "pod-a", (gpu, "3g.40gb", 4, 4)).devices[0]
        release(car, "pod-a")
        hardware = SimulatedHardware.open(car.sim_state).layout(0)

        again = allocate(car, "pod-b", (gpu, "3g.40gb", 4, 4)).devices[0]

        assert first.outcome == pb.CREATED
        assert again.outcome == pb.REUSED
        assert (again.mig_uuid, again.gpu_instance_id, again.compute_instance_id) == (
            first.mig_uuid,
            first.gpu_instance_id,
            first.compute_instance_id,
        )
        assert SimulatedHardware.open(car.sim_state).layout(0) == hardware  # nothing created or destroyed

    def test_an_overlapping_idle_instance_is_reclaimed_and_a_distant_one_survives(self, car: Sidecar) -> None:
        gpu = h100(car)
        in_way = allocate(car, "pod-a", (gpu, "1g.10gb", 5, 1)).devices[0]
        far = allocate(car, "pod-b", (gpu, "1g.10gb", 0, 1)).devices[0]
        release(car, "pod-a")
        release(car, "pod-b")

        result = allocate(car, "pod-c", (gpu, "3g.40gb", 4, 4))

        assert [r.mig_uuid for r in result.reclaimed] == [in_way.mig_uuid]
        hardware, records, cdi = seen(car)
        assert {h[1] for h in hardware} == {far.mig_uuid, result.devices[0].mig_uuid}
        assert len(records) == 2
        assert not any(in_way.mig_uuid in name for name in cdi)
        assert any(far.mig_uuid in name for name in cdi)


class TestBlockers:
    def test_an_active_instance_blocks_and_nothing_changes(self, car: Sidecar) -> None:
        gpu = h100(car)
        active = allocate(car, "pod-a", (gpu, "1g.10gb", 6, 1)).devices[0]
        before = seen(car)

        with pytest.raises(grpc.RpcError) as caught:
            allocate(car, "pod-b", (gpu, "3g.40gb", 4, 4))

        code, reason, meta = error_info(caught.value)
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PLACEMENT_BUSY")
        assert (meta["blocker"], meta["mig_uuid"]) == ("ACTIVE", active.mig_uuid)
        assert seen(car) == before

    def test_a_foreign_instance_blocks_and_nothing_changes(self, car: Sidecar) -> None:
        gpu = h100(car)
        SimulatedHardware.open(car.sim_state).create_instance(0, "1g.10gb", 5, 1)
        before = seen(car)

        with pytest.raises(grpc.RpcError) as caught:
            allocate(car, "pod-b", (gpu, "3g.40gb", 4, 4))

        _, reason, meta = error_info(caught.value)
        assert (reason, meta["blocker"]) == ("PLACEMENT_BUSY", "foreign")
        assert seen(car) == before

    def test_an_error_instance_blocks_until_the_reconciler_destroys_it(self, car: Sidecar) -> None:
        gpu = h100(car)
        stuck = allocate(car, "pod-a", (gpu, "1g.10gb", 4, 1)).devices[0]
        release(car, "pod-a")
        hw = SimulatedHardware.open(car.sim_state)
        hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
        with pytest.raises(grpc.RpcError) as failed:
            allocate(car, "pod-b", (gpu, "3g.40gb", 4, 4))
        assert error_info(failed.value)[:2] == (grpc.StatusCode.UNAVAILABLE, "NVML_ERROR")

        with pytest.raises(grpc.RpcError) as caught:
            allocate(car, "pod-c", (gpu, "1g.10gb", 4, 1))
        _, reason, meta = error_info(caught.value)
        assert (reason, meta["blocker"], meta["mig_uuid"]) == ("PLACEMENT_BUSY", "ERROR", stuck.mig_uuid)

        hw.clear_faults()
        result, reasons, pause = None, set(), threading.Event()
        for _ in range(300):  # the reconciler runs every 0.2 s in these tests
            try:
                result = allocate(car, "pod-c", (gpu, "3g.40gb", 4, 4))
                break
            except grpc.RpcError as exc:
                reasons.add(error_info(exc)[1])
                pause.wait(0.05)
        assert reasons <= {"PLACEMENT_BUSY"}
        assert result is not None
        assert result.devices[0].outcome == pb.CREATED
        hardware, _, cdi = seen(car)
        assert stuck.mig_uuid not in {h[1] for h in hardware}
        assert not any(stuck.mig_uuid in name for name in cdi)


class TestAllOrNothing:
    def test_a_failing_second_device_leaves_nothing_behind(self, car: Sidecar) -> None:
        SimulatedHardware.open(car.sim_state).inject_fault(
            "create-gi", NVML_ERROR_UNKNOWN, after=1, times=FOREVER
        )

        with pytest.raises(grpc.RpcError):
            allocate(car, "pod-a", (h100(car, 0), "1g.10gb", 0, 1), (h100(car, 1), "1g.10gb", 0, 1))

        assert seen(car) == ([], [], [])


class TestLegacyMode:
    def test_without_cdi_the_lifecycle_works_and_the_cdi_dir_stays_empty(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=["--no-cdi"])
        assert "--cdi-dir" not in car.command()
        car.recover()
        gpu = h100(car)
        first = allocate(car, "pod-a", (gpu, "1g.10gb", 4, 1)).devices[0]
        release(car, "pod-a")
        again = allocate(car, "pod-b", (gpu, "1g.10gb", 4, 1)).devices[0]
        release(car, "pod-b")
        reclaimed = allocate(car, "pod-c", (gpu, "3g.40gb", 4, 4)).reclaimed

        assert (first.cdi_device, again.outcome, again.mig_uuid) == ("", pb.REUSED, first.mig_uuid)
        assert [r.mig_uuid for r in reclaimed] == [first.mig_uuid]
        assert not car.cdi_dir.exists() or list(car.cdi_dir.iterdir()) == []
