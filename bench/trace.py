#!/usr/bin/env python3
"""A steady pod stream through a real sidecar on 8 simulated H100-80GB: idle cache against eager (not a test).

The trace (seeded, the same for every variant): Poisson arrivals, exponential lifetimes, one MIG device
per pod from a profile mix of 50 % 1g.10gb, 30 % 2g.20gb, 20 % 3g.40gb, sized so that about 60 % of
the memory slices are held on average. Events run in trace order, one RPC at a time, over the sidecar's
Unix socket, like a plugin that allocates and releases pods one by one.

The simulator's latency model is that of a real driver, scaled down by ``--scale`` (printed) so a run
takes minutes: GI create 800 ms, CI create 200 ms, CI destroy 200 ms, GI destroy 400 ms, 1 ms for every
other call. Allocate latency is reported *at real scale*: the wall clock measured for the call, minus
the scaled delay of the NVML calls it made (counted exactly by the simulator), plus their real-scale
delay. The sidecar's own CPU time is kept as measured rather than multiplied by 1/scale.

Variants, one fresh sidecar each: a *policy* (what happens at release) and a *scheduler* (which GPU
and placement a pod gets):

* policies: ``eager`` — destroy on release, as HAMi v2.10 does: ``Release`` then ``ReclaimIdle`` of that
  instance; ``idle`` — ``Release`` only, the instance stays IDLE for reuse; ``idle+reserve`` — the same
  with the sidecar's background free reserve (``RESERVE_ARGS``);
* schedulers: ``first-fit`` — first GPU, first placement with no ACTIVE instance over it (blind to idle
  ones, as HAMi's scheduler is); ``prefer-idle`` — an exact idle match, then a free placement, then the
  fewest idle slices to reclaim, computed client-side from ``GetState``; ``advised`` — each GPU's first
  entry of ``RankPlacements``, the best class on the lowest GPU.

A variant whose RPC or flag the sidecar does not serve yet prints ``n/a`` with the reason.

Usage: ``bench/trace.py [--pods 2000] [--scale 0.02] [--seed 7] [--disk] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

from sidecar.advice import GpuView, OwnedInstance
from sidecar.domain import ForeignInstance, Placement, State
from sidecar.idle_policy import node_reserve
from sidecar.nvml.sim import OP_ALIASES, SimulatedHardware

GPUS = 8
MEMORY_SLICES = 8  # an H100-80GB's memory-slice axis
MIX = (("1g.10gb", 0.5), ("2g.20gb", 0.3), ("3g.40gb", 0.2))
LOAD = 0.6  # mean share of memory slices held by live pods
MEAN_LIFETIME = 600.0  # trace seconds; only ratios of trace times matter
# Real-scale latency model (seconds) by simulator operation; every other call takes OTHER_S.
MODEL_S = {"create-gi": 0.800, "create-ci": 0.200, "destroy-ci": 0.200, "destroy-gi": 0.400}
OTHER_S = 0.001
# Server flags of the background free reserve: keep a free placement ready for every profile of the mix.
RESERVE_FLAG = "--idle-reserve"
RESERVE_ARGS = [RESERVE_FLAG, ",".join(p for p, _ in MIX)]
SETTLE_TIMEOUT_S = 30.0


class NotServedError(Exception):
    """The sidecar does not serve what a variant needs; the row prints n/a with this reason."""


def real_delay(fn: str) -> float:
    if fn == "nvmlErrorString":  # the simulator never delays it
        return 0.0
    for op, seconds in MODEL_S.items():
        if fn in OP_ALIASES[op]:
            return seconds
    return OTHER_S


def own_delay(calls: dict[str, int], reclaimed: int) -> float:
    """The real-scale delay of an Allocate's own NVML calls among ``calls`` (counted from just before
    the request to just after the answer).

    The sidecar wakes its background reconciler just before it answers, so a trim it starts can land
    in that window. A trim only destroys; the Allocate itself destroys one CI and one GI per instance
    it reports reclaimed (one CI per GI in this trace), so destroys beyond that are the trim's and are
    left out. A trim's other calls (its listing, process check and live check; about ten at 1 ms)
    cannot be told apart and stay in."""
    out = 0.0
    for fn, n in calls.items():
        destroys = any(fn in OP_ALIASES[op] for op in ("destroy-ci", "destroy-gi"))
        out += real_delay(fn) * (min(n, reclaimed) if destroys else n)
    return out


def set_latency_model(hw: SimulatedHardware, scale: float) -> None:
    """Delays add up per call ("any" plus the operation's own), so each operation gets model - other."""
    hw.set_latency("any", OTHER_S * scale)
    for op, seconds in MODEL_S.items():
        hw.set_latency(op, (seconds - OTHER_S) * scale)


# -- the trace -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    uid: str
    profile: str
    arrive: float
    leave: float


def make_trace(pods: int, seed: int) -> list[Pod]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible trace, nothing secret
    size = {"1g.10gb": 1, "2g.20gb": 2, "3g.40gb": 4}
    mean_slices = sum(size[p] * w for p, w in MIX)
    rate = LOAD * GPUS * MEMORY_SLICES / mean_slices / MEAN_LIFETIME  # Little's law
    names, weights = [p for p, _ in MIX], [w for _, w in MIX]
    out, t = [], 0.0
    for i in range(pods):
        t += rng.expovariate(rate)
        profile = rng.choices(names, weights)[0]
        out.append(Pod(f"p{i}", profile, t, t + rng.expovariate(1 / MEAN_LIFETIME)))
    return out


# -- schedulers ------------------------------------------------------------------------------------

Choice = tuple[str, "pb.Placement"]


def overlaps(a: Any, b: Any) -> bool:
    return bool(a.start < b.start + b.size and b.start < a.start + a.size)


class Scheduler:
    name = ""

    def __init__(self, stub: pb_grpc.MigSidecarStub, placements: dict[str, dict[str, list[Any]]]) -> None:
        self.stub = stub
        self.placements = placements  # gpu uuid -> profile -> legal placements (DiscoverProfiles order)

    def choose(self, profile: str) -> Choice | None:
        raise NotImplementedError


class FirstFit(Scheduler):
    """First GPU, first placement not under an ACTIVE (or foreign, or in-flight) instance; idle = free."""

    name = "first-fit"

    def choose(self, profile: str) -> Choice | None:
        for gpu in self.stub.GetState(pb.GetStateRequest()).gpus:
            held = [i.placement for i in gpu.instances if i.state != pb.IDLE] + [
                f.placement for f in gpu.foreign
            ]
            for p in self.placements[gpu.gpu.uuid][profile]:
                if not any(overlaps(p, h) for h in held):
                    return gpu.gpu.uuid, p
        return None


class PreferIdle(Scheduler):
    """An exact IDLE match, then a free placement, then the fewest idle slices to reclaim (lowest GPU)."""

    name = "prefer-idle"

    def choose(self, profile: str) -> Choice | None:
        best: tuple[tuple[int, int, int], Choice] | None = None
        for g, gpu in enumerate(self.stub.GetState(pb.GetStateRequest()).gpus):
            idle = [i for i in gpu.instances if i.state == pb.IDLE]
            held = [i.placement for i in gpu.instances if i.state != pb.IDLE] + [
                f.placement for f in gpu.foreign
            ]
            for p in self.placements[gpu.gpu.uuid][profile]:
                if any(overlaps(p, h) for h in held):
                    continue
                under = [i for i in idle if overlaps(p, i.placement)]
                exact = len(under) == 1 and under[0].profile == profile and under[0].placement == p
                cost = (0, 0) if exact else (1, 0) if not under else (2, sum(i.placement.size for i in under))
                key = (*cost, g)
                if best is None or key < best[0]:
                    best = key, (gpu.gpu.uuid, p)
        return None if best is None else best[1]


class Advised(Scheduler):
    """The best class over the GPUs, each GPU's own first entry of RankPlacements, lowest GPU on ties."""

    name = "advised"

    def choose(self, profile: str) -> Choice | None:
        best: tuple[tuple[int, int], Choice] | None = None
        for g, uuid in enumerate(self.placements):
            try:
                ranked = self.stub.RankPlacements(pb.RankPlacementsRequest(gpu_uuid=uuid, profile=profile))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise NotServedError("RankPlacements not served") from err
                raise
            top = next((r for r in ranked.placements if r.cost != pb.BLOCKED), None)
            if top is not None and (best is None or (top.cost, g) < best[0]):
                best = (top.cost, g), (uuid, top.placement)
        return None if best is None else best[1]


SCHEDULERS: dict[str, type[Scheduler]] = {s.name: s for s in (FirstFit, PreferIdle, Advised)}


# -- one variant -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    policy: str  # eager | idle | idle+reserve
    scheduler: str
    sidecar_args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.policy}/{self.scheduler}"


