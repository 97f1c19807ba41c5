#!/usr/bin/env python3
"""The serving edge under load: health Check and Allocate throughput with following streams open (not a test).

One ``python -m sidecar serve`` on ``--gpus`` simulated H100-80GB, files on /dev/shm (``--disk``
runs everything a second time on disk and prints that table beside), recovered, then:

1. idle: ``--checks`` health Checks, paced as under load (their p99 is the baseline), and
   ``--rounds`` rounds of ALREADY_ALLOCATED and a reuse Allocate on one placement (their p50s);
2. load without streams: GI create and destroy made to take ``--op-seconds`` (the simulator's
   latency knob), ``--clients`` clients each on a placement of its own, in a loop: Allocate (a GI
   created), Release, ReclaimIdle (the GI destroyed), for ``--seconds``; a prober sends a health
   Check every ``PROBE_EVERY_S`` with the probe's 5 s deadline, from a process of its own;
3. the same load with ``--followers`` following ``WatchHealth`` streams on one channel and
   ``--lone-followers`` more, each on a channel of its own, open throughout.

Printed, as ratios of this one run: the health Check's p99 under load (3) against idle (1), the
Allocate throughput of (3) against (2), every call refused (by code and reason) in (2) and (3),
and the reuse Allocate's p50 against ALREADY_ALLOCATED's. A Check past its deadline is counted and
timed at the deadline. The results: ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

from sidecar.nvml.sim import SimulatedHardware

PROBE_DEADLINE_S = 5.0  # the deployed liveness probe's (``hami-mig-sidecar health``)
PROBE_EVERY_S = 0.1
CALL_TIMEOUT_S = 60.0
PLACEMENTS_1G = 7  # 1g.10gb placements of an H100-80GB


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def allocate_request(gpu: str, pod: str, start: int) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="bench", name=pod),
        container_name="main",
        devices=[
            pb.DeviceRequest(gpu_uuid=gpu, profile="1g.10gb", placement=pb.Placement(start=start, size=1))
        ],
    )


def refusal(err: grpc.RpcError) -> str:
    """``CODE`` or ``CODE/REASON`` of a failed call."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return f"{err.code().name}/{info.reason}"
    return err.code().name


@dataclass
class Phase:
    """What one load phase measured."""

    seconds: float = 0.0
    allocated: int = 0
    checks: list[float] = field(default_factory=list)
    missed_checks: int = 0
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, what: str) -> None:
        with self.lock:
            self.refused[what] += 1


