#!/usr/bin/env python3
"""A bounded soak: 64 concurrent clients over one real sidecar's socket, then the invariants (not a test).

One ``python -m sidecar serve`` with its shipped defaults on simulated GPUs (``--sim-gpus``; files on
/dev/shm unless ``--disk``), recovered, then ``--clients`` threads making a seeded random mix of
Allocate (the GPU's 1g, 2g and 3g profiles at their legal placements), Release, SyncActive, GetState,
ListGpus, ReclaimIdle and Recover for ``--seconds`` (or ``--calls`` calls), each with a ``--deadline``.
Refusals are counted by RPC and ErrorInfo reason; an INTERNAL answer, a reason-less one or a call past
its deadline (a hang: a node that stops serving) is a finding. ``--faults`` injects NVML failures
through the simulator's fault knob; ``--kill-every`` SIGKILLs the sidecar now and then (sometimes
inside its Recover) and restarts it on the same files, recovered with what the clients hold. At the
end (faults cleared, a SyncActive with every held allocation, then a kill -9 and a Recover, ERROR
instances given the reconciler's time): every GI owned, every owned instance on its live GI and CI,
the ACTIVE instances exactly the clients', no CDI file without an owner; exit 1 otherwise.
``--runs N`` repeats the whole N times on fresh files (seeds ``--seed`` on), exit 1 if any run fails.

The results: ``bench/README.md``; the runs and what they found: ``bench/HISTORY.md``, "soak.py".
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc
from restartable import CHANNEL_OPTIONS, TIMEOUT_S, Sidecar
from trace_workload import set_latency_model

from sidecar.nvml.sim import SimulatedHardware

PROFILES = re.compile(r"^[123]g\.\d+gb$")  # the plain 1g, 2g and 3g profiles of any GPU
MIX = "allocate=40,release=25,sync=5,state=10,gpus=10,reclaim=10,recover=2"  # --mix: kind=weight
# What --faults injects: operations of the create, destroy and lookup paths, and codes the adapter
# retries (TIMEOUT, IN_USE on a destroy) or gives up on at once (UNKNOWN).
FAULT_OPS = (
    "create-gi", "create-ci", "destroy-ci", "destroy-gi", "get-gpu-instances", "get-gpu-instance",
    "get-compute-instances", "get-compute-instance", "processes", "handle-by-uuid", "get-mig-mode",
)  # fmt: skip
FAULT_CODES = ("UNKNOWN", "TIMEOUT", "IN_USE")
ERROR_WAIT_S = 60.0
PENDING_FAULTS = 4
METHODS = (
    ("allocate", "Allocate"),
    ("release", "Release"),
    ("sync", "SyncActive"),
    ("state", "GetState"),
    ("gpus", "ListGpus"),
    ("reclaim", "ReclaimIdle"),
    ("recover", "Recover"),
)


class Shared:
    """What all clients hold (pod UID -> the AllocateResponse), and the counters.

    A SyncActive lists every held allocation. An Allocate answered but not yet entered here would be
    idled by a SyncActive whose generation was read after the answer: a race of this harness, not of
    the sidecar (a plugin records the allocation before it syncs). So Allocates run as readers of
    ``fence`` and a SyncActive as its writer; so do Releases and a Recover, whose list would otherwise
    name an instance released, then trimmed, while it verifies (a plugin recovers only at its start)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fence = threading.Condition()
        self.allocating = 0
        self.syncing = False
        self.held: dict[str, Any] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.example: dict[tuple[str, str, str], str] = {}  # the first message of each kind of error
        self.kills = 0
        self.faults = 0
        self.chaos_failure = ""  # what stopped the chaos thread (a restart that never recovered ...)
        self.down = threading.Event()  # set from a kill until the restarted sidecar is recovered
        self.last_restart = 0.0

    def restarting(self, err: grpc.RpcError) -> bool:
        """A reason-less UNAVAILABLE or CANCELLED while the sidecar is down or just after it came
        back: the transport's, not the sidecar's (an answer of the sidecar always has a reason)."""
        transport = err.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
        return transport and (self.down.is_set() or time.monotonic() - self.last_restart < 2.0)

    def enter_allocate(self) -> None:
        with self.fence:
            self.fence.wait_for(lambda: not self.syncing)
            self.allocating += 1

    def leave_allocate(self) -> None:
        with self.fence:
            self.allocating -= 1
            self.fence.notify_all()

    def enter_sync(self) -> None:
        with self.fence:
            self.fence.wait_for(lambda: not self.syncing)
            self.syncing = True
            self.fence.wait_for(lambda: self.allocating == 0)

    def leave_sync(self) -> None:
        with self.fence:
            self.syncing = False
            self.fence.notify_all()

    def active(self) -> list[Any]:
        with self.lock:
            return [
                pb.ActiveAllocation(
                    pod=pb.PodRef(uid=uid, namespace="soak", name=uid),
                    container_name="main",
                    device_index=d.device_index,
                    gpu_uuid=d.gpu_uuid,
                    profile=d.profile,
                    placement=d.placement,
                    mig_uuid=d.mig_uuid,
                    gpu_instance_id=d.gpu_instance_id,
                    compute_instance_id=d.compute_instance_id,
                )
                for uid, response in self.held.items()
                for d in response.devices
            ]


