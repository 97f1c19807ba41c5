"""Claim owners over the Unix socket: a real ``serve`` process on simulated GPUs, talked to as a DRA
kubelet plugin (Allocate with ``claim``, ``Release{claim_uid}``) and HAMi's device plugin (pods,
SyncActive, UndoAllocate) do. Outcomes are read from the simulated driver (``sim list``, ``sim
stats``), the record files, the CDI directory and GetState, never from the sidecar's memory alone.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import (
    CALL_TIMEOUT_S,
    Sidecar,
    SidecarFactory,
    allocate_one,
    failure,
    gpu_uuid,
    instances,
    snapshot_dir,
)

from sidecar.nvml.sim import OP_ALIASES

pytestmark = pytest.mark.e2e

QUIET = ("--reconcile-interval", "3600")  # no background round while a test compares snapshots


@pytest.fixture
def car(sidecar_factory: SidecarFactory) -> Sidecar:
    car = sidecar_factory(QUIET)
    car.recover()
    return car


def claim_allocate(car: Sidecar, claim: str, *starts: int, request: str = "gpu") -> pb.AllocateRequest:
    """A claim's Allocate of one 1g.10gb device per placement start on GPU 0."""
    return pb.AllocateRequest(
        claim=pb.ClaimRef(uid=claim, namespace="team-a", name=f"name-{claim}"),
        devices=[
            pb.DeviceRequest(
                device_index=i,
                gpu_uuid=gpu_uuid(car, 0),
                profile="1g.10gb",
                placement=pb.Placement(start=start, size=1),
                request=request,
            )
            for i, start in enumerate(starts)
        ],
    )


def allocate(car: Sidecar, claim: str, *starts: int, request: str = "gpu") -> Any:
    return car.stub.Allocate(claim_allocate(car, claim, *starts, request=request), timeout=CALL_TIMEOUT_S)


def release_claim(car: Sidecar, claim: str) -> Any:
    return car.stub.Release(pb.ReleaseRequest(claim_uid=claim), timeout=CALL_TIMEOUT_S)


def gi_creates(car: Sidecar) -> int:
    stats = car.sim_stats()
    assert stats is not None
    return sum(int(n) for fn, n in stats["calls"].items() if fn in OP_ALIASES["create-gi"])


def everything(car: Sidecar) -> tuple[object, ...]:
    """The hardware, the record files and the CDI files: what "nothing changed" compares."""
    return car.hardware(), snapshot_dir(car.state_dir), snapshot_dir(car.cdi_dir)


def state_names(car: Sidecar) -> dict[str, str]:
    return {mig: pb.InstanceState.Name(i.state) for mig, i in instances(car).items()}


class TestAClaimThroughTheSocket:
    def test_create_release_and_reuse_by_the_next_claim_without_a_gi_created(self, car: Sidecar) -> None:
        first = allocate(car, "claim-a", 0).devices[0]
        assert pb.Outcome.Name(first.outcome) == "CREATED"
        assert first.cdi_device == f"k8s.hami.io/mig={first.mig_uuid}"
        assert any(first.mig_uuid in name for name in car.cdi_files())

        released = release_claim(car, "claim-a").released
        assert [r.mig_uuid for r in released] == [first.mig_uuid]
        assert state_names(car) == {first.mig_uuid: "IDLE"}
        creates = gi_creates(car)

        second = allocate(car, "claim-b", 0).devices[0]

        assert pb.Outcome.Name(second.outcome) == "REUSED"
        assert second.mig_uuid == first.mig_uuid
        assert gi_creates(car) == creates
        [record] = car.records().values()
        assert record["state"] == "ACTIVE"
        assert record["owner"]["kind"] == "CLAIM"
        assert record["owner"]["claim"] == {"uid": "claim-b", "namespace": "team-a", "name": "name-claim-b"}
        assert record["owner"]["request"] == "gpu"

    def test_get_state_and_status_name_the_claim_and_its_request(self, car: Sidecar) -> None:
        claims = allocate(car, "claim-a", 0, request="gpu/small").devices[0]
        pods = allocate_one(car, "pod-a", 0, "1g.10gb", 1, 1)

        owners = {mig: i.owner for mig, i in instances(car).items()}

        claim_owner, pod_owner = owners[claims.mig_uuid], owners[pods.mig_uuid]
        assert pb.OwnerKind.Name(claim_owner.kind) == "OWNER_KIND_CLAIM"
        assert (claim_owner.claim.uid, claim_owner.claim.name, claim_owner.request) == (
            "claim-a",
            "name-claim-a",
            "gpu/small",
        )
        assert not claim_owner.HasField("pod")
        assert pb.OwnerKind.Name(pod_owner.kind) == "OWNER_KIND_POD"
        assert pod_owner.pod.uid == "pod-a"
        status = car.cli("status", "--socket", str(car.socket))
        assert status.returncode == 0, status.stderr
        assert "claim team-a/name-claim-a[gpu/small/0]" in status.stdout
        assert "default/pod-a[0/0]" in status.stdout

    def test_a_repeat_is_already_allocated_and_other_devices_a_key_conflict(self, car: Sidecar) -> None:
        first = allocate(car, "claim-a", 0, 1)
        before = everything(car)

        again = allocate(car, "claim-a", 0, 1)
        code, reason, _ = failure(lambda: allocate(car, "claim-a", 2))

        assert [pb.Outcome.Name(d.outcome) for d in again.devices] == ["ALREADY_ALLOCATED"] * 2
        assert [d.mig_uuid for d in again.devices] == [d.mig_uuid for d in first.devices]
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "KEY_CONFLICT")
        assert everything(car) == before

    @pytest.mark.parametrize(
        "mutate",
        [
            pytest.param(lambda r: r.pod.CopyFrom(pb.PodRef(uid="pod-a")), id="pod and claim"),
            pytest.param(lambda r: setattr(r, "container_name", "main"), id="claim with a container"),
            pytest.param(lambda r: setattr(r.claim, "uid", "claim a"), id="malformed claim uid"),
            pytest.param(lambda r: setattr(r.devices[0], "request", ""), id="no request"),
            pytest.param(lambda r: setattr(r.devices[0], "request", "Gpu"), id="malformed request"),
        ],
    )
    def test_a_malformed_claim_allocate_is_invalid_and_changes_nothing(
        self, car: Sidecar, mutate: Any
    ) -> None:
        allocate(car, "claim-a", 0)
        request = claim_allocate(car, "claim-b", 1)
        mutate(request)
        before = everything(car)

        code, reason, metadata = failure(lambda: car.stub.Allocate(request, timeout=CALL_TIMEOUT_S))

        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        assert metadata["field"]
        assert everything(car) == before

    @pytest.mark.parametrize(
        "request_",
        [pb.ReleaseRequest(), pb.ReleaseRequest(pod_uid="claim-a", claim_uid="claim-a")],
        ids=["neither", "both"],
    )
    def test_a_release_naming_not_exactly_one_owner_is_invalid_and_changes_nothing(
        self, car: Sidecar, request_: pb.ReleaseRequest
    ) -> None:
        allocate(car, "claim-a", 0)
        before = everything(car)
        code, reason, metadata = failure(lambda: car.stub.Release(request_, timeout=CALL_TIMEOUT_S))
        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        assert metadata["field"] == "pod_uid,claim_uid"
        assert everything(car) == before

    def test_the_json_call_allocates_and_releases_a_claim(self, car: Sidecar) -> None:
        body = json.dumps(
            {
                "claim": {"uid": "claim-j", "namespace": "team-a", "name": "j"},
                "devices": [
                    {
                        "device_index": 0,
                        "gpu_uuid": gpu_uuid(car, 0),
                        "profile": "1g.10gb",
                        "placement": {"start": 0, "size": 1},
                        "request": "gpu",
                    }
                ],
            }
        )
        made = car.cli("call", "Allocate", body, "--socket", str(car.socket))
        assert made.returncode == 0, made.stderr
        mig_uuid = json.loads(made.stdout)["devices"][0]["mig_uuid"]
        assert state_names(car) == {mig_uuid: "ACTIVE"}

        gone = car.cli("call", "Release", '{"claim_uid": "claim-j"}', "--socket", str(car.socket))

        assert gone.returncode == 0, gone.stderr
        assert [r["mig_uuid"] for r in json.loads(gone.stdout)["released"]] == [mig_uuid]
        assert state_names(car) == {mig_uuid: "IDLE"}


