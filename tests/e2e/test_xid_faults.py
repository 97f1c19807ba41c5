"""Critical Xids through the socket, raised on the simulated hardware's C ABI (``sim xid``), so the
pynvml adapter's event path (event set, registration, wait) runs as it would over a real driver.

What is asserted is what a plugin, an operator or the next pod would see: the records on disk, the
simulated layout, the CDI files and the answers. No timing: each test waits (bounded) for the state
the sidecar must reach.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from helpers_e2e import wait_until
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory, allocate_one, annotation

pytestmark = pytest.mark.e2e

WAIT_S = 60.0  # a bound on waiting for a state, never a measured duration


def wait_for(car: Sidecar, what: str, condition: Callable[[], bool]) -> None:
    wait_until(what, condition, car=car, within=WAIT_S)


def started(sidecar_factory: SidecarFactory, *args: str) -> Sidecar:
    car = sidecar_factory(extra_args=list(args), sim_gpus="h100-80gb:2")
    car.recover()
    car.log_event("watching critical Xid events on 2 GPU(s)")
    return car


def record_of(car: Sidecar, device: Any) -> dict[str, Any] | None:
    return next((r for r in car.records().values() if r.get("mig_uuid") == device.mig_uuid), None)


def gis(car: Sidecar, gpu: int) -> set[int]:
    return {gi["id"] for gi in car.hardware()[gpu]["gis"]}


def assert_destroyed(car: Sidecar, gpu: int, device: Any) -> None:
    """Gone everywhere: the hardware, the record and its CDI spec."""
    assert record_of(car, device) is None
    assert device.gpu_instance_id not in gis(car, gpu)
    assert not any(device.mig_uuid in name for name in car.cdi_files())


def xid(car: Sidecar, gpu: int, code: int, device: Any | None = None) -> None:
    where = (
        ()
        if device is None
        else ("--gi", str(device.gpu_instance_id), "--ci", str(device.compute_instance_id))
    )
    car.sim("xid", "--gpu", str(gpu), *where, str(code))


def release(car: Sidecar, pod: str) -> list[Any]:
    return list(car.stub.Release(pb.ReleaseRequest(pod_uid=pod), timeout=CALL_TIMEOUT_S).released)


def test_an_active_instance_hit_by_an_xid_is_destroyed_at_its_release_never_idle(
    sidecar_factory: SidecarFactory,
) -> None:
    car = started(sidecar_factory)
    hit = allocate_one(car, "pod-hit", 0, "1g.10gb", 0, 1)
    other = allocate_one(car, "pod-other", 0, "1g.10gb", 1, 1)
    xid(car, 0, 79, hit)
    wait_for(car, "the fault recorded", lambda: (record_of(car, hit) or {}).get("xid") == 79)
    assert record_of(car, hit)["state"] == "ACTIVE"  # type: ignore[index]  # its pod still runs there
    assert record_of(car, other)["xid"] == 0  # type: ignore[index]  # another GI of that GPU

    assert [r.mig_uuid for r in release(car, "pod-hit")] == [hit.mig_uuid]
    assert_destroyed(car, 0, hit)  # by the time Release answered
    # The next pod asking for that placement gets a fresh instance, never the faulted one.
    again = allocate_one(car, "pod-next", 0, "1g.10gb", 0, 1)
    assert again.mig_uuid != hit.mig_uuid
    # The healthy neighbour is released as usual: IDLE, kept for reuse.
    release(car, "pod-other")
    assert record_of(car, other)["state"] == "IDLE"  # type: ignore[index]


def test_an_idle_instance_hit_by_an_xid_is_never_reused_and_the_reconciler_destroys_it(
    sidecar_factory: SidecarFactory,
) -> None:
    car = started(sidecar_factory)
    idle = allocate_one(car, "pod-1", 0, "1g.10gb", 0, 1)
    release(car, "pod-1")
    car.sim("fault", "destroy-ci", "IN_USE", "--times", "100000")  # the destroy cannot finish yet
    xid(car, 0, 48, idle)
    wait_for(
        car, "the faulted IDLE instance ERROR", lambda: (record_of(car, idle) or {}).get("state") == "ERROR"
    )
    assert record_of(car, idle)["xid"] == 48  # type: ignore[index]
    # Refused to a reuse meanwhile: an Allocate of the same profile gets another instance.
    fresh = allocate_one(car, "pod-2", 0, "1g.10gb", 1, 1)
    assert fresh.mig_uuid != idle.mig_uuid
    assert idle.gpu_instance_id in gis(car, 0)  # kept while its destroy fails

    car.sim("faults", "--clear")
    wait_for(car, "the reconciler destroyed it", lambda: record_of(car, idle) is None)
    assert_destroyed(car, 0, idle)
    assert record_of(car, fresh)["state"] == "ACTIVE"  # type: ignore[index]


def test_a_gpu_wide_xid_faults_every_owned_instance_of_that_gpu_and_no_foreign_one(
    sidecar_factory: SidecarFactory,
) -> None:
    car = started(sidecar_factory)
    active = allocate_one(car, "pod-a", 1, "1g.10gb", 0, 1)
    idle = allocate_one(car, "pod-i", 1, "1g.10gb", 1, 1)
    release(car, "pod-i")
    elsewhere = allocate_one(car, "pod-e", 0, "1g.10gb", 0, 1)
    car.sim("create", "--gpu", "1", "--profile", "1g.10gb", "--placement", "6:1")
    foreign = gis(car, 1) - {active.gpu_instance_id, idle.gpu_instance_id}
    xid(car, 1, 79)  # the whole GPU: GI and CI IDs 0xFFFFFFFF in the event

    wait_for(car, "the IDLE one destroyed", lambda: record_of(car, idle) is None)
    assert record_of(car, active)["xid"] == 79  # type: ignore[index]
    assert record_of(car, active)["state"] == "ACTIVE"  # type: ignore[index]
    assert record_of(car, elsewhere)["xid"] == 0  # type: ignore[index]  # another GPU
    reported = car.log_event("Xid faulted instances")
    assert set(reported["foreign_gis"]) == foreign  # reported...
    assert foreign <= gis(car, 1)  # ...never touched
    release(car, "pod-a")
    assert record_of(car, active) is None
    assert gis(car, 1) == foreign


def test_an_ignored_xid_changes_nothing(sidecar_factory: SidecarFactory) -> None:
    car = started(sidecar_factory)
    device = allocate_one(car, "pod-1", 0, "1g.10gb", 0, 1)
    idle = allocate_one(car, "pod-2", 0, "1g.10gb", 1, 1)
    release(car, "pod-2")
    before = (car.records(), car.hardware(), car.cdi_files())
    xid(car, 0, 13, device)  # an application error (graphics engine exception)
    xid(car, 0, 43)  # GPU-wide, application error too
    car.log_event("ignored Xid")
    wait_for(car, "both Xids seen", lambda: car.log_text().count('"msg":"ignored Xid"') == 2)
    assert (car.records(), car.hardware(), car.cdi_files()) == before
    again = allocate_one(car, "pod-3", 0, "1g.10gb", 1, 1)
    assert again.mig_uuid == idle.mig_uuid  # the IDLE one is reused as before


def test_a_fault_survives_a_kill_and_recover(sidecar_factory: SidecarFactory) -> None:
    car = started(sidecar_factory)
    held = allocate_one(car, "pod-held", 0, "1g.10gb", 0, 1)
    gone = allocate_one(car, "pod-gone", 0, "1g.10gb", 1, 1)
    xid(car, 0, 94, held)
    xid(car, 0, 95, gone)
    wait_for(
        car,
        "both faults recorded",
        lambda: [(record_of(car, d) or {}).get("xid") for d in (held, gone)] == [94, 95],
    )
    car.kill9()
    car.start()
    # pod-held is still running; pod-gone ended while the sidecar was down.
    car.recover([annotation("pod-held", held)])
    assert record_of(car, held)["xid"] == 94  # type: ignore[index]
    assert record_of(car, held)["state"] == "ACTIVE"  # type: ignore[index]
    # The one no pod holds is never restored IDLE: ERROR, then destroyed by the reconciler.
    wait_for(car, "the unheld faulted instance destroyed", lambda: record_of(car, gone) is None)
    assert gone.gpu_instance_id not in gis(car, 0)
    release(car, "pod-held")
    assert record_of(car, held) is None
    assert held.gpu_instance_id not in gis(car, 0)


def test_health_reaches_get_state_and_a_following_watch(sidecar_factory: SidecarFactory) -> None:
    car = started(sidecar_factory)
    hit = allocate_one(car, "pod-hit", 0, "1g.10gb", 0, 1)
    fine = allocate_one(car, "pod-fine", 0, "1g.10gb", 1, 1)
    stream = car.stub.WatchHealth(pb.WatchHealthRequest(follow=True), timeout=WAIT_S)
    opening = [next(stream), next(stream)]  # the health as it stands, one update per instance
    assert {(u.mig_uuid, u.health, u.current) for u in opening} == {
        (hit.mig_uuid, pb.HEALTHY, True),
        (fine.mig_uuid, pb.HEALTHY, True),
    }
    xid(car, 0, 79, hit)
    change = next(stream)
    assert (change.mig_uuid, change.health, change.xid, change.current) == (
        hit.mig_uuid,
        pb.FAULTED,
        79,
        False,
    )
    assert (change.gpu_instance_id, change.placement.start) == (hit.gpu_instance_id, 0)
    stream.cancel()

    state = car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
    health = {i.mig_uuid: (i.health, i.xid) for g in state.gpus for i in g.instances}
    assert health == {hit.mig_uuid: (pb.FAULTED, 79), fine.mig_uuid: (pb.HEALTHY, 0)}
    # Without follow: the health as it stands, then the stream ends.
    once = list(car.stub.WatchHealth(pb.WatchHealthRequest(), timeout=CALL_TIMEOUT_S))
    assert sorted((u.mig_uuid, u.health) for u in once) == sorted(
        [(hit.mig_uuid, pb.FAULTED), (fine.mig_uuid, pb.HEALTHY)]
    )
    # The operator's command streams the same: one JSON object a line.
    result = car.cli("call", "WatchHealth", "{}", "--socket", str(car.socket))
    assert result.returncode == 0, result.stderr
    lines = sorted(
        (d["mig_uuid"], d["health"], d["xid"]) for d in map(json.loads, result.stdout.splitlines())
    )
    assert lines == sorted([(hit.mig_uuid, "FAULTED", 79), (fine.mig_uuid, "HEALTHY", 0)])
    follower = car.stub.WatchHealth(pb.WatchHealthRequest(follow=True), timeout=WAIT_S)
    assert len([next(follower), next(follower)]) == 2
    proc = car.proc
    assert proc is not None
    proc.send_signal(signal.SIGTERM)  # a following stream does not hold up shutdown: it ends
    assert list(follower) == []
    assert proc.wait(timeout=WAIT_S) == 0


def test_a_gpu_whose_mig_mode_the_sidecar_enables_is_watched_too(sidecar_factory: SidecarFactory) -> None:
    """Hopper switches MIG mode at once: an instance made right after SetMigMode is as protected as
    one on a GPU that started with MIG enabled."""
    car = sidecar_factory(sim_gpus="h100-80gb:2", start=False)
    car.sim("init", "--gpus", "h100-80gb:2", "--mig-disabled")
    car.start()
    car.recover()
    car.log_event("no MIG-enabled GPU: Xid events are not watched")
    gpu = next(g for g in car.gpus() if g.index == 0)
    answer = car.stub.SetMigMode(
        pb.SetMigModeRequest(gpu_uuid=gpu.uuid, enabled=True), timeout=CALL_TIMEOUT_S
    )
    assert answer.mig_mode.current
    assert not answer.needs_reset
    car.log_event("watching critical Xid events on 1 GPU(s)")

    idle = allocate_one(car, "pod-1", 0, "1g.10gb", 0, 1)
    release(car, "pod-1")
    xid(car, 0, 48, idle)
    wait_for(car, "the faulted IDLE instance gone", lambda: record_of(car, idle) is None)
    assert_destroyed(car, 0, idle)
    again = car.stub.SetMigMode(pb.SetMigModeRequest(gpu_uuid=gpu.uuid, enabled=True), timeout=CALL_TIMEOUT_S)
    assert again.mig_mode.current
    assert car.log_text().count("watching critical Xid events") == 1  # a GPU already watched: no restart


def test_an_xid_past_32_bits_is_kept_whole_and_every_answer_still_comes(
    sidecar_factory: SidecarFactory,
) -> None:
    """NVML's event data is 64 bits, the contract's first ``xid`` field 32: the record keeps the
    value, ``xid64`` carries it, ``xid`` says 4294967295 (never 0, which reads as HEALTHY), and
    GetState, WatchHealth and ``status`` answer, before and after a restart reads the record back."""
    big = 2**32 + 79
    car = started(sidecar_factory)
    hit = allocate_one(car, "pod-hit", 0, "1g.10gb", 0, 1)
    follower = car.stub.WatchHealth(pb.WatchHealthRequest(follow=True), timeout=WAIT_S)
    assert next(follower).current
    xid(car, 0, big, hit)
    change = next(follower)
    follower.cancel()
    assert (change.mig_uuid, change.health, change.xid, change.xid64) == (
        hit.mig_uuid,
        pb.FAULTED,
        2**32 - 1,
        big,
    )
    assert record_of(car, hit)["xid"] == big  # type: ignore[index]

    def every_answer() -> None:
        state = car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
        assert [(i.mig_uuid, i.health, i.xid, i.xid64) for g in state.gpus for i in g.instances] == [
            (hit.mig_uuid, pb.FAULTED, 2**32 - 1, big)
        ]
        once = list(car.stub.WatchHealth(pb.WatchHealthRequest(), timeout=CALL_TIMEOUT_S))
        assert [(u.mig_uuid, u.xid64) for u in once] == [(hit.mig_uuid, big)]
        for command in (["status"], ["status", "--json"], ["call", "WatchHealth"]):
            result = car.cli(*command, "--socket", str(car.socket))
            assert result.returncode == 0, (command, result.stderr)

    every_answer()
    car.kill9()
    car.start()
    car.recover([annotation("pod-hit", hit)])
    every_answer()
    # Still faulted: destroyed at its release, never handed to the next pod.
    assert [r.mig_uuid for r in release(car, "pod-hit")] == [hit.mig_uuid]
    assert_destroyed(car, 0, hit)