NO_REASON = "(no reason)"
RESTART = "(sidecar restarting)"


def reason_of(err: grpc.RpcError) -> str:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return NO_REASON


def client(  # noqa: PLR0917 - a thread target, called with its args tuple
    n: int,
    socket: Path,
    gpus: dict[str, list[tuple[str, int, int]]],
    shared: Shared,
    stop: threading.Event,
    budget: int,
    deadline_s: float,
    mix: dict[str, int],
) -> None:
    rng = random.Random(n)  # noqa: S311 - a seeded workload, not a secret
    channel = grpc.insecure_channel(f"unix://{socket}", options=CHANNEL_OPTIONS)
    stub: Any = pb_grpc.MigSidecarStub(channel)
    mine: list[str] = []
    serial = 0
    kinds, weights = zip(*mix.items(), strict=True)
    while not stop.is_set():
        with shared.lock:
            if budget and sum(shared.calls.values()) >= budget:
                stop.set()
                break
        kind = rng.choices(kinds, weights)[0]
        if kind == "release" and not mine:
            kind = "allocate"
        try:
            if kind == "allocate":
                serial += 1
                uid = f"c{n}-p{serial}"
                devices = []  # one GPU's device, or one in four on two GPUs (their locks taken in order)
                for i, gpu in enumerate(
                    rng.sample(list(gpus), 2 if len(gpus) > 1 and rng.random() < 0.25 else 1)
                ):
                    profile, start, size = rng.choice(gpus[gpu])
                    at = pb.Placement(start=start, size=size)
                    devices.append(
                        pb.DeviceRequest(gpu_uuid=gpu, profile=profile, placement=at, device_index=i)
                    )
                request = pb.AllocateRequest(
                    pod=pb.PodRef(uid=uid, namespace="soak", name=uid), container_name="main", devices=devices
                )
                with shared.lock:
                    shared.calls["Allocate"] += 1
                shared.enter_allocate()
                try:
                    response = stub.Allocate(request, timeout=deadline_s)
                    with shared.lock:
                        shared.held[uid] = response
                    mine.append(uid)
                finally:
                    shared.leave_allocate()
            elif kind == "release":
                uid = mine.pop(rng.randrange(len(mine)))
                shared.enter_allocate()  # a Recover's list is never older than a Release
                try:
                    with shared.lock:
                        shared.calls["Release"] += 1
                        shared.held.pop(uid, None)  # gone from the pod list before the call, as on a node
                    stub.Release(pb.ReleaseRequest(pod_uid=uid), timeout=deadline_s)
                finally:
                    shared.leave_allocate()
            elif kind == "sync":
                with shared.lock:
                    shared.calls["SyncActive"] += 1
                shared.enter_sync()
                try:
                    generation = stub.GetInfo(pb.GetInfoRequest(), timeout=deadline_s).generation
                    sync = pb.SyncActiveRequest(generation=generation, active=shared.active())
                    stub.SyncActive(sync, timeout=deadline_s)
                finally:
                    shared.leave_sync()
            elif kind == "state":
                with shared.lock:
                    shared.calls["GetState"] += 1
                stub.GetState(pb.GetStateRequest(), timeout=deadline_s)
            elif kind == "gpus":
                with shared.lock:
                    shared.calls["ListGpus"] += 1
                stub.ListGpus(pb.ListGpusRequest(), timeout=deadline_s)
            elif kind == "reclaim":
                with shared.lock:
                    shared.calls["ReclaimIdle"] += 1
                stub.ReclaimIdle(pb.ReclaimIdleRequest(gpu_uuid=rng.choice(list(gpus))), timeout=deadline_s)
            else:
                with shared.lock:
                    shared.calls["Recover"] += 1
                shared.enter_sync()  # as a plugin recovers: with every allocation it holds
                try:
                    stub.Recover(pb.RecoverRequest(active=shared.active()), timeout=deadline_s)
                finally:
                    shared.leave_sync()
        except grpc.RpcError as err:
            method = dict(METHODS)[kind]
            reason = reason_of(err)
            if reason == NO_REASON and shared.restarting(err):
                reason = RESTART
            with shared.lock:
                shared.errors[(method, err.code().name, reason)] += 1
                shared.example.setdefault((method, err.code().name, reason), str(err.details()))
            if reason in {RESTART, "NOT_RECOVERED"}:
                time.sleep(0.05)  # the sidecar is restarting: no busy loop against it
    channel.close()


