#!/usr/bin/env python3
"""A steady pod stream through a real sidecar on 8 simulated H100-80GB: idle cache against eager (not a test).

The trace (seeded, the same for every variant): Poisson arrivals, exponential lifetimes, one MIG device
per pod from a profile mix of 50 % 1g.10gb, 30 % 2g.20gb, 20 % 3g.40gb, sized so that about 60 % of
the memory slices are held on average. Events run in trace order, one RPC at a time, over the sidecar's
Unix socket, like a plugin that allocates and releases pods one by one.

The default run is what an operator gets: the measured eager row, then the release policy the shipped
manifests install (their flags, read from them, with ``serve``'s defaults for the rest) under each
HAMi scheduler: #2855 without the scheduler change, and with the helper at each of its preferences,
under spread and under binpack; the sidecar's advice; and the foresight bound beside them.

The latency model, the variants (a release policy and a scheduler each), the flags and the results:
``bench/README.md``; each in detail, and the runs before: ``bench/HISTORY.md``.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import os
import random
import re
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

from sidecar import config
from sidecar.model.idle_policy import IdleSettings
from sidecar.nvml.port import Placement
from sidecar.nvml.sim import OP_ALIASES, SimulatedHardware

GPUS = 8
MIX = (("1g.10gb", 0.5), ("2g.20gb", 0.3), ("3g.40gb", 0.2))
LOAD = 0.6  # mean share of memory slices held by live pods (--load)
MEAN_LIFETIME = 600.0  # trace seconds; only ratios of trace times matter
# Real-scale latency model (seconds) by simulator operation; every other call takes OTHER_S.
MODEL_S = {"create-gi": 0.800, "create-ci": 0.200, "destroy-ci": 0.200, "destroy-gi": 0.400}
OTHER_S = 0.001
# Server flags of the background free reserve: keep a free placement ready for every profile of the mix.
RESERVE_FLAG = "--idle-reserve"
RESERVE_ARGS = [RESERVE_FLAG, ",".join(p for p, _ in MIX)]
NO_RESERVE_ARGS = [RESERVE_FLAG, "off"]
PER_GPU_ARGS = [RESERVE_FLAG, "auto", "--idle-reserve-per-gpu"]
# The files that install the sidecar: the Helm post-renderer's patch and the standalone DaemonSet.
SHIPPED = ("deploy/helm/sidecar-patch.yaml", "deploy/daemonset.yaml")
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


def make_trace(pods: int, seed: int, load: float = LOAD) -> list[Pod]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible trace, nothing secret
    size = {"1g.10gb": 1, "2g.20gb": 2, "3g.40gb": 4}
    mean_slices = sum(size[p] * w for p, w in MIX)
    rate = load * GPUS * MEMORY_SLICES / mean_slices / MEAN_LIFETIME  # Little's law
    names, weights = [p for p, _ in MIX], [w for _, w in MIX]
    out, t = [], 0.0
    for i in range(pods):
        t += rng.expovariate(rate)
        profile = rng.choices(names, weights)[0]
        out.append(Pod(f"p{i}", profile, t, t + rng.expovariate(1 / MEAN_LIFETIME)))
    return out


# -- one variant -----------------------------------------------------------------------------------


def shipped_args(path: Path) -> tuple[str, ...]:
    """The ``serve`` flags a shipped manifest gives the ``mig-sidecar`` container: its ``args`` after
    ``serve``, and its ``HAMI_MIG_SIDECAR_*`` variables of the idle policy and the reconciler as flags
    (the paths, the socket and the metrics address are the trace's own)."""
    text = path.read_text()
    block = text[text.index("- name: mig-sidecar") :]
    args = json.loads(re.search(r"^\s*args: (\[.*\])", block, re.MULTILINE).group(1))  # type: ignore[union-attr]
    if args[:1] != ["serve"]:
        raise SystemExit(f"{path}: the mig-sidecar container does not run serve: {args}")
    flags = {spec.env: spec for spec in config.SERVE_FLAGS if spec.dest.startswith(POLICY_SETTINGS)}
    out = list(args[1:])
    for name, value in re.findall(r"- name: (HAMI_MIG_SIDECAR_\w+)\s*\n\s*value: \"?([^\"\s#]*)", block):
        spec = flags.get(name)
        if spec is not None:
            out += [spec.flag] if spec.switch and value.lower() in ("1", "true", "yes", "on") else []
            out += [] if spec.switch else [spec.flag, value]
    return tuple(out)


POLICY_SETTINGS = ("idle_", "max_idle", "reconcile")


def shipped_policy(root: Path) -> tuple[str, tuple[str, ...]]:
    """The release policy both shipped manifests install: a name for the rows and its flags. They must
    give the same flags (``tests/unit/test_deploy.py`` checks it too); ``serve``'s defaults fill the rest."""
    flags = {name: shipped_args(root / name) for name in SHIPPED}
    if len(set(flags.values())) != 1:
        raise SystemExit(f"the shipped manifests give the sidecar different flags: {flags}")
    args = flags[SHIPPED[0]]
    return "shipped" + (f"[{' '.join(args)}]" if args else ""), args


@dataclass(frozen=True)
class Variant:
    policy: str  # eager | idle | idle+reserve | shipped...
    scheduler: str
    sidecar_args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.policy}/{self.scheduler}"


