"""The serving edge gives every caller its turn, through the socket (``sidecar.edge.server``).

Following ``WatchHealth`` streams and a busy node's Allocates leave the health Check answering
SERVING within the probe's deadline, and the lifecycle calls either succeed or are refused
RESOURCE_EXHAUSTED (reason OVERLOADED), never queued without bound; nothing is lost.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc
from helpers_e2e import assert_converged
from inprocess_sidecar import CALL_TIMEOUT_S, inprocess_sidecar
from sidecar_process import SidecarFactory, error_info, snapshot_dir

from sidecar.edge.admission import Admission
from sidecar.nvml.sim import SimulatedHardware

PROBE_DEADLINE_S = 5.0  # the deployed liveness probe's
GPUS = 10  # a 1g.10gb placement of its own for each of the 64 clients
CLIENTS = 64
LOAD_S = 20.0


def allocate_request(gpu: str, pod: str, start: int) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="t", name=pod),
        container_name="main",
        devices=[
            pb.DeviceRequest(gpu_uuid=gpu, profile="1g.10gb", placement=pb.Placement(start=start, size=1))
        ],
    )


class Outcomes:
    """Every answer the clients and the prober got, by RPC and code (and health status)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.codes: dict[tuple[str, str], int] = {}
        self.health: dict[str, int] = {}

    def add(self, table: dict[Any, int], key: Any) -> None:
        with self.lock:
            table[key] = table.get(key, 0) + 1


def client(stub: Any, gpu: str, start: int, name: str, stop: threading.Event, seen: Outcomes) -> None:  # noqa: PLR0917 - a thread target
    """Allocate, Release, ReclaimIdle (a GI created and destroyed each round) until ``stop``; a call
    refused RESOURCE_EXHAUSTED is sent again, as the Go client does."""
    n = 0
    while not stop.is_set():
        pod = f"{name}-{n}"
        n += 1
        calls: list[tuple[str, Any, Any]] = [("Allocate", stub.Allocate, allocate_request(gpu, pod, start))]
        for index, (method, call, request) in enumerate(calls):
            while True:
                try:
                    answer = call(request, timeout=CALL_TIMEOUT_S * 2)
                except grpc.RpcError as err:
                    code, reason, _ = error_info(err)
                    seen.add(seen.codes, (method, f"{code.name}/{reason}"))
                    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and reason == "OVERLOADED":
                        continue
                    return  # anything else is a finding: counted above, and the client stops
                seen.add(seen.codes, (method, "OK"))
                break
            if index == 0:
                mig = answer.devices[0].mig_uuid
                calls.append(("Release", stub.Release, pb.ReleaseRequest(pod_uid=pod)))
                calls.append(
                    ("ReclaimIdle", stub.ReclaimIdle, pb.ReclaimIdleRequest(gpu_uuid=gpu, mig_uuids=[mig]))
                )


def prober(channel: grpc.Channel, stop: threading.Event, seen: Outcomes) -> None:
    health: Any = health_pb2_grpc.HealthStub(channel)  # typed without its methods
    while not stop.wait(0.2):
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=PROBE_DEADLINE_S).status
            seen.add(seen.health, health_pb2.HealthCheckResponse.ServingStatus.Name(status))
        except grpc.RpcError as err:
            seen.add(seen.health, err.code().name)


