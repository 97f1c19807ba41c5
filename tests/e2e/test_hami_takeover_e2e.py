"""Taking over HAMi's in-process lifecycle at Recover, on the simulated node, without a drain.

Instances are made with ``sim create`` (as HAMi made them), HAMi's records and CDI specs are written
byte for byte as HAMi writes them (``hami_format``); then a real sidecar recovers, serves, crashes."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami_format import record_filename, spec_filename, write_record, write_spec
from helpers_e2e import TAKEOVER_POINTS
from sidecar_process import Sidecar, SidecarFactory, allocate_one, instances, snapshot_dir

from sidecar.lifecycle import crashpoints

pytestmark = pytest.mark.e2e

ADOPT = "--adopt-existing-mig-instances"
CALL_TIMEOUT_S = 30


def hami_instance(
    car: Sidecar,
    profile: str,
    start: int,
    size: int,
    *,
    gi_offset: int = 0,
    version: int = 1,
) -> dict[str, Any]:
    """Create an instance on GPU 0 as HAMi would and leave HAMi's record and spec for it."""
    car.sim("create", "--gpu", "0", "--profile", profile, "--placement", f"{start}:{size}")
    gpu = car.hardware()[0]
    gi = next(g for g in gpu["gis"] if g["placement"]["start"] == start)
    ci = gi["cis"][0]
    car.state_dir.mkdir(parents=True, exist_ok=True)
    car.cdi_dir.mkdir(parents=True, exist_ok=True)
    uuid = ci["mig_uuid"]
    gi_id = gi["id"] + gi_offset
    write_record(car.state_dir, uuid, gpu["uuid"], profile, start, size, gi_id, ci["id"], version=version)
    write_spec(car.cdi_dir, uuid, gpu["uuid"], 0, gi["id"], ci["id"])
    return {
        "uuid": uuid,
        "gi": gi["id"],
        "ci": ci["id"],
        "gpu": gpu["uuid"],
        "profile": profile,
        "placement": (start, size),
        "record": car.state_dir / record_filename(uuid),
        "spec": car.cdi_dir / spec_filename(uuid),
    }


def listed(pod: str, inst: dict[str, Any]) -> Any:
    """The pod list's entry for a pod running on ``inst`` (what the plugin reads from its annotation)."""
    return pb.ActiveAllocation(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        device_index=0,
        gpu_uuid=inst["gpu"],
        profile=inst["profile"],
        placement=pb.Placement(start=inst["placement"][0], size=inst["placement"][1]),
        mig_uuid=inst["uuid"],
        gpu_instance_id=inst["gi"],
        compute_instance_id=inst["ci"],
    )


def own_spec(car: Sidecar, uuid: str) -> bool:
    """Whether the sidecar's own CDI spec of ``uuid`` is there (its file names the MIG UUID)."""
    return any(uuid in name for name in car.cdi_files())


def live_uuids(car: Sidecar) -> set[str]:
    return {ci["mig_uuid"] for g in car.hardware() for gi in g["gis"] for ci in gi["cis"]}


def release(car: Sidecar, pod: str) -> None:
    car.stub.Release(pb.ReleaseRequest(pod_uid=pod), timeout=CALL_TIMEOUT_S)


def test_two_idle_hami_instances_are_taken_over_and_their_files_replaced(sidecar: Sidecar) -> None:
    a = hami_instance(sidecar, "1g.10gb", 0, 1)
    b = hami_instance(sidecar, "1g.10gb", 1, 1)
    report = sidecar.recover()
    assert not report.errors
    assert {r.mig_uuid for r in report.restored_idle} == {a["uuid"], b["uuid"]}
    assert {u: i.state for u, i in instances(sidecar).items()} == {a["uuid"]: pb.IDLE, b["uuid"]: pb.IDLE}
    assert not (sidecar.state_dir / record_filename(a["uuid"])).exists()
    assert not (sidecar.cdi_dir / spec_filename(b["uuid"])).exists()
    assert {r["taken_over_from"] for r in sidecar.records().values()} == {"hami"}


