#!/usr/bin/env python3
"""A bounded soak: 64 concurrent clients over one real sidecar's socket, then the invariants (not a test).

One ``python -m sidecar serve`` on simulated H100s (files on /dev/shm unless ``--disk``), recovered,
then ``--clients`` threads making a seeded random mix of Allocate, Release, SyncActive, GetState,
ListGpus and ReclaimIdle for ``--seconds`` (or ``--calls`` calls). Refusals are counted by RPC and
ErrorInfo reason; an INTERNAL answer or a reason-less one is a finding. ``--faults`` injects NVML
failures through the simulator's fault knob; ``--kill-every`` SIGKILLs the sidecar now and then
(sometimes inside its Recover) and restarts it on the same files, recovered with what the clients
hold. At the end (faults cleared, one last kill and Recover, ERROR instances given the reconciler's
time): every GI owned, every owned instance on its live GI and CI, the ACTIVE instances exactly the
clients', no CDI file without an owner; exit 1 otherwise.

The results: ``bench/README.md``; the runs and what they found: ``bench/HISTORY.md``, "soak.py".
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import shutil
import signal
import subprocess
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
from trace_workload import set_latency_model

from sidecar.nvml.sim import SimulatedHardware

PLACEMENTS = {
    "1g.10gb": [(s, 1) for s in range(7)],
    "2g.20gb": [(s, 2) for s in (0, 2, 4)],
    "3g.40gb": [(s, 4) for s in (0, 4)],
}
MIX = (("allocate", 40), ("release", 25), ("sync", 5), ("state", 10), ("gpus", 10), ("reclaim", 10))
TIMEOUT_S = 60.0
# Channels reconnect within a second of a restart instead of after grpc's default backoff (minutes).
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000))
# What --faults injects: operations of the create, destroy and lookup paths, and codes the adapter
# retries (TIMEOUT, IN_USE on a destroy) or gives up on at once (UNKNOWN).
FAULT_OPS = (
    "create-gi", "create-ci", "destroy-ci", "destroy-gi", "get-gpu-instances", "get-gpu-instance",
    "get-compute-instances", "get-compute-instance", "processes", "handle-by-uuid", "get-mig-mode",
)  # fmt: skip
FAULT_CODES = ("UNKNOWN", "TIMEOUT", "IN_USE")
ERROR_WAIT_S = 60.0
RECOVER_ATTEMPTS = 50
PENDING_FAULTS = 4
METHODS = (
    ("allocate", "Allocate"),
    ("release", "Release"),
    ("sync", "SyncActive"),
    ("state", "GetState"),
    ("gpus", "ListGpus"),
    ("reclaim", "ReclaimIdle"),
)


class Shared:
    """What all clients hold (pod UID -> the AllocateResponse), and the counters.

    A SyncActive lists every held allocation. An Allocate answered but not yet entered here would be
    idled by a SyncActive whose generation was read after the answer: a race of this harness, not of
    the sidecar (a plugin records the allocation before it syncs). So Allocates run as readers of
    ``fence`` and a SyncActive as its writer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fence = threading.Condition()
        self.allocating = 0
        self.syncing = False
        self.held: dict[str, Any] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[tuple[str, str, str]] = collections.Counter()
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
    n: int, socket: Path, gpus: list[str], shared: Shared, stop: threading.Event, budget: int
) -> None:
    rng = random.Random(n)  # noqa: S311 - a seeded workload, not a secret
    channel = grpc.insecure_channel(f"unix://{socket}", options=CHANNEL_OPTIONS)
    stub: Any = pb_grpc.MigSidecarStub(channel)
    mine: list[str] = []
    serial = 0
    kinds, weights = zip(*MIX, strict=True)
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
                profile = rng.choice(list(PLACEMENTS))
                start, size = rng.choice(PLACEMENTS[profile])
                device = pb.DeviceRequest(
                    gpu_uuid=rng.choice(gpus), profile=profile, placement=pb.Placement(start=start, size=size)
                )
                request = pb.AllocateRequest(
                    pod=pb.PodRef(uid=uid, namespace="soak", name=uid),
                    container_name="main",
                    devices=[device],
                )
                with shared.lock:
                    shared.calls["Allocate"] += 1
                shared.enter_allocate()
                try:
                    response = stub.Allocate(request, timeout=TIMEOUT_S)
                    with shared.lock:
                        shared.held[uid] = response
                    mine.append(uid)
                finally:
                    shared.leave_allocate()
            elif kind == "release":
                uid = mine.pop(rng.randrange(len(mine)))
                with shared.lock:
                    shared.calls["Release"] += 1
                    shared.held.pop(uid, None)  # gone from the pod list before the call, as on a node
                stub.Release(pb.ReleaseRequest(pod_uid=uid), timeout=TIMEOUT_S)
            elif kind == "sync":
                with shared.lock:
                    shared.calls["SyncActive"] += 1
                shared.enter_sync()
                try:
                    generation = stub.GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT_S).generation
                    sync = pb.SyncActiveRequest(generation=generation, active=shared.active())
                    stub.SyncActive(sync, timeout=TIMEOUT_S)
                finally:
                    shared.leave_sync()
            elif kind == "state":
                with shared.lock:
                    shared.calls["GetState"] += 1
                stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT_S)
            elif kind == "gpus":
                with shared.lock:
                    shared.calls["ListGpus"] += 1
                stub.ListGpus(pb.ListGpusRequest(), timeout=TIMEOUT_S)
            else:
                with shared.lock:
                    shared.calls["ReclaimIdle"] += 1
                stub.ReclaimIdle(pb.ReclaimIdleRequest(gpu_uuid=rng.choice(gpus)), timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            method = dict(METHODS)[kind]
            reason = reason_of(err)
            if reason == NO_REASON and shared.restarting(err):
                reason = RESTART
            with shared.lock:
                shared.errors[(method, err.code().name, reason)] += 1
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


class Sidecar:
    """The sidecar process under test, killed and started again on the same files."""

    def __init__(self, root: Path, gpus: int, extra: list[str]) -> None:
        self.root, self.socket = root, root / "s.sock"
        self.hw_file, self.cdi_dir = root / "hw.json", root / "cdi"
        self.command = [
            sys.executable, "-m", "sidecar", "serve", "--backend", "simulated",
            "--sim-state", str(self.hw_file), "--sim-gpus", f"h100-80gb:{gpus}",
            "--state-dir", str(root / "state"), "--cdi-dir", str(self.cdi_dir),
            "--socket", str(self.socket), "--log-level", "WARNING", *extra,
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
        self.log = (root / "sidecar.log").open("ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.recover_retries = 0

    def _spawn(self) -> Any:
        """Start the process and wait for its socket; a stub on a new channel (the last one closed)."""
        self.proc = subprocess.Popen(self.command, env=self.env, stderr=self.log)
        if self.channel is not None:
            self.channel.close()
        self.channel = grpc.insecure_channel(f"unix://{self.socket}", options=CHANNEL_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=60)
        return pb_grpc.MigSidecarStub(self.channel)

    def start(self, active: list[Any]) -> Any:
        """Start it, wait for the socket, Recover with ``active``; the stub."""
        stub = self._spawn()
        for attempt in range(RECOVER_ATTEMPTS):
            try:
                stub.Recover(pb.RecoverRequest(active=active), timeout=TIMEOUT_S)
                return stub
            except grpc.RpcError as err:  # an injected fault: retried, as the plugin retries it
                if err.code() is not grpc.StatusCode.UNAVAILABLE or attempt == RECOVER_ATTEMPTS - 1:
                    raise
                self.recover_retries += 1
                time.sleep(0.2)
        raise AssertionError("unreachable")

    def start_killed_in_recover(self, active: list[Any], after_s: float) -> None:
        """Start it and call Recover, with a SIGKILL ``after_s`` into the call."""
        stub = self._spawn()
        assert self.proc is not None
        killer = threading.Timer(after_s, self.proc.send_signal, (signal.SIGKILL,))
        killer.start()
        with contextlib.suppress(grpc.RpcError):  # killed inside it, or an injected fault
            stub.Recover(pb.RecoverRequest(active=active), timeout=TIMEOUT_S)
        killer.join()
        self.proc.wait(timeout=30)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.log.close()


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--calls", type=int, default=0, help="stop after this many calls (0: none)")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
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

    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="hms-soak-", dir=None if args.disk or not shm.is_dir() else shm))
    sidecar = Sidecar(root, args.gpus, ["--idle-reserve", args.idle_reserve] if args.idle_reserve else [])
    shared, stop = Shared(), threading.Event()
    try:
        stub = sidecar.start([])
        if args.latency_scale:
            set_latency_model(SimulatedHardware.open(sidecar.hw_file), args.latency_scale)
        gpus = [g.uuid for g in stub.ListGpus(pb.ListGpusRequest(), timeout=TIMEOUT_S).gpus]
        threads = [
            threading.Thread(
                target=client, args=(args.seed * 1000 + n, sidecar.socket, gpus, shared, stop, args.calls)
            )
            for n in range(args.clients)
        ]
        monkey = threading.Thread(
            target=chaos,
            args=(sidecar, shared, stop, random.Random(args.seed), args.faults, args.kill_every),  # noqa: S311
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
        if args.kill_every:
            stub = restart(sidecar, shared, random.Random(args.seed))  # noqa: S311
        wrong = settle(stub) if args.faults else []
        wrong += [f"the chaos thread failed: {shared.chaos_failure}"] if shared.chaos_failure else []
        wrong += violations(stub, hw, sidecar.cdi_dir, shared)
    finally:
        sidecar.stop()
    total = sum(shared.calls.values())
    print(f"{args.clients} clients, {elapsed:.1f} s, {total} calls ({total / elapsed:.0f}/s)")
    if args.faults or args.kill_every:
        print(
            f"  {shared.faults} NVML faults injected, {shared.kills} kills (the last after the clients),"
            f" {sidecar.recover_retries} Recovers retried"
        )
    for method, n in sorted(shared.calls.items()):
        print(f"  {method:<12} {n}")
    print(f"errors: {sum(shared.errors.values())}")
    for (method, code, reason), n in sorted(shared.errors.items()):
        print(f"  {method:<12} {code:<20} {reason:<22} {n}")
    # UNIMPLEMENTED: an RPC of the contract this build does not serve yet; not a finding.
    internal = sum(
        n
        for (_, code, reason), n in shared.errors.items()
        if code == "INTERNAL" or (reason == NO_REASON and code != "UNIMPLEMENTED")
    )
    print(f"invariants: {'ok' if not wrong else f'{len(wrong)} violated'}")
    for line in wrong[:20]:
        print(f"  {line}")
    shutil.rmtree(root, ignore_errors=True)
    return 1 if wrong or internal else 0


if __name__ == "__main__":
    sys.exit(main())