VARIANTS = (
    Variant("eager", "first-fit"),
    Variant("idle", "first-fit"),
    Variant("idle", "prefer-idle"),
    Variant("idle", "advised"),
    Variant("idle+reserve", "prefer-idle", tuple(RESERVE_ARGS)),
    Variant("idle+reserve", "advised", tuple(RESERVE_ARGS)),
)


@dataclass
class Result:
    variant: Variant
    skipped: str = ""
    allocated: int = 0
    unschedulable: int = 0
    failed: int = 0
    created: int = 0
    reused: int = 0
    reclaimed: int = 0
    unsettled: int = 0  # events after which the background reserve did not settle in time
    latency: list[float] = field(default_factory=list)  # seconds at real scale
    wall: float = 0.0


class Sidecar:
    """One ``python -m sidecar serve`` on fresh simulated hardware, with its own paths."""

    def __init__(self, root: Path, state_root: Path, scale: float, args: Sequence[str]) -> None:
        self.root = root
        socket, hw = root / "s.sock", root / "hw.json"
        command = [
            sys.executable, "-m", "sidecar", "serve", "--backend", "simulated",
            "--sim-state", str(hw), "--sim-gpus", f"h100-80gb:{GPUS}",
            "--state-dir", str(state_root / "state"), "--cdi-dir", str(state_root / "cdi"),
            "--socket", str(socket), "--log-level", "WARNING", *args,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
        self.log = (root / "sidecar.log").open("wb")  # JSON log lines; UNIMPLEMENTED answers log errors
        self.proc = subprocess.Popen(command, env=env, stderr=self.log)
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.stub = pb_grpc.MigSidecarStub(self.channel)
        self.stub.Recover(pb.RecoverRequest())
        self.hw = SimulatedHardware.open(hw)
        set_latency_model(self.hw, scale)

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def serves_flag(flag: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--help"], capture_output=True, text=True, check=False
    )
    return flag in done.stdout


def allocate(car: Sidecar, pod: Pod, gpu: str, where: Any, *, scale: float, result: Result) -> str | None:
    """One Allocate, timed and counted; returns the MIG UUID, or None when the sidecar refused."""
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod.uid, namespace="trace", name=pod.uid),
        container_name="main",
        devices=[pb.DeviceRequest(gpu_uuid=gpu, profile=pod.profile, placement=where)],
    )
    car.hw.reset_call_counts()
    started = time.perf_counter()
    try:
        response = car.stub.Allocate(request, timeout=120)
    except grpc.RpcError as err:
        result.failed += 1
        print(f"  {pod.uid}: Allocate {pod.profile} at {where.start}:{where.size}: {err.code().name}")
        return None
    wall = time.perf_counter() - started
    modeled = own_delay(car.hw.call_counts(), len(response.reclaimed))
    result.latency.append(wall - modeled * scale + modeled)
    device = response.devices[0]
    result.allocated += 1
    result.created += device.outcome == pb.CREATED
    result.reused += device.outcome == pb.REUSED
    result.reclaimed += len(response.reclaimed)
    return str(device.mig_uuid)


