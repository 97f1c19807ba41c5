#!/usr/bin/env python3
"""Where a decision's time goes: the lifecycle in one process under cProfile (not a test).

gRPC handlers run on worker threads, which ``python -m cProfile`` on the sidecar does not see; this
drives the same pieces the sidecar wires together — the pynvml adapter over the simulated library with
its state in a *file* (as ``serve --backend simulated`` has it), records with fsync, CDI files from the
fake ``/proc`` — through the cycle of ``decision_latency.py``, and prints the functions with the most
time of their own.

Usage: ``bench/profile_lifecycle.py [--rounds N] [--top K] [--sort tottime|cumulative]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import sys
import tempfile
from pathlib import Path

from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.inventory import LayoutRecordingPort
from sidecar.model.domain import AllocateRequest, DeviceRequest, PodRef, Reservation
from sidecar.nvml.port import Placement
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall
from sidecar.store.cdi import CdiSpecs
from sidecar.store.records import RecordStore


def request(gpu: str, pod: str, profile: str, start: int, size: int) -> AllocateRequest:
    return AllocateRequest(
        pod=PodRef(pod, "bench", pod),
        container_name="main",
        container_index=0,
        devices=(DeviceRequest(0, Reservation(gpu, profile, Placement(start, size))),),
    )


def cycle(lifecycle: Lifecycle, gpu: str, i: int) -> None:
    """The decisions of ``decision_latency.py`` in the same order, then the idle 7g.80gb blocker."""
    w, c, r, z = f"w{i}", f"c{i}", f"r{i}", f"z{i}"
    lifecycle.allocate(request(gpu, w, "1g.10gb", 0, 1))
    lifecycle.allocate(request(gpu, c, "1g.10gb", 1, 1))
    lifecycle.allocate(request(gpu, c, "1g.10gb", 1, 1))
    lifecycle.release(c)
    lifecycle.allocate(request(gpu, r, "1g.10gb", 1, 1))
    lifecycle.snapshot()
    lifecycle.release(w)
    lifecycle.release(r)
    lifecycle.allocate(request(gpu, z, "7g.80gb", 0, 8))
    lifecycle.release(z)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--sort", default="tottime", choices=("tottime", "cumulative"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hmsp"))
    try:
        hw = SimulatedHardware.init_file(root / "hw.json", [("h100-80gb", 1)])
        install(hw)
        port = PynvmlBackend()
        records = RecordStore(root / "state")
        records.open()
        assert hw.proc_root is not None
        ctx = LifecycleContext(
            LayoutRecordingPort(port), records, CdiSpecs(root / "cdi", proc_root=hw.proc_root), hw.boot_id
        )
        ctx.install([], 0)
        lifecycle = Lifecycle(ctx)
        gpu = port.gpus()[0].uuid
        lifecycle.allocate(request(gpu, "z", "7g.80gb", 0, 8))
        lifecycle.release("z")
        cycle(lifecycle, gpu, -1)  # warm-up
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.rounds):
            cycle(lifecycle, gpu, i)
        profile.disable()
        stats = pstats.Stats(profile)
        stats.strip_dirs().sort_stats(args.sort).print_stats(args.top)
        records.close()
        port.close()
    finally:
        uninstall()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
