"""HAMi's lazy-lifecycle scenarios that the first contract answered differently, over the socket.

Each test starts a real ``serve`` process on simulated GPUs (GPU 0 is an H100-80GB), talks to it as
the plugin does, and reads the outcome where an operator would: the simulated hardware (``sim list``),
the record files and the CDI directory. The reconciler is quiet (an hour between rounds), so what
changes is the request's doing, not a background round's.

- an ERROR instance in a request's way (at exactly its reservation, or overlapping it) is destroyed
  inside the Allocate, then the create proceeds; a destroy that fails again answers UNAVAILABLE;
- a pending reservation (an ``ActiveAllocation`` without runtime identity) is accepted by Recover and
  SyncActive and keeps the IDLE or ERROR instance at exactly its spot from being destroyed;
- a file at a spec's path that is not this sidecar's spec is never overwritten nor removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from helpers_e2e import wait_until
from sidecar_process import (
    CALL_TIMEOUT_S,
    Sidecar,
    SidecarFactory,
    allocate_one,
    failure,
    gpu_uuid,
    states,
)

from sidecar.lifecycle import crashpoints

pytestmark = pytest.mark.e2e

QUIET = ["--reconcile-interval", "3600"]
FOREVER = "1000"


def live_mig_uuids(car: Sidecar) -> set[str]:
    return {ci["mig_uuid"] for g in car.hardware() for gi in g["gis"] for ci in gi["cis"]}


def record_states(car: Sidecar) -> dict[str, str]:
    """MIG UUID -> state of every record file."""
    return {r["mig_uuid"]: r["state"] for r in car.records().values()}


def release(car: Sidecar, pod: str) -> None:
    car.stub.Release(pb.ReleaseRequest(pod_uid=pod), timeout=CALL_TIMEOUT_S)


def allocate(car: Sidecar, pod: str, profile: str, start: int, size: int) -> Any:
    """The whole Allocate response for one device on GPU 0."""
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        devices=[
            pb.DeviceRequest(
                gpu_uuid=gpu_uuid(car, 0), profile=profile, placement=pb.Placement(start=start, size=size)
            )
        ],
    )
    return car.stub.Allocate(request, timeout=CALL_TIMEOUT_S)


def make_error(car: Sidecar, pod: str = "pod-a", start: int = 4) -> Any:
    """An ERROR instance 1g.10gb@start:1 on GPU 0: allocated, released, its reclaim's destroy failing
    (``sim fault``). The fault stays; the caller clears it (``sim faults --clear``) when it wants.
    The reclaim asks for the 2g.20gb around it only, so an ERROR instance elsewhere is not in its way."""
    device = allocate_one(car, pod, 0, "1g.10gb", start, 1)
    release(car, pod)
    car.sim("fault", "destroy-ci", "999", "--times", FOREVER)
    code, reason, _ = failure(lambda: allocate_one(car, f"{pod}-reclaimer", 0, "2g.20gb", start // 2 * 2, 2))
    assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "NVML_ERROR")
    assert record_states(car)[device.mig_uuid] == "ERROR"
    return device


def spec_names(car: Sidecar) -> set[str]:
    return set(car.cdi_files())


class TestAnErrorInstanceInTheWayIsRetriedInline:
    """HAMi's TestMIGErrorAtExactKeyRetriesReclamation, over the socket."""

    def test_at_exactly_the_key_it_is_destroyed_then_the_instance_is_created(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=QUIET)
        car.recover()
        broken = make_error(car)
        car.sim("faults", "--clear")

        response = allocate(car, "pod-a", "1g.10gb", 4, 1)  # the same key and reservation

        [device] = response.devices
        assert device.outcome == pb.CREATED
        assert device.mig_uuid != broken.mig_uuid
        assert [r.mig_uuid for r in response.reclaimed] == [broken.mig_uuid]
        assert broken.mig_uuid not in live_mig_uuids(car)
        assert record_states(car) == {device.mig_uuid: "ACTIVE"}
        assert not any(broken.mig_uuid in name for name in spec_names(car))

    def test_overlapping_the_placement_it_is_destroyed_with_the_idle_instances_in_the_way(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=QUIET)
        car.recover()
        broken = make_error(car)
        car.sim("faults", "--clear")
        idle = allocate_one(car, "pod-idle", 0, "1g.10gb", 5, 1)
        release(car, "pod-idle")

        response = allocate(car, "pod-new", "3g.40gb", 4, 4)

        [device] = response.devices
        assert device.outcome == pb.CREATED
        assert {r.mig_uuid for r in response.reclaimed} == {broken.mig_uuid, idle.mig_uuid}
        assert live_mig_uuids(car) == {device.mig_uuid}
        assert record_states(car) == {device.mig_uuid: "ACTIVE"}

    def test_a_destroy_that_fails_again_answers_unavailable_and_destroys_nothing_else(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=QUIET)
        car.recover()
        broken = make_error(car)
        idle = allocate_one(car, "pod-idle", 0, "1g.10gb", 5, 1)
        release(car, "pod-idle")
        hardware = car.hardware()

        code, reason, meta = failure(lambda: allocate(car, "pod-new", "3g.40gb", 4, 4))

        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "NVML_ERROR")
        assert (meta["blocker"], meta["mig_uuid"]) == ("ERROR", broken.mig_uuid)
        assert car.hardware() == hardware  # the idle instance behind it was not reclaimed
        assert record_states(car) == {broken.mig_uuid: "ERROR", idle.mig_uuid: "IDLE"}

        car.sim("faults", "--clear")  # the same request succeeds once the destroy does
        assert allocate(car, "pod-new", "3g.40gb", 4, 4).devices[0].outcome == pb.CREATED

    def test_a_kill9_after_the_inline_destroy_leaves_nothing_behind_after_recover(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=QUIET, env={crashpoints.ENV: "after-inline-error-retry"})
        car.recover()
        broken = make_error(car)
        car.sim("faults", "--clear")
        with pytest.raises(grpc.RpcError):
            allocate(car, "pod-a", "1g.10gb", 4, 1)
        assert car.proc is not None
        assert car.proc.wait(timeout=30) == 137
        assert broken.mig_uuid not in live_mig_uuids(car)

        car.restart(env={})
        report = car.recover()

        assert list(report.errors) == []
        assert (car.records(), car.cdi_files(), live_mig_uuids(car)) == ({}, [], set())
        assert allocate(car, "pod-a", "1g.10gb", 4, 1).devices[0].outcome == pb.CREATED
        assert set(states(car).values()) == {pb.ACTIVE}