def violations(stub: Any, hw: SimulatedHardware, cdi_dir: Path, shared: Shared) -> list[str]:
    """The invariants of the module docstring, as a list of what is wrong."""
    found: list[str] = []
    state = stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT_S)
    owned = {(i.gpu_uuid, i.gpu_instance_id): i for g in state.gpus for i in g.instances}
    found += [
        f"foreign instance on {g.gpu.uuid}: {f.profile} GI {f.gpu_instance_id} {f.mig_uuid}"
        for g in state.gpus
        for f in g.foreign
    ]
    live = {(layout.uuid, gi.id): gi for layout in hw.layouts() for gi in layout.gis}
    found += [f"GI {key} has no owner" for key in set(live) - set(owned)]
    for key, instance in owned.items():
        gi = live.get(key)
        if gi is None:
            found.append(
                f"{instance.mig_uuid} ({pb.InstanceState.Name(instance.state)}) names no live GI {key}"
            )
        elif [c.mig_uuid for c in gi.cis] != [instance.mig_uuid] and instance.state != pb.ERROR:
            found.append(f"{key}: recorded {instance.mig_uuid}, live {[c.mig_uuid for c in gi.cis]}")
    active = {i.mig_uuid for i in owned.values() if i.state == pb.ACTIVE}
    held = {d.mig_uuid for response in shared.held.values() for d in response.devices}
    found += [f"held by a client but not ACTIVE: {m}" for m in held - active]
    found += [f"ACTIVE but held by no client: {m}" for m in active - held]
    mig_uuids = {i.mig_uuid for i in owned.values()}
    for path in cdi_dir.glob("*.json"):
        if not any(m in path.name for m in mig_uuids):
            found.append(f"CDI file without an owner: {path.name}")
    return found


def restart(sidecar: Sidecar, shared: Shared, rng: random.Random) -> Any:
    """Kill the sidecar, then start it and Recover with what the clients hold. The clients' Allocates
    are fenced out (as for a SyncActive) until Recover has the list: one answered just before the kill
    is either entered in ``held`` first or failed at the client. One restart in three is killed again
    0-200 ms into its Recover (a crash during recovery, whose destroys and record writes it
    interrupts), then started once more."""
    shared.down.set()
    sidecar.kill()
    shared.kills += 1
    shared.enter_sync()
    try:
        if rng.random() < 1 / 3:
            sidecar.start_killed_in_recover(shared.active(), rng.uniform(0, 0.2))
            shared.kills += 1
        stub = sidecar.start(shared.active())
    finally:
        shared.last_restart = time.monotonic()
        shared.down.clear()
        shared.leave_sync()
    return stub


