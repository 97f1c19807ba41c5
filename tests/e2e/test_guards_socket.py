"""The guards through the socket: what a pending reservation protects, fresh advice, one acceptance
rule for listed identities, the sidecar's own record against a HAMi file, and the receive limit.

Each test is one of the cases an attack on the last round found; the sidecars run with an hour-long
reconciler interval, and the in-process one has its reconciler rounds driven by the test (one call of
``run_once`` is one round, no wall clock involved).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami_format import record_filename, write_record
from inprocess_sidecar import InProcessSidecar, inprocess_sidecar
from sidecar_process import (
    CALL_TIMEOUT_S,
    Sidecar,
    SidecarFactory,
    allocate_one,
    annotation,
    failure,
    gpu_uuid,
    instances,
    layouts,
)

from sidecar.edge import limits
from sidecar.nvml.sim import SimulatedHardware

pytestmark = pytest.mark.e2e

QUIET = ["--reconcile-interval", "3600"]


@pytest.fixture
def car(sidecar_factory: SidecarFactory) -> Sidecar:
    return sidecar_factory(QUIET)


def pending(pod: str, gpu: str, profile: str, start: int, size: int) -> Any:
    """A pending reservation: the scheduler placed ``pod`` there, no runtime identity yet."""
    return pb.ActiveAllocation(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        device_index=0,
        gpu_uuid=gpu,
        profile=profile,
        placement=pb.Placement(start=start, size=size),
    )


def sync(car: Sidecar, *active: Any) -> Any:
    generation = car.info().generation
    return car.stub.SyncActive(
        pb.SyncActiveRequest(generation=generation, active=list(active)), timeout=CALL_TIMEOUT_S
    )


def rank(car: Sidecar | InProcessSidecar, gpu: str, profile: str) -> dict[int, Any]:
    request = pb.RankPlacementsRequest(gpu_uuid=gpu, profile=profile)
    return {p.placement.start: p for p in car.stub.RankPlacements(request, timeout=CALL_TIMEOUT_S).placements}


def idle(  # noqa: PLR0917 - reads like the reservation it makes
    car: Sidecar, pod: str, gpu: int, profile: str, start: int, size: int
) -> str:
    mig: str = allocate_one(car, pod, gpu, profile, start, size).mig_uuid
    car.stub.Release(pb.ReleaseRequest(pod_uid=pod), timeout=CALL_TIMEOUT_S)
    return mig


def live_migs(car: Sidecar) -> set[str]:
    return {ci.mig_uuid for layout in layouts(car) for gi in layout.gis for ci in gi.cis}


# -- 1: another pod never takes the IDLE instance a pending reservation holds ---------------------------
@pytest.mark.parametrize("via", ["SyncActive", "Recover"])
def test_another_pods_allocate_never_reuses_the_reserved_idle_instance(car: Sidecar, via: str) -> None:
    car.recover()
    gpu = gpu_uuid(car, 0)
    mig = idle(car, "pod-a", 0, "1g.10gb", 1, 1)
    reservation = pending("res", gpu, "1g.10gb", 1, 1)
    if via == "SyncActive":
        sync(car, reservation)
    else:
        assert list(car.recover([reservation]).errors) == []
    assert (rank(car, gpu, "1g.10gb")[1].cost, rank(car, gpu, "1g.10gb")[1].blocker) == (
        pb.BLOCKED,
        "reserved",
    )

    code, reason, metadata = failure(lambda: allocate_one(car, "intruder", 0, "1g.10gb", 1, 1))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PLACEMENT_BUSY")
    assert (metadata["guarded_by"], metadata["mig_uuid"]) == ("pending reservation of res/0/0", mig)
    # Nor by a larger request over it (the reclaim path consults the same guard).
    assert failure(lambda: allocate_one(car, "intruder", 0, "2g.20gb", 0, 2))[1] == "PLACEMENT_BUSY"

    got = allocate_one(car, "res", 0, "1g.10gb", 1, 1)
    assert (got.outcome, got.mig_uuid) == (pb.REUSED, mig)


# -- 2: advice reflects the live layout within one reconciler round and after a busy Allocate ---------
@pytest.fixture
def inproc() -> Iterator[InProcessSidecar]:
    with inprocess_sidecar() as car:
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        yield car


def test_advice_sees_an_out_of_band_create_and_destroy_within_one_reconciler_round(
    inproc: InProcessSidecar,
) -> None:
    """The reconciler's clock is the test's: one interval passes when the test says so."""
    reconciler = inproc.app.reconciler
    now = [1000.0]
    reconciler.clock = lambda: now[0]
    reconciler.run_once()
    gpu = inproc.gpu_uuids()[0]
    assert rank(inproc, gpu, "1g.10gb")[3].cost == pb.FREE
    hw = SimulatedHardware.open(inproc.sim_state)
    made = hw.create_instance(0, "1g.10gb", 3, 1)  # what an operator's nvidia-smi would do

    assert reconciler.run_once().layout_refreshed == ()  # a kicked round within the interval
    now[0] += reconciler.interval_s  # one interval later: the round lists every GPU
    assert set(reconciler.run_once().layout_refreshed) == set(inproc.gpu_uuids())
    after_create = rank(inproc, gpu, "1g.10gb")[3]
    assert (after_create.cost, after_create.blocker) == (pb.BLOCKED, "foreign")

    hw.destroy_instance(0, made.id)
    now[0] += reconciler.interval_s
    reconciler.run_once()
    assert rank(inproc, gpu, "1g.10gb")[3].cost == pb.FREE


def test_advice_sees_what_an_allocate_that_found_the_placement_busy_listed(inproc: InProcessSidecar) -> None:
    gpu = inproc.gpu_uuids()[0]
    assert rank(inproc, gpu, "2g.20gb")[2].cost == pb.FREE
    hw = SimulatedHardware.open(inproc.sim_state)
    hw.create_instance(0, "1g.10gb", 2, 1)

    request = pb.AllocateRequest(
        pod=pb.PodRef(uid="pod-a", namespace="default", name="pod-a"),
        container_name="main",
        devices=[pb.DeviceRequest(gpu_uuid=gpu, profile="2g.20gb", placement=pb.Placement(start=2, size=2))],
    )
    assert failure(lambda: inproc.stub.Allocate(request, timeout=CALL_TIMEOUT_S))[1] == "PLACEMENT_BUSY"
    # No reconciler round in between: the Allocate's own listing refreshed the view.
    busy = rank(inproc, gpu, "2g.20gb")[2]
    assert (busy.cost, busy.blocker) == (pb.BLOCKED, "foreign")
    assert rank(inproc, gpu, "1g.10gb")[2].cost == pb.BLOCKED


# -- 3: reclaims and the disable spare a reserved IDLE instance unless forced -------------------------
def test_reclaim_and_disable_spare_the_reserved_idle_instance_unless_forced(car: Sidecar) -> None:
    car.recover()
    gpu = gpu_uuid(car, 1)
    reserved = idle(car, "pod-a", 1, "1g.10gb", 1, 1)
    other = idle(car, "pod-b", 1, "1g.10gb", 2, 1)
    sync(car, pending("res", gpu, "1g.10gb", 1, 1))

    done = car.stub.ReclaimIdle(pb.ReclaimIdleRequest(gpu_uuid=gpu), timeout=CALL_TIMEOUT_S)
    assert ([r.mig_uuid for r in done.reclaimed], [r.mig_uuid for r in done.kept]) == ([other], [reserved])

    named = pb.ReclaimIdleRequest(gpu_uuid=gpu, mig_uuids=[reserved])
    code, reason, metadata = failure(lambda: car.stub.ReclaimIdle(named, timeout=CALL_TIMEOUT_S))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "RESERVED")
    assert (metadata["guarded_by"], metadata["mig_uuid"]) == ("pending reservation of res/0/0", reserved)

    disable = pb.SetMigModeRequest(gpu_uuid=gpu, enabled=False, reclaim_idle=True)
    code, reason, metadata = failure(lambda: car.stub.SetMigMode(disable, timeout=CALL_TIMEOUT_S))
    assert (code, reason, metadata["guarded_by"]) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "RESERVED",
        "pending reservation of res/0/0",
    )
    assert reserved in live_migs(car)
    assert next(g for g in car.gpus() if g.uuid == gpu).mig_mode.current

    forced = pb.ReclaimIdleRequest(gpu_uuid=gpu, mig_uuids=[reserved], force=True)
    assert [r.mig_uuid for r in car.stub.ReclaimIdle(forced, timeout=CALL_TIMEOUT_S).reclaimed] == [reserved]
    forced_off = pb.SetMigModeRequest(gpu_uuid=gpu, enabled=False, reclaim_idle=True, force=True)
    assert not car.stub.SetMigMode(forced_off, timeout=CALL_TIMEOUT_S).mig_mode.current
    assert reserved not in live_migs(car)


def test_the_reclaim_cli_lists_the_kept_instance(car: Sidecar) -> None:
    car.recover()
    reserved = idle(car, "pod-a", 1, "1g.10gb", 1, 1)
    sync(car, pending("res", gpu_uuid(car, 1), "1g.10gb", 1, 1))
    out = car.cli("reclaim", "--socket", str(car.socket), "--gpu", "1")
    assert out.returncode == 0, out.stderr
    assert f"kept {reserved}" in out.stdout
    assert reserved in live_migs(car)


# -- 4: a HAMi record naming an instance the sidecar owns: the sidecar's record wins, named in errors --
def test_a_hami_record_naming_an_owned_instance_is_a_conflict_and_changes_nothing(car: Sidecar) -> None:
    car.recover()
    got = allocate_one(car, "pod-a", 0, "1g.10gb", 0, 1)
    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=CALL_TIMEOUT_S)
    ours = dict(car.records())
    write_record(
        car.state_dir,
        got.mig_uuid,
        got.gpu_uuid,
        "1g.10gb",
        0,
        1,
        got.gpu_instance_id,
        got.compute_instance_id,
    )
    hami_file = car.state_dir / record_filename(got.mig_uuid)

    errors = list(car.recover().errors)

    assert any(hami_file.name in e and "already owns" in e for e in errors), errors
    assert hami_file.exists()
    assert car.records() == ours
    inst = instances(car)[got.mig_uuid]
    assert (inst.state, inst.taken_over_from) == (pb.IDLE, "")


# -- 5: one acceptance rule for an entry that gives the MIG UUID alone --------------------------------
def test_recover_and_sync_active_accept_an_entry_with_only_the_mig_uuid_alike(car: Sidecar) -> None:
    car.recover()
    got = allocate_one(car, "pod-a", 0, "1g.10gb", 0, 1)
    only_uuid = annotation("pod-a", got)
    only_uuid.gpu_instance_id = only_uuid.compute_instance_id = 0
    wrong_ids = annotation("pod-a", got)
    wrong_ids.gpu_instance_id = got.gpu_instance_id + 1

    car.restart(QUIET)
    assert failure(lambda: car.recover([wrong_ids]))[1] == "UNVERIFIABLE_STATE"
    answer = car.recover([only_uuid])
    assert list(answer.errors) == []
    [adopted] = answer.adopted_active
    assert (adopted.mig_uuid, adopted.gpu_instance_id, adopted.compute_instance_id) == (
        got.mig_uuid,
        got.gpu_instance_id,
        got.compute_instance_id,
    )

    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=CALL_TIMEOUT_S)
    assert list(sync(car, wrong_ids).reactivated) == []
    assert [r.mig_uuid for r in sync(car, only_uuid).reactivated] == [got.mig_uuid]
    assert instances(car)[got.mig_uuid].owner.pod.uid == "pod-a"


# -- 6: a body above the largest valid request: the transport's RESOURCE_EXHAUSTED -------------------
def test_a_body_above_the_receive_limit_is_resource_exhausted_and_changes_nothing(car: Sidecar) -> None:
    car.recover()
    too_big = pb.SyncActiveRequest(active=[pending("pod-a", gpu_uuid(car, 0), "1g.10gb", 0, 1)])
    too_big.active[0].pod.name = "n" * (limits.MAX_REQUEST_BYTES + 1)
    before = car.records(), car.hardware()
    with pytest.raises(grpc.RpcError) as caught:
        car.stub.SyncActive(too_big, timeout=CALL_TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (car.records(), car.hardware()) == before
    assert car.info().api_version == "v1"
