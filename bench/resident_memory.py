#!/usr/bin/env python3
"""Resident memory of a sidecar serving a full node: 8 GPUs x 7 instances (not a test).

The DaemonSet's memory request and limit are set from this figure (``deploy/daemonset.yaml``; the
manifest check in ``integration/manifests`` reads the number printed here from ``bench/README.md``).

Starts one ``hami-mig-sidecar serve`` process on a simulated node of 8 H100-80GB, with the metrics
endpoint on, recovers it, then fills every GPU with seven 1g.10gb instances (every 1g.10gb placement),
releases half of them (IDLE: the idle cache is part of the table too), scrapes ``/metrics`` and asks
``GetState`` (both build their answers from the whole table), and reads the process's ``VmRSS`` and
``VmHWM`` (peak) from ``/proc/PID/status``. The simulated driver runs inside the sidecar process, so
the figure includes its state (a few KB of JSON for 56 instances); the pynvml backend on a node has
the driver library mapped instead, which is shared and mostly not resident.

Usage: ``bench/resident_memory.py [--gpus 8] [--rounds 3]``. ``--rounds`` repeats the
allocate/release cycle on the full node before measuring, so that caches grown by churn are counted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

PROFILE = "1g.10gb"
INSTANCES_PER_GPU = 7
MIB = 1024 * 1024


def status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request(gpu: str, pod: str, start: int) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        devices=[
            pb.DeviceRequest(
                device_index=0, gpu_uuid=gpu, profile=PROFILE, placement=pb.Placement(start=start, size=1)
            )
        ],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hmsmem", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    sock = root / "s.sock"
    port = free_port()
    command = [
        sys.executable, "-m", "sidecar", "serve", "--backend", "simulated",
        "--sim-state", str(root / "hw.json"), "--sim-gpus", f"h100-80gb:{args.gpus}",
        "--state-dir", str(root / "state"), "--cdi-dir", str(root / "cdi"),
        "--socket", str(sock), "--metrics-address", f"127.0.0.1:{port}", "--log-level", "WARNING",
    ]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
    proc = subprocess.Popen(command, env=environ, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            stub = pb_grpc.MigSidecarStub(channel)
            deadline = time.monotonic() + 60
            while True:
                try:
                    stub.GetInfo(pb.GetInfoRequest(), timeout=2)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.1)
            after_start = status_kib(proc.pid, "VmRSS")
            stub.Recover(pb.RecoverRequest(), timeout=30)
            gpus = [g.uuid for g in stub.ListGpus(pb.ListGpusRequest(), timeout=30).gpus]
            pods: list[str] = []
            for round_ in range(args.rounds):
                for g, gpu in enumerate(gpus):
                    for start in range(INSTANCES_PER_GPU):
                        pod = f"pod-{round_}-{g}-{start}"
                        stub.Allocate(request(gpu, pod, start), timeout=30)
                        pods.append(pod)
                # every instance released but the last round's even placements: IDLE and ACTIVE both
                for pod in pods if round_ + 1 < args.rounds else pods[::2]:
                    stub.Release(pb.ReleaseRequest(pod_uid=pod), timeout=30)
                pods = [] if round_ + 1 < args.rounds else pods[1::2]
            state = stub.GetState(pb.GetStateRequest(), timeout=30)
            instances = sum(len(g.instances) for g in state.gpus)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
                scraped = len(answer.read())
            rss, peak = status_kib(proc.pid, "VmRSS"), status_kib(proc.pid, "VmHWM")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{len(gpus)} GPUs x {INSTANCES_PER_GPU} instances ({instances} in GetState), "
        f"{args.rounds} rounds, metrics page {scraped} bytes"
    )
    print(f"resident after start: {after_start / 1024:.1f} MiB")
    print(f"resident memory, {len(gpus)} GPUs x {INSTANCES_PER_GPU} instances: {rss / 1024:.1f} MiB")
    print(f"peak resident (VmHWM): {peak / 1024:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
