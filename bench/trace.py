#!/usr/bin/env python3
"""A steady pod stream through a real sidecar on 8 simulated H100-80GB: idle cache against eager (not a test).

The trace (seeded, the same for every variant): Poisson arrivals, exponential lifetimes, one MIG device
per pod from a profile mix of 50 % 1g.10gb, 30 % 2g.20gb, 20 % 3g.40gb, sized so that about 60 % of
the memory slices are held on average. Events run in trace order, one RPC at a time, over the sidecar's
Unix socket, like a plugin that allocates and releases pods one by one.

The latency model, the variants (a release policy and a scheduler each), the flags and the results:
``bench/README.md``; each in detail, and the runs before: ``bench/HISTORY.md``.
"""

from __future__ import annotations

import argparse
import functools
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
from hami_order import Profile
from trace_state import MEMORY_SLICES, SCHEDULERS, Mirror, NotServedError, Published, Settler, placement

from sidecar.nvml.port import Placement
from sidecar.nvml.sim import OP_ALIASES, SimulatedHardware

GPUS = 8
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
    Variant("eager", "hami-2855"),
    Variant("idle", "hami-v2.10"),
    Variant("idle", "hami-v2.10+helper"),
    Variant("idle", "hami-2855"),
    Variant("idle", "hami-2855+placement-key"),
    Variant("idle", "hami-2855+helper"),
    Variant("idle", "advised"),
    Variant("idle+reserve", "hami-2855", tuple(RESERVE_ARGS)),
    Variant("idle+reserve", "hami-2855+exact-gpu-key", tuple(RESERVE_ARGS)),
    Variant("idle+reserve", "hami-2855+helper", tuple(RESERVE_ARGS)),
    Variant("idle+reserve", "advised", tuple(RESERVE_ARGS)),
)
# Not in the default run (--only NAME): the client-side stand-ins the rows above replaced.
EXTRA_VARIANTS = (
    Variant("eager", "first-fit"),
    Variant("idle", "first-fit"),
    Variant("idle", "prefer-idle"),
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
    trims: int = 0  # events after which the background reserve had a trim to make
    diverged: str = ""  # how the mirror differed from GetState, if it ever did
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


@functools.cache
def serve_help() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--help"], capture_output=True, text=True, check=False
    )
    return done.stdout


def serves_flag(flag: str) -> bool:
    return flag in serve_help()


def allocate(
    car: Sidecar, mirror: Mirror, pod: Pod, gpu: str, where: Placement, *, scale: float, result: Result
) -> str | None:
    """One Allocate, timed and counted; returns the MIG UUID, or None when the sidecar refused."""
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod.uid, namespace="trace", name=pod.uid),
        container_name="main",
        devices=[
            pb.DeviceRequest(
                gpu_uuid=gpu, profile=pod.profile, placement=pb.Placement(start=where.start, size=where.size)
            )
        ],
    )
    car.hw.reset_call_counts()
    started = time.perf_counter()
    try:
        response = car.stub.Allocate(request, timeout=120)
    except grpc.RpcError as err:
        result.failed += 1
        print(f"  {pod.uid}: Allocate {pod.profile} at {where.start}:{where.size}: {err.code().name}")
        mirror.load(car.stub.GetState(pb.GetStateRequest()))  # what a refusal left, in the sidecar's words
        return None
    wall = time.perf_counter() - started
    modeled = own_delay(car.hw.call_counts(), len(response.reclaimed))
    result.latency.append(wall - modeled * scale + modeled)
    mirror.allocated(response)
    device = response.devices[0]
    result.allocated += 1
    result.created += device.outcome == pb.CREATED
    result.reused += device.outcome == pb.REUSED
    result.reclaimed += len(response.reclaimed)
    return str(device.mig_uuid)


def release(car: Sidecar, mirror: Mirror, pod: Pod, gpu: str, mig_uuid: str, *, policy: str) -> None:
    mirror.released(car.stub.Release(pb.ReleaseRequest(pod_uid=pod.uid)).released)
    if policy != "eager":
        return
    try:
        answer = car.stub.ReclaimIdle(pb.ReclaimIdleRequest(gpu_uuid=gpu, mig_uuids=[mig_uuid]))
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise NotServedError("ReclaimIdle not served") from err
        raise
    mirror.reclaimed(answer.reclaimed)


