"""The composition root: the one place that builds and wires the sidecar's objects.

Order matters and is the point of this module:

1. open the hardware backend (NVML or the simulated node) — without a driver ``--backend nvml`` fails
   here with a clear message; the simulator is never substituted;
2. ``RecordStore.open()`` takes the state directory's flock *before* the socket is touched: a second
   sidecar on the same directory exits here, and cannot unlink the first one's live socket (a Python
   gRPC server silently takes over an existing socket path);
3. build CDI specs, lifecycle, recovery, reconciler and the gRPC server, every dependency passed in;
   sweep the CDI temp files a crash inside a write left (the lock says no write of ours runs);
4. only while holding the lock: remove a stale socket file (one that no process answers on: a
   sidecar of another state directory may be serving there), bind, chmod 0660;
5. health: ``""`` SERVING, the MigSidecar service NOT_SERVING until the first successful ``Recover``,
   which also starts the reconciler (before recovery the table does not describe the hardware).

SIGTERM/SIGINT: stop accepting, answer the in-flight calls that finish within the grace period (the
others are cancelled towards their clients), wait until every handler has returned (gRPC does not stop
handler threads, and one past the grace period still creates hardware and writes records), then stop
the reconciler, close the backend, remove the socket, release the lock, exit 0.

Nothing here does I/O at import time; ``serve`` takes the backend opener as an argument so tests and
tools can wire a different one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import signal
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from sidecar import nvml
from sidecar.config import ServeConfig
from sidecar.edge import unixsocket
from sidecar.edge.metrics import Metrics
from sidecar.edge.server import MigSidecarServicer, ServerInfo, SidecarServer
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.faults import FaultReport
from sidecar.lifecycle.idle_trim import IdleTrimmer
from sidecar.lifecycle.inventory import LayoutRecordingPort
from sidecar.lifecycle.liveness import Liveness
from sidecar.lifecycle.locks import Locks
from sidecar.lifecycle.logs import event
from sidecar.lifecycle.reconciler import Reconciler
from sidecar.lifecycle.recover import Recoverer
from sidecar.lifecycle.xid_watch import XidWatcher
from sidecar.model.errors import StateWriteFailed
from sidecar.nvml.metered import MeteredPort
from sidecar.nvml.port import NvmlError
from sidecar.store.cdi import CdiSpecs
from sidecar.store.records import BOOT_ID_PATH, RecordStore, StateDirLocked

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1


BackendOpener = Callable[[ServeConfig], nvml.Backend]


class StartupError(Exception):
    """The sidecar cannot start; the message says why and what to do. Nothing was served."""


def read_boot_id(proc_root: Path) -> str:
    """``<proc>/sys/kernel/random/boot_id``: changes on every boot, which is when GI/CI vanish.

    The simulated backend writes one into its fake /proc, so the same code path serves both."""
    path = proc_root / BOOT_ID_PATH
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise StartupError(f"cannot read the boot id from {path}: {exc.strerror}") from exc


def open_default_backend(config: ServeConfig) -> nvml.Backend:
    """Open the backend ``config`` names through ``sidecar.nvml.open_backend``."""
    return nvml.open_backend(config.backend, config.sim_state, config.sim_gpus_text or None)


class Application:
    """The wired sidecar. Built by ``build``; ``start`` binds, ``shutdown`` undoes everything in order."""

    def __init__(
        self,
        *,
        config: ServeConfig,
        backend: nvml.Backend,
        records: RecordStore,
        cdi: CdiSpecs,
        lifecycle: Lifecycle,
        recovery: Recoverer,
        reconciler: Reconciler,
        metrics: Metrics,
        server: SidecarServer,
        xid_watcher: XidWatcher | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.records = records
        self.cdi = cdi
        self.lifecycle = lifecycle
        self.recovery = recovery
        self.reconciler = reconciler
        self.metrics = metrics
        self.server = server
        self.xid_watcher = xid_watcher
        self._recovered_lock = threading.Lock()
        self._reconciler_started = False
        self._socket_bound = False

    def on_recovered(self) -> None:
        """Called after every successful Recover: health turns SERVING, the reconciler and the Xid
        watcher start once (the table they act on is trusted from now on)."""
        with self._recovered_lock:
            self.server.mark_recovered()
            if not self._reconciler_started:
                self.reconciler.start()
                if self.xid_watcher is not None:
                    self.xid_watcher.start()
                self._reconciler_started = True

    def start(self) -> None:
        """Bind the socket (the state lock is already held) and the optional metrics endpoint."""
        socket = self.config.socket
        try:
            self._clear_socket_path(socket)
        except OSError as exc:
            # A parent that is a file, a read-only or foreign-owned directory: a setup error to report.
            raise StartupError(f"cannot prepare the socket path {socket}: {exc}") from exc
        previous = os.umask(0o117)  # the socket is born 0660; the chmod below makes it explicit
        try:
            self.server.start(str(socket))
        except RuntimeError as exc:
            raise StartupError(f"cannot bind the gRPC socket {socket}: {exc}") from exc
        finally:
            os.umask(previous)
        self._socket_bound = True
        try:
            socket.chmod(0o660)
        except OSError as exc:
            raise StartupError(f"cannot set mode 0660 on the socket {socket}: {exc}") from exc
        if self.config.metrics_address is not None:
            address = self.config.metrics_address
            try:
                self.metrics.serve(address.host, address.port)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics on {address}: {exc.strerror}") from exc

    @staticmethod
    def _clear_socket_path(socket: Path) -> None:
        """Create the socket's directory (0750) if missing and remove a stale socket; OSError otherwise."""
        if not socket.parent.exists():
            socket.parent.mkdir(parents=True, mode=0o750)
            socket.parent.chmod(0o750)  # mkdir's mode is filtered by the umask
        try:
            mode = socket.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise StartupError(f"{socket} exists and is not a socket; refusing to replace it")
        # The state directory lock keeps out a sidecar of this directory only; one with another
        # --state-dir and the same --socket would lose its socket here, and stay unreachable.
        if unixsocket.probe(socket) is unixsocket.Probe.ANSWERS:
            raise StartupError(
                f"another process is serving on the socket {socket}; refusing to remove it"
                " (a second sidecar with another --state-dir? stop it or choose another --socket)"
            )
        socket.unlink()
        event(log, logging.INFO, "removed stale socket", socket=str(socket))

    def shutdown(self) -> None:
        """Stop serving, then release resources in the reverse order of acquisition. Idempotent.

        ``server.stop`` returns only once no handler runs any more: the reconciler, NVML and the
        records (with the state directory lock) must outlive every call that uses them."""
        if self._socket_bound:
            self.server.stop(self.config.shutdown_grace_s)
        if self._reconciler_started:
            if self.xid_watcher is not None:
                self.xid_watcher.stop()  # before NVML shuts down: it waits on an NVML event set
            self.reconciler.stop()
            self._reconciler_started = False
        self.metrics.close()
        if self._socket_bound:
            with contextlib.suppress(FileNotFoundError):
                self.config.socket.unlink()
            self._socket_bound = False
        self.backend.close()
        self.records.close()


