#!/usr/bin/env python3
"""The serving edge under load: health Check and Allocate throughput with following streams open (not a test).

One ``python -m sidecar serve`` on ``--gpus`` simulated H100-80GB, files on /dev/shm (``--disk``
runs everything a second time on disk and prints that table beside), recovered, then three phases
of ``--seconds`` each, with a prober sending a health Check every ``PROBE_EVERY_S`` (the probe's
5 s deadline) throughout each:

1. idle: nothing else (its Checks' p99 is the baseline); before it, ``--rounds`` rounds of
   ALREADY_ALLOCATED and a reuse Allocate on one placement (their p50s);
2. load without streams: GI create and destroy made to take ``--op-seconds`` (the simulator's
   latency knob), ``--clients`` clients each on a placement of its own, in a loop: Allocate (a GI
   created), Release, ReclaimIdle (the GI destroyed);
3. the same load with ``--followers`` following ``WatchHealth`` streams on one channel and
   ``--lone-followers`` more, each on a channel of its own, open throughout and read.

Each party (the prober, the load clients, the followers, the reference server) is a process of its
own (``edge_load_parties.py``, which says why), sharing the machine's CPUs with the sidecar as a
node's plugin does. The pacing of the Checks is the same in every phase, and a phase of 20 s makes
1000 of them, so a p99 is the tenth slowest, not one outlier. Each turn the prober also checks a
reference server, right before or right after the sidecar (in turn): grpcio's own asyncio health
servicer alone in a process, which has none of the sidecar's work and meets the machine as it is at
that moment; what moves its p99 from phase to phase is the machine (the clients' CPU, and whatever
else runs there), not the sidecar.

Printed, as ratios of this one run: the health Check's p99 under load (3) against idle (1), the
reference server's p99 in the same phases and the Check's over it (what the sidecar adds), the
Allocate throughput of (3) against (2), every call refused (by code and reason) in (2) and (3), the
reuse Allocate's p50 against ALREADY_ALLOCATED's, and the 1-minute load average of the machine as
the run started and ended. ``--runs N`` repeats the whole run N times and prints each, then the
Check's ratios run by run. A Check past its deadline is counted and timed at the deadline. The
results: ``bench/README.md``.
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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from edge_load_parties import CALL_TIMEOUT_S, PROBE_DEADLINE_S, Party, allocate_request
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

from sidecar.nvml.sim import SimulatedHardware

PROBE_EVERY_S = 0.02
PLACEMENTS_1G = 7  # 1g.10gb placements of an H100-80GB


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Phase:
    """What one phase measured."""

    seconds: float = 0.0
    allocated: int = 0
    checks: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)  # the reference server's Checks
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    streams_ended: int = 0

    @property
    def missed_checks(self) -> int:
        return sum(1 for t in self.checks if t >= PROBE_DEADLINE_S)


class Sidecar:
    """The sidecar, and beside it the reference health server."""

    def __init__(self, root: Path, gpus: int) -> None:
        self.root, self.socket, self.hw_file = root, root / "s.sock", root / "hw.json"
        self.reference = root / "reference.sock"
        self.reference_server = Party("reference", {"socket": str(self.reference)})
        command = [
            sys.executable, "-m", "sidecar", "serve", "--backend", "simulated",
            "--sim-state", str(self.hw_file), "--sim-gpus", f"h100-80gb:{gpus}",
            "--state-dir", str(root / "state"), "--cdi-dir", str(root / "cdi"),
            "--socket", str(self.socket), "--log-level", "WARNING",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
        self.log = (root / "sidecar.log").open("ab")
        self.proc = subprocess.Popen(command, env=env, stderr=self.log)
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.stub = pb_grpc.MigSidecarStub(self.channel)
        self.stub.Recover(pb.RecoverRequest(), timeout=CALL_TIMEOUT_S)
        self.gpus = [g.uuid for g in self.stub.ListGpus(pb.ListGpusRequest()).gpus]
        self.hw = SimulatedHardware.open(self.hw_file)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()
        self.reference_server.results()


def reuse_figures(car: Sidecar, rounds: int) -> tuple[list[float], list[float]]:
    """ALREADY_ALLOCATED's latencies and the reuse Allocate's, on an idle sidecar."""
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
    return held, reused


def phase(car: Sidecar, args: argparse.Namespace, tag: str, *, clients: int, streams: bool) -> Phase:
    """``seconds`` of Checks, to the sidecar and to the reference server, with ``clients`` load
    clients and, with ``streams``, the followers."""
    socket = str(car.socket)
    followers = (
        Party("followers", {"socket": socket, "shared": args.followers, "lone": args.lone_followers})
        if streams
        else None
    )
    load = (
        Party(
            "clients",
            {"socket": socket, "gpus": car.gpus, "clients": clients, "seconds": args.seconds, "tag": tag},
        )
        if clients
        else None
    )
    prober = Party("prober", {"sockets": [socket, str(car.reference)], "every": PROBE_EVERY_S})
    if load is not None:
        load.tell("go")
    time.sleep(args.seconds)
    checks, reference = prober.results()["checks"]
    measured = Phase(seconds=args.seconds, checks=checks, reference=reference)
    if load is not None:
        done = load.results()
        measured.seconds, measured.allocated = done["seconds"], done["allocated"]
        measured.refused.update(done["refused"])
    if followers is not None:
        measured.streams_ended = followers.results()["ended"]
    return measured


@dataclass
class Run:
    load_average: tuple[float, float]  # 1-minute, as the run started and ended
    idle: Phase
    held: list[float]
    reused: list[float]
    plain: Phase
    streams: Phase


def run(args: argparse.Namespace, parent: Path | None) -> Run:
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="hmse", dir=parent))
    car = Sidecar(root, args.gpus)
    try:
        held, reused = reuse_figures(car, args.rounds)
        idle = phase(car, args, "i", clients=0, streams=False)
        car.hw.set_latency("create-gi", args.op_seconds)
        car.hw.set_latency("destroy-gi", args.op_seconds)
        plain = phase(car, args, "p", clients=args.clients, streams=False)
        streams = phase(car, args, "s", clients=args.clients, streams=True)
        return Run((load_before, os.getloadavg()[0]), idle, held, reused, plain, streams)
    finally:
        car.stop()
        shutil.rmtree(root, ignore_errors=True)


def check_ratio(run: Run) -> float:
    """The goal's: the Check's p99 with the load and the streams, over its p99 idle."""
    return percentile(run.streams.checks, 0.99) / percentile(run.idle.checks, 0.99)


def own_ratio(measured: Phase) -> float:
    """The Check's p99 over the reference server's in the same phase: what the sidecar adds."""
    return percentile(measured.checks, 0.99) / percentile(measured.reference, 0.99)


def rows(run: Run) -> Iterator[tuple[str, str]]:
    idle99 = percentile(run.idle.checks, 0.99)
    load99 = percentile(run.streams.checks, 0.99)
    plain99 = percentile(run.plain.checks, 0.99)
    yield "load average (1 min) at start / end", f"{run.load_average[0]:.2f} / {run.load_average[1]:.2f}"
    yield (
        "health Checks idle / without / with streams",
        " / ".join(str(len(p.checks)) for p in (run.idle, run.plain, run.streams)),
    )
    yield "health Check p99 idle", f"{idle99 * 1e3:.2f} ms"
    yield (
        "health Check p50 idle / without / with streams",
        " / ".join(f"{percentile(p.checks, 0.5) * 1e3:.2f}" for p in (run.idle, run.plain, run.streams))
        + " ms",
    )
    yield "health Check p99, load without streams", f"{plain99 * 1e3:.2f} ms ({plain99 / idle99:.1f}x idle)"
    yield (
        "health Check p99, load with streams",
        f"{load99 * 1e3:.2f} ms ({check_ratio(run):.1f}x idle; goal <= 3x)",
    )
    ref = [percentile(p.reference, 0.99) for p in (run.idle, run.plain, run.streams)]
    yield (
        "reference server's Check p99 idle / without / with",
        " / ".join(f"{r * 1e3:.2f}" for r in ref) + f" ms ({ref[2] / ref[0]:.1f}x idle)",
    )
    yield (
        "Check p99 / reference's, idle / without / with",
        " / ".join(f"{own_ratio(p):.1f}x" for p in (run.idle, run.plain, run.streams)),
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
    for name, measured in (("without", run.plain), ("with", run.streams)):
        refused = ", ".join(f"{k} {v}" for k, v in sorted(measured.refused.items())) or "none"
        yield f"refused, load {name} streams", refused
    yield "streams ended by the sidecar", str(run.streams.streams_ended)
    held, reused = statistics.median(run.held), statistics.median(run.reused)
    yield (
        "reuse Allocate p50 / ALREADY_ALLOCATED p50",
        f"{reused / held:.2f}x ({reused * 1e3:.2f} / {held * 1e3:.2f} ms)",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--gpus", type=int, default=10, help="simulated H100s (default 10: a placement per client)"
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase (default 20)")
    parser.add_argument(
        "--op-seconds", type=float, default=1.0, help="each GI create and destroy (default 1)"
    )
    parser.add_argument("--followers", type=int, default=50, help="following streams on one channel")
    parser.add_argument("--lone-followers", type=int, default=20, help="following streams, a channel each")
    parser.add_argument("--rounds", type=int, default=100, help="reuse / ALREADY_ALLOCATED rounds")
    parser.add_argument("--disk", action="store_true", help="run again with the files on disk, side by side")
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole run (default 1)")
    args = parser.parse_args()
    if args.clients > args.gpus * PLACEMENTS_1G:
        parser.error(f"--clients {args.clients} needs at least {-(-args.clients // PLACEMENTS_1G)} GPUs")
    print(
        f"{args.clients} clients on {args.gpus} simulated H100-80GB,"
        f" GI create and destroy {args.op_seconds} s, {args.seconds} s a phase,"
        f" {args.followers}+{args.lone_followers} following streams,"
        f" a health Check every {PROBE_EVERY_S * 1e3:.0f} ms, {os.cpu_count()} CPUs",
        flush=True,
    )
    shm = Path("/dev/shm")
    by_run: dict[str, list[float]] = collections.defaultdict(list)
    for n in range(1, args.runs + 1):
        runs = {"tmpfs": run(args, shm if shm.is_dir() else None)}
        if args.disk:
            runs["disk"] = run(args, None)
        table = {name: dict(rows(r)) for name, r in runs.items()}
        for name, r in runs.items():
            by_run[f"{name}, with streams / idle"].append(check_ratio(r))
            by_run[f"{name}, with streams / reference"].append(own_ratio(r.streams))
        width = max(len(k) for k in table["tmpfs"])
        title = f"run {n} of {args.runs}" if args.runs > 1 else ""
        print(f"\n{title:<{width}}  " + "  |  ".join(table))
        for key in table["tmpfs"]:
            print(f"{key:<{width}}  " + "  |  ".join(t[key] for t in table.values()), flush=True)
    if args.runs > 1:
        print("\nhealth Check p99, run by run:")
        for name, ratios in by_run.items():
            print(
                f"  {name}: "
                + ", ".join(f"{r:.2f}x" for r in ratios)
                + f" (median {statistics.median(ratios):.2f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
