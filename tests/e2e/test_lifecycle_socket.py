"""The lifecycle issue's "Done when" list, item by item, over the Unix socket, with CDI and ``--no-cdi``.

Each test starts a real ``serve`` process on simulated GPUs (h100-80gb:2, a100-40gb:1), recovers it
with no active pods and then talks to it only as HAMi's Go plugin does: gRPC over its socket. Outcomes
are read where an operator would look for them, never from the sidecar's memory alone:

- the hardware: ``sim list --json`` on the simulated driver's state file (GI/CI IDs, MIG UUIDs);
- the ownership records: the JSON files in the state directory;
- the CDI specs: the files in the CDI directory;
- the sidecar's own view: ``GetState``, which must agree with the three above.

Every test runs twice. ``cdi``: specs are written to the CDI directory. ``no-cdi``: the sidecar gets the
same CDI directory from the environment (as the chart sets it) *and* ``--no-cdi``; the flag wins, every
response carries an empty ``cdi_device`` and the directory, which exists, stays empty.

Faults are injected through the simulated driver's own knob (``sim fault``): the next calls of one NVML
operation fail with ``NVML_ERROR_UNKNOWN``, which is not transient, so the sidecar's bounded retries do
not absorb it. A sidecar process starts in well under a second, so each test gets its own (isolation
beats sharing). Tests that compare byte snapshots start it with a reconciler interval of an hour, so
no background round can rewrite a record while they look.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from helpers_e2e import wait_until
from sidecar_process import (
    CALL_TIMEOUT_S,
    Sidecar,
    SidecarFactory,
    allocate_one,
    annotation,
    error_info,
    failure,
    snapshot_dir,
    states,
)

from sidecar.nvml.sim import OP_ALIASES

pytestmark = pytest.mark.e2e

NVML_ERROR_UNKNOWN = "999"
FOREVER = "1000"  # more failures than any bounded retry or test ever consumes
QUIET = ("--reconcile-interval", "3600")  # no background round while a test compares snapshots

Device = tuple[str, str, int, int]  # (GPU UUID, profile, placement start, placement size)
Start = Callable[..., Sidecar]


# -- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(params=["cdi", "no-cdi"])
def mode(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


@pytest.fixture
def start(mode: str, sidecar_factory: SidecarFactory) -> Start:
    """Start and recover a sidecar in ``mode``; extra serve flags as arguments."""

    def make(*extra: str) -> Sidecar:
        car = sidecar_factory(start=False)
        car.cdi_dir.mkdir()
        if mode == "no-cdi":
            car.extra_args = ["--no-cdi", *extra]
            car.env = {"HAMI_MIG_SIDECAR_CDI_DIR": str(car.cdi_dir)}  # the flag must beat it
        else:
            car.extra_args = list(extra)
        car.start()
        assert car.info().cdi_enabled is (mode == "cdi")
        car.recover()
        return car

    return make


@pytest.fixture
def car(start: Start) -> Sidecar:
    return start()


# -- talking to the sidecar ------------------------------------------------------------------------------


def cdi_on(car: Sidecar) -> bool:
    return "--no-cdi" not in car.extra_args


def h100(car: Sidecar, n: int = 0) -> str:
    uuids: list[str] = [g.uuid for g in car.gpus() if "H100" in g.model]
    return uuids[n]


def allocate(car: Sidecar, pod: str, *devices: Device, timeout: float = CALL_TIMEOUT_S) -> Any:
    """Allocate for container 0 of ``pod``; checks the CDI name every device comes back with."""
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
    response = car.stub.Allocate(request, timeout=timeout)
    for device in response.devices:
        if cdi_on(car):
            assert device.cdi_device.endswith("=" + device.mig_uuid)
        else:
            assert device.cdi_device == ""
    return response


def refused(car: Sidecar, pod: str, *devices: Device) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """An Allocate that must fail: its (code, reason, metadata)."""
    with pytest.raises(grpc.RpcError) as caught:
        allocate(car, pod, *devices)
    return error_info(caught.value)


def release(car: Sidecar, pod: str, timeout: float = CALL_TIMEOUT_S) -> Any:
    return car.stub.Release(pb.ReleaseRequest(pod_uid=pod), timeout=timeout)


def get_state(car: Sidecar) -> Any:
    return car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)


def fault(car: Sidecar, op: str, after: int = 0) -> None:
    car.sim("fault", op, NVML_ERROR_UNKNOWN, "--after", str(after), "--times", FOREVER)


# -- reading the hardware and the disk -------------------------------------------------------------------


def gis(car: Sidecar) -> dict[tuple[str, int], dict[str, Any]]:
    """(GPU UUID, GI ID) -> the GI as the simulated driver reports it (placement, its CIs)."""
    return {(g["uuid"], gi["id"]): gi for g in car.hardware() for gi in g["gis"]}


def live_mig_uuids(car: Sidecar) -> set[str]:
    return {ci["mig_uuid"] for gi in gis(car).values() for ci in gi["cis"]}


def cdi_uuids(car: Sidecar) -> set[str]:
    """The MIG UUIDs the CDI spec files are named for (``<vendor>-<class>_<MIG UUID>.json``)."""
    return {name.removesuffix(".json").rpartition("_")[2] for name in car.cdi_files()}


def record_of(car: Sidecar, mig_uuid: str) -> dict[str, Any] | None:
    return next((r for r in car.records().values() if r["mig_uuid"] == mig_uuid), None)


def create_calls(car: Sidecar) -> int:
    """NVML create calls (GI and CI, every C entry point) the simulated driver has answered so far."""
    stats = car.sim_stats()
    assert stats is not None, "this simulator cannot count NVML calls (sim stats)"
    creates = {*OP_ALIASES["create-gi"], *OP_ALIASES["create-ci"]}
    return sum(int(n) for fn, n in stats["calls"].items() if fn in creates)


def assert_consistent(car: Sidecar) -> None:
    """Every GI/CI on the hardware has a record, every record has its GI/CI, GetState and CDI agree.

    An ERROR record may have lost its CI (a GI destroy failed after the CI destroy succeeded) or never
    got one (the undo of a create failed), but the GI it names must still be there: ERROR means "this
    could not be destroyed". Every other record names exactly its live GI and its one CI. With CDI, the
    spec files are exactly those of the records that have one (an ERROR instance keeps its file until
    its hardware is gone); without it, the CDI directory is empty."""
    live = gis(car)
    records = car.records()
    claimed: set[tuple[str, int]] = set()
    for name, rec in records.items():
        key = (rec["gpu_uuid"], rec["gpu_instance_id"])
        assert rec["gpu_instance_id"] is not None, f"{name} ({rec['state']}) names no GI"
        assert key in live, f"{name} ({rec['state']}) names GI {key[1]}, which is not on the hardware"
        gi = live[key]
        assert (gi["profile"], gi["placement"]) == (rec["profile"], rec["placement"]), name
        cis = [(ci["id"], ci["mig_uuid"]) for ci in gi["cis"]]
        if rec["state"] == "ERROR":
            assert cis in ([], [(rec["compute_instance_id"], rec["mig_uuid"])]), name
            assert rec["last_error"], f"{name} is ERROR without saying why"
        else:
            assert rec["state"] in ("ACTIVE", "IDLE"), name
            assert cis == [(rec["compute_instance_id"], rec["mig_uuid"])], name
        claimed.add(key)
    assert set(live) == claimed, f"GIs on the hardware without a record: {set(live) - claimed}"

    view = {
        (i.gpu_uuid, i.gpu_instance_id, i.mig_uuid, pb.InstanceState.Name(i.state))
        for g in get_state(car).gpus
        for i in g.instances
    }
    assert view == {
        (r["gpu_uuid"], r["gpu_instance_id"], r["mig_uuid"] or "", r["state"]) for r in records.values()
    }
    if cdi_on(car):
        assert cdi_uuids(car) == {r["mig_uuid"] for r in records.values() if r["cdi_device"]}
        assert all(r["cdi_device"] for r in records.values() if r["state"] in ("ACTIVE", "IDLE"))
    else:
        assert car.cdi_files() == []


def frozen(car: Sidecar) -> tuple[Any, ...]:
    """Hardware layout, record files and CDI files, byte for byte."""
    return car.hardware(), snapshot_dir(car.state_dir), snapshot_dir(car.cdi_dir)


# -- the items -------------------------------------------------------------------------------------------


class TestExactReuse:
    def test_the_same_reservation_after_a_release_gets_the_same_mig_uuid_as_reused_with_no_create_call(
        self, car: Sidecar
    ) -> None:
        gpu = h100(car)
        first = allocate(car, "pod-a", (gpu, "3g.40gb", 4, 4)).devices[0]
        released = release(car, "pod-a").released
        hardware, cdi = car.hardware(), snapshot_dir(car.cdi_dir)
        creates = create_calls(car)

        again = allocate(car, "pod-b", (gpu, "3g.40gb", 4, 4)).devices[0]

        assert first.outcome == pb.CREATED
        assert [r.mig_uuid for r in released] == [first.mig_uuid]
        assert again.outcome == pb.REUSED
        assert (again.mig_uuid, again.gpu_instance_id, again.compute_instance_id, again.cdi_device) == (
            first.mig_uuid,
            first.gpu_instance_id,
            first.compute_instance_id,
            first.cdi_device,
        )
        assert car.hardware() == hardware  # nothing created or destroyed: the GI/CI are the same ones
        assert creates >= 2  # the first Allocate created a GI and a CI: the counter sees them
        assert create_calls(car) == creates  # zero NVML create calls for the reuse
        assert snapshot_dir(car.cdi_dir) == cdi  # the existing spec was validated, not rewritten
        [record] = car.records().values()
        assert (record["state"], record["mig_uuid"], record["owner"]["pod"]["uid"]) == (
            "ACTIVE",
            first.mig_uuid,
            "pod-b",
        )
        assert_consistent(car)


class TestReclaimUnderPlacementPressure:
    def test_only_the_overlapping_idle_instance_is_destroyed_and_reported_with_its_record_and_cdi_file(
        self, car: Sidecar
    ) -> None:
        gpu = h100(car)
        in_way = allocate(car, "pod-a", (gpu, "1g.10gb", 5, 1)).devices[0]
        far = allocate(car, "pod-b", (gpu, "1g.10gb", 0, 1)).devices[0]
        release(car, "pod-a")
        release(car, "pod-b")

        result = allocate(car, "pod-c", (gpu, "3g.40gb", 4, 4))

        [reclaimed] = result.reclaimed
        assert (reclaimed.mig_uuid, reclaimed.gpu_instance_id, reclaimed.placement.start) == (
            in_way.mig_uuid,
            in_way.gpu_instance_id,
            5,
        )
        assert result.devices[0].outcome == pb.CREATED
        assert live_mig_uuids(car) == {far.mig_uuid, result.devices[0].mig_uuid}
        assert record_of(car, in_way.mig_uuid) is None
        survivor = record_of(car, far.mig_uuid)
        assert survivor is not None
        assert (survivor["state"], survivor["gpu_instance_id"]) == ("IDLE", far.gpu_instance_id)
        if cdi_on(car):
            assert cdi_uuids(car) == {far.mig_uuid, result.devices[0].mig_uuid}
        assert_consistent(car)


def make_blocker(car: Sidecar, kind: str) -> str:
    """Put a ``kind`` instance at 1g.10gb 5:1 on the first H100; return its MIG UUID."""
    gpu = h100(car)
    if kind == "foreign":
        car.sim("create", "--gpu", "0", "--profile", "1g.10gb", "--placement", "5:1")
        [gi] = [gi for (g, _), gi in gis(car).items() if g == gpu]
        uuid: str = gi["cis"][0]["mig_uuid"]
        return uuid
    device = allocate(car, "pod-blocker", (gpu, "1g.10gb", 5, 1)).devices[0]
    if kind == "ERROR":
        release(car, "pod-blocker")
        fault(car, "destroy-ci")
        code, reason, _ = refused(car, "pod-reclaimer", (gpu, "2g.20gb", 4, 2))
        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "NVML_ERROR")
        car.sim("faults", "--clear")
        assert (record_of(car, device.mig_uuid) or {}).get("state") == "ERROR"
        # A pod still holds it (the plugin's pod list names it): an Allocate's inline ERROR retry
        # must not destroy it, so it blocks like any other instance that is not IDLE.
        held = [annotation("pod-blocker", device)]
        car.stub.SyncActive(
            pb.SyncActiveRequest(generation=car.info().generation, active=held), timeout=CALL_TIMEOUT_S
        )
    mig_uuid: str = device.mig_uuid
    return mig_uuid


class TestBlockersAreNeverTouched:
    @pytest.mark.parametrize("kind", ["ACTIVE", "ERROR", "foreign"])
    def test_an_overlapping_request_fails_placement_busy_and_nothing_changes_anywhere(
        self, start: Start, kind: str
    ) -> None:
        car = start(*QUIET)
        gpu = h100(car)
        blocker = make_blocker(car, kind)
        idle = allocate(car, "pod-idle", (gpu, "1g.10gb", 4, 1)).devices[0]  # also in the way, reclaimable
        release(car, "pod-idle")
        before = frozen(car)

        code, reason, meta = refused(car, "pod-new", (gpu, "3g.40gb", 4, 4))

        assert (code, reason, meta["blocker"]) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "PLACEMENT_BUSY",
            kind,
        )
        if kind != "foreign":
            assert meta["mig_uuid"] == blocker
        assert frozen(car) == before  # not even the reclaimable IDLE instance was destroyed
        assert {blocker, idle.mig_uuid} <= live_mig_uuids(car)
        if cdi_on(car):
            assert cdi_uuids(car) == {r["mig_uuid"] for r in car.records().values() if r["cdi_device"]}
        else:
            assert car.cdi_files() == []


class TestAllOrNothing:
    def test_a_failing_second_device_destroys_the_instance_the_first_device_created(
        self, car: Sidecar
    ) -> None:
        fault(car, "create-gi", after=1)

        code, reason, _ = refused(
            car, "pod-a", (h100(car, 0), "1g.10gb", 0, 1), (h100(car, 1), "1g.10gb", 0, 1)
        )

        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "NVML_ERROR")
        assert gis(car) == {}
        assert car.records() == {}
        assert car.cdi_files() == []
        assert_consistent(car)

    def test_a_failing_second_device_puts_the_reused_first_device_back_to_idle(self, car: Sidecar) -> None:
        cached = allocate(car, "pod-old", (h100(car, 0), "1g.10gb", 0, 1)).devices[0]
        release(car, "pod-old")
        hardware, cdi = car.hardware(), snapshot_dir(car.cdi_dir)
        fault(car, "create-gi")

        code, reason, _ = refused(
            car, "pod-a", (h100(car, 0), "1g.10gb", 0, 1), (h100(car, 1), "1g.10gb", 0, 1)
        )

        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "NVML_ERROR")
        assert car.hardware() == hardware
        assert snapshot_dir(car.cdi_dir) == cdi
        [record] = car.records().values()
        assert (record["state"], record["owner"], record["mig_uuid"]) == ("IDLE", None, cached.mig_uuid)
        assert_consistent(car)
        car.sim("faults", "--clear")
        again = allocate(car, "pod-b", (h100(car, 0), "1g.10gb", 0, 1)).devices[0]
        assert (again.outcome, again.mig_uuid) == (pb.REUSED, cached.mig_uuid)


class FaultCase(NamedTuple):
    """Faults to inject as (NVML operation, calls let through first), whether an IDLE instance sits in
    the way (1g.10gb 4:1, so the request reclaims it first), how many devices the request has (the
    first is 3g.40gb 4:4 on the first H100, the second 1g.10gb 0:1 on the other), and what must be
    left besides the ACTIVE instance the GPU already holds: nothing, or an ERROR instance at a
    placement start with or without its CI."""

    faults: tuple[tuple[str, int], ...]
    idle_in_way: bool
    devices: int
    error_at: int | None = None
    error_keeps_ci: bool = False


FAULT_CASES = {
    "create-gi fails": FaultCase((("create-gi", 0),), idle_in_way=False, devices=1),
    "create-ci fails": FaultCase((("create-ci", 0),), idle_in_way=False, devices=1),
    "reclaim's destroy-ci fails": FaultCase(
        (("destroy-ci", 0),), idle_in_way=True, devices=1, error_at=4, error_keeps_ci=True
    ),
    "reclaim's destroy-gi fails": FaultCase((("destroy-gi", 0),), idle_in_way=True, devices=1, error_at=4),
    "create-ci fails and its undo's destroy-gi fails": FaultCase(
        (("create-ci", 0), ("destroy-gi", 0)), idle_in_way=False, devices=1, error_at=4
    ),
    "the second device fails and the first device's undo fails at destroy-ci": FaultCase(
        (("create-gi", 1), ("destroy-ci", 0)), idle_in_way=False, devices=2, error_at=4, error_keeps_ci=True
    ),
}


class TestNvmlFaultAtEveryMutatingCall:
    @pytest.mark.parametrize("case", list(FAULT_CASES))
    def test_no_gi_or_ci_without_a_record_and_no_record_without_its_gi_or_ci(
        self, car: Sidecar, case: str
    ) -> None:
        spec = FAULT_CASES[case]
        gpu = h100(car)
        keep = allocate(car, "pod-keep", (gpu, "1g.10gb", 0, 1)).devices[0]
        if spec.idle_in_way:
            allocate(car, "pod-idle", (gpu, "1g.10gb", 4, 1))
            release(car, "pod-idle")
        for op, after in spec.faults:
            fault(car, op, after)
        devices = [(gpu, "3g.40gb", 4, 4), (h100(car, 1), "1g.10gb", 0, 1)][: spec.devices]

        code, reason, meta = refused(car, "pod-new", *devices)

        assert (code, reason, meta.get("nvml_code")) == (grpc.StatusCode.UNAVAILABLE, "NVML_ERROR", "999")
        assert_consistent(car)
        others = {r["mig_uuid"]: r for r in car.records().values() if r["mig_uuid"] != keep.mig_uuid}
        assert (record_of(car, keep.mig_uuid) or {}).get("state") == "ACTIVE"
        if spec.error_at is None:
            assert others == {}
            assert set(gis(car)) == {(gpu, keep.gpu_instance_id)}
        else:
            [error] = others.values()
            assert (error["state"], error["placement"]["start"]) == ("ERROR", spec.error_at)
            live = live_mig_uuids(car)
            assert (error["mig_uuid"] in live) is spec.error_keeps_ci
            if spec.error_keeps_ci and cdi_on(car):
                assert error["mig_uuid"] in cdi_uuids(car)  # its spec stays until the hardware is gone

        car.sim("faults", "--clear")
        wait_until(
            "the reconciler destroyed every ERROR instance",
            lambda: not any(r["state"] == "ERROR" for r in car.records().values()),
        )
        assert_consistent(car)
        assert set(gis(car)) == {(gpu, keep.gpu_instance_id)}


class TestStuckDestroy:
    def test_it_stays_error_and_unused_and_once_the_fault_clears_the_hardware_goes_before_cdi_and_record(
        self, car: Sidecar
    ) -> None:
        gpu = h100(car)
        stuck = allocate(car, "pod-a", (gpu, "1g.10gb", 4, 1)).devices[0]
        release(car, "pod-a")
        fault(car, "destroy-ci")
        assert refused(car, "pod-b", (gpu, "3g.40gb", 4, 4))[1] == "NVML_ERROR"
        # Exactly its reservation: the inline retry of its destroy fails again, a retryable answer.
        _, reason, meta = refused(car, "pod-c", (gpu, "1g.10gb", 4, 1))
        assert (reason, meta["blocker"], meta["mig_uuid"]) == ("NVML_ERROR", "ERROR", stuck.mig_uuid)

        def failures_left() -> int:
            return sum(int(f["times"]) for f in car.sim_list()["faults"])

        left = failures_left()
        wait_until("the reconciler retried twice", lambda: failures_left() <= left - 2)
        record = record_of(car, stuck.mig_uuid)
        assert record is not None
        assert record["state"] == "ERROR"
        assert stuck.mig_uuid in live_mig_uuids(car)
        assert cdi_uuids(car) == ({stuck.mig_uuid} if cdi_on(car) else set())
        assert_consistent(car)

        car.sim("faults", "--clear")

        def gone() -> bool:
            # Files first, hardware second: a record or spec seen missing must mean a GI already gone.
            has_record = record_of(car, stuck.mig_uuid) is not None
            has_spec = stuck.mig_uuid in cdi_uuids(car)
            on_hardware = stuck.mig_uuid in live_mig_uuids(car) or (gpu, stuck.gpu_instance_id) in gis(car)
            assert has_record or not on_hardware, "record removed while the instance is still there"
            assert has_spec or not on_hardware or not cdi_on(car), "CDI spec removed before the hardware"
            return not (has_record or has_spec or on_hardware)

        wait_until("the reconciler destroyed the ERROR instance", gone)
        assert list(get_state(car).pending_cdi_removals) == []
        assert allocate(car, "pod-d", (gpu, "3g.40gb", 4, 4)).devices[0].outcome == pb.CREATED
        assert_consistent(car)


RENAME_EXCHANGE = 2  # linux/fs.h


def exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (``renameat2(RENAME_EXCHANGE)``): no reader ever sees either missing."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


class TestCdiRemovalRetry:
    @pytest.mark.parametrize("mode", ["cdi"])  # with --no-cdi there is no CDI file to remove
    def test_a_removal_that_fails_is_queued_and_the_reconciler_removes_the_file_later(
        self, car: Sidecar
    ) -> None:
        gpu = h100(car)
        old = allocate(car, "pod-a", (gpu, "1g.10gb", 4, 1)).devices[0]
        release(car, "pod-a")
        [spec] = [p for p in car.cdi_dir.iterdir() if old.mig_uuid in p.name]
        fault(car, "destroy-ci")
        assert refused(car, "pod-b", (gpu, "3g.40gb", 4, 4))[1] == "NVML_ERROR"  # ERROR now, spec kept
        # Tests run as root, so a read-only mode would not stop the unlink, and whatever sits at the
        # spec's path instead is not the sidecar's spec, which it never removes. The CDI directory
        # itself out of reach does it: a file in its place (ENOTDIR), whatever the privileges. The
        # reconciler's destroy of the ERROR instance writes nothing there, so only the removal fails.
        content = spec.read_bytes()
        away = car.cdi_dir.with_name("cdi-away")
        car.cdi_dir.rename(away)
        car.cdi_dir.write_text("not a directory")
        car.sim("faults", "--clear")

        wait_until("the ERROR instance is destroyed", lambda: record_of(car, old.mig_uuid) is None)
        assert old.mig_uuid not in live_mig_uuids(car)  # the record goes with the hardware, not the file
        assert list(get_state(car).pending_cdi_removals) == [str(spec)]
        assert (away / spec.name).read_bytes() == content  # still there, untouched

        # Bring the directory back atomically, so every retry sees either the obstacle or the
        # directory with the spec in it; only the reconciler can then make the spec disappear.
        exchange(away, car.cdi_dir)
        assert car.cdi_dir.is_dir()

        wait_until("the reconciler removed the queued spec", lambda: not spec.exists())
        assert list(get_state(car).pending_cdi_removals) == []
        away.unlink()
        assert cdi_uuids(car) == set()
        assert_consistent(car)


# (GPU index, profile, start, size): overlapping reservations on two GPUs, so that concurrent requests
# contend for the same instance (reuse), block each other (PLACEMENT_BUSY) and reclaim each other's
# released instances.
RESERVATIONS = [
    (0, "1g.10gb", 0, 1),
    (0, "1g.10gb", 1, 1),
    (0, "2g.20gb", 0, 2),
    (1, "1g.10gb", 4, 1),
    (1, "2g.20gb", 4, 2),
    (1, "3g.40gb", 4, 4),
]
PODS = 20  # 20 Allocates ...
RELEASERS = 12  # ... and 12 Releases: 32 calls in flight together
ATTEMPTS = 3  # per pod, while its Allocate is refused PLACEMENT_BUSY
# The last of 32 calls queued behind per-GPU locks, each holding them for record and CDI fsyncs, may
# wait long on a slow shared disk. The test is about exclusivity, not latency: a generous deadline, so
# that DEADLINE_EXCEEDED never stands in for an answer.
QUEUED_CALL_TIMEOUT_S = 120.0


class TestConcurrency:
    def test_concurrent_allocates_and_releases_never_give_one_instance_to_two_keys(
        self, car: Sidecar
    ) -> None:
        gpus = [h100(car, 0), h100(car, 1)]
        lock = threading.Lock()
        holder: dict[str, str] = {}  # MIG UUID -> pod that holds it ACTIVE, by the responses
        double: list[str] = []
        failures: list[str] = []
        released: dict[str, list[str]] = {}
        barrier = threading.Barrier(PODS)

        def worker(i: int) -> None:
            pod = f"pod-{i:02d}"
            g, profile, start_, size = RESERVATIONS[i % len(RESERVATIONS)]
            barrier.wait()
            device = None
            for _ in range(ATTEMPTS):  # a refused request tries again: more hand-overs between keys
                try:
                    device = allocate(
                        car, pod, (gpus[g], profile, start_, size), timeout=QUEUED_CALL_TIMEOUT_S
                    ).devices[0]
                    break
                except grpc.RpcError as exc:
                    with lock:
                        failures.append(error_info(exc)[1])
            if device is None:
                return
            with lock:
                if device.mig_uuid in holder:
                    double.append(f"{device.mig_uuid}: {holder[device.mig_uuid]} and {pod}")
                holder[device.mig_uuid] = pod
            if i < RELEASERS:
                # Drop the claim *before* the Release is sent: whoever gets this UUID after this point
                # may legitimately have it; before it, the sidecar would have handed it out twice.
                with lock:
                    del holder[device.mig_uuid]
                refs = release(car, pod, timeout=QUEUED_CALL_TIMEOUT_S).released
                with lock:
                    released[pod] = [r.mig_uuid for r in refs]
                assert [r.mig_uuid for r in refs] == [device.mig_uuid]

        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                worker(i)
            except BaseException as exc:  # noqa: BLE001 - surfaced by the main thread below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(PODS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        assert errors == []
        assert double == []
        assert set(failures) <= {"PLACEMENT_BUSY"}
        assert holder or released  # something was allocated at all
        active = {
            i.mig_uuid: i.owner.pod.uid
            for g in get_state(car).gpus
            for i in g.instances
            if i.state == pb.ACTIVE
        }
        assert active == holder
        assert all(r["state"] in ("ACTIVE", "IDLE") for r in car.records().values())
        assert_consistent(car)


class TestReuseOfABusyIdleInstance:
    def test_reuse_while_a_process_still_runs_is_unavailable_instance_in_use_and_then_succeeds(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        old = allocate_one(sidecar, "pod-old", 0, "1g.10gb", 0, 1)
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-old"), timeout=30)
        sidecar.sim("busy", "--mig-uuid", old.mig_uuid, "on")

        code, reason, metadata = failure(lambda: allocate_one(sidecar, "pod-new", 0, "1g.10gb", 0, 1))

        assert (code, reason, metadata["mig_uuid"]) == (
            grpc.StatusCode.UNAVAILABLE,
            "INSTANCE_IN_USE",
            old.mig_uuid,
        )
        assert states(sidecar) == {old.mig_uuid: pb.IDLE}
        sidecar.sim("busy", "--mig-uuid", old.mig_uuid, "off")
        again = allocate_one(sidecar, "pod-new", 0, "1g.10gb", 0, 1)
        assert (again.outcome, again.mig_uuid) == (pb.REUSED, old.mig_uuid)


class TestSyncActiveIsFencedByTheGeneration:
    def test_a_pod_list_taken_before_a_release_leaves_the_released_instance_idle_for_the_next_pod(
        self, car: Sidecar
    ) -> None:
        """The plugin reads the generation, lists pods (pod-a is alive), pod-a's release is confirmed,
        then the SyncActive built from that list arrives: it must not hand the instance back."""
        a = allocate(car, "pod-a", (h100(car), "1g.10gb", 0, 1)).devices[0]
        generation = car.info().generation
        listed = annotation("pod-a", a)
        release(car, "pod-a")

        synced = car.stub.SyncActive(
            pb.SyncActiveRequest(generation=generation, active=[listed]), timeout=CALL_TIMEOUT_S
        )

        assert (list(synced.idled), list(synced.reactivated)) == ([], [])
        assert states(car) == {a.mig_uuid: pb.IDLE}
        b = allocate(car, "pod-b", (h100(car), "1g.10gb", 0, 1)).devices[0]
        assert (b.outcome, b.mig_uuid) == (pb.REUSED, a.mig_uuid)

    def test_a_generation_never_handed_out_is_invalid_argument_and_changes_nothing(
        self, car: Sidecar
    ) -> None:
        allocate(car, "pod-a", (h100(car), "1g.10gb", 0, 1))
        current = car.info().generation
        before = frozen(car)

        code, reason, metadata = failure(
            lambda: car.stub.SyncActive(pb.SyncActiveRequest(generation=current + 1), timeout=CALL_TIMEOUT_S)
        )

        assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")
        assert metadata == {"generation": str(current + 1), "current": str(current)}
        assert frozen(car) == before
        assert car.info().generation == current


class TestSetMigModeWhileAProcessRunsOnTheGpu:
    def test_it_is_unavailable_instance_in_use_and_the_mode_stays(self, car: Sidecar) -> None:
        gpu = h100(car)
        car.sim("busy", "--mig-uuid", gpu, "on")

        code, reason, metadata = failure(
            lambda: car.stub.SetMigMode(
                pb.SetMigModeRequest(gpu_uuid=gpu, enabled=False), timeout=CALL_TIMEOUT_S
            )
        )

        assert (code, reason, metadata["gpu_uuid"]) == (grpc.StatusCode.UNAVAILABLE, "INSTANCE_IN_USE", gpu)
        assert next(g for g in car.gpus() if g.uuid == gpu).mig_mode.current
        car.sim("busy", "--mig-uuid", gpu, "off")
        done = car.stub.SetMigMode(pb.SetMigModeRequest(gpu_uuid=gpu, enabled=False), timeout=CALL_TIMEOUT_S)
        assert (done.mig_mode.current, done.needs_reset) == (False, False)