def build(config: ServeConfig, backend: nvml.Backend, records: RecordStore, boot_id: str) -> Application:
    """Wire everything from an open backend and a locked record store. No socket is touched here."""
    metrics = Metrics()
    liveness = Liveness(config.stuck_threshold_s)  # NVML calls and reconciler rounds, for the health service
    # The NVML port, every decorator of it stacked here and nowhere else, from the lifecycle down:
    # the listing tap keeps the advice's layout view (``lifecycle.inventory``), the meter counts and
    # times each call once (``nvml.metered``), the backend makes the pynvml call, mapping its errors
    # and retrying transient codes (``nvml.pynvml_backend`` over ``nvml.calls``).
    port = LayoutRecordingPort(MeteredPort(backend.port, metrics, liveness))
    cdi = CdiSpecs(config.cdi_dir, kind=config.cdi_kind, proc_root=backend.proc_root)
    # The one context, given once to each of its users; a wait for a GPU lock is not stuck work.
    ctx = LifecycleContext(port, records, cdi, boot_id, locks=Locks(liveness.waiting, liveness.clock))
    lifecycle = Lifecycle(ctx)
    recovery = Recoverer(ctx, adopt_existing=config.adopt_existing, hami_takeover=config.hami_takeover)
    # Always there: whatever the settings, a client's KeepFree placements are kept free.
    idle = IdleTrimmer(ctx, config.idle, on_trim=lambda cause: metrics.idle_trims.labels(cause).inc())
    reconciler = Reconciler(lifecycle, interval_s=config.reconcile_interval_s, idle=idle, liveness=liveness)
    metrics.watch(
        lifecycle.instances, cdi.pending_removals, recovered=lambda: lifecycle.recovered, liveness=liveness
    )
    metrics.idle_ttl.set(config.idle.ttl_s or 0)
    info = ServerInfo(
        backend=backend.kind,
        boot_id=boot_id,
        cdi_enabled=cdi.enabled,
        adopt_existing=config.adopt_existing,
        started_at=dt.datetime.now(dt.UTC),
    )
    servicer = MigSidecarServicer(lifecycle, recovery, info, metrics)
    watcher = None
    if backend.xids is not None:

        def on_xid(report: FaultReport) -> None:
            metrics.count_xid(report)
            log_xid(report)
            servicer.health_feed.publish(report.changed)  # WatchHealth's followers
            if report.faulted:
                reconciler.kick()  # a faulted IDLE instance is ERROR now: destroyed off the request path

        watcher = XidWatcher(ctx, backend.xids, frozenset(config.xid_ignore), on_report=on_xid)
    server = SidecarServer(servicer, liveness=liveness)
    app = Application(
        config=config,
        backend=backend,
        records=records,
        cdi=cdi,
        lifecycle=lifecycle,
        recovery=recovery,
        reconciler=reconciler,
        metrics=metrics,
        server=server,
        xid_watcher=watcher,
    )
    servicer.on_recovered = app.on_recovered
    if watcher is not None:
        servicer.on_mig_enabled = watcher.include
    if config.idle.enabled:
        servicer.on_change = reconciler.kick  # the idle policy runs right after, off the request path
    servicer.on_keep_free = reconciler.kick  # the named placements are freed now, whatever the policy
    return app