def pending(car: Sidecar, pod: str, profile: str, start: int, size: int) -> Any:
    """What the plugin lists for a pod the scheduler reserved a spot for, before its Allocate."""
    return pb.ActiveAllocation(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        gpu_uuid=gpu_uuid(car, 0),
        profile=profile,
        placement=pb.Placement(start=start, size=size),
    )


class TestAPendingReservation:
    """HAMi's TestMIGCleanupRetryPreservesActiveReservation, and Recover accepting the reservation."""

    def test_recover_accepts_it_and_it_guards_the_error_instance_at_it_until_its_allocate(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory()  # the reconciler retries every 0.2 s
        car.recover()
        guarded = make_error(car, "pod-a", 0)
        unguarded = make_error(car, "pod-c", 4)
        car.kill9()
        car.start()

        report = car.recover([pending(car, "pod-q", "1g.10gb", 0, 1)])

        assert list(report.errors) == []
        assert record_states(car) == {guarded.mig_uuid: "ERROR", unguarded.mig_uuid: "ERROR"}
        car.sim("faults", "--clear")
        # A round visits the records in name order (placement 0:1 before 4:1, as recovery installed
        # them), so once the unguarded one is gone, a round has passed the guarded one by.
        wait_until(
            "the reconciler destroyed the unguarded instance",
            lambda: unguarded.mig_uuid not in record_states(car),
        )
        assert record_states(car) == {guarded.mig_uuid: "ERROR"}
        assert guarded.mig_uuid in live_mig_uuids(car)

        code, reason, meta = failure(lambda: allocate(car, "pod-x", "3g.40gb", 0, 4))
        assert (code, reason, meta["blocker"]) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "PLACEMENT_BUSY",
            "ERROR",
        )
        assert meta["guarded_by"] == "pending reservation of pod-q/0/0"

        response = allocate(car, "pod-q", "1g.10gb", 0, 1)  # the reservation's own Allocate
        assert response.devices[0].outcome == pb.CREATED
        assert [r.mig_uuid for r in response.reclaimed] == [guarded.mig_uuid]

    def test_sync_active_sets_it_and_a_kill9_right_after_loses_nothing_recover_cannot_restore(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=QUIET, env={crashpoints.ENV: "after-sync-pending"})
        car.recover()
        idle = allocate_one(car, "pod-a", 0, "1g.10gb", 4, 1)
        release(car, "pod-a")
        listed = [pending(car, "pod-q", "1g.10gb", 4, 1)]
        with pytest.raises(grpc.RpcError):
            car.stub.SyncActive(
                pb.SyncActiveRequest(generation=car.info().generation, active=listed), timeout=CALL_TIMEOUT_S
            )
        assert car.proc is not None
        assert car.proc.wait(timeout=30) == 137

        car.restart(env={})
        car.recover(listed)  # the plugin's next list still has the reservation
        hardware = car.hardware()

        code, reason, meta = failure(lambda: allocate(car, "pod-x", "3g.40gb", 4, 4))
        assert (reason, meta["blocker"], meta["mig_uuid"]) == ("PLACEMENT_BUSY", "IDLE", idle.mig_uuid)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert car.hardware() == hardware
        reused = allocate(car, "pod-q", "1g.10gb", 4, 1).devices[0]
        assert (reused.outcome, reused.mig_uuid) == (pb.REUSED, idle.mig_uuid)


