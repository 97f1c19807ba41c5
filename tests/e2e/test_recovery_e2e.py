"""Restart recovery over the socket: a real sidecar killed with SIGKILL and started again.

The simulated hardware lives in a state file that outlives the process, records and CDI specs live in
their directories: exactly what a crashed sidecar leaves on a node. Each test then calls ``Recover``
with what the Go plugin would read from pod annotations and checks the hardware (the state file), the
files and what later calls do.
"""

from __future__ import annotations

import grpc
import msgspec
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from helpers_e2e import CREATE_POINTS, DELETE_POINTS, assert_converged, crash_during
from sidecar_process import (
    Sidecar,
    SidecarFactory,
    allocate_one,
    annotation,
    failure,
    gpu_uuid,
    instances,
    layouts,
    snapshot_dir,
    states,
)

from sidecar.lifecycle import crashpoints
from sidecar.nvml.sim import SimulatedHardware

pytestmark = pytest.mark.e2e

NVML_ERROR_UNKNOWN = 999
FOREVER = 1000
ADOPT = "--adopt-existing-mig-instances"
SERVICE = "hami.migsidecar.v1.MigSidecar"
SERVING = 1


def gis(car: Sidecar, gpu: int) -> set[tuple[str, int]]:
    """(placement, number of CIs) of every GI on one GPU, read from the simulated hardware."""
    return {(str(gi.placement), len(gi.cis)) for gi in layouts(car)[gpu].gis}


def files(car: Sidecar) -> dict[str, bytes]:
    """Every record and CDI file with its bytes (the lock file and temp files included)."""
    found = {}
    for directory in (car.state_dir, car.cdi_dir):
        if directory.exists():
            found.update({f"{directory.name}/{p.name}": p.read_bytes() for p in directory.iterdir()})
    return found


class TestOwnedInstancesSurviveKill9:
    def test_two_active_come_back_active_and_the_released_one_idle_with_its_mig_uuid(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        a = allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
        b = allocate_one(sidecar, "pod-b", 0, "3g.40gb", 4, 4)
        c = allocate_one(sidecar, "pod-c", 1, "2g.20gb", 2, 2)
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-c"), timeout=30)
        cdi_before = {k: v for k, v in files(sidecar).items() if k.startswith("cdi/")}
        assert len(cdi_before) == 3

        sidecar.kill9()
        sidecar.start()
        assert sidecar.health_status(SERVICE) != SERVING
        report = sidecar.recover([annotation("pod-a", a), annotation("pod-b", b)])

        assert sidecar.health_status(SERVICE) == SERVING
        assert {r.mig_uuid for r in report.adopted_active} == {a.mig_uuid, b.mig_uuid}
        assert [r.mig_uuid for r in report.restored_idle] == [c.mig_uuid]
        states = {uuid: i.state for uuid, i in instances(sidecar).items()}
        assert states == {a.mig_uuid: pb.ACTIVE, b.mig_uuid: pb.ACTIVE, c.mig_uuid: pb.IDLE}
        assert {k: v for k, v in files(sidecar).items() if k.startswith("cdi/")} == cdi_before
        again = allocate_one(sidecar, "pod-d", 1, "2g.20gb", 2, 2)
        assert (again.outcome, again.mig_uuid) == (pb.REUSED, c.mig_uuid)

    def test_recover_can_be_called_again_and_reports_the_same(self, sidecar: Sidecar) -> None:
        """The startup Recover after a kill -9 does the work; the same call repeated changes nothing."""
        sidecar.recover()
        a = allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
        b = allocate_one(sidecar, "pod-b", 1, "2g.20gb", 2, 2)
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=30)
        sidecar.sim("create", "--gpu", "2", "--profile", "1g.5gb", "--placement", "0:1")  # foreign
        sidecar.kill9()
        sidecar.start()
        listed = [annotation("pod-a", a)]

        first = sidecar.recover(listed)
        after_first = layouts(sidecar), files(sidecar)
        second = sidecar.recover(listed)

        assert (layouts(sidecar), files(sidecar)) == after_first
        assert second == first
        assert [r.mig_uuid for r in first.adopted_active] == [a.mig_uuid]
        assert [r.mig_uuid for r in first.restored_idle] == [b.mig_uuid]
        assert len(first.preserved_foreign) == 1
        assert states(sidecar) == {a.mig_uuid: pb.ACTIVE, b.mig_uuid: pb.IDLE}


