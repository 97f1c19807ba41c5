#!/usr/bin/env python3
"""A bounded soak: 64 concurrent clients over one real sidecar's socket, then the invariants (not a test).

One ``python -m sidecar serve`` on simulated H100s (state, records and CDI files on /dev/shm unless
``--disk``), recovered, then ``--clients`` threads, each with its own channel, making a seeded random
mix of Allocate, Release, SyncActive, GetState, ListGpus and ReclaimIdle until ``--seconds`` have
passed or ``--calls`` calls were made in all. Refusals are expected (a placement another client
holds is PLACEMENT_BUSY); they are counted by RPC and ErrorInfo reason. An INTERNAL answer or a
reason-less error is a finding.

At the end, with every client stopped, the invariants are checked against the simulated hardware:
every GI is owned (no foreign instance), every owned instance names its live GI and its one CI by
MIG UUID, the ACTIVE instances are exactly those the clients hold, and no CDI file lacks an owner.
Exit status 1 when any invariant or an INTERNAL answer failed.

Usage: ``bench/soak.py [--clients 64] [--seconds 30] [--calls 0] [--gpus 4] [--seed 1] [--disk]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
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

from sidecar.nvml.sim import SimulatedHardware

PLACEMENTS = {
    "1g.10gb": [(s, 1) for s in range(7)],
    "2g.20gb": [(s, 2) for s in (0, 2, 4)],
    "3g.40gb": [(s, 4) for s in (0, 4)],
}
MIX = (("allocate", 40), ("release", 25), ("sync", 5), ("state", 10), ("gpus", 10), ("reclaim", 10))
TIMEOUT_S = 60.0
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


def reason_of(err: grpc.RpcError) -> str:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return "(no reason)"


def client(  # noqa: PLR0917 - a thread target, called with its args tuple
    n: int, socket: Path, gpus: list[str], shared: Shared, stop: threading.Event, budget: int
) -> None:
    rng = random.Random(n)  # noqa: S311 - a seeded workload, not a secret
    channel = grpc.insecure_channel(f"unix://{socket}")
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
                    request = pb.SyncActiveRequest(generation=generation, active=shared.active())
                    stub.SyncActive(request, timeout=TIMEOUT_S)
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
            with shared.lock:
                shared.errors[(method, err.code().name, reason_of(err))] += 1
    channel.close()


def violations(stub: Any, hw: SimulatedHardware, cdi_dir: Path, shared: Shared) -> list[str]:
    """The invariants of the module docstring, as a list of what is wrong."""
    found: list[str] = []
    state = stub.GetState(pb.GetStateRequest(), timeout=TIMEOUT_S)
    owned = {(i.gpu_uuid, i.gpu_instance_id): i for g in state.gpus for i in g.instances}
    found += [f"foreign instance on {g.uuid}: {f}" for g in state.gpus for f in g.foreign]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--calls", type=int, default=0, help="stop after this many calls (0: none)")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--disk", action="store_true", help="state under the system temp dir, not /dev/shm")
    args = parser.parse_args()

    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="hms-soak-", dir=None if args.disk or not shm.is_dir() else shm))
    socket, hw_file, cdi_dir = root / "s.sock", root / "hw.json", root / "cdi"
    command = [
        sys.executable, "-m", "sidecar", "serve", "--backend", "simulated",
        "--sim-state", str(hw_file), "--sim-gpus", f"h100-80gb:{args.gpus}",
        "--state-dir", str(root / "state"), "--cdi-dir", str(cdi_dir),
        "--socket", str(socket), "--log-level", "WARNING",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
    log = (root / "sidecar.log").open("wb")
    proc = subprocess.Popen(command, env=env, stderr=log)
    channel = grpc.insecure_channel(f"unix://{socket}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub: Any = pb_grpc.MigSidecarStub(channel)
        stub.Recover(pb.RecoverRequest(), timeout=TIMEOUT_S)
        gpus = [g.uuid for g in stub.ListGpus(pb.ListGpusRequest(), timeout=TIMEOUT_S).gpus]
        shared, stop = Shared(), threading.Event()
        threads = [
            threading.Thread(
                target=client, args=(args.seed * 1000 + n, socket, gpus, shared, stop, args.calls)
            )
            for n in range(args.clients)
        ]
        started = time.monotonic()
        for t in threads:
            t.start()
        stop.wait(args.seconds)
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        wrong = violations(stub, SimulatedHardware.open(hw_file), cdi_dir, shared)
    finally:
        channel.close()
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    total = sum(shared.calls.values())
    print(f"{args.clients} clients, {elapsed:.1f} s, {total} calls ({total / elapsed:.0f}/s)")
    for method, n in sorted(shared.calls.items()):
        print(f"  {method:<12} {n}")
    print(f"errors: {sum(shared.errors.values())}")
    for (method, code, reason), n in sorted(shared.errors.items()):
        print(f"  {method:<12} {code:<20} {reason:<22} {n}")
    # UNIMPLEMENTED: an RPC of the contract this build does not serve yet; not a finding.
    internal = sum(
        n
        for (_, code, reason), n in shared.errors.items()
        if code == "INTERNAL" or (reason == "(no reason)" and code != "UNIMPLEMENTED")
    )
    print(f"invariants: {'ok' if not wrong else f'{len(wrong)} violated'}")
    for line in wrong[:20]:
        print(f"  {line}")
    shutil.rmtree(root, ignore_errors=True)
    return 1 if wrong or internal else 0


if __name__ == "__main__":
    sys.exit(main())
