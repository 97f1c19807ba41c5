#!/usr/bin/env python3
"""Decision cost of the sidecar over its Unix socket: wall-clock ratios and NVML calls (not a test).

Starts one sidecar on simulated hardware (one H100-80GB), then drives the same cycle every round on
the same socket and measures each decision: its wall clock as a ratio to ``GetInfo`` in the same run,
its NVML calls, the time inside the simulated driver; what each column means, the flags and the
results: ``bench/README.md``.

The cycle (every round is identical, so every round makes the same calls; a decision whose count
differs between rounds is flagged):

1. Allocate CREATED + reclaim — 1g.10gb at 0:1 while an idle 7g.80gb covers the GPU: one reclaim;
2. Allocate CREATED — 1g.10gb at 1:1, a free placement;
3. ALREADY_ALLOCATED — the same request again (a kubelet retry);
4. Release — the pod of (2): its instance goes IDLE;
5. Allocate REUSED — another pod asks for 1g.10gb at 1:1 and gets the idle instance;
6. SyncActive — the plugin's periodic level-triggered sync, with both live allocations listed;
7. GetState — what ``status`` shows an operator;
8. (not measured) release everything, allocate and release a 7g.80gb to leave the idle blocker of (1).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

from sidecar.nvml.sim import SimulatedHardware

HEALTH = "health Check"


class HealthCheck(Protocol):
    """The one method of grpc's health stub timed here, as the generated stub has it."""

    def Check(self, request: health_pb2.HealthCheckRequest) -> health_pb2.HealthCheckResponse: ...  # noqa: N802


DECISIONS = (
    HEALTH,
    "GetInfo",
    "Allocate CREATED+reclaim",
    "Allocate CREATED",
    "ALREADY_ALLOCATED",
    "Release",
    "Allocate REUSED",
    "SyncActive",
    "GetState",
)
_MUTATIONS = ("Create", "Destroy")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def request(gpu: str, pod: str, profile: str, start: int, size: int) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="bench", name=pod),
        container_name="main",
        devices=[
            pb.DeviceRequest(gpu_uuid=gpu, profile=profile, placement=pb.Placement(start=start, size=size))
        ],
    )


def active(pod: str, device: pb.AllocatedDevice) -> pb.ActiveAllocation:
    return pb.ActiveAllocation(
        pod=pb.PodRef(uid=pod, namespace="bench", name=pod),
        container_name="main",
        gpu_uuid=device.gpu_uuid,
        profile=device.profile,
        placement=device.placement,
        mig_uuid=device.mig_uuid,
        gpu_instance_id=device.gpu_instance_id,
        compute_instance_id=device.compute_instance_id,
    )


class Meter:
    """Times one decision and counts the NVML calls the sidecar made for it."""

    def __init__(self, hardware: SimulatedHardware) -> None:
        self.hardware = hardware
        self.seconds: dict[str, list[float]] = {name: [] for name in DECISIONS}
        self.driver: dict[str, list[float]] = {name: [] for name in DECISIONS}
        self.calls: dict[str, list[dict[str, int]]] = {name: [] for name in DECISIONS}

    def __call__(self, name: str, call: Callable[[], object]) -> object:
        self.hardware.reset_call_counts()
        started = time.perf_counter()
        result = call()
        self.seconds[name].append(time.perf_counter() - started)
        self.driver[name].append(self.hardware.store.driver_ns() / 1e9)
        self.calls[name].append(self.hardware.call_counts())
        return result


def one_round(stub: pb_grpc.MigSidecarStub, health: HealthCheck, gpu: str, i: int, measure: Meter) -> None:
    def expect(response: object, outcome: int) -> pb.AllocatedDevice:
        assert isinstance(response, pb.AllocateResponse)
        device = response.devices[0]
        if device.outcome != outcome:
            raise SystemExit(f"round {i}: expected outcome {pb.Outcome.Name(outcome)}, got {device}")
        return device

    # Every request is built before its clock starts: the figures are the RPC's, not the client's.
    w, c, r = f"w{i}", f"c{i}", f"r{i}"
    info = pb.GetInfoRequest()
    at_0, at_1, reuse = (request(gpu, pod, "1g.10gb", start, 1) for pod, start in ((w, 0), (c, 1), (r, 1)))
    release = pb.ReleaseRequest(pod_uid=c)
    check = health_pb2.HealthCheckRequest(service="")
    measure(HEALTH, lambda: health.Check(check))
    measure("GetInfo", lambda: stub.GetInfo(info))
    reclaim = measure("Allocate CREATED+reclaim", lambda: stub.Allocate(at_0))
    if not isinstance(reclaim, pb.AllocateResponse) or len(reclaim.reclaimed) != 1:
        raise SystemExit(f"round {i}: expected exactly one reclaimed instance, got {reclaim}")
    first = expect(reclaim, pb.CREATED)
    expect(measure("Allocate CREATED", lambda: stub.Allocate(at_1)), pb.CREATED)
    expect(measure("ALREADY_ALLOCATED", lambda: stub.Allocate(at_1)), pb.ALREADY_ALLOCATED)
    measure("Release", lambda: stub.Release(release))
    second = expect(measure("Allocate REUSED", lambda: stub.Allocate(reuse)), pb.REUSED)
    generation = stub.GetInfo(pb.GetInfoRequest()).generation
    sync = pb.SyncActiveRequest(generation=generation, active=[active(w, first), active(r, second)])
    synced = measure("SyncActive", lambda: stub.SyncActive(sync))
    if not isinstance(synced, pb.SyncActiveResponse) or synced.idled or synced.reactivated:
        raise SystemExit(
            f"round {i}: SyncActive with every live allocation listed changed something: {synced}"
        )
    state = pb.GetStateRequest()
    measure("GetState", lambda: stub.GetState(state))
    leave_idle_blocker(stub, gpu, [w, r], f"z{i}")