class TestForeignInstances:
    def test_a_sim_created_instance_is_preserved_never_reused_and_adopted_only_when_enabled(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.sim("create", "--gpu", "0", "--profile", "3g.40gb", "--placement", "0:4")
        (foreign,) = layouts(sidecar)[0].gis
        report = sidecar.recover()
        assert [r.mig_uuid for r in report.preserved_foreign] == [foreign.mig_uuid]

        code, reason, _ = failure(lambda: allocate_one(sidecar, "pod-a", 0, "1g.10gb", 1, 1))
        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "PLACEMENT_BUSY")
        code, reason, _ = failure(lambda: allocate_one(sidecar, "pod-a", 0, "3g.40gb", 0, 4))
        assert reason == "PLACEMENT_BUSY"
        assert sidecar.recover().preserved_foreign == report.preserved_foreign
        assert {gi.mig_uuid for gi in layouts(sidecar)[0].gis} == {foreign.mig_uuid}

        sidecar.kill9()
        sidecar.restart(extra_args=[ADOPT])
        adopted = sidecar.recover()
        assert [r.mig_uuid for r in adopted.adopted_foreign] == [foreign.mig_uuid]
        reused = allocate_one(sidecar, "pod-b", 0, "3g.40gb", 0, 4)
        assert (reused.outcome, reused.mig_uuid) == (pb.REUSED, foreign.mig_uuid)

    def test_orphan_gis_are_removed_only_with_adoption_and_only_on_idle_gpus(self, sidecar: Sidecar) -> None:
        sidecar.sim("create", "--gpu", "0", "--profile", "3g.40gb", "--placement", "4:4", "--no-ci")
        sidecar.sim("create", "--gpu", "1", "--profile", "3g.40gb", "--placement", "4:4", "--no-ci")
        sidecar.recover()
        a = allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
        assert gis(sidecar, 0) == {("0:1", 1), ("4:4", 0)}
        assert gis(sidecar, 1) == {("4:4", 0)}, "without adoption an orphan is preserved"

        sidecar.kill9()
        sidecar.restart(extra_args=[ADOPT])
        report = sidecar.recover([annotation("pod-a", a)])

        assert [r.gpu_uuid for r in report.removed_orphan_gis] == [gpu_uuid(sidecar, 1)]
        assert gis(sidecar, 1) == set()
        assert gis(sidecar, 0) == {("0:1", 1), ("4:4", 0)}, "a GPU with an active allocation keeps it"


class TestRecoveryRefusesWhatItCannotVerify:
    def test_a_mig_uuid_that_does_not_match_the_hardware_is_unverifiable_and_changes_no_byte(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=[ADOPT])
        car.recover()
        a = allocate_one(car, "pod-a", 0, "1g.10gb", 0, 1)
        allocate_one(car, "pod-b", 0, "1g.10gb", 1, 1)
        car.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=30)
        car.sim("create", "--gpu", "1", "--profile", "3g.40gb", "--placement", "4:4", "--no-ci")
        car.kill9()
        car.start()
        hw_before, files_before = car.sim_state.read_bytes(), files(car)
        lying = annotation("pod-a", a)
        lying.mig_uuid = "MIG-00000000-0000-5000-8000-000000000000"

        code, reason, metadata = failure(lambda: car.recover([lying]))

        assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "UNVERIFIABLE_STATE")
        assert "pod-a" in metadata.get("allocations", "")
        assert car.sim_state.read_bytes() == hw_before
        assert files(car) == files_before
        assert car.health_status(SERVICE) != SERVING
        code, reason, _ = failure(lambda: car.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=30))
        assert reason == "NOT_RECOVERED"

    def test_nvml_failing_during_gather_fails_modifies_nothing_and_a_later_recover_succeeds(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
        sidecar.kill9()
        sidecar.sim("reboot")  # every record is stale now: a recovery that ran would drop it
        sidecar.start()
        sidecar.sim("fault", "get-gpu-instances", str(NVML_ERROR_UNKNOWN), "--times", str(FOREVER))
        files_before = files(sidecar)

        code, reason, metadata = failure(sidecar.recover)

        assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "NVML_ERROR")
        assert metadata["nvml_code"] == str(NVML_ERROR_UNKNOWN)
        assert files(sidecar) == files_before
        SimulatedHardware.open(sidecar.sim_state).clear_faults()
        report = sidecar.recover()
        assert len(report.dropped_stale_records) == 1
        assert not any(k.endswith(".json") for k in files(sidecar))