def log_xid(report: FaultReport) -> None:
    """One line per Xid event: what it faulted, the foreign GIs it named (reported, never touched)."""
    if not report.counted:
        event(log, logging.INFO, "ignored Xid", xid=report.xid, gpu=report.gpu_uuid)
        return
    event(
        log,
        logging.ERROR,
        "Xid faulted instances",
        xid=report.xid,
        gpu=report.gpu_uuid,
        faulted=[f"{r.reservation.profile}@{r.reservation.placement}" for r in report.faulted],
        foreign_gis=list(report.foreign),
    )


def sweep_cdi_temp_files(cdi: CdiSpecs) -> None:
    """Remove the CDI temp files a crash in the middle of a write left (only while the lock is held).

    Housekeeping: a temp file is a dotfile no CDI reader loads, so a directory that cannot be listed
    is logged and left for recovery, which reads the same directory and reports it there."""
    try:
        removed = cdi.sweep_temp_files()
    except StateWriteFailed as exc:
        event(log, logging.WARNING, "cdi temp sweep failed", error=str(exc))
        return
    if removed:
        event(log, logging.INFO, "removed leftover cdi temp files", files=removed)


def open_app(config: ServeConfig, open_backend: BackendOpener = open_default_backend) -> Application:
    """Steps 1-3 of the startup order; raises ``StartupError`` (releasing what it took) on failure."""
    try:
        backend = open_backend(config)
    # nvml.BackendUnavailableError is a RuntimeError: no driver, bad simulator state, unknown model.
    except (RuntimeError, NvmlError, OSError, ValueError) as exc:
        hint = ""
        if config.backend == "nvml" and "--backend simulated" not in str(exc):
            hint = " (for a node without a GPU, ask for --backend simulated --sim-state FILE explicitly)"
        raise StartupError(f"cannot open the {config.backend} backend: {exc}{hint}") from exc
    records = RecordStore(config.state_dir)
    try:
        records.open()
    except StateDirLocked as exc:
        backend.close()
        raise StartupError(
            f"state directory {config.state_dir} is locked by another running sidecar ({exc}); "
            "only one sidecar may own a node's MIG instances"
        ) from exc
    except (OSError, StateWriteFailed) as exc:  # the directory is a file, missing, read-only ...
        backend.close()
        raise StartupError(f"cannot use the state directory {config.state_dir}: {exc}") from exc
    try:
        boot_id = read_boot_id(backend.proc_root)
        app = build(config, backend, records, boot_id)
        sweep_cdi_temp_files(app.cdi)
        return app
    except BaseException:
        records.close()
        backend.close()
        raise


STOP_POLL_S = 0.5  # the longest a signal handled on another thread waits to be acted on


def wait_for_stop(stop: threading.Event) -> None:
    """Wait for ``stop`` in slices, never in one untimed wait.

    The kernel may hand SIGTERM to any thread that does not block it (the Xid watcher, the
    reconciler, gRPC's threads), and then the main thread, parked in an untimed lock wait, is never
    woken to run the Python handler: the sidecar would ignore SIGTERM until the kubelet's SIGKILL.
    A timed wait returns to the interpreter at every slice, which runs any handler still pending."""
    while not stop.wait(STOP_POLL_S):
        pass


def serve(
    config: ServeConfig,
    open_backend: BackendOpener = open_default_backend,
    stop: threading.Event | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or ``stop`` is set). Returns the process exit code."""
    stop = stop if stop is not None else threading.Event()
    if threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            event(log, logging.INFO, "stopping", signal=signal.Signals(signum).name)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        app = open_app(config, open_backend)
    except StartupError as exc:
        event(log, logging.ERROR, "startup failed", error=str(exc))
        return EXIT_STARTUP_FAILED
    try:
        app.start()
    except StartupError as exc:
        event(log, logging.ERROR, "startup failed", error=str(exc))
        app.shutdown()
        return EXIT_STARTUP_FAILED
    event(
        log,
        logging.INFO,
        "serving",
        socket=str(config.socket),
        backend=app.backend.kind,
        state_dir=str(config.state_dir),
        cdi_dir=str(config.cdi_dir) if config.cdi_dir is not None else "",
        boot_id=app.server.servicer.info.boot_id,
        metrics=app.metrics.bound_port or "",
    )
    try:
        wait_for_stop(stop)
    finally:
        app.shutdown()
        event(log, logging.INFO, "stopped", socket=str(config.socket))
    return EXIT_OK
