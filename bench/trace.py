#!/usr/bin/env python3
"""A steady pod stream through a real sidecar on 8 simulated H100-80GB: idle cache against eager (not a test).

The default run is what an operator gets: the measured eager row, then the release policy the shipped
manifests install (their flags, read from them, with ``serve``'s defaults for the rest) under each
HAMi scheduler: #2855 without the scheduler change, and with the helper at each of its preferences,
under spread and under binpack; the sidecar's advice; and the foresight bound beside them.

The parts: the seeded trace and the latency model in ``trace_workload.py`` (``policy_replay.py``
replays the same trace over the sidecar's pure decisions); one variant's run through a sidecar, event
by event, in ``trace_run.py``; the node's mirror and the schedulers in ``trace_state.py``; here,
which variants run and the report of what they measured (the table, each scheduler against the
advice, the foresight bound, the ``--plot`` chart).

The latency model, the variants (a release policy and a scheduler each), the flags and the results:
``bench/README.md``; each in detail, and the runs before: ``bench/HISTORY.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from policy_replay import clairvoyant, replay
from trace_run import Result, Variant, run_variant
from trace_workload import GPUS, LOAD, MIX, Pod, make_trace

from sidecar import config

# Server flags of the background free reserve: keep a free placement ready for every profile of the mix.
RESERVE_FLAG = "--idle-reserve"
RESERVE_ARGS = [RESERVE_FLAG, ",".join(p for p, _ in MIX)]
NO_RESERVE_ARGS = [RESERVE_FLAG, "off"]
PER_GPU_ARGS = [RESERVE_FLAG, "auto", "--idle-reserve-per-gpu"]
# The files that install the sidecar: the Helm post-renderer's patch and the standalone DaemonSet.
SHIPPED = ("deploy/helm/sidecar-patch.yaml", "deploy/daemonset.yaml")


# -- the variants ----------------------------------------------------------------------------------


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