class Sidecar:
    def __init__(self, root: Path, gpus: int) -> None:
        self.root, self.socket, self.hw_file = root, root / "s.sock", root / "hw.json"
        command = [
            sys.executable, "-m", "sidecar", "serve", "--backend", "simulated",
            "--sim-state", str(self.hw_file), "--sim-gpus", f"h100-80gb:{gpus}",
            "--state-dir", str(root / "state"), "--cdi-dir", str(root / "cdi"),
            "--socket", str(self.socket), "--log-level", "WARNING",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
        self.log = (root / "sidecar.log").open("ab")
        self.proc = subprocess.Popen(command, env=env, stderr=self.log)
        self.channel = self.connect()
        self.stub = pb_grpc.MigSidecarStub(self.channel)
        self.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        self.gpus = [g.uuid for g in self.stub.ListGpus(pb.ListGpusRequest()).gpus]
        self.hw = SimulatedHardware.open(self.hw_file)

    def connect(self) -> grpc.Channel:
        channel = grpc.insecure_channel(f"unix://{self.socket}")
        grpc.channel_ready_future(channel).result(timeout=60)
        return channel

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def idle_figures(car: Sidecar, checks: int, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """Health Check latencies, then ALREADY_ALLOCATED's and the reuse Allocate's, on an idle sidecar."""
    timed = Prober(car.socket, checks, PROBE_EVERY_S).results()  # paced as under load: each wakes the sidecar
    held: list[float] = []
    reused: list[float] = []
    gpu = car.gpus[0]
    car.stub.Allocate(allocate_request(gpu, "warm", 0))  # the GI every round reuses, created once
    car.stub.Release(pb.ReleaseRequest(pod_uid="warm"))
    for i in range(rounds):
        pod = allocate_request(gpu, f"r{i}", 0)
        started = time.perf_counter()
        answer = car.stub.Allocate(pod)
        reused.append(time.perf_counter() - started)
        if answer.devices[0].outcome != pb.REUSED:
            raise SystemExit(f"round {i}: expected REUSED, got {answer.devices[0]}")
        started = time.perf_counter()
        answer = car.stub.Allocate(pod)
        held.append(time.perf_counter() - started)
        if answer.devices[0].outcome != pb.ALREADY_ALLOCATED:
            raise SystemExit(f"round {i}: expected ALREADY_ALLOCATED, got {answer.devices[0]}")
        car.stub.Release(pb.ReleaseRequest(pod_uid=f"r{i}"))
    return timed, held, reused


def client(car: Sidecar, index: int, stop: threading.Event, phase: Phase, tag: str) -> None:
    """Allocate (a GI created), Release, ReclaimIdle (destroyed) on this client's placement until ``stop``."""
    stub = car.stub
    gpu = car.gpus[index % len(car.gpus)]
    start = index // len(car.gpus)
    n = 0
    while not stop.is_set():
        pod = f"{tag}-{index}-{n}"
        n += 1
        try:
            answer = stub.Allocate(allocate_request(gpu, pod, start), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            phase.count(f"Allocate {refusal(err)}")
            continue
        if not stop.is_set():
            with phase.lock:
                phase.allocated += 1
        release = pb.ReleaseRequest(pod_uid=pod)
        reclaim = pb.ReclaimIdleRequest(gpu_uuid=gpu, mig_uuids=[answer.devices[0].mig_uuid])
        for name, call, request in (
            ("Release", stub.Release, release),
            ("ReclaimIdle", stub.ReclaimIdle, reclaim),
        ):
            while True:  # a refused Release or ReclaimIdle is sent again: the placement must come free
                try:
                    call(request, timeout=CALL_TIMEOUT_S)
                    break
                except grpc.RpcError as err:
                    phase.count(f"{name} {refusal(err)}")
                    if err.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                        break
                    time.sleep(0.05)


class Prober:
    """Health Checks from a process of its own (``--probe``): in this one they would wait for the
    interpreter lock behind the clients' threads, and time the harness, not the sidecar. A Check past
    the probe's deadline is timed at the deadline."""

    def __init__(self, socket: Path, count: int, every: float) -> None:
        command = [sys.executable, __file__, "--probe", str(socket), str(count), str(every)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the prober did not start")

    def results(self) -> list[float]:
        """Stop probing (stdin closed) and the latencies, in seconds."""
        out, _ = self.proc.communicate(timeout=120)
        return [float(x) for x in out.split()]


def probe_main(socket: str, count: int, every: float) -> int:
    """The prober process: ``count`` Checks (0: until stdin closes), ``every`` seconds apart."""
    channel = grpc.insecure_channel(f"unix://{socket}")
    grpc.channel_ready_future(channel).result(timeout=60)
    health: Any = health_pb2_grpc.HealthStub(channel)  # typed without its methods
    check = health_pb2.HealthCheckRequest(service="")
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    print("ready", flush=True)
    timed: list[float] = []
    while len(timed) < count if count else not stop.wait(every):
        started = time.perf_counter()
        try:
            health.Check(check, timeout=PROBE_DEADLINE_S)
        except grpc.RpcError:
            timed.append(PROBE_DEADLINE_S)
            continue
        timed.append(time.perf_counter() - started)
    print("\n".join(f"{t:.6f}" for t in timed))
    return 0


@dataclass
class Followers:
    channels: list[grpc.Channel]
    calls: list[Any]

    def close(self) -> int:
        """Cancel every stream; how many had ended before (the sidecar ended or refused them)."""
        ended = sum(1 for c in self.calls if not c.is_active())
        for c in self.calls:
            c.cancel()
        for ch in self.channels:
            ch.close()
        return ended


def open_followers(car: Sidecar, shared: int, lone: int) -> Followers:
    one = car.connect()
    channels = [one] + [car.connect() for _ in range(lone)]
    stubs = [pb_grpc.MigSidecarStub(one)] * shared + [pb_grpc.MigSidecarStub(ch) for ch in channels[1:]]
    calls = [s.WatchHealth(pb.WatchHealthRequest(follow=True)) for s in stubs]
    return Followers(channels, calls)


def load(car: Sidecar, clients: int, seconds: float, tag: str) -> Phase:
    phase = Phase()
    stop = threading.Event()
    threads = [threading.Thread(target=client, args=(car, i, stop, phase, tag)) for i in range(clients)]
    prober = Prober(car.socket, 0, PROBE_EVERY_S)
    started = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    phase.seconds = time.perf_counter() - started
    phase.checks = prober.results()
    phase.missed_checks = sum(1 for t in phase.checks if t >= PROBE_DEADLINE_S)
    for t in threads:
        t.join()
    return phase


@dataclass
class Run:
    idle_checks: list[float]
    held: list[float]
    reused: list[float]
    plain: Phase
    streams: Phase
    streams_ended: int


def run(args: argparse.Namespace, parent: Path | None) -> Run:
    root = Path(tempfile.mkdtemp(prefix="hmse", dir=parent))
    car = Sidecar(root, args.gpus)
    try:
        idle_checks, held, reused = idle_figures(car, args.checks, args.rounds)
        car.hw.set_latency("create-gi", args.op_seconds)
        car.hw.set_latency("destroy-gi", args.op_seconds)
        plain = load(car, args.clients, args.seconds, "p")
        followers = open_followers(car, args.followers, args.lone_followers)
        try:
            time.sleep(1.0)  # every stream open and past its current state
            streams = load(car, args.clients, args.seconds, "s")
        finally:
            ended = followers.close()
        return Run(idle_checks, held, reused, plain, streams, ended)
    finally:
        car.stop()
        shutil.rmtree(root, ignore_errors=True)


def rows(run: Run) -> Iterator[tuple[str, str]]:
    idle99 = percentile(run.idle_checks, 0.99)
    load99 = percentile(run.streams.checks, 0.99)
    plain99 = percentile(run.plain.checks, 0.99)
    yield "health Check p99 idle", f"{idle99 * 1e3:.2f} ms"
    yield (
        "health Check p50 idle / without / with streams",
        " / ".join(
            f"{percentile(c, 0.5) * 1e3:.2f}" for c in (run.idle_checks, run.plain.checks, run.streams.checks)
        )
        + " ms",
    )
    yield "health Check p99, load without streams", f"{plain99 * 1e3:.2f} ms ({plain99 / idle99:.1f}x idle)"
    yield (
        "health Check p99, load with streams",
        f"{load99 * 1e3:.2f} ms ({load99 / idle99:.1f}x idle; goal <= 3x)",
    )
    yield (
        "health Checks past 5 s (without / with streams)",
        f"{run.plain.missed_checks} / {run.streams.missed_checks}",
    )
    rate_plain = run.plain.allocated / run.plain.seconds
    rate_streams = run.streams.allocated / run.streams.seconds
    ratio = rate_streams / rate_plain if rate_plain else float("nan")
    yield "Allocates/s without streams", f"{rate_plain:.2f} ({run.plain.allocated})"
    yield (
        "Allocates/s with streams",
        f"{rate_streams:.2f} ({run.streams.allocated}; {ratio:.2f}x; goal >= 0.9x)",
    )
    for name, phase in (("without", run.plain), ("with", run.streams)):
        refused = ", ".join(f"{k} {v}" for k, v in sorted(phase.refused.items())) or "none"
        yield f"refused, load {name} streams", refused
    yield "streams ended by the sidecar", str(run.streams_ended)
    held, reused = statistics.median(run.held), statistics.median(run.reused)
    yield (
        "reuse Allocate p50 / ALREADY_ALLOCATED p50",
        f"{reused / held:.2f}x ({reused * 1e3:.2f} / {held * 1e3:.2f} ms)",
    )


def main() -> int:
    if sys.argv[1:2] == ["--probe"]:
        return probe_main(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--gpus", type=int, default=10, help="simulated H100s (default 10: a placement per client)"
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=15.0, help="each load phase (default 15)")
    parser.add_argument(
        "--op-seconds", type=float, default=1.0, help="each GI create and destroy (default 1)"
    )
    parser.add_argument("--followers", type=int, default=50, help="following streams on one channel")
    parser.add_argument("--lone-followers", type=int, default=20, help="following streams, a channel each")
    parser.add_argument("--checks", type=int, default=100, help="health Checks on the idle sidecar")
    parser.add_argument("--rounds", type=int, default=100, help="reuse / ALREADY_ALLOCATED rounds")
    parser.add_argument("--disk", action="store_true", help="run again with the files on disk, side by side")
    args = parser.parse_args()
    if args.clients > args.gpus * PLACEMENTS_1G:
        parser.error(f"--clients {args.clients} needs at least {-(-args.clients // PLACEMENTS_1G)} GPUs")
    shm = Path("/dev/shm")
    runs = {"tmpfs": run(args, shm if shm.is_dir() else None)}
    if args.disk:
        runs["disk"] = run(args, None)
    print(
        f"{args.clients} clients on {args.gpus} simulated H100-80GB,"
        f" GI create and destroy {args.op_seconds} s, {args.seconds} s a phase,"
        f" {args.followers}+{args.lone_followers} following streams"
    )
    table = {name: dict(rows(r)) for name, r in runs.items()}
    width = max(len(k) for k in table["tmpfs"])
    print(f"{'':<{width}}  " + "  |  ".join(table))
    for key in table["tmpfs"]:
        print(f"{key:<{width}}  " + "  |  ".join(t[key] for t in table.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