class TestOneActiveAndTwoIdleAreTakenOverAndServed:
    """The node as HAMi left it: a pod on the instance at 6:1, two IDLE instances at 0:1 and 1:1."""

    @staticmethod
    def node(car: Sidecar) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        active = hami_instance(car, "1g.10gb", 6, 1)
        a = hami_instance(car, "1g.10gb", 0, 1)
        b = hami_instance(car, "1g.10gb", 1, 1)
        report = car.recover([listed("pod-hami", active)])
        assert list(report.errors) == []
        assert [r.mig_uuid for r in report.adopted_active] == [active["uuid"]]
        assert {r.mig_uuid for r in report.restored_idle} == {a["uuid"], b["uuid"]}
        return active, a, b

    def test_all_three_are_owned_marked_and_only_the_active_ones_hami_spec_stays(
        self, sidecar: Sidecar
    ) -> None:
        active, a, b = self.node(sidecar)
        owned = instances(sidecar)
        assert {u: i.state for u, i in owned.items()} == {
            active["uuid"]: pb.ACTIVE,
            a["uuid"]: pb.IDLE,
            b["uuid"]: pb.IDLE,
        }
        assert owned[active["uuid"]].owner.pod.uid == "pod-hami"
        assert {i.taken_over_from for i in owned.values()} == {"hami"}
        assert not any(inst["record"].exists() for inst in (active, a, b))
        assert active["spec"].exists()
        assert not a["spec"].exists()
        assert not b["spec"].exists()
        assert all(own_spec(sidecar, inst["uuid"]) for inst in (active, a, b))

    def test_status_and_records_verify_show_them_taken_over(self, sidecar: Sidecar) -> None:
        self.node(sidecar)
        status = sidecar.cli("status", "--socket", str(sidecar.socket), "--json")
        assert status.returncode == 0, status.stderr
        assert "TAKEN OVER FROM" in sidecar.cli("status", "--socket", str(sidecar.socket)).stdout
        assert '"taken_over_from": "hami"' in status.stdout
        verify = sidecar.cli("records", "verify", "--state-dir", str(sidecar.state_dir))
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert verify.stdout.count(": taken over from HAMi") == 3
        assert "HAMI " not in verify.stdout

    def test_the_idle_ones_are_reused_with_their_mig_uuid_then_reclaimed_under_pressure(
        self, sidecar: Sidecar
    ) -> None:
        active, a, b = self.node(sidecar)
        for pod, inst in (("pod-b", a), ("pod-c", b)):
            device = allocate_one(sidecar, pod, 0, "1g.10gb", inst["placement"][0], 1)
            assert (device.outcome, device.mig_uuid, device.gpu_instance_id) == (
                pb.REUSED,
                inst["uuid"],
                inst["gi"],
            )
            assert device.cdi_device.startswith("k8s.hami.io/mig=")  # the sidecar's own spec
            assert not inst["spec"].exists()
            release(sidecar, pod)

        big = allocate_one(sidecar, "pod-d", 0, "3g.40gb", 0, 4)

        assert big.outcome == pb.CREATED
        assert live_uuids(sidecar) == {active["uuid"], big.mig_uuid}
        assert not own_spec(sidecar, a["uuid"])
        assert not own_spec(sidecar, b["uuid"])
        assert set(instances(sidecar)) == {active["uuid"], big.mig_uuid}
        assert active["spec"].exists()

    def test_the_active_one_keeps_hamis_spec_through_its_release_until_its_destroy(
        self, sidecar: Sidecar
    ) -> None:
        active, _, _ = self.node(sidecar)
        release(sidecar, "pod-hami")
        assert instances(sidecar)[active["uuid"]].state == pb.IDLE
        assert active["spec"].exists()

        big = allocate_one(sidecar, "pod-d", 0, "3g.40gb", 4, 4)

        assert big.outcome == pb.CREATED
        assert active["uuid"] not in live_uuids(sidecar)
        assert not active["spec"].exists()
        assert not own_spec(sidecar, active["uuid"])
        assert active["uuid"] not in instances(sidecar)


