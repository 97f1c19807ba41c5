"""UndoAllocate, ReclaimIdle and SetMigMode(reclaim_idle) over the socket, the ``reclaim`` CLI, and
kill -9 at their crash points followed by Recover.

"Nothing changed" is checked where an operator would look: GetState, the record files, the CDI files
and the simulated hardware's layout. The sidecars run with an hour-long reconciler interval so no
background round rewrites a file while a test compares snapshots.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from helpers_e2e import TAKEOVER_POINTS, assert_converged, crash_during
from sidecar_process import (
    CALL_TIMEOUT_S,
    Sidecar,
    SidecarFactory,
    allocate_one,
    annotation,
    failure,
    gpu_uuid,
    layouts,
    snapshot_dir,
    states,
)

from sidecar.lifecycle import crashpoints

pytestmark = pytest.mark.e2e

QUIET = ["--reconcile-interval", "3600"]
NOBODY = "MIG-00000000-0000-0000-0000-000000000000"


def allocate(car: Sidecar, pod: str, *devices: tuple[int, str, int, int]) -> Any:
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        devices=[
            pb.DeviceRequest(
                device_index=i,
                gpu_uuid=gpu_uuid(car, gpu),
                profile=profile,
                placement=pb.Placement(start=start, size=size),
            )
            for i, (gpu, profile, start, size) in enumerate(devices)
        ],
    )
    return car.stub.Allocate(request, timeout=CALL_TIMEOUT_S)


def idle(car: Sidecar, pod: str, gpu: int, start: int) -> str:
    mig: str = allocate_one(car, pod, gpu, "1g.10gb", start, 1).mig_uuid
    car.stub.Release(pb.ReleaseRequest(pod_uid=pod), timeout=CALL_TIMEOUT_S)
    return mig


def undo(car: Sidecar, pod: str, container: int = 0) -> Any:
    request = pb.UndoAllocateRequest(pod_uid=pod, container_index=container)
    return car.stub.UndoAllocate(request, timeout=CALL_TIMEOUT_S)


def reclaim(car: Sidecar, gpu: int, *mig_uuids: str) -> Any:
    request = pb.ReclaimIdleRequest(gpu_uuid=gpu_uuid(car, gpu), mig_uuids=list(mig_uuids))
    return car.stub.ReclaimIdle(request, timeout=CALL_TIMEOUT_S)


def everything(car: Sidecar) -> tuple[Any, ...]:
    """GetState, record files, CDI files and the hardware layout: what "nothing changed" compares."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
    return state, snapshot_dir(car.state_dir), snapshot_dir(car.cdi_dir), layouts(car)


def live(car: Sidecar) -> set[str]:
    return {ci.mig_uuid for g in layouts(car) for gi in g.gis for ci in gi.cis}


@pytest.fixture
def car(sidecar_factory: SidecarFactory) -> Sidecar:
    made = sidecar_factory(extra_args=QUIET)
    made.recover()
    return made


class TestUndoAllocate:
    def test_the_created_instance_goes_the_reused_one_idles_and_a_repeat_is_empty(self, car: Sidecar) -> None:
        first = idle(car, "pod-a", 0, 0)
        devices = allocate(car, "pod-b", (0, "1g.10gb", 0, 1), (0, "1g.10gb", 1, 1)).devices
        assert [d.outcome for d in devices] == [pb.REUSED, pb.CREATED]
        created = devices[1].mig_uuid
        assert {r["mig_uuid"]: r["origin"] for r in car.records().values()} == {
            first: "REUSED",
            created: "CREATED",
        }

        answer = undo(car, "pod-b")

        assert [r.mig_uuid for r in answer.destroyed] == [created]
        assert [r.mig_uuid for r in answer.idled] == [first]
        assert live(car) == {first}
        assert states(car) == {first: pb.IDLE}
        assert [r["state"] for r in car.records().values()] == ["IDLE"]
        assert all(created not in name for name in car.cdi_files())
        before = everything(car)
        assert undo(car, "pod-b") == pb.UndoAllocateResponse()
        assert everything(car) == before

    def test_an_unknown_key_is_ok_and_bad_input_is_invalid_request_both_changing_nothing(
        self, car: Sidecar
    ) -> None:
        allocate_one(car, "pod-a", 0, "1g.10gb", 0, 1)
        before = everything(car)

        assert undo(car, "pod-nobody") == pb.UndoAllocateResponse()
        assert undo(car, "pod-a", 3) == pb.UndoAllocateResponse()
        for bad in ("", "../pod-a"):
            code, reason, _ = failure(lambda bad=bad: undo(car, bad))
            assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")

        assert everything(car) == before