def _corrupt(kind: str, data: bytes) -> bytes:
    envelope = msgspec.json.decode(data)
    if kind == "truncated":
        return data[: len(data) // 2]
    if kind == "bad checksum":
        envelope["checksum"] = "sha256:" + "0" * 64
    elif kind == "unknown field":
        envelope["record"]["surprise"] = 1
    elif kind == "wrong version":
        envelope["version"] = 99
    return msgspec.json.encode(envelope)


class TestCorruptRecords:
    def test_corrupt_records_are_never_deleted_their_instances_stay_foreign_and_verify_names_them(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=[ADOPT])
        car.recover()
        kinds = ["truncated", "bad checksum", "unknown field", "wrong version"]
        made = [allocate_one(car, f"pod-{n}", 0, "1g.10gb", n, 1) for n in range(len(kinds))]
        car.kill9()
        records = sorted(car.state_dir.glob("mig-*.json"))
        assert len(records) == len(kinds)
        broken = {}
        for kind, path in zip(kinds, records, strict=True):
            broken[path] = _corrupt(kind, path.read_bytes())
            path.write_bytes(broken[path])

        car.start()
        report = car.recover()

        assert {p: p.read_bytes() for p in broken} == broken
        assert {r.mig_uuid for r in report.preserved_foreign} == {d.mig_uuid for d in made}
        assert (len(report.adopted_foreign), len(report.removed_orphan_gis)) == (0, 0)
        assert list(report.dropped_stale_records) == []
        assert instances(car) == {}
        _, reason, _ = failure(lambda: allocate_one(car, "pod-x", 0, "1g.10gb", 0, 1))
        assert reason == "PLACEMENT_BUSY"
        verify = car.cli("records", "verify", "--state-dir", str(car.state_dir))
        assert verify.returncode == 1
        for path in broken:
            assert path.stem in verify.stdout


class TestCrashPoints:
    @pytest.mark.parametrize("point", CREATE_POINTS)
    def test_a_crash_inside_a_create_leaves_nothing_unowned_after_recovery(
        self, sidecar_factory: SidecarFactory, point: str
    ) -> None:
        car = sidecar_factory(env={crashpoints.ENV: point})
        car.recover()
        with pytest.raises(grpc.RpcError):
            allocate_one(car, "pod-a", 0, "3g.40gb", 4, 4)
        assert car.proc is not None
        assert car.proc.wait(timeout=30) == 137

        car.restart(env={})
        report = car.recover()

        assert list(report.errors) == []
        assert_converged(car)
        assert gis(car, 0) == set()
        created = allocate_one(car, "pod-a", 0, "3g.40gb", 4, 4)
        assert created.outcome == pb.CREATED

    @pytest.mark.parametrize("point", DELETE_POINTS)
    def test_a_crash_inside_a_reclaim_leaves_nothing_unowned_after_recovery(
        self, sidecar_factory: SidecarFactory, point: str
    ) -> None:
        car = sidecar_factory(env={crashpoints.ENV: point})
        car.recover()
        idle = allocate_one(car, "pod-a", 0, "1g.10gb", 4, 1)
        car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=30)
        with pytest.raises(grpc.RpcError):
            allocate_one(car, "pod-b", 0, "3g.40gb", 4, 4)  # overlaps the idle one: reclaim it first
        assert car.proc is not None
        assert car.proc.wait(timeout=30) == 137

        car.restart(env={})
        car.recover()

        assert_converged(car)
        assert idle.mig_uuid not in {gi.mig_uuid for gi in layouts(car)[0].gis}
        assert allocate_one(car, "pod-b", 0, "3g.40gb", 4, 4).outcome == pb.CREATED


# -- a repeated Recover, and the generation the plugin read before a crash -------------------------------


