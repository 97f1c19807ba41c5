"""Background retries (architecture section 5 and the spec's CDI lifecycle).

STUB — the interface below is fixed; the bodies are filled in by the lifecycle work.

Retries the destruction of ERROR instances that no active allocation references (the CDI file and the
record go only after the hardware is gone) and retries queued CDI removals.
"""

from __future__ import annotations

import msgspec

from sidecar.domain import InstanceRef
from sidecar.lifecycle import Lifecycle


class ReconcileReport(msgspec.Struct, frozen=True):
    destroyed: tuple[InstanceRef, ...] = ()
    still_failing: tuple[str, ...] = ()
    cdi_removed: tuple[str, ...] = ()


class Reconciler:
    def __init__(self, lifecycle: Lifecycle, interval_s: float = 10.0) -> None:
        self.lifecycle = lifecycle
        self.interval_s = interval_s

    def run_once(self) -> ReconcileReport:
        raise NotImplementedError

    def start(self) -> None:
        """Run ``run_once`` every ``interval_s`` on a daemon thread (only after recovery succeeded)."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError
