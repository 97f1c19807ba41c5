"""The liveness probe's command turns unhealthy when the NVML backend hangs, and healthy again after.

The hang is a simulator latency of ten minutes on the GI destroy of the reconciler's idle trim
(``--idle-ttl``): the call the reconciler makes never returns on its own within the test. With
``--stuck-threshold 2`` the health service answers NOT_SERVING once it has run that long; removing
the latency (the driver recovering) lets the call return, and the next Check answers SERVING. No
timing is asserted: the test waits (bounded) for each state the sidecar must reach.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from helpers_e2e import wait_until
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory, allocate_one

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "hami.migsidecar.v1.MigSidecar"
WAIT_S = 120.0  # a bound on waiting for a state, never a measured duration


def wait_for(car: Sidecar, what: str, condition: Callable[[], bool]) -> None:
    wait_until(what, condition, car=car, within=WAIT_S)


def probe(car: Sidecar, *service: str) -> tuple[int, str]:
    """What kubelet's exec probe sees: the exit status and output of ``hami-mig-sidecar health``."""
    result = car.cli("health", "--socket", str(car.socket), *(("--service", service[0]) if service else ()))
    return result.returncode, result.stdout + result.stderr


def test_a_hung_nvml_call_of_the_reconciler_fails_the_probe_until_it_returns(
    sidecar_factory: SidecarFactory,
) -> None:
    car = sidecar_factory(extra_args=["--idle-ttl", "1", "--stuck-threshold", "2"], sim_gpus="h100-80gb:1")
    car.recover()
    assert probe(car) == (0, "(process): SERVING\n")
    assert probe(car, SERVICE)[0] == 0
    device = allocate_one(car, "pod-1", 0, "1g.10gb", 0, 1)
    car.sim("latency", "destroy-gi", "600")
    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-1"), timeout=CALL_TIMEOUT_S)

    # The reconciler trims the IDLE instance after its TTL and hangs in the GI destroy.
    wait_for(car, "health NOT_SERVING", lambda: car.health_status() == NOT_SERVING)
    code, output = probe(car)
    assert code == 1
    assert output == "(process): NOT_SERVING\n"
    assert probe(car, SERVICE) == (1, f"{SERVICE}: NOT_SERVING\n")
    stuck = car.log_event("stuck: health NOT_SERVING")
    assert stuck["part"] in {"nvml", "reconciler"}
    assert stuck["seconds"] >= 2  # logged rounded to 0.1 s
    # The call has not returned: the teardown it belongs to still holds the instance's record.
    assert [r["state"] for r in car.records().values()] == ["DELETING"]

    car.sim("latency", "destroy-gi", "0")  # the driver answers again
    wait_for(car, "health SERVING", lambda: car.health_status() == SERVING)
    assert probe(car) == (0, "(process): SERVING\n")
    assert probe(car, SERVICE) == (0, f"{SERVICE}: SERVING\n")
    car.log_event("no longer stuck: health SERVING")
    # The trim the hang held up completed: the instance is gone from the hardware and the records.
    wait_for(car, "the trimmed instance gone", lambda: not car.records())
    assert all(not g["gis"] for g in car.hardware()), device.mig_uuid


def allocate_past_its_deadline(car: Sidecar, pod: str, start: int) -> None:
    """An Allocate whose NVML call hangs: the client gives up at its deadline, the server goes on."""
    with contextlib.suppress(grpc.RpcError):
        allocate_one(car, pod, 0, "1g.10gb", start, 1)


