#!/usr/bin/env python3
"""Decision latency of the sidecar over its Unix socket (not part of the tests).

Starts one sidecar on the simulated backend, then measures on the same socket:

* GetInfo — the floor: gRPC over a Unix socket plus the servicer, no hardware, no disk;
* Allocate that REUSES an idle instance (after a Release) — records and CDI checked, no NVML create;
* Allocate that CREATES an instance — reclaim of an idle blocker, GI and CI creation, records written
  with fsync, a CDI file.

Prints p50/p99 of each and the ratios to GetInfo. Usage: ``bench/decision_latency.py [--rounds N]``.
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

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def request(gpu: str, pod: str) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="bench", name=pod),
        container_name="main",
        devices=[pb.DeviceRequest(gpu_uuid=gpu, profile="1g.10gb", placement=pb.Placement(start=0, size=1))],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hmsb"))
    socket = root / "s.sock"
    command = [
        sys.executable, "-m", "sidecar", "serve", "--backend", "simulated",
        "--sim-state", str(root / "hw.json"), "--sim-gpus", "h100-80gb:1",
        "--state-dir", str(root / "state"), "--cdi-dir", str(root / "cdi"), "--socket", str(socket),
        "--log-level", "WARNING",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
    proc = subprocess.Popen(command, env=env)
    try:
        channel = grpc.insecure_channel(f"unix://{socket}")
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = pb_grpc.MigSidecarStub(channel)
        stub.Recover(pb.RecoverRequest())
        gpu = stub.ListGpus(pb.ListGpusRequest()).gpus[0].uuid

        info, reused, created = [], [], []
        for i in range(args.rounds):
            info.append(timed(lambda: stub.GetInfo(pb.GetInfoRequest())))
            # CREATED: from round 1 on this also reclaims the idle 7g.80gb the previous round left behind,
            # which is the realistic "placement pressure" path.
            created.append(timed(lambda i=i: stub.Allocate(request(gpu, f"c{i}"))))
            stub.Release(pb.ReleaseRequest(pod_uid=f"c{i}"))
            reused.append(timed(lambda i=i: stub.Allocate(request(gpu, f"r{i}"))))
            stub.Release(pb.ReleaseRequest(pod_uid=f"r{i}"))
            # Reclaim the idle 1g by allocating the whole GPU, then release and reclaim that too.
            whole = request(gpu, f"w{i}")
            whole.devices[0].profile, whole.devices[0].placement.size = "7g.80gb", 8
            stub.Allocate(whole)
            stub.Release(pb.ReleaseRequest(pod_uid=f"w{i}"))
        base = statistics.median(info)
        print(f"{'call':<22}{'p50 ms':>10}{'p99 ms':>10}{'p50 / GetInfo':>16}")
        for name, samples in (
            ("GetInfo", info),
            ("Allocate (REUSED)", reused),
            ("Allocate (CREATED)", created),
        ):
            p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
            print(f"{name:<22}{p50 * 1e3:>10.2f}{p99 * 1e3:>10.2f}{p50 / base:>16.1f}")
        channel.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
