"""The Xid watcher: one thread, off every request's path, waiting for critical Xid events.

Started once recovery has succeeded (the table it marks is trusted from then on), it registers every
MIG-enabled GPU for ``nvmlEventTypeXidCriticalError`` in one event set and waits on it with a short
timeout, so that ``stop`` ends it within one wait at shutdown, before NVML is shut down. Each event
goes to ``faults.apply_xid``; what it did goes to ``on_report`` (metrics, the log, the reconciler's
wake-up, the health stream). A wait that fails (the driver answering an error) is logged and tried
again after a pause: watching is best effort, never a reason to stop serving.

A GPU whose MIG mode the sidecar enables later (SetMigMode; Hopper and later switch at once) is
added by ``include``: the event set is made again over every MIG-enabled GPU, so an Xid raised in
the few milliseconds between the old set's end and the new one's registration is missed. A mode
changed behind the sidecar's back (``nvidia-smi``) is not seen until a restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.faults import FaultReport, apply_xid
from sidecar.model.errors import SidecarError
from sidecar.nvml.port import NvmlError, XidEvents

_log = logging.getLogger(__name__)
WAIT_MS = 500  # one wait; ``stop`` returns within about this
RETRY_S = 5.0  # the pause after a failed wait


class XidWatcher:
    def __init__(
        self,
        ctx: LifecycleContext,
        source: XidEvents,
        ignored: frozenset[int],
        on_report: Callable[[FaultReport], None] = lambda _: None,
    ) -> None:
        self.ctx = ctx
        self.source = source
        self.ignored = ignored
        self.on_report = on_report
        self.watched: tuple[str, ...] = ()  # the GPUs registered
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False  # ``start`` was asked for (and ``stop`` not since), watching or not
        self._lock = threading.Lock()  # ``start``, ``include`` and ``stop`` one at a time

    def start(self) -> bool:
        """Register the MIG-enabled GPUs and start the thread; False (logged) when nothing can be
        watched: no MIG-enabled GPU, or the driver refused the registration."""
        with self._lock:
            self._started = True
            return self._start()

    def include(self, gpu_uuid: str) -> None:
        """Watch ``gpu_uuid`` too, now that its MIG mode is enabled: the thread is started again over
        every MIG-enabled GPU. Nothing happens before ``start`` or for a GPU already watched."""
        with self._lock:
            if self._started and gpu_uuid not in self.watched:
                self._end_thread()
                self._start()

    def _start(self) -> bool:
        if self._thread is not None:
            return True
        try:
            gpus = sorted((g for g in self.ctx.port.gpus() if g.mig_current), key=lambda g: g.index)
            uuids = [g.uuid for g in gpus]
            if not uuids:
                _log.info("no MIG-enabled GPU: Xid events are not watched")
                return False
            watch = self.source.watch_xids(uuids)
        except NvmlError as exc:
            _log.error("Xid events cannot be watched: %s", exc)
            return False
        self.watched = tuple(uuids)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(watch,), name="xid-watch", daemon=True)
        self._thread.start()
        _log.info("watching critical Xid events on %d GPU(s)", len(uuids))
        return True

    def stop(self) -> None:
        """End the thread (within one wait) and free the event set."""
        with self._lock:
            self._started = False
            self._end_thread()

    def _end_thread(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self.watched = ()

    def _loop(self, watch: object) -> None:
        try:
            while not self._stop.is_set():
                try:
                    event = self.source.wait_xid(watch, WAIT_MS)
                except NvmlError as exc:
                    _log.error("waiting for Xid events failed: %s; trying again", exc)
                    self._stop.wait(RETRY_S)
                    continue
                if event is None or self._stop.is_set():
                    continue
                try:
                    report = apply_xid(self.ctx, event, self.ignored)
                except SidecarError as exc:
                    _log.error("Xid %d on %s not applied: %s", event.xid, event.gpu_uuid, exc)
                    continue
                try:
                    self.on_report(report)
                except Exception:  # noqa: BLE001 - a failing listener must not end the watch
                    _log.exception("Xid report listener failed")
        finally:
            try:
                self.source.stop_watching(watch)
            except NvmlError as exc:
                _log.warning("freeing the Xid event set failed: %s", exc)