def test_following_streams_and_busy_clients_leave_every_call_its_turn(
    sidecar_factory: SidecarFactory,
) -> None:
    car = sidecar_factory(sim_gpus=f"h100-80gb:{GPUS}")
    car.recover()
    gpus = [g.uuid for g in car.gpus()]
    car.sim("latency", "create-gi", "1")
    car.sim("latency", "destroy-gi", "1")
    target = f"unix://{car.socket}"
    shared = car.channel
    assert shared is not None
    lone = [grpc.insecure_channel(target) for _ in range(20)]
    streams = [
        pb_grpc.MigSidecarStub(shared).WatchHealth(pb.WatchHealthRequest(follow=True)) for _ in range(50)
    ]
    streams += [pb_grpc.MigSidecarStub(ch).WatchHealth(pb.WatchHealthRequest(follow=True)) for ch in lone]
    probe_channel = grpc.insecure_channel(target)
    seen = Outcomes()
    stop = threading.Event()
    threads = [
        threading.Thread(target=client, args=(car.stub, gpus[i % GPUS], i // GPUS, f"p{i}", stop, seen))
        for i in range(CLIENTS)
    ]
    threads.append(threading.Thread(target=prober, args=(probe_channel, stop, seen)))
    try:
        for t in threads:
            t.start()
        stop.wait(LOAD_S)
    finally:
        stop.set()
        for t in threads:
            t.join()
        still_open = [s.is_active() for s in streams]
        for s in streams:
            s.cancel()
        for ch in [*lone, probe_channel]:
            ch.close()
    assert all(still_open), "the sidecar ended a following stream"
    assert set(seen.health) == {"SERVING"}, seen.health
    answers = {key for key in seen.codes if key[1] != "RESOURCE_EXHAUSTED/OVERLOADED"}
    assert answers == {("Allocate", "OK"), ("Release", "OK"), ("ReclaimIdle", "OK")}, seen.codes
    assert seen.codes[("Allocate", "OK")] >= CLIENTS  # every client went round at least once
    car.sim("latency", "create-gi", "0")
    car.sim("latency", "destroy-gi", "0")
    # Nothing lost: every GI owned and on its record, every CDI spec owned, nothing left ACTIVE.
    assert_converged(car)
    assert all(
        i.state != pb.ACTIVE for g in car.stub.GetState(pb.GetStateRequest()).gpus for i in g.instances
    )


def test_a_call_past_the_admitted_ones_is_refused_overloaded_and_changes_nothing() -> None:
    with inprocess_sidecar(sim_gpus="h100-80gb:1") as car:
        car.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        servicer = car.app.server.servicer
        servicer.admission.close()  # idle: nothing to wait for
        servicer.admission = Admission(workers=1, admitted=2)
        gpu = car.gpu_uuids()[0]
        hardware = SimulatedHardware.open(car.sim_state)
        hardware.set_latency("create-gi", 600.0)  # the two admitted calls wait until it is lifted
        answers: dict[str, Any] = {}

        def files_and_hardware() -> tuple[Any, ...]:
            # Not GetState: it needs room in the admission too.
            return snapshot_dir(car.state_dir), snapshot_dir(car.cdi_dir), hardware.layouts()

        def allocate(pod: str, start: int) -> None:
            answers[pod] = car.stub.Allocate(allocate_request(gpu, pod, start), timeout=CALL_TIMEOUT_S * 4)

        held = [threading.Thread(target=allocate, args=(f"held{i}", i)) for i in range(2)]
        for t in held:
            t.start()
        # The simulator makes the GI, then sleeps out the latency: once the GI is there, the one worker
        # sleeps inside create-gi and the other held call waits for it; nothing moves until lifted.
        while servicer.admission.held < 2 or not any(g.gis for g in hardware.layouts()):
            threading.Event().wait(0.01)
        before = files_and_hardware()
        for start in (2, 3):
            try:
                car.stub.Allocate(allocate_request(gpu, f"late{start}", start), timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as err:
                code, reason, metadata = error_info(err)
            else:
                raise AssertionError("a call past the admitted ones was answered")
            assert (code, reason, metadata["method"]) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "OVERLOADED",
                "Allocate",
            )
        after = files_and_hardware()
        hardware.set_latency("create-gi", 0)
        for t in held:
            t.join()
        assert before == after  # the refused calls changed nothing
        assert {pod: a.devices[0].outcome for pod, a in answers.items()} == {
            "held0": pb.CREATED,
            "held1": pb.CREATED,
        }
        # Once the room is back, the same request goes through.
        again = car.stub.Allocate(allocate_request(gpu, "late2", 2), timeout=CALL_TIMEOUT_S)
        assert again.devices[0].outcome == pb.CREATED