def undo_device(car: Sidecar, mig: str, pod: str, container: int = 0, device: int = 0) -> Any:
    request = pb.UndoDeviceRequest(mig_uuid=mig, pod_uid=pod, container_index=container, device_index=device)
    return car.stub.UndoDevice(request, timeout=CALL_TIMEOUT_S)


class TestUndoDevice:
    def test_one_device_is_undone_its_neighbour_kept_and_a_late_repeat_spares_the_next_pod(
        self, car: Sidecar
    ) -> None:
        first = idle(car, "pod-a", 0, 0)
        answer = allocate(car, "pod-b", (0, "1g.10gb", 0, 1), (0, "1g.10gb", 1, 1))
        reused, created = answer.devices[0].mig_uuid, answer.devices[1].mig_uuid
        assert reused == first
        # the answer carries the generation GetInfo would say: the fence of a later SyncActive
        assert (
            answer.generation == car.stub.GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S).generation > 0
        )

        gone = undo_device(car, created, "pod-b", device=1)
        assert (gone.destroyed.mig_uuid, gone.HasField("idled"), gone.skipped) == (
            created,
            False,
            pb.UNDO_SKIP_UNSPECIFIED,
        )
        assert gone.generation == car.stub.GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S).generation
        assert states(car) == {reused: pb.ACTIVE}
        assert live(car) == {reused}

        back = undo_device(car, reused, "pod-b", device=0)
        assert back.idled.mig_uuid == reused
        assert not back.HasField("destroyed")
        assert states(car) == {reused: pb.IDLE}
        again = undo_device(car, reused, "pod-b", device=0)
        assert again.skipped == pb.UNDO_SKIP_NOT_ACTIVE

        taken = allocate_one(car, "pod-c", 0, "1g.10gb", 0, 1)
        assert (taken.outcome, taken.mig_uuid) == (pb.REUSED, reused)
        before = everything(car)
        late = undo_device(car, reused, "pod-b", device=0)
        assert late.skipped == pb.UNDO_SKIP_OTHER_OWNER
        assert "pod-c" in late.detail
        assert everything(car) == before

    def test_another_pods_instance_an_unknown_one_and_bad_input_change_nothing(self, car: Sidecar) -> None:
        held = allocate_one(car, "pod-a", 0, "1g.10gb", 0, 1).mig_uuid
        before = everything(car)

        assert undo_device(car, held, "pod-b").skipped == pb.UNDO_SKIP_OTHER_OWNER
        assert undo_device(car, held, "pod-a", container=1).skipped == pb.UNDO_SKIP_OTHER_OWNER
        assert undo_device(car, NOBODY, "pod-a").skipped == pb.UNDO_SKIP_UNKNOWN_INSTANCE
        for mig, pod in (("", "pod-a"), ("MIG-nope", "pod-a"), (held, ""), (held, "../pod-a")):
            code, reason, _ = failure(lambda mig=mig, pod=pod: undo_device(car, mig, pod))
            assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"), (mig, pod)

        assert everything(car) == before
        assert states(car) == {held: pb.ACTIVE}