def chaos(  # noqa: PLR0917 - a thread target, called with its args tuple
    sidecar: Sidecar,
    shared: Shared,
    stop: threading.Event,
    rng: random.Random,
    faults: float,
    kill_every: float,
) -> None:
    """Inject a fault about ``faults`` times a second; kill and restart every ``kill_every`` s or so."""
    hw = SimulatedHardware.open(sidecar.hw_file)
    tick = 1.0 / faults if faults else 0.5
    next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5) if kill_every else float("inf")
    try:
        while not stop.wait(tick * rng.uniform(0.5, 1.5)):
            if faults and len(hw.faults()) < PENDING_FAULTS:  # one no call meets yet waits, not piles up
                hw.inject_fault(rng.choice(FAULT_OPS), rng.choice(FAULT_CODES), after=rng.randrange(4))
                shared.faults += 1
            if time.monotonic() >= next_kill:
                restart(sidecar, shared, rng)
                next_kill = time.monotonic() + kill_every * rng.uniform(0.5, 1.5)
    except Exception as exc:  # noqa: BLE001 - reported as a finding, and the run stops
        shared.chaos_failure = repr(exc)
        stop.set()


def settle(stub: Any) -> list[str]:
    """With the faults cleared, wait for the reconciler to destroy ERROR instances; those still there."""
    deadline = time.monotonic() + ERROR_WAIT_S
    while True:
        state = stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT_S)
        errors = [
            i.mig_uuid or f"{g.gpu.uuid} {i.profile}"
            for g in state.gpus
            for i in g.instances
            if i.state == pb.ERROR
        ]
        if not errors or time.monotonic() > deadline:
            return [f"still ERROR {ERROR_WAIT_S:.0f} s after the faults stopped: {e}" for e in errors]
        time.sleep(0.5)


def parse_mix(text: str) -> dict[str, int]:
    mix = {kind: int(weight) for kind, _, weight in (item.partition("=") for item in text.split(","))}
    if not mix.keys() <= dict(METHODS).keys():
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(dict(METHODS))}")
    return mix


def workload(stub: Any) -> dict[str, list[tuple[str, int, int]]]:
    """GPU UUID -> (profile, start, size) of each legal placement of its plain 1g, 2g and 3g profiles."""
    out = {}
    for gpu in stub.ListGpus(pb.ListGpusRequest(), timeout=TIMEOUT_S).gpus:
        profiles = stub.DiscoverProfiles(pb.DiscoverProfilesRequest(gpu_uuid=gpu.uuid), timeout=TIMEOUT_S)
        out[gpu.uuid] = [
            (p.name, at.start, at.size)
            for p in profiles.profiles
            if PROFILES.match(p.name)
            for at in p.placements
        ]
    return out