def spec_path(car: Sidecar, mig_uuid: str) -> Path:
    return car.cdi_dir / f"k8s.hami.io-mig_{mig_uuid}.json"


def spec_of(kind: str, *names: str) -> bytes:
    devices = [{"name": n, "containerEdits": {"env": ["FROM=someone-else"]}} for n in names]
    return json.dumps({"cdiVersion": "0.5.0", "kind": kind, "devices": devices}).encode()


OTHER_MIG = "MIG-0badc0de-1111-5222-8333-444455556666"


def idle_with_file(car: Sidecar, content: bytes) -> tuple[Any, Path]:
    """pod-a's 1g.10gb@4:1, released (IDLE), with ``content`` put where its spec file is."""
    idle = allocate_one(car, "pod-a", 0, "1g.10gb", 4, 1)
    release(car, "pod-a")
    path = spec_path(car, idle.mig_uuid)
    assert path.is_file()
    path.write_bytes(content)
    return idle, path


class TestAFileThatIsNotThisSidecarsSpec:
    """HAMi's CDI ownership: only a spec of this kind naming that MIG UUID is the sidecar's."""

    @pytest.mark.parametrize("kind", ["foreign kind", "mismatched MIG UUID"])
    def test_is_kept_on_ensure_and_on_remove(self, sidecar_factory: SidecarFactory, kind: str) -> None:
        car = sidecar_factory(extra_args=QUIET)
        car.recover()
        content = (
            spec_of("nvidia.com/gpu", "placeholder")
            if kind == "foreign kind"
            else spec_of("k8s.hami.io/mig", OTHER_MIG)
        )
        idle, path = idle_with_file(car, content.replace(b"placeholder", b"MIG-anything"))
        content = path.read_bytes()

        code, reason, meta = failure(lambda: allocate(car, "pod-b", "1g.10gb", 4, 1))  # reuse: ensure

        assert (code, reason, meta["file"]) == (grpc.StatusCode.UNAVAILABLE, "STATE_WRITE_FAILED", str(path))
        assert path.read_bytes() == content
        assert record_states(car) == {idle.mig_uuid: "IDLE"}

        response = allocate(car, "pod-c", "3g.40gb", 4, 4)  # reclaims it: remove

        assert [r.mig_uuid for r in response.reclaimed] == [idle.mig_uuid]
        assert path.read_bytes() == content
        assert idle.mig_uuid not in live_mig_uuids(car)
        assert record_states(car) == {response.devices[0].mig_uuid: "ACTIVE"}
        state = car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
        assert list(state.pending_cdi_removals) == []  # no retry makes it ours

    def test_recovery_keeps_it_and_says_so(self, sidecar_factory: SidecarFactory) -> None:
        car = sidecar_factory(extra_args=QUIET)
        car.recover()
        idle, path = idle_with_file(car, spec_of("nvidia.com/gpu", "MIG-anything"))
        content = path.read_bytes()
        car.kill9()
        car.start()

        report = car.recover()

        assert any(str(path) in line for line in report.errors)
        assert path.read_bytes() == content
        assert record_states(car) == {idle.mig_uuid: "IDLE"}

    def test_a_corrupt_spec_of_this_kind_naming_the_instance_is_rewritten(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=QUIET)
        car.recover()
        first = allocate_one(car, "pod-a", 0, "1g.10gb", 4, 1)
        good = spec_path(car, first.mig_uuid).read_bytes()
        release(car, "pod-a")
        spec_path(car, first.mig_uuid).write_bytes(spec_of("k8s.hami.io/mig", first.mig_uuid))

        reused = allocate(car, "pod-b", "1g.10gb", 4, 1).devices[0]

        assert (reused.outcome, reused.mig_uuid) == (pb.REUSED, first.mig_uuid)
        assert spec_path(car, first.mig_uuid).read_bytes() == good

    def test_a_kill9_after_a_reclaim_kept_it_leaves_it_and_nothing_else_after_recover(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=QUIET, env={crashpoints.ENV: "after-foreign-cdi-kept"})
        car.recover()
        idle, path = idle_with_file(car, spec_of("nvidia.com/gpu", "MIG-anything"))
        content = path.read_bytes()
        with pytest.raises(grpc.RpcError):
            allocate(car, "pod-c", "3g.40gb", 4, 4)
        assert car.proc is not None
        assert car.proc.wait(timeout=30) == 137
        assert idle.mig_uuid not in live_mig_uuids(car)  # destroyed, its record not deleted yet
        assert [r["state"] for r in car.records().values()] == ["DELETING"]

        car.restart(env={})
        report = car.recover()

        assert list(report.errors) == []
        assert (car.records(), live_mig_uuids(car)) == ({}, set())
        assert car.cdi_files() == [path.name]
        assert path.read_bytes() == content
        assert allocate(car, "pod-c", "3g.40gb", 4, 4).devices[0].outcome == pb.CREATED