class TestHamiRecordsThatDoNotMatchAreKept:
    def test_a_wrong_gi_id_and_a_bad_version_are_kept_untouched_and_their_instances_foreign(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        """With adoption of unowned instances on, which would otherwise take both."""
        car = sidecar_factory(extra_args=[ADOPT])
        wrong_gi = hami_instance(car, "1g.10gb", 0, 1, gi_offset=5)
        bad_version = hami_instance(car, "1g.10gb", 1, 1, version=2)
        hardware, state, cdi = car.hardware(), snapshot_dir(car.state_dir), snapshot_dir(car.cdi_dir)

        report = car.recover()

        assert car.hardware() == hardware
        assert {k: v for k, v in snapshot_dir(car.state_dir).items() if k.startswith("hami-")} == {
            k: v for k, v in state.items() if k.startswith("hami-")
        }
        assert snapshot_dir(car.cdi_dir) == cdi
        assert car.records() == {}
        assert instances(car) == {}
        assert {r.mig_uuid for r in report.preserved_foreign} == {wrong_gi["uuid"], bad_version["uuid"]}
        assert report.adopted_foreign == report.removed_orphan_gis == []
        for inst in (wrong_gi, bad_version):
            assert any(inst["record"].name in e for e in report.errors), list(report.errors)
        assert any("GPU instance ID" in e for e in report.errors if wrong_gi["record"].name in e)
        assert any("unsupported version 2" in e for e in report.errors if bad_version["record"].name in e)

        verify = car.cli("records", "verify", "--state-dir", str(car.state_dir))
        hami_lines = [line for line in verify.stdout.splitlines() if line.startswith("  HAMI")]
        assert len(hami_lines) == 2, verify.stdout
        assert any(line.startswith(f"  HAMI     {wrong_gi['record']}: ") for line in hami_lines)
        assert any(line.startswith(f"  HAMI     {bad_version['record']}: not usable") for line in hami_lines)


def hami_or_ours(car: Sidecar, insts: list[dict[str, Any]]) -> dict[str, tuple[bool, bool]]:
    """MIG UUID -> (the sidecar's record of it exists, HAMi's record file of it exists)."""
    ours = {r["mig_uuid"] for r in car.records().values()}
    return {i["uuid"]: (i["uuid"] in ours, i["record"].exists()) for i in insts}


@pytest.mark.parametrize("point", TAKEOVER_POINTS)
def test_a_kill_9_inside_the_takeover_then_recover_loses_nothing_and_leaks_nothing(
    sidecar_factory: SidecarFactory, point: str
) -> None:
    car = sidecar_factory(env={crashpoints.ENV: point})
    active = hami_instance(car, "1g.10gb", 6, 1)
    a = hami_instance(car, "1g.10gb", 0, 1)
    b = hami_instance(car, "1g.10gb", 1, 1)
    insts = [active, a, b]
    hardware = car.hardware()
    pods = [listed("pod-hami", active)]

    with pytest.raises(grpc.RpcError):  # the process dies mid-call
        car.recover(pods)
    assert car.proc is not None
    assert car.proc.wait(timeout=CALL_TIMEOUT_S) == 137
    # The pod list's adoption came first; then the crash, inside the first conversion (files in name
    # order): that one's record is durable, HAMi's file there or gone; the other is not converted yet.
    crashed = hami_or_ours(car, insts)
    assert crashed[active["uuid"]] == (True, True)
    assert sorted(crashed[i["uuid"]] for i in (a, b)) == sorted(
        [(True, point == TAKEOVER_POINTS[0]), (False, True)]
    )

    car.restart(env={})  # HAMi's files are in the state directory as the sidecar starts
    report = car.recover(pods)

    assert list(report.errors) == []
    assert car.hardware() == hardware
    assert hami_or_ours(car, insts) == {i["uuid"]: (True, False) for i in insts}
    owned = instances(car)
    assert {u: i.state for u, i in owned.items()} == {
        active["uuid"]: pb.ACTIVE,
        a["uuid"]: pb.IDLE,
        b["uuid"]: pb.IDLE,
    }
    assert owned[active["uuid"]].owner.pod.uid == "pod-hami"
    assert {i.taken_over_from for i in owned.values()} == {"hami"}
    assert all(own_spec(car, i["uuid"]) for i in insts)
    assert [p.name for p in car.cdi_dir.glob("hami-*")] == [active["spec"].name]
    state = car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
    assert all(not g.foreign for g in state.gpus)
    assert allocate_one(car, "pod-b", 0, "1g.10gb", 0, 1).mig_uuid == a["uuid"]


def test_a_listed_instance_whose_hami_file_a_crash_left_is_finished_and_keeps_its_mark(
    sidecar_factory: SidecarFactory,
) -> None:
    """The pod-list adoption writes the ACTIVE record first; a crash before HAMi's file goes, then a
    Recover, then another restart: the instance stays marked, so its destroy removes HAMi's spec."""
    car = sidecar_factory(env={crashpoints.ENV: "after-takeover-record"})
    active = hami_instance(car, "1g.10gb", 6, 1)
    pods = [listed("pod-hami", active)]
    with pytest.raises(grpc.RpcError):  # the process dies mid-call
        car.recover(pods)
    assert car.proc is not None
    assert car.proc.wait(timeout=CALL_TIMEOUT_S) == 137

    car.restart(env={})
    assert list(car.recover(pods).errors) == []
    car.restart(env={})
    assert list(car.recover(pods).errors) == []

    assert hami_or_ours(car, [active]) == {active["uuid"]: (True, False)}
    assert instances(car)[active["uuid"]].taken_over_from == "hami"
    release(car, "pod-hami")
    allocate_one(car, "pod-d", 0, "3g.40gb", 4, 4)
    assert not active["spec"].exists()