def release(car: Sidecar, policy: str, pod: Pod, gpu: str, mig_uuid: str) -> None:
    car.stub.Release(pb.ReleaseRequest(pod_uid=pod.uid))
    if policy != "eager":
        return
    try:
        car.stub.ReclaimIdle(pb.ReclaimIdleRequest(gpu_uuid=gpu, mig_uuids=[mig_uuid]))
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise NotServedError("ReclaimIdle not served") from err
        raise


def _view(gpu: Any) -> GpuView:
    def place(p: Any) -> Placement:
        return Placement(p.start, p.size)

    return GpuView(
        gpu_uuid=gpu.gpu.uuid,
        memory_slices=MEMORY_SLICES,
        owned=tuple(
            OwnedInstance(i.profile, place(i.placement), State(pb.InstanceState.Name(i.state)), i.mig_uuid)
            for i in gpu.instances
        ),
        foreign=tuple(
            ForeignInstance(gpu.gpu.uuid, f.profile, place(f.placement), f.gpu_instance_id)
            for f in gpu.foreign
        ),
    )


def settle(car: Sidecar, placements: dict[str, dict[str, list[Any]]]) -> bool:
    """Wait (bounded) until the sidecar's background reserve has nothing left to do.

    In the trace's own time about 30 s pass between two events, far more than a trim takes; replayed
    back to back, the next event would otherwise race the trim the last one woke. Nothing is in
    flight and the reserve decision (the sidecar's own pure function, over GetState) chooses nothing.
    False if that did not happen within ``SETTLE_TIMEOUT_S``."""
    reserve = {
        uuid: {name: [Placement(p.start, p.size) for p in ps] for name, ps in by_profile.items()}
        for uuid, by_profile in placements.items()
    }
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        gpus = car.stub.GetState(pb.GetStateRequest()).gpus
        busy = any(i.state in (pb.CREATING, pb.DELETING) for g in gpus for i in g.instances)
        if not busy and not node_reserve([_view(g) for g in gpus], reserve):
            return True
        time.sleep(0.002)
    return False


