#!/usr/bin/env python3
"""What one simulated NVML call costs in a hot loop, through pynvml's own wrappers (not a test).

Installs the simulator over a state file on tmpfs (``/dev/shm``, as ``/var/run`` is on a node) with
``--gpus`` H100-80GB, each with ``--instances`` 1g.10gb instances, and times, per call: the four
queries of a reuse decision (MIG mode, handle by MIG UUID, GI ID, processes), an empty transaction
(the lock, the count, the check that the file is unchanged), and a GI+CI create and destroy cycle
(its six calls together). Prints the best of ``--repeat`` runs in microseconds.

A loop on one process keeps every cache warm: inside a request each step costs about three times as
much (``bench/HISTORY.md``, "Where the reuse time goes"), so compare two commits with this script on the
same machine in one sitting, and read ``decision_latency.py``'s ``driver ms`` for the in-request share.

Usage: ``bench/sim_calls.py [--gpus 1] [--instances 1] [--number 5000] [--repeat 5]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import timeit
from collections.abc import Callable
from ctypes import byref
from pathlib import Path
from typing import Any

import pynvml as nv

from sidecar.nvml.sim import SimulatedHardware, install, uninstall


def calls(hw: SimulatedHardware, gpus: int, instances: int) -> dict[str, Callable[[], Any]]:
    """The timed calls, each a closure over handles taken once."""
    for g in range(gpus):
        for start in range(instances):
            hw.create_instance(g, "1g.10gb", start, 1)
    nv.nvmlInit()
    dev = nv.nvmlDeviceGetHandleByIndex(0)
    layout = hw.layout(0)
    mig_uuid = layout.gis[-1].mig_uuid if layout.gis else None
    mig = nv.nvmlDeviceGetHandleByUUID(mig_uuid) if mig_uuid else None
    profile = nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, nv.NVML_GPU_INSTANCE_PROFILE_1_SLICE).id
    free = nv.c_nvmlGpuInstancePlacement_t(6, 1)

    def empty_transaction() -> None:
        with hw.store.transaction(call="nvmlBenchEmpty"):
            pass

    def create_destroy() -> None:
        gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile, byref(free))
        nv.nvmlGpuInstanceGetInfo(gi)
        ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
        nv.nvmlComputeInstanceGetInfo(ci)
        nv.nvmlComputeInstanceDestroy(ci)
        nv.nvmlGpuInstanceDestroy(gi)

    timed: dict[str, Callable[[], Any]] = {"nvmlDeviceGetMigMode": lambda: nv.nvmlDeviceGetMigMode(dev)}
    if mig is not None:
        timed["nvmlDeviceGetHandleByUUID (MIG)"] = lambda: nv.nvmlDeviceGetHandleByUUID(mig_uuid)
        timed["nvmlDeviceGetGpuInstanceId"] = lambda: nv.nvmlDeviceGetGpuInstanceId(mig)
        timed["nvmlDeviceGetComputeRunningProcesses"] = lambda: nv.nvmlDeviceGetComputeRunningProcesses(mig)
    timed["empty transaction"] = empty_transaction
    if instances < 7:
        timed["create+destroy GI and CI (6 calls)"] = create_destroy
    return timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--instances", type=int, default=1, help="1g.10gb instances per GPU (0-7)")
    parser.add_argument("--number", type=int, default=5000, help="calls per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs; the best is printed")
    args = parser.parse_args()
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="hmsc", dir=shm if shm.is_dir() else None))
    try:
        hw = SimulatedHardware.init_file(root / "hw.json", [("h100-80gb", args.gpus)])
        install(hw)
        timed = calls(hw, args.gpus, args.instances)
        print(f"{args.gpus} simulated H100-80GB, {args.instances} instance(s) each; best of {args.repeat}")
        for name, call in timed.items():
            number = args.number if "6 calls" not in name else max(1, args.number // 20)
            best = min(timeit.repeat(call, number=number, repeat=args.repeat)) / number
            print(f"{name:40s} {best * 1e6:9.2f} us")
    finally:
        uninstall()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
