#!/usr/bin/env python3
"""Run ``hami-mig-sidecar`` with every thread under cProfile, one table per thread (not a test).

``python -m cProfile`` sees the main thread only, and the sidecar's main thread only waits: the
handlers run on the gRPC server's workers, the reconciler, the Xid watcher and the health feed on
their own threads. This wrapper gives each thread its own profiler as it starts
(``threading.setprofile``), and at exit writes ``FILE`` (all threads merged, for ``pstats``) and
prints, per thread name, the functions with the most calls: what runs beside a request, and how
often, shows up as calls on a thread that is not a handler's. ``decision_latency.py --profile FILE``
starts the sidecar this way. Usage: ``profile_threads.py FILE [--top N] -- serve ...``.
"""

from __future__ import annotations

import atexit
import cProfile
import pstats
import sys
import threading
from collections import defaultdict
from typing import Any

_PROFILES: dict[str, list[cProfile.Profile]] = defaultdict(list)
_LOCK = threading.Lock()


def _start(*_: Any) -> None:
    """Run by every new thread before its target: this thread gets a profiler of its own."""
    profile = cProfile.Profile()
    with _LOCK:
        _PROFILES[threading.current_thread().name.split("-")[0].rstrip("_0123456789")].append(profile)
    profile.enable()  # replaces this hook for the thread: from now on only cProfile sees it


def _report(path: str, top: int) -> None:
    merged: pstats.Stats | None = None
    with _LOCK:
        groups = {name: list(profiles) for name, profiles in _PROFILES.items()}
    for name, profiles in sorted(groups.items()):
        stats: pstats.Stats | None = None
        for profile in profiles:
            profile.create_stats()  # a thread still running: its calls up to now
            if not profile.stats:
                continue
            stats = pstats.Stats(profile, stream=sys.stderr) if stats is None else stats.add(profile)
            merged = pstats.Stats(profile) if merged is None else merged.add(profile)
        if stats is None:
            continue
        print(f"\n=== thread {name} ({len(profiles)} thread(s)) ===", file=sys.stderr)
        stats.sort_stats("ncalls").print_stats(top)
    if merged is not None:
        merged.dump_stats(path)


def main() -> None:
    args = sys.argv[1:]
    split = args.index("--")
    path, rest, argv = args[0], args[1:split], args[split + 1 :]
    top = int(rest[rest.index("--top") + 1]) if "--top" in rest else 25
    main_profile = cProfile.Profile()
    _PROFILES["MainThread"].append(main_profile)
    threading.setprofile(_start)
    atexit.register(_report, path, top)
    from sidecar.cli import main as sidecar_main  # noqa: PLC0415 - after the hook: its threads too

    main_profile.enable()
    code = sidecar_main(argv)
    main_profile.disable()
    sys.exit(code)


if __name__ == "__main__":
    main()