def test_creates_queued_on_one_gpu_keep_health_serving_and_a_hung_create_does_not(
    sidecar_factory: SidecarFactory,
) -> None:
    """Seven 1.5 s creates queued on one GPU with the threshold at 5 s: the reconciler round each
    Allocate wakes (the reserve lists the GPU under its lock) waits behind them for up to 9 s, and
    that wait is not stuck work, so health stays SERVING while every Allocate succeeds. A create
    that hangs is stuck work: health turns NOT_SERVING, and SERVING again once it returns."""
    car = sidecar_factory(
        extra_args=["--idle-reserve", "1g.10gb", "--stuck-threshold", "5"], sim_gpus="h100-80gb:1"
    )
    car.recover()
    car.sim("latency", "create-gi", "1.5")
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.add(car.health_status())
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        futures = [pool.submit(allocate_one, car, f"pod-{i}", 0, "1g.10gb", i, 1) for i in range(7)]
        devices = [f.result() for f in futures]
    seen.add(car.health_status())
    done.set()
    watcher.join()
    assert len({d.mig_uuid for d in devices}) == 7
    assert seen == {SERVING}
    assert "stuck: health NOT_SERVING" not in car.log_text()

    # An NVML call of an Allocate that never returns on its own (the process count that proves the
    # released instance idle before its reuse) is stuck work, whoever waits behind it.
    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-6"), timeout=CALL_TIMEOUT_S)
    car.sim("latency", "processes", "600")
    hung = threading.Thread(target=allocate_past_its_deadline, args=(car, "pod-hung", 6), daemon=True)
    hung.start()
    wait_for(car, "health NOT_SERVING", lambda: car.health_status() == NOT_SERVING)
    stuck = car.log_event("stuck: health NOT_SERVING")
    assert stuck["part"] == "nvml"
    assert stuck["seconds"] >= 5
    car.sim("latency", "processes", "0")
    wait_for(car, "health SERVING", lambda: car.health_status() == SERVING)
    hung.join(WAIT_S)
    wait_for(
        car,
        "the reuse the hang held up done",
        lambda: [r["state"] for r in car.records().values()] == ["ACTIVE"] * 7,
    )


def test_a_wait_for_a_gpu_lock_whose_holder_makes_no_progress_fails_the_probe_until_it_moves(
    sidecar_factory: SidecarFactory, tmp_path: Path
) -> None:
    """A holder blocked outside any NVML call: the node's ``/proc/devices`` (read for every CDI spec
    written under the GPU lock) is made a FIFO nobody writes, as a hung file system would leave a
    read. No call's age grows, so only the second Allocate's wait for that GPU's lock shows it: past
    the threshold the probe fails (kubelet would restart the container and Recover take over). Once
    the read returns, both Allocates complete and the probe passes again."""
    car = sidecar_factory(extra_args=["--stuck-threshold", "2"], sim_gpus="h100-80gb:1")
    car.recover()
    devices = car.sim_state.with_name(car.sim_state.name + ".proc") / "devices"
    content = devices.read_text()
    fifo = tmp_path / "devices.fifo"
    os.mkfifo(fifo)
    os.link(fifo, tmp_path / "devices.held")
    fifo.replace(devices)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(allocate_one, car, "pod-1", 0, "1g.10gb", 0, 1)
        # Its CREATING record: it holds the GPU's lock (no ``sim`` call here, which would rewrite
        # the simulator's /proc files).
        wait_for(car, "the first Allocate under the lock", lambda: bool(car.records()))
        second = pool.submit(allocate_one, car, "pod-2", 0, "1g.10gb", 1, 1)
        wait_for(car, "health NOT_SERVING", lambda: car.health_status() == NOT_SERVING)
        assert probe(car)[0] == 1
        stuck = car.log_event("stuck: health NOT_SERVING")
        assert stuck["part"] == "lock-wait"
        assert stuck["seconds"] >= 2
        assert not first.done()
        assert not second.done()
        regular = tmp_path / "devices.txt"
        regular.write_text(content)
        regular.replace(devices)
        (tmp_path / "devices.held").write_text(content)  # the blocked read returns
        devices_out = [first.result(), second.result()]
    wait_for(car, "health SERVING", lambda: car.health_status() == SERVING)
    assert probe(car)[0] == 0
    assert [d.placement.start for d in devices_out] == [0, 1]
    assert sorted(r["state"] for r in car.records().values()) == ["ACTIVE", "ACTIVE"]