def variants(shipped: str, args: tuple[str, ...]) -> tuple[tuple[Variant, ...], tuple[Variant, ...]]:
    """The default run's rows (the measured eager, then the shipped configuration under each HAMi
    scheduler: #2855 without the scheduler change, with the helper at its default preference and at
    idle-first, under spread and binpack, and the sidecar's advice), and the rows of ``--only``."""
    helpers = ("", "+helper", "+helper-idle-first")
    hami = [f"hami-2855-{gpu}{helper}" for gpu in ("spread", "binpack") for helper in helpers]
    default = (
        Variant("eager", "hami-2855-spread", tuple(NO_RESERVE_ARGS)),
        *(Variant(shipped, h, args) for h in hami),
        Variant(shipped, "advised", args),
    )
    extra = (
        *(
            Variant(policy, s, tuple(a))
            for policy, a in (
                ("idle", NO_RESERVE_ARGS),
                ("idle+reserve", RESERVE_ARGS),
                ("auto-per-gpu", PER_GPU_ARGS),
            )
            for s in (*hami, "hami-v2.10-spread", "hami-v2.10-spread+helper", "advised")
        ),
        Variant("eager", "first-fit", tuple(NO_RESERVE_ARGS)),
        Variant("idle", "first-fit", tuple(NO_RESERVE_ARGS)),
        Variant("idle", "prefer-idle", tuple(NO_RESERVE_ARGS)),
    )
    return default, extra


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


def idle_settings(args: Sequence[str]) -> IdleSettings:
    """The idle policy ``serve`` runs with ``args`` (its defaults for the rest), by its own parser."""
    parser = argparse.ArgumentParser()
    config.add_serve_flags(parser)
    given = vars(parser.parse_args([*args, "--backend", "simulated", "--sim-state", "hw.json"]))
    return config.load(given, {}).idle


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
        idle = idle_settings(variant.sidecar_args)
        settler = (
            Settler(
                car.stub,
                mirror,
                {u: {name: ps for name, ps in by.items() if name in mix} for u, by in placements.items()},
                SETTLE_TIMEOUT_S,
                auto=idle.reserve_asked_within_s is not None,
                per_gpu=idle.reserve_per_gpu,
            )
            if idle.reserve or idle.reserve_asked_within_s is not None
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
                settler.ask(pod.profile)
                settler.observe(choice[0], pod.profile, choice[1])
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
        f"{'policy/scheduler':<44}{'pods':>6}{'GI/pod':>8}{'reuse':>7}{'reclaim/pod':>12}"
        f"{'mean ms':>9}{'p50 ms':>8}{'p99 ms':>8}{'mean/eager':>11}{'p99/eager':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if r.skipped or not r.latency:
            print(f"{r.variant.name:<44}  n/a ({r.skipped or 'nothing allocated'})")
            continue
        n = r.allocated
        print(
            f"{r.variant.name:<44}{n:>6}{r.created / n:>8.3f}{r.reused / n:>7.1%}{r.reclaimed / n:>12.3f}"
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


def foresight(results: list[Result], trace: list[Pod]) -> None:
    """The foresight bound beside the rows: ``policy_replay.py``'s clairvoyant reserve (it trims for a
    profile only when the profile's next event is an arrival, and destroys the copies whose next miss
    is furthest away, read from the trace's future) over the sidecar's advice, on this run's trace.
    No sidecar runs it: its latency is the model's (a create, a destroy per victim, a reuse), against
    the measured eager row's mean and p99."""
    from policy_replay import clairvoyant, replay  # noqa: PLC0415 - it imports this module

    row = replay("foresight", trace, clairvoyant(victims=True))
    eager = next((r for r in results if r.variant.policy == "eager" and r.latency), None)
    mean, p99 = statistics.fmean(row.latency), percentile(row.latency, 0.99)
    ratios = (
        ""
        if eager is None
        else (
            f", {mean / statistics.fmean(eager.latency):.2f}x the measured eager mean, "
            f"{p99 / percentile(eager.latency, 0.99):.2f}x its p99"
        )
    )
    print(
        f"foresight bound (clairvoyant reserve over the advice, modeled): GI creations per pod "
        f"{row.creates / row.served:.3f}, mean {mean * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms{ratios}"
    )
    for r in results:
        if r.latency and r.variant.policy != "eager":
            saved = (statistics.fmean(eager.latency) - statistics.fmean(r.latency)) if eager else 0.0
            bound = (statistics.fmean(eager.latency) - mean) if eager else 1.0
            print(f"  {r.variant.name}: {saved / bound:.0%} of the bound's mean saving against eager")
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
        "--load", type=float, default=LOAD, help=f"mean share of the memory slices held (default {LOAD})"
    )
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
    trace = make_trace(args.pods, args.seed, args.load)
    shipped, shipped_flags = shipped_policy(Path(__file__).resolve().parents[1])
    default, extra = variants(shipped, shipped_flags)
    chosen = [v for v in (*default, *extra) if v.name in args.only] if args.only else list(default)
    print(
        f"{args.pods} pods on {GPUS} simulated H100-80GB, seed {args.seed}, "
        f"mix {', '.join(f'{w:.0%} {p}' for p, w in MIX)}, load {args.load:.0%} of memory slices; "
        f"latency model scaled by {args.scale} (reported at real scale); "
        f"state on {'disk' if args.disk else 'tmpfs'} ({state_base})"
    )
    results = []
    for v in chosen:
        result = run_variant(v, trace, args.scale, state_base, check=args.check, refresh_s=args.refresh)
        results.append(result)
        print(f"  ran {v.name}: {results[-1].skipped or f'{results[-1].wall:.0f} s'}", flush=True)
    print()
    report(results)
    foresight(results, trace)
    if args.plot is not None:
        title = f"{args.pods} pods, seed {args.seed}, 8 simulated H100-80GB, load {args.load:.0%}"
        plot(results, args.plot, title)
        print(f"\nlatency CDF written to {args.plot}")
    return 1 if any(r.diverged for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
