"""Follow-ups of a correctness review, over the socket: what the Go plugin sees of each decision.

Each test talks to a real sidecar process on simulated hardware kept in a state file, and checks the
gRPC status and reason, GetInfo/GetState and the files.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import Sidecar, error_info, snapshot_dir

from sidecar.nvml.simulated import SimulatedHardware

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


def failure(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return error_info(caught.value)


def states(car: Sidecar) -> dict[str, int]:
    """MIG UUID -> InstanceState of every owned instance, as GetState reports it."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=30)
    return {i.mig_uuid: i.state for g in state.gpus for i in g.instances}


def files(car: Sidecar) -> tuple[dict[str, bytes], dict[str, bytes]]:
    return snapshot_dir(car.state_dir), snapshot_dir(car.cdi_dir)


class TestGenerationAcrossKill9:
    def test_a_sync_active_fenced_before_the_crash_never_idles_an_instance_allocated_after_it(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        allocate(sidecar, "pod-b", 0, "1g.10gb", 0, 1)
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=30)
        sidecar.sim("fault", "create-gi", "999")
        code, _, _ = failure(lambda: allocate(sidecar, "pod-c", 0, "2g.20gb", 0, 2))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert sidecar.records() == {}  # the instance activated last is gone, with its record
        read_by_the_plugin = sidecar.info().generation

        sidecar.kill9()
        sidecar.start()
        sidecar.recover()
        assert sidecar.info().generation >= read_by_the_plugin
        d = allocate(sidecar, "pod-d", 0, "1g.10gb", 4, 1)
        synced = sidecar.stub.SyncActive(pb.SyncActiveRequest(generation=read_by_the_plugin), timeout=30)

        assert list(synced.idled) == []
        assert states(sidecar) == {d.mig_uuid: pb.ACTIVE}


class TestRepeatedRecover:
    def test_a_second_recover_with_an_old_pod_list_keeps_a_newer_allocation_active(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        held = allocate(sidecar, "pod-a", 0, "1g.10gb", 0, 1)

        sidecar.recover()  # a pod list taken before pod-a's Allocate

        assert states(sidecar) == {held.mig_uuid: pb.ACTIVE}


class TestReuseOfABusyIdleInstance:
    def test_reuse_while_a_process_still_runs_is_unavailable_instance_in_use_and_then_succeeds(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        old = allocate(sidecar, "pod-old", 0, "1g.10gb", 0, 1)
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-old"), timeout=30)
        sidecar.sim("busy", "--mig-uuid", old.mig_uuid, "on")

        code, reason, metadata = failure(lambda: allocate(sidecar, "pod-new", 0, "1g.10gb", 0, 1))

        assert (code, reason, metadata["mig_uuid"]) == (
            grpc.StatusCode.UNAVAILABLE,
            "INSTANCE_IN_USE",
            old.mig_uuid,
        )
        assert states(sidecar) == {old.mig_uuid: pb.IDLE}
        sidecar.sim("busy", "--mig-uuid", old.mig_uuid, "off")
        again = allocate(sidecar, "pod-new", 0, "1g.10gb", 0, 1)
        assert (again.outcome, again.mig_uuid) == (pb.REUSED, old.mig_uuid)


class TestLegacyMigUuid:
    def test_recover_over_a_legacy_mig_uuid_is_unverifiable_state_and_changes_no_file(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.sim("create", "--gpu", "1", "--profile", "1g.10gb", "--placement", "0:1")
        with SimulatedHardware.open(sidecar.sim_state).store.transaction() as state:
            gpu = state.gpus[1]
            gi = gpu.gis[0]
            ci = gi.cis[0]
            ci.mig_uuid = legacy = f"MIG-{gpu.uuid}/{gi.id}/{ci.id}"  # what R450/R460 drivers report
        before = files(sidecar)

        code, reason, metadata = failure(sidecar.recover)

        assert (code, reason, metadata["mig_uuid"]) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "UNVERIFIABLE_STATE",
            legacy,
        )
        assert files(sidecar) == before
        assert not sidecar.info().recovered