class TestPodsAndClaimsOnOneSidecar:
    def test_neither_kind_releases_the_others_instances(self, car: Sidecar) -> None:
        claims = allocate(car, "uid-1", 0).devices[0]
        pods = allocate_one(car, "uid-1", 0, "1g.10gb", 1, 1)
        generation = car.info().generation

        # HAMi's device plugin: a pod list without the claim, its own pod's release, its undo.
        car.stub.UndoAllocate(
            pb.UndoAllocateRequest(pod_uid="uid-1", container_index=5), timeout=CALL_TIMEOUT_S
        )
        undone = car.stub.UndoDevice(
            pb.UndoDeviceRequest(mig_uuid=claims.mig_uuid, pod_uid="uid-1"), timeout=CALL_TIMEOUT_S
        )
        assert pb.UndoSkip.Name(undone.skipped) == "UNDO_SKIP_OTHER_OWNER"
        synced = car.stub.SyncActive(pb.SyncActiveRequest(generation=generation), timeout=CALL_TIMEOUT_S)
        assert [r.mig_uuid for r in synced.idled] == [pods.mig_uuid]
        assert state_names(car) == {claims.mig_uuid: "ACTIVE", pods.mig_uuid: "IDLE"}

        # And the other way round: a claim's release leaves a pod's instance ACTIVE.
        again = allocate_one(car, "uid-1", 0, "1g.10gb", 1, 1)
        assert [r.mig_uuid for r in release_claim(car, "uid-1").released] == [claims.mig_uuid]
        assert car.stub.Release(pb.ReleaseRequest(pod_uid="uid-1"), timeout=CALL_TIMEOUT_S).released[
            0
        ].mig_uuid == (again.mig_uuid)
        assert state_names(car) == {claims.mig_uuid: "IDLE", pods.mig_uuid: "IDLE"}

    def test_a_claims_instance_stays_active_across_a_sidecar_restart(self, car: Sidecar) -> None:
        claims = allocate(car, "claim-a", 0).devices[0]
        pods = allocate_one(car, "pod-a", 0, "1g.10gb", 1, 1)
        record_before = next(r for r in car.records().values() if r["mig_uuid"] == claims.mig_uuid)

        car.kill9()
        car.start()
        report = car.recover()  # HAMi's plugin lists no pod: the pod's instance goes IDLE

        assert list(report.errors) == []
        assert state_names(car) == {claims.mig_uuid: "ACTIVE", pods.mig_uuid: "IDLE"}
        record_after = next(r for r in car.records().values() if r["mig_uuid"] == claims.mig_uuid)
        assert record_after == record_before
        assert pb.Outcome.Name(allocate(car, "claim-a", 0).devices[0].outcome) == "ALREADY_ALLOCATED"
        assert [r.mig_uuid for r in release_claim(car, "claim-a").released] == [claims.mig_uuid]
