"""Background retries of ERROR instances and of CDI spec removals.

Retries the destruction of ERROR instances that no active allocation references and no pending
reservation keeps (``pending.Guards``; the CDI file and the record go only after the hardware is
gone) and retries queued CDI removals.

Each attempt runs under the GPU lock of its instance through ``Lifecycle.retry_error``, so it never
races an allocation on the same GPU. An instance is *referenced* when the plugin's last SyncActive
(before the first one: the successful Recover's active allocations) listed its MIG UUID as held by a
live pod: it is left alone then, because destroying a device under a
running container is worse than keeping a broken one. A destroy that still fails leaves the instance
ERROR with the new ``last_error``; the next round tries again. A round then lists the GIs of every
MIG-enabled GPU into the advice's layout view (``gpu_views.refresh_layout``) when ``interval_s`` has
passed on ``clock`` since the last listing, so ``RankPlacements`` sees a GI created or destroyed
outside the sidecar within one interval; the rounds an Allocate or a Release kicks in between make no
listing (they would take every GPU lock beside the request path). With an idle policy configured, or
placements a client keeps free (``KeepFree``), each round then trims IDLE instances (``idle_trim``).
``run_once`` is the whole algorithm; the thread only repeats it (every ``interval_s``, or at once
after ``kick``), so tests call ``run_once`` directly.
Each round of the thread is registered with ``liveness`` while it runs: a round whose own work (not
its wait for a GPU lock) passes the threshold turns the health service NOT_SERVING. ``kicks`` and
``rounds`` count the wake-ups asked and the rounds run; an Allocate refused for bad input asks none.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import msgspec

from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.idle_trim import IdleTrimmer
from sidecar.lifecycle.liveness import Liveness
from sidecar.model.domain import InstanceRef, State
from sidecar.model.errors import SidecarError

_log = logging.getLogger(__name__)
_PAST_DUE_S = 0.005


class ReconcileReport(msgspec.Struct, frozen=True):
    destroyed: tuple[InstanceRef, ...] = ()
    still_failing: tuple[str, ...] = ()
    cdi_removed: tuple[str, ...] = ()
    trimmed: tuple[InstanceRef, ...] = ()
    layout_refreshed: tuple[str, ...] = ()  # the GPUs whose GIs were listed into the advice's view


class Reconciler:
    def __init__(
        self,
        lifecycle: Lifecycle,
        interval_s: float = 10.0,
        idle: IdleTrimmer | None = None,
        liveness: Liveness | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lifecycle = lifecycle
        self.interval_s = interval_s
        self.idle = idle
        self.clock = clock
        self._listed_at: float | None = None  # when ``refresh_layout`` last ran, on ``clock``
        self.liveness = liveness if liveness is not None else Liveness(float("inf"))
        self._stop = threading.Event()
        # Kicks are counted, not flagged: one that comes while the loop wakes for another (between
        # the wait and the next round) still gets a round of its own.
        self._wake = threading.Condition()
        self._kicks = 0
        # Rounds the background loop has run (a failed one too): what shows that a call did, or did
        # not, cost the node a round (the metrics and the tests read it).
        self.rounds = 0
        self._thread: threading.Thread | None = None

    def run_once(self) -> ReconcileReport:
        """One round: every unreferenced ERROR instance, then the queued CDI removals.

        Returns nothing to do before recovery has succeeded: until then the table is not trusted.
        """
        if not self.lifecycle.recovered:
            return ReconcileReport()
        destroyed: list[InstanceRef] = []
        failing: list[str] = []
        for record in self.lifecycle.instances():
            if record.state is not State.ERROR:
                continue
            try:
                ref = self.lifecycle.retry_error(record.name)
            except SidecarError as exc:
                _log.warning("ERROR instance %s still cannot be destroyed: %s", record.name, exc)
                failing.append(record.name)
                continue
            if ref is not None:
                _log.info("destroyed ERROR instance %s", record.name)
                destroyed.append(ref)
        cdi_removed = self.lifecycle.retry_cdi_removals()
        refreshed = self._refresh_layout()
        trimmed = [t.ref for t in self.idle.run_once()] if self.idle is not None else []
        return ReconcileReport(
            destroyed=tuple(destroyed),
            still_failing=tuple(failing),
            cdi_removed=tuple(cdi_removed),
            trimmed=tuple(trimmed),
            layout_refreshed=tuple(refreshed),
        )

    def _refresh_layout(self) -> list[str]:
        """The layout listing, once per ``interval_s`` on ``clock``; the GPUs listed ([] when not due)."""
        now = self.clock()
        if self._listed_at is not None and 0 <= now - self._listed_at < self.interval_s:
            return []
        self._listed_at = now
        try:
            return self.lifecycle.refresh_layout()
        except SidecarError as exc:
            _log.warning("layout view not refreshed this round: %s", exc)
            return []

    def kick(self) -> None:
        """Run the next round now rather than at the end of the interval (after a release or an
        allocation, the idle policy may have work: the free reserve is restored off the next
        request's path)."""
        with self._wake:
            self._kicks += 1
            self._wake.notify()

    @property
    def kicks(self) -> int:
        """Requests for an early round so far (``kick``); several may share one round."""
        with self._wake:
            return self._kicks

    def start(self) -> None:
        """Run ``run_once`` every ``interval_s`` on a daemon thread (only after recovery succeeded)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        with self._wake:
            seen = self._kicks  # a kick from here on gets its round, however soon the thread runs
        self._thread = threading.Thread(target=self._loop, args=(seen,), name="reconciler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the loop to end and wait for it; prompt because the loop sleeps on a condition."""
        self._stop.set()
        self.kick()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _sleep_s(self) -> float:
        """Until the next round: the interval, or less when an IDLE instance's TTL ends sooner (a
        hair past the end, as the policy trims what is strictly older than the TTL)."""
        due = self.idle.seconds_until_due() if self.idle is not None else None
        return self.interval_s if due is None else min(self.interval_s, due + _PAST_DUE_S)

    def _kicked_since(self, seen: int) -> bool:
        return self._kicks != seen

    def _loop(self, seen: int) -> None:
        while True:
            sleep_s = self._sleep_s()  # reads the table: never under the condition a kick takes
            with self._wake:
                self._wake.wait_for(functools.partial(self._kicked_since, seen), sleep_s)
                seen = self._kicks
            if self._stop.is_set():
                return
            try:
                with self.liveness.running("reconciler"):
                    self.run_once()
            except Exception:  # noqa: BLE001 - one bad round must not end background retries for good
                _log.exception("reconciler round failed")
            finally:
                self.rounds += 1