def run(args: argparse.Namespace, seed: int) -> bool:
    """One soak on fresh files; prints its summary, True when nothing was found."""
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="hms-soak-", dir=None if args.disk or not shm.is_dir() else shm))
    extra = ["--reconcile-interval", str(args.reconcile_interval)] if args.reconcile_interval else []
    sidecar = Sidecar(
        root, args.sim_gpus, extra + (["--idle-reserve", args.idle_reserve] if args.idle_reserve else [])
    )
    shared, stop = Shared(), threading.Event()
    try:
        stub = sidecar.start([])
        if args.latency_scale:
            set_latency_model(SimulatedHardware.open(sidecar.hw_file), args.latency_scale)
        gpus = workload(stub)
        limits = (args.calls, args.deadline, args.mix)
        threads = [
            threading.Thread(
                target=client, args=(seed * 1000 + n, sidecar.socket, gpus, shared, stop, *limits)
            )
            for n in range(args.clients)
        ]
        monkey = threading.Thread(
            target=chaos,
            args=(sidecar, shared, stop, random.Random(seed), args.faults, args.kill_every),  # noqa: S311
        )
        started = time.monotonic()
        for t in threads:
            t.start()
        if args.faults or args.kill_every:
            monkey.start()
        stop.wait(args.seconds)
        stop.set()
        for t in [*threads, *([monkey] if monkey.is_alive() else [])]:
            t.join()
        elapsed = time.monotonic() - started
        hw = SimulatedHardware.open(sidecar.hw_file)
        hw.clear_faults()
        stub = pb_grpc.MigSidecarStub(sidecar.channel)  # the chaos thread may have restarted it
        generation = stub.GetInfo(pb.GetInfoRequest(), timeout=args.deadline).generation
        stub.SyncActive(
            pb.SyncActiveRequest(generation=generation, active=shared.active()), timeout=args.deadline
        )
        stub = restart(sidecar, shared, random.Random(seed))  # noqa: S311
        wrong = settle(stub) if args.faults else []
        wrong += [f"the chaos thread failed: {shared.chaos_failure}"] if shared.chaos_failure else []
        wrong += violations(stub, hw, sidecar.cdi_dir, shared)
    finally:
        sidecar.stop()
    total = sum(shared.calls.values())
    print(f"seed {seed}: {args.clients} clients, {elapsed:.1f} s, {total} calls ({total / elapsed:.0f}/s)")
    print(
        f"  {shared.faults} NVML faults injected, {shared.kills} kills (the last after the clients),"
        f" {sidecar.recover_retries} Recovers retried"
    )
    for method, n in sorted(shared.calls.items()):
        print(f"  {method:<12} {n}")
    print(f"errors: {sum(shared.errors.values())}")
    for (method, code, reason), n in sorted(shared.errors.items()):
        print(f"  {method:<12} {code:<20} {reason:<22} {n}  ({shared.example[method, code, reason][:400]})")
    # UNIMPLEMENTED: an RPC of the contract this build does not serve yet; not a finding.
    found = sum(
        n
        for (_, code, reason), n in shared.errors.items()
        if code in {"INTERNAL", "DEADLINE_EXCEEDED"} or (reason == NO_REASON and code != "UNIMPLEMENTED")
    )
    print(f"invariants: {'ok' if not wrong else f'{len(wrong)} violated'}")
    print(f"calls INTERNAL, reason-less or past their deadline: {found}")
    for line in wrong[:20]:
        print(f"  {line}")
    shutil.rmtree(root, ignore_errors=True)
    return not wrong and not found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--calls", type=int, default=0, help="stop after this many calls (0: none)")
    parser.add_argument("--sim-gpus", default="h100-80gb:4", help="the simulated node, as serve's --sim-gpus")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1, help="whole soaks on fresh files, seeds --seed on")
    parser.add_argument("--mix", type=parse_mix, default=parse_mix(MIX), help=f"kind=weight,... ({MIX})")
    parser.add_argument("--deadline", type=float, default=30.0, help="each client call's deadline in seconds")
    parser.add_argument("--reconcile-interval", type=float, help="the sidecar's --reconcile-interval")
    parser.add_argument("--disk", action="store_true", help="state under the system temp dir, not /dev/shm")
    parser.add_argument("--faults", type=float, default=0.0, help="NVML faults injected per second (0: none)")
    parser.add_argument(
        "--kill-every", type=float, default=0.0, help="SIGKILL and restart about every S seconds (0: never)"
    )
    parser.add_argument(
        "--latency-scale", type=float, default=0.0, help="the real-driver latency model times X (0: none)"
    )
    parser.add_argument(
        "--idle-reserve", metavar="PROFILES", help="run the sidecar with --idle-reserve PROFILES (its trims)"
    )
    args = parser.parse_args()
    passed = [run(args, args.seed + n) for n in range(args.runs)]
    print(f"runs passed: {sum(passed)} of {len(passed)}")
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