class TestReclaimIdle:
    def test_each_refusal_has_its_reason_and_destroys_nothing(self, car: Sidecar) -> None:
        a = idle(car, "pod-a", 0, 0)
        busy = idle(car, "pod-b", 0, 1)
        held = allocate_one(car, "pod-c", 0, "1g.10gb", 2, 1).mig_uuid
        car.sim("busy", "--mig-uuid", busy, "on")
        before = everything(car)

        refusals = [
            ((a, held), grpc.StatusCode.FAILED_PRECONDITION, "NOT_IDLE"),
            ((a, NOBODY), grpc.StatusCode.NOT_FOUND, "UNKNOWN_INSTANCE"),
            ((), grpc.StatusCode.UNAVAILABLE, "INSTANCE_IN_USE"),
            ((busy,), grpc.StatusCode.UNAVAILABLE, "INSTANCE_IN_USE"),
            (("MIG-nope",), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"),
        ]
        for names, want_code, want_reason in refusals:
            code, reason, _ = failure(lambda names=names: reclaim(car, 0, *names))
            assert (code, reason) == (want_code, want_reason), names
        unknown_gpu = pb.ReclaimIdleRequest(gpu_uuid="GPU-00000000-0000-0000-0000-000000000000")
        code, reason, _ = failure(lambda: car.stub.ReclaimIdle(unknown_gpu, timeout=CALL_TIMEOUT_S))
        assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "UNKNOWN_GPU")

        assert everything(car) == before
        assert [r.mig_uuid for r in reclaim(car, 0, a).reclaimed] == [a]
        assert states(car) == {busy: pb.IDLE, held: pb.ACTIVE}

    def test_the_cli_reclaims_every_idle_instance_and_reports_a_refusal_by_reason(self, car: Sidecar) -> None:
        a, b = idle(car, "pod-a", 0, 0), idle(car, "pod-b", 0, 1)
        held = allocate_one(car, "pod-c", 0, "1g.10gb", 2, 1).mig_uuid
        before = everything(car)

        refused = car.cli("reclaim", "--socket", str(car.socket), "--gpu", "0", "--mig-uuid", held)

        assert refused.returncode == 1
        assert "FAILED_PRECONDITION NOT_IDLE" in refused.stderr
        assert everything(car) == before
        done = car.cli("reclaim", "--socket", str(car.socket), "--gpu", "0")
        assert done.returncode == 0, done.stderr
        assert {line.split()[1] for line in done.stdout.splitlines()} == {a, b}
        assert states(car) == {held: pb.ACTIVE}
        assert live(car) == {held}


class TestSetMigModeReclaimIdle:
    def test_a_gpu_with_only_idle_instances_is_disabled_and_one_with_an_active_refuses(
        self, car: Sidecar
    ) -> None:
        idle(car, "pod-a", 1, 0)
        idle(car, "pod-b", 0, 0)
        allocate_one(car, "pod-c", 0, "1g.10gb", 1, 1)
        before = everything(car)

        refuse = pb.SetMigModeRequest(gpu_uuid=gpu_uuid(car, 0), enabled=False, reclaim_idle=True)
        code, reason, meta = failure(lambda: car.stub.SetMigMode(refuse, timeout=CALL_TIMEOUT_S))
        assert (code, reason, meta["blocker"]) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "PLACEMENT_BUSY",
            "ACTIVE",
        )
        assert everything(car) == before

        disable = pb.SetMigModeRequest(gpu_uuid=gpu_uuid(car, 1), enabled=False, reclaim_idle=True)
        answer = car.stub.SetMigMode(disable, timeout=CALL_TIMEOUT_S)
        assert not answer.mig_mode.pending
        assert layouts(car)[1].gis == ()
        assert not any(r["gpu_uuid"] == gpu_uuid(car, 1) for r in car.records().values())


# -- kill -9 in the middle, then Recover: nothing leaked ------------------------------------------------

DESTROY_POINTS = crashpoints.POINTS[
    crashpoints.POINTS.index("after-record-deleting") : crashpoints.POINTS.index("after-remove-cdi") + 1
]


UNDO_POINTS = ["after-undo-destroy-one", "after-undo-idle-one"]
RECLAIM_POINTS = ["after-reclaim-idle-one"]
DISABLE_POINT = "after-reclaim-for-disable"
IDLE_TRIM_POINT = "before-idle-trim"  # armed by test_idle_trim_e2e
# armed by test_hami_parity: the inline ERROR retry, a SyncActive's pending set, a foreign CDI file kept
PARITY_POINTS = ("after-inline-error-retry", "after-sync-pending", "after-foreign-cdi-kept")


def test_every_crash_point_is_in_a_crash_matrix() -> None:
    """A point no test arms is a path no crash test covers."""
    creates = crashpoints.POINTS[: crashpoints.POINTS.index("after-write-cdi") + 1]
    armed = {*creates, *TAKEOVER_POINTS, *DESTROY_POINTS, *UNDO_POINTS, *RECLAIM_POINTS}
    armed |= {DISABLE_POINT, IDLE_TRIM_POINT, *PARITY_POINTS}
    assert armed == set(crashpoints.POINTS)


