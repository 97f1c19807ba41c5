#!/usr/bin/env python3
"""Claims through the real kube-scheduler and the DRA plugin: warm reuse vs create-per-claim (not a test).

The trace is ``trace_workload.py``'s (seeded Poisson arrivals, exponential lifetimes, 50 % 1g.10gb,
30 % 2g.20gb, 20 % 3g.40gb on 8 simulated H100-80GB at ``--load`` of the memory slices), each pod a
ResourceClaim for one device of its profile. It is replayed once per row, in one run, each time on a
fresh sidecar with the simulator's latency model of ``trace_workload.py`` (GI create 0.8 s, CI create
0.2 s, CI destroy 0.2 s, GI destroy 0.4 s, every other call 1 ms; ``--scale`` shrinks it):

- ``create-per-claim``: the plugin destroys a claim's instances at unprepare (its
  ``DestroyAtUnprepare``), what NVIDIA's DRA driver does with dynamic MIG; the sidecar's background
  reserve off;
- ``warm reuse/shipped``: the plugin releases them IDLE and lists warm devices first, so the
  scheduler, which takes the first device that fits, brings a claim to a cached instance; on the
  sidecar as ``deploy/dra/daemonset.yaml`` ships it (the reserve off: the plugin's ``KeepFree``
  keeps each asked profile's next placement free);
- ``warm reuse/serve defaults``: the same on ``serve``'s defaults, as a sidecar shared with HAMi's
  device plugin runs: the reserve at ``auto`` also trims IDLE instances on its own, some of them
  listed warm in the slices.

Every claim is plain: one request for a device of its profile by a CEL selector on the ``profile``
attribute, no list of first available subrequests, so only the slice order brings it to a warm device.
The Go half (``integration/goclient/internal/drabench``, run as a Go benchmark) starts the API server
and kube-scheduler of ``make kube-binaries``, the plugin through the kubeletplugin helper, and calls
NodePrepareResources and NodeUnprepareResources as kubelet does; its package comment says how the
trace is replayed. Before each arrival it waits for the node to settle (the slices republished, the
trim the plugin asked for done), as the trace's arrivals, tens of seconds apart, would let it;
``--no-settle`` sends each arrival right after the last event instead, so the republishing's and the
trim's lag count. A pod the scheduler finds unschedulable is given five seconds to be tried again
and bound, as the scheduler does when the claim or slice it waited for changes (``retried``: a
departed claim's deletion it had not seen yet, a pool it saw half rewritten); still unschedulable,
it is ``refused``. A claim the plugin refuses at prepare is counted (``stuck``: its pod would never
start) and its pod and claim deleted; ``--no-keep-free`` runs the plugin without naming placements to
keep free, for comparison. ``warm`` is the share of prepared claims whose prepare reused an IDLE
instance (the plugin's warm-hit counter moved), whatever the slices said of the device. GPU
instances created per prepared claim are counted by the simulated hardware
(``SimulatedHardware.call_counts``), exact; the prepare latencies are wall clock, so their ratios to
the create-per-claim row of the same run are what compare. Results: ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from trace import percentile, shipped_args

from trace_run import Sidecar
from trace_workload import GPUS, LOAD, MIX, make_trace

from sidecar.nvml.sim import OP_ALIASES, SimulatedHardware

ROOT = Path(__file__).resolve().parents[1]
GO_MODULE = ROOT / "integration" / "goclient"
BINARIES = ("etcd", "kube-apiserver", "kube-scheduler")
NO_RESERVE = ("--idle-reserve", "off")


@dataclass
class Row:
    name: str
    claims: list[dict[str, object]] = field(default_factory=list)
    created: int = 0  # GPU instances the simulated hardware created
    destroyed: int = 0  # and destroyed (at unprepare, reclaimed in a claim's way, or trimmed)
    wall: float = 0.0

    @property
    def prepared(self) -> list[dict[str, object]]:
        return [c for c in self.claims if not c["refused"] and not c.get("prepare_error")]

    @property
    def prepare_refused(self) -> list[dict[str, object]]:
        """Claims the scheduler allocated and the plugin refused at prepare: pods that never start."""
        return [c for c in self.claims if c.get("prepare_error")]

    def prepare_s(self) -> list[float]:
        return sorted(float(str(c["prepare_s"])) for c in self.prepared)


def go() -> str:
    found = shutil.which("go")
    if found is None:
        raise SystemExit("go not found on PATH")
    return found


def find(name: str) -> str | None:
    """A Go-installed program: on PATH, else in GOPATH/bin (where ``make kube-binaries`` puts it)."""
    found = shutil.which(name)
    if found:
        return found
    env = subprocess.run([go(), "env", "GOPATH"], capture_output=True, text=True, check=True)
    candidate = Path(env.stdout.strip()) / "bin" / name
    return str(candidate) if candidate.exists() else None


def gi_calls(hw: SimulatedHardware, op: str) -> int:
    return sum(n for fn, n in hw.call_counts().items() if fn in OP_ALIASES[op])


@dataclass(frozen=True)
class Variant:
    name: str
    destroy: bool  # the plugin destroys a claim's instances at unprepare
    sidecar_args: tuple[str, ...]


def variants() -> tuple[Variant, ...]:
    """The rows: create-per-claim with the background reserve off; warm reuse on the sidecar as the
    DRA path ships it (``deploy/dra/daemonset.yaml``'s flags, as ``trace.py`` reads a manifest's);
    warm reuse on ``serve``'s defaults, which a sidecar the DRA plugin shares with HAMi's device
    plugin runs (the reserve at ``auto``)."""
    flags = shipped_args(ROOT / "deploy" / "dra" / "daemonset.yaml")
    return (
        Variant("create-per-claim", destroy=True, sidecar_args=NO_RESERVE),
        Variant("warm reuse/shipped", destroy=False, sidecar_args=flags),
        Variant("warm reuse/serve defaults", destroy=False, sidecar_args=()),
    )


def run_row(
    v: Variant,
    bench: Path,
    trace_file: Path,
    scale: float,
    state_base: Path,
    *,
    settle: bool,
    keep_free: bool,
    results: Path | None,
) -> Row:
    row = Row(v.name)
    root = Path(tempfile.mkdtemp(prefix="hmdra"))
    state_root = Path(tempfile.mkdtemp(prefix="hmdra", dir=state_base))
    out = root / "results.json"
    car = Sidecar(root, state_root, scale, v.sidecar_args)
    try:
        before = gi_calls(car.hw, "create-gi"), gi_calls(car.hw, "destroy-gi")
        env = {
            **os.environ,
            "DRA_BENCH_SOCKET": str(root / "s.sock"),
            "DRA_BENCH_TRACE": str(trace_file),
            "DRA_BENCH_OUT": str(out),
            "DRA_BENCH_DESTROY": "1" if v.destroy else "0",
            "DRA_BENCH_SETTLE": "1" if settle else "0",
            "DRA_BENCH_KEEP": "1" if keep_free else "0",
        }
        started = time.perf_counter()
        done = subprocess.run(
            [str(bench), "-test.run", "^$", "-test.bench", "BenchmarkClaimTrace", "-test.benchtime", "1x"],
            cwd=GO_MODULE / "internal" / "drabench", env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        row.wall = time.perf_counter() - started
        if done.returncode != 0 or not out.exists():
            failed = f"{v.name}: the Go benchmark failed ({done.returncode})"
            raise SystemExit(f"{failed}:\n{done.stdout}\n{done.stderr}")
        row.claims = json.loads(out.read_text())
        if results is not None:
            shutil.copy(out, results / f"{v.name.replace(' ', '-').replace('/', '-')}.json")
        row.created = gi_calls(car.hw, "create-gi") - before[0]
        row.destroyed = gi_calls(car.hw, "destroy-gi") - before[1]
    finally:
        car.close()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(state_root, ignore_errors=True)
    return row


def report(rows: list[Row]) -> None:
    base = rows[0]
    header = (
        f"{'row':<26} {'claims':>6} {'retried':>7} {'refused':>7} {'stuck':>5} {'GI/claim':>8} "
        f"{'del/claim':>9} {'warm':>6} "
        f"{'mean ms':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'sched p50':>9} {'mean/create':>11} {'p99/create':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        lat, prepared = r.prepare_s(), r.prepared
        sched = sorted(float(str(c["schedule_s"])) for c in prepared)
        warm = sum(1 for c in prepared if c.get("reused")) / len(prepared)
        mean, p99 = statistics.fmean(lat), percentile(lat, 0.99)
        base_lat = base.prepare_s()
        stuck = len(r.prepare_refused)
        refused = len(r.claims) - len(prepared) - stuck
        retried = sum(1 for c in prepared if c.get("retried"))
        print(
            f"{r.name:<26} {len(prepared):>6} {retried:>7} {refused:>7} {stuck:>5} "
            f"{r.created / len(prepared):>8.3f} "
            f"{r.destroyed / len(prepared):>9.3f} {warm:>6.1%} {mean * 1e3:>8.1f} "
            f"{percentile(lat, 0.5) * 1e3:>8.1f} {p99 * 1e3:>8.1f} "
            f"{percentile(sched, 0.5) * 1e3:>7.1f}ms {mean / statistics.fmean(base_lat):>11.2f} "
            f"{p99 / percentile(base_lat, 0.99):>10.2f}"
        )
    print()
    for r in rows:
        parts = []
        for label, on_warm in (("an IDLE instance", True), ("a new one", False)):
            lat = sorted(float(str(c["prepare_s"])) for c in r.prepared if bool(c.get("reused")) == on_warm)
            if lat:
                parts.append(
                    f"{len(lat)} on {label} (mean {statistics.fmean(lat) * 1e3:.1f} ms, "
                    f"p50 {percentile(lat, 0.5) * 1e3:.1f}, p99 {percentile(lat, 0.99) * 1e3:.1f})"
                )
        over = [c for c in r.prepared if not c.get("reused") and int(str(c.get("over_idle", 0))) > 0]
        if over:
            lat = sorted(float(str(c["prepare_s"])) for c in over)
            destroys = statistics.fmean(int(str(c["over_idle"])) for c in over)
            retried = sum(1 for c in over if c.get("retried"))
            parts.append(
                f"of the new ones {len(over)} over IDLE instances ({destroys:.1f} on average, "
                f"{retried} retried; "
                f"p50 {percentile(lat, 0.5) * 1e3:.1f} ms, p99 {percentile(lat, 0.99) * 1e3:.1f})"
            )
        print(f"{r.name}: {', '.join(parts)}")
        for c in r.prepare_refused:
            print(
                f"  {c['uid']} ({c['profile']} on {c['device']}) refused at prepare: "
                f"{str(c['prepare_error'])[:240]}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--claims", type=int, default=200, help="claims in the trace (default 200)")
    parser.add_argument("--seed", type=int, default=7, help="trace seed (default 7)")
    parser.add_argument(
        "--load", type=float, default=LOAD, help=f"mean share of the memory slices held (default {LOAD})"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="latency model scale (default 1, real)")
    parser.add_argument("--disk", action="store_true", help="records and CDI specs on disk, not on /dev/shm")
    parser.add_argument(
        "--no-settle", action="store_true", help="no wait for the node to settle before each arrival"
    )
    parser.add_argument(
        "--no-keep-free",
        action="store_true",
        help="the plugin names no placement to keep free (KeepFree): a cold claim waits for its destroys",
    )
    parser.add_argument("--results", type=Path, help="a directory to keep each row's claims in, as JSON")
    args = parser.parse_args()
    missing = [b for b in BINARIES if find(b) is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not built: `make kube-binaries` builds them")
    state_base = Path.cwd() if args.disk else Path("/dev/shm")
    work = Path(tempfile.mkdtemp(prefix="hmdra"))
    try:
        bench = work / "drabench.test"
        subprocess.run(
            [go(), "test", "-c", "-o", str(bench), "./internal/drabench"], cwd=GO_MODULE, check=True
        )
        trace_file = work / "trace.json"
        trace = make_trace(args.claims, args.seed, args.load)
        claims = [
            {"uid": f"claim-{i}", "profile": p.profile, "arrive": p.arrive, "leave": p.leave}
            for i, p in enumerate(trace)
        ]
        trace_file.write_text(json.dumps(claims))
        print(
            f"{args.claims} claims on {GPUS} simulated H100-80GB, seed {args.seed}, "
            f"mix {', '.join(f'{w:.0%} {p}' for p, w in MIX)}, load {args.load:.0%} of memory slices; "
            f"latency model scaled by {args.scale}; state on {'disk' if args.disk else 'tmpfs'} "
            f"({state_base}); {'no wait' if args.no_settle else 'a wait'} for the node to settle "
            "before each arrival"
        )
        rows = []
        for v in variants():
            rows.append(
                run_row(
                    v,
                    bench,
                    trace_file,
                    args.scale,
                    state_base,
                    settle=not args.no_settle,
                    keep_free=not args.no_keep_free,
                    results=args.results,
                )
            )
            print(f"  ran {v.name}: {rows[-1].wall:.0f} s", flush=True)
        print()
        report(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