def publish(gpu: Any, profiles: Sequence[Any], allowed: set[str]) -> Published:
    """What HAMi's plugin publishes for ``gpu`` with the allow list ``allowed``."""
    kept = {
        p.name: Profile(
            p.name, int(p.memory_mb), int(p.core_percent), tuple(placement(x) for x in p.placements)
        )
        for p in profiles
        if p.name in allowed
    }
    count = max((int(p.instance_count) for p in profiles if p.name in allowed), default=0)
    return Published(int(gpu.index), int(gpu.memory_mb), count, kept)


def run_variant(
    variant: Variant, trace: list[Pod], scale: float, state_base: Path, *, check: bool, refresh_s: float
) -> Result:
    result = Result(variant)
    missing = [a for a in variant.sidecar_args if a.startswith("--") and not serves_flag(a)]
    if missing:
        result.skipped = f"sidecar has no {' '.join(missing)}"
        return result
    root = Path(tempfile.mkdtemp(prefix="hmst"))
    state_root = Path(tempfile.mkdtemp(prefix="hmst", dir=state_base))
    car = Sidecar(root, state_root, scale, variant.sidecar_args)
    started = time.perf_counter()

    def compare() -> None:
        if not result.diverged:
            result.diverged = mirror.differs(car.stub.GetState(pb.GetStateRequest()))

    try:
        gpus = list(car.stub.ListGpus(pb.ListGpusRequest()).gpus)
        uuids = [g.uuid for g in gpus]
        discovered = {
            u: list(car.stub.DiscoverProfiles(pb.DiscoverProfilesRequest(gpu_uuid=u)).profiles) for u in uuids
        }
        placements = {u: {p.name: [placement(x) for x in p.placements] for p in discovered[u]} for u in uuids}
        mix = {p for p, _ in MIX}
        published = {g.uuid: publish(g, discovered[g.uuid], mix) for g in gpus}
        mirror = Mirror(uuids)
        compare()  # the GPUs in ListGpus order, nothing on them
        scheduler = SCHEDULERS[variant.scheduler](car.stub, placements, mirror, published)
        scheduler.refresh_s = refresh_s
        settler = (
            Settler(
                car.stub,
                mirror,
                {u: {name: ps for name, ps in by.items() if name in mix} for u, by in placements.items()},
                SETTLE_TIMEOUT_S,
            )
            if RESERVE_FLAG in variant.sidecar_args
            else None
        )

        def after_event() -> None:
            if settler is not None and not settler.settle():
                result.unsettled += 1
            if check:
                compare()

        events: list[tuple[float, int, int]] = [(p.arrive, 1, i) for i, p in enumerate(trace)]
        heapq.heapify(events)
        live: dict[int, tuple[str, str]] = {}
        while events:
            now, kind, i = heapq.heappop(events)
            scheduler.clock(now)
            pod = trace[i]
            if kind == 0:
                gpu, mig = live.pop(i)
                release(car, mirror, pod, gpu, mig, policy=variant.policy)
                after_event()
                continue
            choice = scheduler.choose(pod.profile)
            if choice is None:
                result.unschedulable += 1
                continue
            if settler is not None:
                settler.quiet()
            mig_uuid = allocate(car, mirror, pod, choice[0], choice[1], scale=scale, result=result)
            if mig_uuid is not None:
                live[i] = (choice[0], mig_uuid)
                heapq.heappush(events, (pod.leave, 0, i))  # releases sort before arrivals at one time
            after_event()
        compare()
        result.trims = 0 if settler is None else settler.waits
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
        f"{'policy/scheduler':<38}{'pods':>6}{'GI/pod':>8}{'reuse':>7}{'reclaim/pod':>12}"
        f"{'mean ms':>9}{'p50 ms':>8}{'p99 ms':>8}{'mean/eager':>11}{'p99/eager':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if r.skipped or not r.latency:
            print(f"{r.variant.name:<38}  n/a ({r.skipped or 'nothing allocated'})")
            continue
        n = r.allocated
        print(
            f"{r.variant.name:<38}{n:>6}{r.created / n:>8.3f}{r.reused / n:>7.1%}{r.reclaimed / n:>12.3f}"
            f"{mean(r) * 1e3:>9.1f}{percentile(r.latency, 0.5) * 1e3:>8.1f}{p99(r) * 1e3:>8.1f}"
            f"{ratio(mean(r), mean):>11}{ratio(p99(r), p99):>10}"
        )
    print()
    against_advice(results, eager)
    for r in results:
        if not r.skipped:
            print(
                f"{r.variant.name}: {r.wall:.0f} s wall, {r.unschedulable} unschedulable, {r.failed} failed"
                + (f", {r.trims} background trims waited for" if r.trims else "")
                + (f", {r.unsettled} unsettled" if r.unsettled else "")
            )
        if r.diverged:
            print(
                f"  {r.variant.name}: the mirror differed from GetState, decisions are suspect: {r.diverged}"
            )