def owners(car: Sidecar) -> dict[str, tuple[int, str]]:
    """MIG UUID -> (InstanceState, owning pod UID) of every owned instance, as GetState reports it."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=30)
    return {i.mig_uuid: (i.state, i.owner.pod.uid) for g in state.gpus for i in g.instances}


class TestARepeatedRecoverWithAnOldPodList:
    def test_an_instance_released_and_reused_by_a_newer_pod_stays_with_that_pod(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        first = allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
        old_pod_list = [annotation("pod-a", first)]
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=30)
        reused = allocate_one(sidecar, "pod-b", 0, "1g.10gb", 0, 1)
        assert (reused.outcome, reused.mig_uuid) == (pb.REUSED, first.mig_uuid)
        files = snapshot_dir(sidecar.state_dir), snapshot_dir(sidecar.cdi_dir)

        report = sidecar.recover(old_pod_list)

        assert owners(sidecar) == {first.mig_uuid: (pb.ACTIVE, "pod-b")}
        assert (snapshot_dir(sidecar.state_dir), snapshot_dir(sidecar.cdi_dir)) == files
        assert list(report.adopted_active) == []
        [line] = report.errors
        assert "pod-a" in line
        assert "pod-b" in line
        assert allocate_one(sidecar, "pod-b", 0, "1g.10gb", 0, 1).outcome == pb.ALREADY_ALLOCATED


class TestGenerationAcrossKill9:
    def test_a_sync_active_fenced_before_the_crash_never_idles_an_instance_allocated_after_it(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        allocate_one(sidecar, "pod-b", 0, "1g.10gb", 0, 1)
        sidecar.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=30)
        sidecar.sim("fault", "create-gi", "999")
        code, _, _ = failure(lambda: allocate_one(sidecar, "pod-c", 0, "2g.20gb", 0, 2))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert sidecar.records() == {}  # the instance activated last is gone, with its record
        read_by_the_plugin = sidecar.info().generation

        sidecar.kill9()
        sidecar.start()
        sidecar.recover()
        assert sidecar.info().generation >= read_by_the_plugin
        d = allocate_one(sidecar, "pod-d", 0, "1g.10gb", 4, 1)
        synced = sidecar.stub.SyncActive(pb.SyncActiveRequest(generation=read_by_the_plugin), timeout=30)

        assert list(synced.idled) == []
        assert states(sidecar) == {d.mig_uuid: pb.ACTIVE}


class TestRepeatedRecover:
    def test_a_second_recover_with_an_old_pod_list_keeps_a_newer_allocation_active(
        self, sidecar: Sidecar
    ) -> None:
        sidecar.recover()
        held = allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)

        sidecar.recover()  # a pod list taken before pod-a's Allocate

        assert states(sidecar) == {held.mig_uuid: pb.ACTIVE}


# -- a kill -9 during recovery's own destroys ----------------------------------------------------------


class TestAKill9WhileRecoveryItselfDestroysSomethingConverges:
    """Recoverer destroys through the same records-first helper as a reclaim; a crash at each of its
    points, then a clean restart and Recover, leaves a node with nothing unowned and nothing stale."""

    @pytest.mark.parametrize("point", DELETE_POINTS)
    def test_removing_an_orphan_gi_with_adoption(self, sidecar_factory: SidecarFactory, point: str) -> None:
        car = sidecar_factory(extra_args=[ADOPT], env={crashpoints.ENV: point})
        car.sim("create", "--gpu", "1", "--profile", "3g.40gb", "--placement", "4:4", "--no-ci")
        crash_during(car, car.recover)

        car.restart(env={})
        report = car.recover()
        again = car.recover()

        assert list(report.errors) == []
        assert layouts(car)[1].gis == ()
        assert_converged(car)
        assert again == pb.RecoverResponse()

    @pytest.mark.parametrize("point", DELETE_POINTS)
    def test_undoing_a_create_a_crash_left_behind(self, sidecar_factory: SidecarFactory, point: str) -> None:
        car = sidecar_factory(env={crashpoints.ENV: "after-create-ci"})
        car.recover()
        crash_during(car, lambda: allocate_one(car, "pod-a", 0, "3g.40gb", 4, 4))
        assert [s["state"] for s in car.records().values()] == ["CREATING"]

        car.restart(env={crashpoints.ENV: point})
        crash_during(car, car.recover)
        car.restart(env={})
        car.recover()

        assert layouts(car)[0].gis == ()
        assert_converged(car)
        assert car.records() == {}
        assert allocate_one(car, "pod-a", 0, "3g.40gb", 4, 4).outcome == pb.CREATED

    @pytest.mark.parametrize("point", DELETE_POINTS)
    def test_finishing_a_reclaim_a_crash_left_behind(
        self, sidecar_factory: SidecarFactory, point: str
    ) -> None:
        car = sidecar_factory(env={crashpoints.ENV: "after-record-deleting"})
        car.recover()
        idle = allocate_one(car, "pod-a", 0, "1g.10gb", 4, 1)
        car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=30)
        crash_during(car, lambda: allocate_one(car, "pod-b", 0, "3g.40gb", 4, 4))
        assert [s["state"] for s in car.records().values()] == ["DELETING"]

        car.restart(env={crashpoints.ENV: point})
        crash_during(car, car.recover)
        car.restart(env={})
        car.recover()

        assert idle.mig_uuid not in {gi.mig_uuid for gi in layouts(car)[0].gis}
        assert_converged(car)
        assert car.records() == {}
        assert car.cdi_files() == []


# -- MIG UUIDs that cannot prove identity --------------------------------------------------------------


def file_snapshots(car: Sidecar) -> tuple[dict[str, bytes], dict[str, bytes]]:
    return snapshot_dir(car.state_dir), snapshot_dir(car.cdi_dir)


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
        before = file_snapshots(sidecar)

        code, reason, metadata = failure(sidecar.recover)

        assert (code, reason, metadata["mig_uuid"]) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "UNVERIFIABLE_STATE",
            legacy,
        )
        assert file_snapshots(sidecar) == before
        assert not sidecar.info().recovered