class TestCrashPoints:
    @pytest.mark.parametrize("point", [*DESTROY_POINTS, *UNDO_POINTS])
    def test_a_crash_inside_undo_allocate_leaves_nothing_leaked_after_recover(
        self, sidecar_factory: SidecarFactory, point: str
    ) -> None:
        car = sidecar_factory(env={crashpoints.ENV: point})
        car.recover()
        first = idle(car, "pod-a", 0, 0)
        allocate(car, "pod-b", (0, "1g.10gb", 0, 1), (0, "1g.10gb", 1, 1), (0, "1g.10gb", 2, 1))

        crash_during(car, lambda: undo(car, "pod-b"))  # the annotation patch failed: pod-b holds nothing
        car.restart(env={})
        car.recover()

        assert_converged(car)
        assert first in live(car)
        assert set(states(car).values()) <= {pb.IDLE}
        # The repeated undo after the restart finds nothing ACTIVE; every slot can be allocated again.
        assert undo(car, "pod-b") == pb.UndoAllocateResponse()
        assert allocate_one(car, "pod-c", 0, "3g.40gb", 4, 4).outcome == pb.CREATED

    @pytest.mark.parametrize("point", [*DESTROY_POINTS, *RECLAIM_POINTS])
    def test_a_crash_inside_reclaim_idle_leaves_nothing_leaked_after_recover(
        self, sidecar_factory: SidecarFactory, point: str
    ) -> None:
        car = sidecar_factory(env={crashpoints.ENV: point})
        car.recover()
        gone = [idle(car, "pod-a", 0, 0), idle(car, "pod-b", 0, 1)]
        held = allocate_one(car, "pod-c", 0, "1g.10gb", 2, 1)

        crash_during(car, lambda: reclaim(car, 0))
        car.restart(env={})
        car.recover([annotation("pod-c", held)])

        assert_converged(car)
        assert states(car)[held.mig_uuid] == pb.ACTIVE
        assert gone[0] not in live(car)  # the first destroy had begun
        left = [m for m in gone if m in live(car)]
        assert [r.mig_uuid for r in reclaim(car, 0).reclaimed] == left
        assert live(car) == {held.mig_uuid}

    def test_a_crash_between_the_reclaim_and_the_mode_change_leaves_nothing_leaked(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(env={crashpoints.ENV: DISABLE_POINT})
        car.recover()
        idle(car, "pod-a", 1, 0)
        disable = pb.SetMigModeRequest(gpu_uuid=gpu_uuid(car, 1), enabled=False, reclaim_idle=True)

        crash_during(car, lambda: car.stub.SetMigMode(disable, timeout=CALL_TIMEOUT_S))
        car.restart(env={})
        car.recover()

        assert_converged(car)
        assert layouts(car)[1].gis == ()
        answer = car.stub.SetMigMode(disable, timeout=CALL_TIMEOUT_S)
        assert not answer.mig_mode.pending


class TestRevision:
    def test_every_change_of_the_owned_instances_moves_it_and_a_refusal_does_not(self, car: Sidecar) -> None:
        """GetInfo's revision, the idle publisher's change feed: a ReclaimIdle and an Xid move it
        and no generation; a refused call moves neither."""

        def info() -> tuple[int, int]:
            got = car.stub.GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S)
            return got.revision, got.generation

        a, b = idle(car, "pod-a", 0, 0), idle(car, "pod-b", 0, 1)
        revision, generation = info()
        assert revision > 0
        failure(lambda: reclaim(car, 0, NOBODY))
        assert info() == (revision, generation)

        assert [r.mig_uuid for r in reclaim(car, 0, a).reclaimed] == [a]
        after_reclaim, same = info()
        assert (after_reclaim > revision, same) == (True, generation)

        gi = next(i.gpu_instance_id for g in everything(car)[0].gpus for i in g.instances if i.mig_uuid == b)
        car.sim("xid", "--gpu", "0", "--gi", str(gi), "79")
        deadline = time.monotonic() + 30
        while states(car).get(b) == pb.IDLE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert states(car).get(b) != pb.IDLE  # ERROR, or already destroyed
        after_xid, same = info()
        assert (after_xid > after_reclaim, same) == (True, generation)
