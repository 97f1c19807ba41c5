#!/usr/bin/env python3
"""The processes of ``edge_load.py`` other than the sidecar: the prober, the load clients, the followers
and the reference health server (not a test).

Each is a process of its own, so that none waits for another's interpreter lock and what is timed is
the sidecar: the prober (one thread, blocking calls), the clients (``grpc.aio``, every client a task
on one event loop and one channel, not an OS thread each) and the followers (the same, one task a
stream). ``edge_load.py`` starts each as ``edge_load_parties.py NAME CONFIG`` (``Party``) and talks
to it by lines: it says ``ready`` on stdout once connected, is told when to go and to stop on stdin,
and prints its results as one JSON document before it exits.
"""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

PROBE_DEADLINE_S = 5.0  # the deployed liveness probe's (``hami-mig-sidecar health``)
CALL_TIMEOUT_S = 60.0
SETTLE_S = 1.0  # after the streams open: every one past its current state


def allocate_request(gpu: str, pod: str, start: int) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="bench", name=pod),
        container_name="main",
        devices=[
            pb.DeviceRequest(gpu_uuid=gpu, profile="1g.10gb", placement=pb.Placement(start=start, size=1))
        ],
    )


def refusal(err: grpc.RpcError) -> str:
    """``CODE`` or ``CODE/REASON`` of a failed call (a blocking or an asyncio one)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return f"{err.code().name}/{info.reason}"
    return err.code().name


class Party:
    """One party, started as this file with its name and its configuration (module notes)."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        command = [sys.executable, __file__, name, json.dumps(config)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit(f"the {name} process did not start")

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def results(self) -> Any:
        """Close its stdin (stop) and read what it measured."""
        out, _ = self.proc.communicate(timeout=CALL_TIMEOUT_S * 2)
        if self.proc.returncode != 0:
            raise SystemExit(f"a bench process failed ({self.proc.returncode})")
        return json.loads(out)


def prober_party(config: dict[str, Any]) -> dict[str, Any]:
    """Every ``every`` seconds until stdin closes, a health Check to each of ``sockets``, one after
    the other and each blocking (the liveness probe's own way), the first one first on every other
    turn: each pair of Checks meets the machine in the same state. A Check past the probe's deadline
    is timed at the deadline."""
    stubs: list[Any] = []  # the health stubs, typed without their methods
    for socket in config["sockets"]:
        channel = grpc.insecure_channel(f"unix://{socket}")
        grpc.channel_ready_future(channel).result(timeout=60)
        stubs.append(health_pb2_grpc.HealthStub(channel))
    check = health_pb2.HealthCheckRequest(service="")
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    print("ready", flush=True)
    timed: list[list[float]] = [[] for _ in stubs]
    every = float(config["every"])
    next_at = time.perf_counter()
    turn = 0
    while not stop.is_set():
        order = list(range(len(stubs)))
        for i in order[turn % 2 :] + order[: turn % 2]:
            started = time.perf_counter()
            try:
                stubs[i].Check(check, timeout=PROBE_DEADLINE_S)
                timed[i].append(time.perf_counter() - started)
            except grpc.RpcError:
                timed[i].append(PROBE_DEADLINE_S)
        turn += 1
        next_at = max(next_at + every, time.perf_counter())
        stop.wait(next_at - time.perf_counter())
    return {"checks": timed}


async def clients_party(config: dict[str, Any]) -> dict[str, Any]:
    """``clients`` clients on one channel, each a task looping Allocate (a GI created), Release,
    ReclaimIdle (destroyed) on a placement of its own, from ``go`` for ``seconds``."""
    gpus: list[str] = config["gpus"]
    allocated = 0
    refused: collections.Counter[str] = collections.Counter()
    stop = asyncio.Event()
    async with grpc.aio.insecure_channel(f"unix://{config['socket']}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        stub = pb_grpc.MigSidecarStub(channel)

        async def client(index: int) -> None:
            nonlocal allocated
            gpu = gpus[index % len(gpus)]
            start = index // len(gpus)
            n = 0
            while not stop.is_set():
                pod = f"{config['tag']}-{index}-{n}"
                n += 1
                try:
                    answer = await stub.Allocate(allocate_request(gpu, pod, start), timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError as err:
                    refused[f"Allocate {refusal(err)}"] += 1
                    continue
                if not stop.is_set():
                    allocated += 1
                release = pb.ReleaseRequest(pod_uid=pod)
                reclaim = pb.ReclaimIdleRequest(gpu_uuid=gpu, mig_uuids=[answer.devices[0].mig_uuid])
                for name, call, request in (
                    ("Release", stub.Release, release),
                    ("ReclaimIdle", stub.ReclaimIdle, reclaim),
                ):
                    # A refused Release or ReclaimIdle is sent again: the placement must come free.
                    while True:
                        try:
                            await call(request, timeout=CALL_TIMEOUT_S)
                            break
                        except grpc.aio.AioRpcError as err:
                            refused[f"{name} {refusal(err)}"] += 1
                            if err.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                                break
                            await asyncio.sleep(0.05)

        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # go
        started = time.perf_counter()
        tasks = [asyncio.create_task(client(i)) for i in range(int(config["clients"]))]
        await asyncio.sleep(float(config["seconds"]))
        stop.set()
        seconds = time.perf_counter() - started
        await asyncio.gather(*tasks)  # each ends its round: the placements come free for the next phase
    return {"seconds": seconds, "allocated": allocated, "refused": dict(refused)}


async def followers_party(config: dict[str, Any]) -> dict[str, Any]:
    """``shared`` following WatchHealth streams on one channel and ``lone`` on a channel each, every
    one read as it comes, until stdin closes; how many the sidecar ended or refused before that."""
    target = f"unix://{config['socket']}"
    channels = [grpc.aio.insecure_channel(target) for _ in range(1 + int(config["lone"]))]
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), 60)
    stubs = [pb_grpc.MigSidecarStub(channels[0])] * int(config["shared"])
    stubs += [pb_grpc.MigSidecarStub(channel) for channel in channels[1:]]
    updates = 0

    async def follow(stub: pb_grpc.MigSidecarStub) -> None:
        nonlocal updates
        async for _ in stub.WatchHealth(pb.WatchHealthRequest(follow=True)):
            updates += 1

    tasks = [asyncio.create_task(follow(stub)) for stub in stubs]
    await asyncio.sleep(SETTLE_S)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    ended = sum(1 for t in tasks if t.done())
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    return {"ended": ended, "updates": updates}


async def reference_party(config: dict[str, Any]) -> dict[str, Any]:
    """grpcio's own asyncio health servicer alone, on a socket of its own, until stdin closes: the
    same Check answered by nothing but grpc.aio, on the same machine at the same moment."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    server.add_insecure_port(f"unix://{config['socket']}")
    await server.start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)
    return {}


def party_main(name: str, config: dict[str, Any]) -> int:
    if name == "prober":
        result = prober_party(config)
    elif name == "reference":
        result = asyncio.run(reference_party(config))
    elif name == "clients":
        result = asyncio.run(clients_party(config))
    else:
        result = asyncio.run(followers_party(config))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(party_main(sys.argv[1], json.loads(sys.argv[2])))