def run_variant(variant: Variant, trace: list[Pod], scale: float, state_base: Path) -> Result:
    result = Result(variant)
    missing = [a for a in variant.sidecar_args if a.startswith("--") and not serves_flag(a)]
    if missing:
        result.skipped = f"sidecar has no {' '.join(missing)}"
        return result
    root = Path(tempfile.mkdtemp(prefix="hmst"))
    state_root = Path(tempfile.mkdtemp(prefix="hmst", dir=state_base))
    car = Sidecar(root, state_root, scale, variant.sidecar_args)
    started = time.perf_counter()
    try:
        uuids = [g.uuid for g in car.stub.ListGpus(pb.ListGpusRequest()).gpus]
        placements = {
            u: {
                p.name: list(p.placements)
                for p in car.stub.DiscoverProfiles(pb.DiscoverProfilesRequest(gpu_uuid=u)).profiles
            }
            for u in uuids
        }
        scheduler = SCHEDULERS[variant.scheduler](car.stub, placements)
        mix = {p for p, _ in MIX}
        reserve = (
            {u: {name: ps for name, ps in by.items() if name in mix} for u, by in placements.items()}
            if RESERVE_FLAG in variant.sidecar_args
            else None
        )
        events: list[tuple[float, int, int]] = [(p.arrive, 1, i) for i, p in enumerate(trace)]
        heapq.heapify(events)
        live: dict[int, tuple[str, str]] = {}
        while events:
            _, kind, i = heapq.heappop(events)
            pod = trace[i]
            if kind == 0:
                gpu, mig = live.pop(i)
                release(car, variant.policy, pod, gpu, mig)
                if reserve and not settle(car, reserve):
                    result.unsettled += 1
                continue
            choice = scheduler.choose(pod.profile)
            if choice is None:
                result.unschedulable += 1
                continue
            mig_uuid = allocate(car, pod, choice[0], choice[1], scale=scale, result=result)
            if mig_uuid is not None:
                live[i] = (choice[0], mig_uuid)
                heapq.heappush(events, (pod.leave, 0, i))  # releases sort before arrivals at one time
            if reserve and not settle(car, reserve):
                result.unsettled += 1
    except NotServedError as why:
        result.skipped = str(why)
    finally:
        result.wall = time.perf_counter() - started
        car.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(state_root, ignore_errors=True)
    return result