def against_advice(results: list[Result], eager: Result | None) -> None:
    """Each scheduler beside the sidecar's advice under the same release policy: GI creations as a
    ratio of the advice's, and the share of the advice's mean saving against the measured eager."""
    done = {r.variant.name: r for r in results if not r.skipped and r.latency}

    def per_pod(r: Result) -> float:
        return max(r.created, 1) / r.allocated

    if eager is None:
        return
    base = statistics.fmean(eager.latency)
    for r in done.values():
        advice = done.get(f"{r.variant.policy}/advised")
        if advice is None or r is advice or r.variant.policy == "eager":
            continue
        saved = base - statistics.fmean(r.latency)
        advice_saved = base - statistics.fmean(advice.latency)
        print(
            f"{r.variant.name}: GI creations per pod {per_pod(r) / per_pod(advice):.2f}x the advice's, "
            f"{saved / advice_saved:.0%} of its mean saving against eager"
        )
    print()


def plot(results: list[Result], path: Path, title: str) -> None:
    """The Allocate latency CDF of every variant on one chart, log x axis (milliseconds at real scale).

    matplotlib is imported here only: an optional bench dependency, never the sidecar's."""
    import matplotlib  # noqa: PLC0415 - optional, only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in results:
        if r.skipped or not r.latency:
            continue
        ms = sorted(x * 1e3 for x in r.latency)
        share = [(i + 1) / len(ms) for i in range(len(ms))]
        eager = r.variant.policy == "eager"
        advised = r.variant.scheduler == "advised" or r.variant.scheduler.endswith("+helper")
        label = f"{r.variant.name} (mean {statistics.fmean(ms):.0f} ms, p99 {percentile(ms, 0.99):.0f} ms)"
        ax.step(
            ms,
            share,
            where="post",
            label=label,
            linewidth=2.4 if eager or advised else 1.2,
            linestyle="--" if eager else "-",
        )
    ax.set_xscale("log")
    ax.set_xlabel("Allocate latency at real scale (ms, log scale)")
    ax.set_ylabel("share of Allocates at or below")
    ax.set_ylim(0, 1.005)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pods", type=int, default=2000, help="pods in the trace (default 2000)")
    parser.add_argument("--scale", type=float, default=0.02, help="latency model scale (default 0.02)")
    parser.add_argument("--seed", type=int, default=7, help="trace seed (default 7)")
    parser.add_argument(
        "--refresh",
        type=float,
        default=15.0,
        help="seconds of trace time between the HAMi scheduler's copies of the idle annotation "
        "(default 15, its node refresh; 0: always fresh)",
    )
    parser.add_argument("--disk", action="store_true", help="records and CDI specs on disk, not on /dev/shm")
    parser.add_argument("--only", nargs="*", metavar="NAME", help="variants to run, e.g. idle/first-fit")
    parser.add_argument(
        "--check", action="store_true", help="compare the mirror with GetState after every event (slow)"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw the latency CDF of every variant (needs matplotlib)",
    )
    args = parser.parse_args()
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401, PLC0415 - fail before the run, not after it
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e '.[bench]'")
    state_base = Path.cwd() if args.disk else Path("/dev/shm")
    trace = make_trace(args.pods, args.seed)
    every = (*VARIANTS, *EXTRA_VARIANTS)
    variants = [v for v in every if v.name in args.only] if args.only else list(VARIANTS)
    print(
        f"{args.pods} pods on {GPUS} simulated H100-80GB, seed {args.seed}, "
        f"mix {', '.join(f'{w:.0%} {p}' for p, w in MIX)}, load {LOAD:.0%} of memory slices; "
        f"latency model scaled by {args.scale} (reported at real scale); "
        f"state on {'disk' if args.disk else 'tmpfs'} ({state_base})"
    )
    results = []
    for v in variants:
        result = run_variant(v, trace, args.scale, state_base, check=args.check, refresh_s=args.refresh)
        results.append(result)
        print(f"  ran {v.name}: {results[-1].skipped or f'{results[-1].wall:.0f} s'}", flush=True)
    print()
    report(results)
    if args.plot is not None:
        plot(
            results, args.plot, f"{args.pods} pods, seed {args.seed}, 8 simulated H100-80GB, load {LOAD:.0%}"
        )
        print(f"\nlatency CDF written to {args.plot}")
    return 1 if any(r.diverged for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