def leave_idle_blocker(stub: pb_grpc.MigSidecarStub, gpu: str, pods: list[str], whole: str) -> None:
    """Release ``pods``, then allocate and release a 7g.80gb over the whole GPU: one idle blocker."""
    for pod in pods:
        stub.Release(pb.ReleaseRequest(pod_uid=pod))
    stub.Allocate(request(gpu, whole, "7g.80gb", 0, 8))
    stub.Release(pb.ReleaseRequest(pod_uid=whole))


def describe(calls: dict[str, int]) -> str:
    return ", ".join(f"{name.removeprefix('nvml')} {n}" for name, n in sorted(calls.items()))


def report(measure: Meter, show_calls: bool) -> None:
    base = statistics.median(measure.seconds["GetInfo"])
    base99 = percentile(measure.seconds["GetInfo"], 0.99)
    header = (
        f"{'decision':<26}{'p50 ms':>9}{'p99 ms':>9}{'p50/GetInfo':>13}{'p99/GetInfo':>13}"
        f"{'NVML calls':>12}{'mutating':>10}{'driver ms':>11}{'own p50/GI':>12}"
    )
    print(header)
    print("-" * len(header))
    for name in DECISIONS:
        samples, counts = measure.seconds[name], measure.calls[name]
        p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
        last = counts[-1]
        total = str(sum(last.values())) + ("" if all(c == last for c in counts) else " (varies)")
        mutating = sum(n for fn, n in last.items() if any(m in fn for m in _MUTATIONS))
        driver = percentile(measure.driver[name], 0.5)
        own = percentile([w - d for w, d in zip(samples, measure.driver[name], strict=True)], 0.5)
        print(
            f"{name:<26}{p50 * 1e3:>9.2f}{p99 * 1e3:>9.2f}{p50 / base:>13.1f}{p99 / base99:>13.1f}"
            f"{total:>12}{mutating:>10}{driver * 1e3:>11.2f}{own / base:>12.1f}"
        )
    check = statistics.median(measure.seconds[HEALTH])
    reuse = statistics.median(measure.seconds["Allocate REUSED"])
    held = statistics.median(measure.seconds["ALREADY_ALLOCATED"])
    print(
        f"Allocate REUSED p50 / health Check p50: {reuse / check:.2f}x"
        f" (health Check {check * 1e3:.2f} ms); / GetInfo p50: {reuse / base:.2f}x"
    )
    # The floor of any Allocate: ALREADY_ALLOCATED makes no NVML call and writes nothing.
    print(f"ALREADY_ALLOCATED p50 / health Check p50: {held / check:.2f}x")
    if show_calls:
        print()
        for name in DECISIONS:
            print(f"{name}: {describe(measure.calls[name][-1]) or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100, help="rounds of the cycle (default 100)")
    parser.add_argument("--calls", action="store_true", help="print each decision's calls per C function")
    parser.add_argument("--profile", type=Path, metavar="FILE", help="cProfile the sidecar into FILE")
    parser.add_argument(
        "--disk", action="store_true", help="also run with the state on disk (default: tmpfs only)"
    )
    args = parser.parse_args()
    # The state directory lives on tmpfs on a node (/var/run); /dev/shm is tmpfs here too.
    tmpfs = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    for where in [tmpfs, *([None] if args.disk or tmpfs is None else [])]:
        print(f"state on {'tmpfs (' + str(where) + ')' if where else 'disk (' + tempfile.gettempdir() + ')'}")
        run(args, where)
    return 0


def run(args: argparse.Namespace, parent: Path | None) -> None:
    """One sidecar, its state under ``parent`` (None: the default temp directory), the whole cycle."""
    root = Path(tempfile.mkdtemp(prefix="hmsb", dir=parent))
    socket, state = root / "s.sock", root / "hw.json"
    python = (
        [sys.executable, "-m", "cProfile", "-o", str(args.profile.resolve())]
        if args.profile
        else [sys.executable]
    )
    command = [
        *python, "-m", "sidecar", "serve", "--backend", "simulated",
        "--sim-state", str(state), "--sim-gpus", "h100-80gb:1",
        "--state-dir", str(root / "state"), "--cdi-dir", str(root / "cdi"), "--socket", str(socket),
        "--log-level", "WARNING",
        # the cycle sets up its own IDLE blockers; serve's default reserve would trim them between steps
        "--idle-reserve", "off",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
    proc = subprocess.Popen(command, env=env)
    try:
        channel = grpc.insecure_channel(f"unix://{socket}")
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = pb_grpc.MigSidecarStub(channel)
        # cast: the typed stubs of grpcio-health-checking declare HealthStub without its methods.
        health = cast(HealthCheck, health_pb2_grpc.HealthStub(channel))
        stub.Recover(pb.RecoverRequest())
        gpu = stub.ListGpus(pb.ListGpusRequest()).gpus[0].uuid
        measure = Meter(SimulatedHardware.open(state))
        leave_idle_blocker(stub, gpu, [], "z")
        one_round(stub, health, gpu, -1, Meter(measure.hardware))  # warm-up: imports, first-use caches
        for i in range(args.rounds):
            one_round(stub, health, gpu, i, measure)
        print(f"{args.rounds} rounds, one simulated H100-80GB, sidecar pid {proc.pid}")
        report(measure, args.calls)
        channel.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
