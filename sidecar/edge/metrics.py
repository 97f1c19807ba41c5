"""Prometheus metrics, on a private registry per application.

Why a private ``CollectorRegistry``: tests start several applications in one process and the global
registry would refuse the second set of metric names; a private one also keeps library metrics out.

Where the numbers come from:

* instances by GPU and state, and the reconciler backlog (ERROR instances + queued CDI removals), are
  read from the lifecycle at scrape time, so they cannot drift from the table they describe;
* creations, destructions and NVML errors by operation and code are counted at the hardware port by
  ``sidecar.nvml.metered.MeteredPort``, a pass-through ``NvmlPort`` the composition root puts in front
  of the backend, so every caller (allocate, rollback, reclaim, recovery, reconciler) is counted the
  same way; ``Metrics`` is the meter it counts into (``nvml_failed``, ``gi_created``, ``gi_destroyed``);
* reuse hits, reclaims and RPC latency are counted by the gRPC servicer from its responses, and so
  are allocated devices by GPU and outcome, reclaims by GPU and Allocate latency by outcome (what
  the dashboard in ``deploy/`` shows per GPU). These per-call observations are queued by the call
  (one append) and applied, in order, by the next read of the registry (a scrape, a scrape
  restricted by ``name[]``, ``get_sample_value``) or once 64 are waiting: a read made after a
  call returned always counts it;
* idle instances and the age of the oldest per GPU are read from the table at scrape time, trims of
  the idle policy are counted by cause as the reconciler makes them;
* whether a Recover succeeded, and the age of the oldest running NVML call and reconciler round
  (``sidecar.lifecycle.liveness``) are read at scrape time; the start time and the idle TTL are set once.

Every metric named by ``deploy/prometheus-rules.yaml`` and ``deploy/grafana-dashboard.json`` is
exported (a test scrapes a running sidecar for each).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from sidecar.lifecycle.faults import FaultReport
from sidecar.lifecycle.gpu_views import last_used
from sidecar.lifecycle.liveness import LOCK_WAIT, Liveness
from sidecar.model.domain import AllocateResult, Outcome, State
from sidecar.model.idle_policy import Cause
from sidecar.model.ownership import OwnershipRecord

PREFIX = "hami_mig_sidecar"

_Labelled = TypeVar("_Labelled", prometheus_client.Counter, prometheus_client.Histogram)

# RPCs are ~1 ms of gRPC overhead; creates are dominated by NVML (tens of ms to seconds on hardware).
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


# Per-call observations waiting to be applied: one read of the registry, or this many of them, apply
# them all (``Metrics.flush``). Small, so the call that applies them pays about 0.1 ms, not more.
DUE_LIMIT = 64


class _FlushingRegistry(CollectorRegistry):
    """A registry that applies the observations still due before anything reads it: every read
    (a scrape, ``get_sample_value``, a scrape restricted by ``name[]``) sees every call answered so far."""

    def __init__(self, flush: Callable[[], None]) -> None:
        super().__init__(auto_describe=True)
        self._flush = flush

    def collect(self) -> Iterator[Metric]:
        self._flush()
        yield from super().collect()

    def restricted_registry(self, names: Iterable[str]) -> Any:
        self._flush()
        return super().restricted_registry(names)


class Metrics:
    """The sidecar's metrics. ``watch`` connects the scrape-time gauges to the lifecycle's state.

    The per-call metrics (``observe_rpc``, ``observe_allocate``) are not applied by the call: each
    queues one entry, and the first read of the registry after it applies the queue, in order, under
    one lock (``flush``). A read after a call has returned always counts it, and the call's own thread
    pays a queue append instead of the counters and histograms, which cost far more each in a
    cold server than in one loop over the queue."""

    def __init__(self) -> None:
        self._due: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._flush_lock = threading.Lock()
        self.registry = _FlushingRegistry(self.flush)
        self.rpc_latency = prometheus_client.Histogram(
            f"{PREFIX}_rpc_duration_seconds",
            "Time to answer a gRPC call of the MigSidecar service, by method and status code.",
            ["method", "code"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reuse_hits = prometheus_client.Counter(
            f"{PREFIX}_reuse_hits",
            "Allocations served by an IDLE instance with exactly the requested reservation.",
            registry=self.registry,
        )
        self.creations = prometheus_client.Counter(
            f"{PREFIX}_gpu_instance_creations",
            "GPU instances created on the hardware (including ones rolled back later).",
            registry=self.registry,
        )
        self.destructions = prometheus_client.Counter(
            f"{PREFIX}_gpu_instance_destructions",
            "GPU instances destroyed on the hardware (reclaims, rollbacks, reconciler retries, recovery).",
            registry=self.registry,
        )
        self.reclaims = prometheus_client.Counter(
            f"{PREFIX}_reclaims",
            "IDLE instances destroyed because they blocked a requested placement.",
            registry=self.registry,
        )
        self.nvml_errors = prometheus_client.Counter(
            f"{PREFIX}_nvml_errors",
            "NVML calls that failed after the adapter's bounded retries, by port operation and nvmlReturn_t"
            " name (INSUFFICIENT_RESOURCES).",
            ["operation", "code"],
            registry=self.registry,
        )
        self.idle_trims = prometheus_client.Counter(
            f"{PREFIX}_idle_trims",
            "IDLE instances the idle policy destroyed in the background, by cause "
            "(ttl, max_idle, reserve, in_the_way).",
            ["cause"],
            registry=self.registry,
        )
        for cause in Cause:  # exported at 0 before the first trim, so the dashboard can name it
            self.idle_trims.labels(cause.value)
        self.allocations = prometheus_client.Counter(
            f"{PREFIX}_allocations",
            "Devices handed out by Allocate, by GPU and outcome (created, reused); retries of an "
            "allocation already made are not counted.",
            ["gpu", "outcome"],
            registry=self.registry,
        )
        self.xid_events = prometheus_client.Counter(
            f"{PREFIX}_xid_events",
            "Critical Xid events NVML reported, by GPU, Xid and whether they fault instances "
            "(counted=false: an application error --xid-ignore names, which changes nothing).",
            ["gpu", "xid", "counted"],
            registry=self.registry,
        )
        self.faulted_instances = prometheus_client.Counter(
            f"{PREFIX}_faulted_instances",
            "Owned instances a critical Xid faulted (never reused again: destroyed at release, or by "
            "the reconciler when IDLE), by GPU and Xid.",
            ["gpu", "xid"],
            registry=self.registry,
        )
        self.gpu_reclaims = prometheus_client.Counter(
            f"{PREFIX}_gpu_reclaims",
            "IDLE instances an Allocate destroyed because they blocked its placement, by GPU.",
            ["gpu"],
            registry=self.registry,
        )
        self.allocate_latency = prometheus_client.Histogram(
            f"{PREFIX}_allocate_duration_seconds",
            "Time to decide an Allocate, by outcome: reused, created, reclaimed (a reclaim was needed), "
            "already_allocated (a retry), failed.",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.start_time = prometheus_client.Gauge(
            f"{PREFIX}_start_time_seconds",
            "When the sidecar started, in seconds since the epoch.",
            registry=self.registry,
        )
        self.start_time.set_to_current_time()
        self.idle_ttl = prometheus_client.Gauge(
            f"{PREFIX}_idle_ttl_seconds", "The idle policy's --idle-ttl (0 when off).", registry=self.registry
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        # The labelled children of the per-call metrics, by label values: ``labels`` takes a lock and
        # builds its key on every call, and every RPC observes two of these. It hands out one child
        # per label values for the registry's life, so a child kept here is the one it would return.
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """One answered call of the MigSidecar service: its latency by method and status code (queued)."""
        self._defer(self._observe_rpc, (method, code, seconds))

    def observe_allocate(self, result: AllocateResult | None, seconds: float) -> None:
        """One Allocate (None: it failed): its devices counted (``count_allocate``) and its latency
        by outcome label (queued)."""
        self._defer(self._observe_allocate, (result, seconds))

    def _defer(self, apply: Callable[..., None], args: tuple[Any, ...]) -> None:
        due = self._due
        due.append((apply, args))
        if len(due) >= DUE_LIMIT:
            self.flush()

    def flush(self) -> None:
        """Apply every queued observation. Under one lock, so a read that comes while another
        applies the queue waits for it to finish."""
        with self._flush_lock:
            due = self._due
            while due:
                apply, args = due.popleft()
                apply(*args)

    def _child(self, metric: _Labelled, *values: str) -> _Labelled:
        """``metric.labels(*values)``, kept (the note on ``_children``)."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def _observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self._child(self.rpc_latency, method, code).observe(seconds)

    def _observe_allocate(self, result: AllocateResult | None, seconds: float) -> None:
        outcome = "failed" if result is None else self.count_allocate(result)
        self._child(self.allocate_latency, outcome).observe(seconds)

    def watch(
        self,
        instances: Callable[[], Sequence[OwnershipRecord]],
        pending_cdi_removals: Callable[[], Sequence[str]],
        clock: Callable[[], float] = time.time,
        *,
        recovered: Callable[[], bool] = lambda: False,
        liveness: Liveness | None = None,
    ) -> None:
        """Expose instances by GPU and state, idle ones and their age, the reconciler backlog, the
        queued CDI removals, whether a Recover succeeded and how long the oldest running NVML call and
        reconciler round have run, computed at every scrape."""
        self.registry.register(_StateCollector(instances, pending_cdi_removals, clock))
        self.registry.register(_HealthCollector(recovered, liveness))

    def count_allocate(self, result: AllocateResult) -> str:
        """Count an Allocate's devices, reuse hits and reclaims (in all and by GPU); returns its outcome
        label."""
        for device in result.devices:
            if device.outcome is Outcome.REUSED:
                self.reuse_hits.inc()
            if device.outcome is not Outcome.ALREADY_ALLOCATED:
                gpu, outcome = device.reservation.gpu_uuid, device.outcome.value.lower()
                self._child(self.allocations, gpu, outcome).inc()
        for ref in result.reclaimed:
            self.reclaims.inc()
            self._child(self.gpu_reclaims, ref.reservation.gpu_uuid).inc()
        outcomes = {device.outcome for device in result.devices}
        if result.reclaimed:
            return "reclaimed"
        if Outcome.CREATED in outcomes:
            return "created"
        if outcomes == {Outcome.ALREADY_ALLOCATED}:
            return "already_allocated"
        return "reused"

    # The meter of ``sidecar.nvml.metered.MeteredPort`` (``NvmlMeter``): what the hardware port counts.
    def nvml_failed(self, operation: str, code: str) -> None:
        self.nvml_errors.labels(operation, code).inc()

    def gi_created(self) -> None:
        self.creations.inc()

    def gi_destroyed(self) -> None:
        self.destructions.inc()

    def count_xid(self, report: FaultReport) -> None:
        """Count one Xid event and the instances it faulted."""
        xid = str(report.xid)
        self.xid_events.labels(report.gpu_uuid, xid, "true" if report.counted else "false").inc()
        if report.faulted:
            self.faulted_instances.labels(report.gpu_uuid, xid).inc(len(report.faulted))

    def serve(self, host: str, port: int) -> None:
        """Start the HTTP endpoint (``/metrics``) on a daemon thread."""
        self._server, self._thread = prometheus_client.start_http_server(
            port, addr=host, registry=self.registry
        )

    @property
    def bound_port(self) -> int | None:
        return None if self._server is None else int(self._server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class _StateCollector:
    def __init__(
        self,
        instances: Callable[[], Sequence[OwnershipRecord]],
        pending_cdi_removals: Callable[[], Sequence[str]],
        clock: Callable[[], float],
    ) -> None:
        self._instances = instances
        self._pending = pending_cdi_removals
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        return [*self._families({}, 0), *self._idle({}, {})]

    def collect(self) -> Iterable[Metric]:
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        idle: collections.Counter[str] = collections.Counter()
        oldest: dict[str, float] = {}
        errors = 0
        now = self._clock()
        for record in self._instances():
            counts[(record.gpu_uuid, record.state.value)] += 1
            errors += record.state is State.ERROR
            if record.state is State.IDLE:
                idle[record.gpu_uuid] += 1
                used = last_used(record)
                age = 0.0 if math.isinf(used) else max(now - used, 0.0)
                oldest[record.gpu_uuid] = max(oldest.get(record.gpu_uuid, 0.0), age)
        removals = len(self._pending())
        return [*self._families(counts, errors + removals, removals), *self._idle(idle, oldest)]

    @staticmethod
    def _idle(idle: dict[str, int], oldest: dict[str, float]) -> list[Metric]:
        count = GaugeMetricFamily(
            f"{PREFIX}_idle_instances", "IDLE owned instances per GPU (the idle cache).", labels=["gpu"]
        )
        age = GaugeMetricFamily(
            f"{PREFIX}_idle_oldest_age_seconds",
            "Seconds since the least recently used IDLE instance of the GPU went IDLE.",
            labels=["gpu"],
        )
        for gpu in sorted(idle):
            count.add_metric([gpu], idle[gpu])
            age.add_metric([gpu], oldest[gpu])
        return [count, age]

    @staticmethod
    def _families(counts: dict[tuple[str, str], int], backlog: int, removals: int = 0) -> list[Metric]:
        instances = GaugeMetricFamily(
            f"{PREFIX}_instances", "Owned MIG instances by GPU and lifecycle state.", labels=["gpu", "state"]
        )
        for (gpu, state), count in sorted(counts.items()):
            instances.add_metric([gpu, state], count)
        pending = GaugeMetricFamily(
            f"{PREFIX}_reconciler_backlog",
            "Work waiting for the reconciler: ERROR instances plus queued CDI spec removals.",
            value=backlog,
        )
        removals_family = GaugeMetricFamily(
            f"{PREFIX}_pending_cdi_removals",
            "CDI spec files queued for removal (their instance is gone; the reconciler retries).",
            value=removals,
        )
        return [instances, pending, removals_family]


class _HealthCollector:
    def __init__(self, recovered: Callable[[], bool], liveness: Liveness | None) -> None:
        self._recovered = recovered
        self._liveness = liveness

    def describe(self) -> Iterable[Metric]:
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        recovered = GaugeMetricFamily(
            f"{PREFIX}_recovered",
            "1 once a Recover has succeeded (Allocate is refused before).",
            value=1 if self._recovered() else 0,
        )
        busy = GaugeMetricFamily(
            f"{PREFIX}_busy_seconds",
            "Seconds the oldest running NVML call (part=nvml) or reconciler round (part=reconciler) has "
            "worked, waits for GPU locks left out, and the longest a wait for a GPU lock has gone with "
            "nothing moving along its chain of holders (part=lock-wait); 0 when none. Past "
            "--stuck-threshold the health service answers NOT_SERVING.",
            labels=["part"],
        )
        ages = self._liveness.oldest() if self._liveness is not None else {}
        for part in ("nvml", "reconciler"):
            busy.add_metric([part], ages.get(part, 0.0))
        busy.add_metric([LOCK_WAIT], self._liveness.quiet_wait() if self._liveness is not None else 0.0)
        return [recovered, busy]