# -- report ----------------------------------------------------------------------------------------


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(results: list[Result]) -> None:
    eager = next((r for r in results if r.variant.policy == "eager" and not r.skipped), None)

    def ratio(value: float, base: Callable[[Result], float]) -> str:
        return "n/a" if eager is None else f"{value / base(eager):.2f}"

    def mean(r: Result) -> float:
        return statistics.fmean(r.latency)

    def p99(r: Result) -> float:
        return percentile(r.latency, 0.99)

    header = (
        f"{'policy/scheduler':<26}{'pods':>6}{'GI/pod':>8}{'reuse':>7}{'reclaim/pod':>12}"
        f"{'mean ms':>9}{'p50 ms':>8}{'p99 ms':>8}{'mean/eager':>11}{'p99/eager':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if r.skipped or not r.latency:
            print(f"{r.variant.name:<26}  n/a ({r.skipped or 'nothing allocated'})")
            continue
        n = r.allocated
        print(
            f"{r.variant.name:<26}{n:>6}{r.created / n:>8.3f}{r.reused / n:>7.1%}{r.reclaimed / n:>12.3f}"
            f"{mean(r) * 1e3:>9.1f}{percentile(r.latency, 0.5) * 1e3:>8.1f}{p99(r) * 1e3:>8.1f}"
            f"{ratio(mean(r), mean):>11}{ratio(p99(r), p99):>10}"
        )
    print()
    for r in results:
        if not r.skipped:
            print(
                f"{r.variant.name}: {r.wall:.0f} s wall, {r.unschedulable} unschedulable, {r.failed} failed"
                + (f", {r.unsettled} unsettled" if r.unsettled else "")
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pods", type=int, default=2000, help="pods in the trace (default 2000)")
    parser.add_argument("--scale", type=float, default=0.02, help="latency model scale (default 0.02)")
    parser.add_argument("--seed", type=int, default=7, help="trace seed (default 7)")
    parser.add_argument("--disk", action="store_true", help="records and CDI specs on disk, not on /dev/shm")
    parser.add_argument("--only", nargs="*", metavar="NAME", help="variants to run, e.g. idle/first-fit")
    args = parser.parse_args()
    state_base = Path.cwd() if args.disk else Path("/dev/shm")
    trace = make_trace(args.pods, args.seed)
    variants = [v for v in VARIANTS if not args.only or v.name in args.only]
    print(
        f"{args.pods} pods on {GPUS} simulated H100-80GB, seed {args.seed}, "
        f"mix {', '.join(f'{w:.0%} {p}' for p, w in MIX)}, load {LOAD:.0%} of memory slices; "
        f"latency model scaled by {args.scale} (reported at real scale); "
        f"state on {'disk' if args.disk else 'tmpfs'} ({state_base})"
    )
    results = []
    for v in variants:
        results.append(run_variant(v, trace, args.scale, state_base))
        print(f"  ran {v.name}: {results[-1].skipped or f'{results[-1].wall:.0f} s'}", flush=True)
    print()
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
