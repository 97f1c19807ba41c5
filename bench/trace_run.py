"""One variant of ``trace.py``: its pods, in trace order, through a real sidecar on fresh simulated hardware.

A variant is a release policy (the sidecar's flags) and a scheduler (``trace_state.SCHEDULERS``).
``run_variant`` starts ``python -m sidecar serve`` on 8 simulated H100-80GB with the latency model of
``trace_workload``, sends each arrival's Allocate and each departure's Release one RPC at a time over
the Unix socket (a plugin allocating and releasing pods one by one), waits after each event for the
background reserve to settle when the policy keeps one, and keeps a mirror of the node's instances
to compare with ``GetState``. What it measures is a ``Result``: the Allocates' latency at real scale
and what each one created, reused and reclaimed.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc
from hami_order import Profile
from trace_state import SCHEDULERS, Mirror, NotServedError, Published, Settler, placement
from trace_workload import GPUS, MIX, Pod, own_delay, set_latency_model

from sidecar import config
from sidecar.model.idle_policy import IdleSettings
from sidecar.nvml.port import Placement
from sidecar.nvml.sim import SimulatedHardware

SETTLE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Variant:
    policy: str  # eager | idle | idle+reserve | shipped...
    scheduler: str
    sidecar_args: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.policy}/{self.scheduler}"


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
