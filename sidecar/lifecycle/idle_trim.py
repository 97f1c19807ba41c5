"""The idle policy applied: the reconciler's background trim of IDLE instances.

``idle_policy.trim`` decides over plain values; this module gathers them (``gpu_views.gpu_view``) and
applies the answer through the recorded teardown (IDLE -> DELETING -> CI and GI destroyed -> CDI spec
removed -> record deleted), so a crash anywhere in a trim leaves what recovery finishes like any
reclaim. One instance at a time, each under its GPU lock, and the decision is taken again under that
lock just before the destroy, over the other GPUs' views as last listed (listing one would take its
lock inside this one, out of ``locks``' order): an Allocate that reused the instance, a pending
reservation that came meanwhile, or a process found running on it (one NVML call per victim) each
spare it. ACTIVE, ERROR,
CREATING/DELETING and foreign instances are never candidates (``idle_policy.trimmable``), so the lock
is held for one destroy at most and an Allocate on that GPU waits for that one only.

With a free reserve the decision needs every MIG-enabled GPU and its foreign GIs. The reconciler runs
a round after every Allocate and Release, so those are listed at most every ``relist_s`` seconds, not
on every round: a round that trims nothing then costs no NVML call and takes no GPU lock. The GPU of a
chosen victim is listed again under its lock before the destroy, so no trim acts on a stale foreign view.

With ``--idle-reserve auto`` the profiles of the reserve are read at the start of each round from
``LifecycleContext.last_asked`` (GI profile -> when a validated Allocate last asked for it, refusals
included, so a request refused PLACEMENT_BUSY makes room for its retry; the server wakes the
reconciler after a refused Allocate as after an answered one). Listing every profile the scheduler
allows instead keeps placements free for profiles nobody asks for: on the trace benchmark's mix, a
reserve of all seven H100 profiles makes GI creations 17.4 % of pods where the mix's three make
11.5 % (``bench/policy_replay.py``). ``last_asked`` is memory only: after a restart nothing is
reserved until requests come, which costs at most the inline reclaims the reserve would have moved.

The ``in_the_way`` cause (``idle_policy.Choices``) learns from every Allocate: ``Allocator.observe``
hands it the device's GPU, profile and placement with the table as it was just before, over the
GPUs whose profiles the inventory has read (no NVML call, no lock beyond the Allocate's own); a
trim for that cause is reported back (``Choices.cleared``), so an Allocate that lands where one was
destroyed still counts as landing on an IDLE instance. Like ``last_asked`` it is memory only.

The placements a client keeps free (``KeepFree``, cause ``next``) are trimmed for whatever the
settings say, the reserve off included: the client asked, naming the placement its scheduler takes
next. The GPUs that client names as its scheduler's are its own: the reserve and ``in_the_way``,
guesses of what a scheduler takes next, leave them alone (the client lists their IDLE instances to
its scheduler as warm, and a request steered onto one being destroyed waits, then creates); the TTL
and the per-GPU cap, the operator's limits, still apply. ``set_keep_free`` validates them as an
Allocate's (a known GPU, a profile it has, a legal placement) and stamps them with the clock; like
``last_asked`` they are memory only, and the client names them again after a restart (it sees the
sidecar's new incarnation).

``clock`` is injected (seconds since the epoch, the scale of the records' ``since`` stamps), so tests
move time instead of sleeping.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import msgspec

from sidecar.lifecycle import crashpoints, gpu_views
from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.teardown import destroy
from sidecar.lifecycle.validate import require_legal
from sidecar.model.advice import GpuView
from sidecar.model.domain import InstanceRef, Reservation, State
from sidecar.model.errors import SidecarError, nvml_errors
from sidecar.model.idle_policy import (
    Cause,
    IdleSettings,
    KeepFree,
    Trim,
    in_the_way,
    keep_free,
    node_reserve,
    trim,
)
from sidecar.model.ownership import record_name
from sidecar.nvml.port import NvmlError

_log = logging.getLogger(__name__)


def set_keep_free(
    ctx: LifecycleContext,
    placements: Sequence[Reservation],
    gpus: Sequence[str] = (),
    *,
    clock: Callable[[], float] = time.time,
) -> None:
    """Replace the placements the trim keeps free and the GPUs the client allocates (``KeepFree``):
    NotRecovered before recovery, UnknownGpu, UnknownProfile and IllegalPlacement as for an
    Allocate, and then nothing changes."""
    ctx.require_recovered()
    for want in placements:
        require_legal(ctx.inventory.resolve_profile(want.gpu_uuid, want.profile), want)
    for gpu in gpus:
        ctx.inventory.gpu_info(gpu)
    ctx.keep_free = KeepFree(tuple(placements), clock(), frozenset(gpus))


class Trimmed(msgspec.Struct, frozen=True):
    ref: InstanceRef
    cause: str


class IdleTrimmer:
    """One pass of the idle policy over every GPU with owned instances."""

    def __init__(
        self,
        ctx: LifecycleContext,
        settings: IdleSettings,
        *,
        clock: Callable[[], float] = time.time,
        on_trim: Callable[[str], None] = lambda cause: None,
        relist_s: float = 10.0,
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.clock = clock
        self.on_trim = on_trim
        self.relist_s = relist_s
        self._listed: tuple[float, list[str]] | None = None  # (when, the MIG-enabled GPUs then)
        self._round_at: float | None = None  # when the last round began
        self._reserved: tuple[str, ...] = ()  # the profiles the reserve keeps ready this round

    def seconds_until_due(self) -> float | None:
        """Seconds until an IDLE instance passes its TTL that the last round did not see past it (0
        when that moment has come already); None with no TTL or none to come.

        The reconciler sleeps no longer than this, so an instance is trimmed when its TTL ends and
        not up to a whole interval later, even when the round right after its release came within
        the TTL. One the last round saw past its TTL was spared for a reason of its own (a process,
        a reservation) and waits for the interval, so this never asks for the same answer again."""
        ttl_s = self.settings.ttl_s
        if ttl_s is None or not self.settings.enabled or not self.ctx.recovered:
            return None
        seen = self._round_at if self._round_at is not None else -math.inf
        dues = [
            due
            for r in self.ctx.table.instances()
            if r.state is State.IDLE and (due := gpu_views.last_used(r) + ttl_s) > seen
        ]
        return max(0.0, min(dues) - self.clock()) if dues else None

    def run_once(self) -> list[Trimmed]:
        """Trim what the policy chooses now, one instance at a time (logged and skipped on failure)."""
        if not (self.settings.enabled or self.ctx.keep_free.next) or not self.ctx.recovered:
            return []
        self._round_at = self.clock()  # every decision of this round reads the clock at or after it
        # A copy (one C call, under the GIL): an Allocate may add a profile while this reads.
        self._reserved = self.settings.reserved(dict(self.ctx.last_asked), self._round_at)
        gpus = self._gpus()
        busy: set[str] = set()
        out: list[Trimmed] = []
        # Every round destroys one instance, or marks one busy, or finds the choice changed under the
        # lock; the bound only guards against a choice that keeps changing.
        for _ in range(2 * len(self.ctx.table.instances()) + 2):
            first = self._decide(gpus, busy)
            if not first:
                break
            try:
                done = self._apply(first[0], gpus, busy)
            except SidecarError as exc:
                _log.warning("idle trim of %s failed: %s", first[0].instance.describe(), exc)
                break
            if done is not None:
                self.on_trim(done.cause)
                out.append(done)
        return out

    def _gpus(self) -> list[str]:
        """The GPUs to look at: with a reserve every MIG-enabled one (an empty GPU is where a profile
        is ready), its foreign view listed afresh; otherwise those with owned instances."""
        if not self._reserved:
            return sorted({r.gpu_uuid for r in self.ctx.table.instances()})
        now = self.clock()
        if self._listed is not None and 0 <= now - self._listed[0] < self.relist_s:
            return self._listed[1]
        out: list[str] = []
        try:
            with nvml_errors("list GPUs"):
                gpus = self.ctx.port.gpus()
        except SidecarError as exc:
            _log.warning("idle trim skipped: %s", exc)
            return []
        for gpu in sorted(g.uuid for g in gpus if g.mig_current):
            try:
                gpu_views.refresh_foreign(self.ctx, gpu)
            except SidecarError as exc:
                _log.warning("idle trim leaves %s out: %s", gpu, exc)
                continue
            out.append(gpu)
        self._listed = (now, out)
        return out

    def _apply(self, chosen: Trim, gpus: list[str], busy: set[str]) -> Trimmed | None:
        """Destroy the chosen instance if, under its GPU lock, it is still the first choice, still
        IDLE and runs no process. None when it was spared."""
        with self.ctx.locks.gpu(chosen.gpu_uuid):
            if self._reserved:
                gpu_views.refresh_foreign(self.ctx, chosen.gpu_uuid)  # a foreign GI may have come since
            try:  # the other GPUs' views as listed: their locks sort anywhere around this one's
                again = self._decide(gpus, busy, list_missing=False)
            except gpu_views.NotListedError:  # a view forgotten since (Recover, a mode change): decide again
                return None
            if not again or again[0] != chosen:
                return None
            record = self.ctx.table.get(record_name(chosen.gpu_uuid, chosen.instance.placement))
            if record is None or record.state is not State.IDLE:  # decided under this lock: never
                return None
            if self._runs_processes(record.mig_uuid):
                busy.add(record.mig_uuid or "")
                return None
            crashpoints.crashpoint("before-idle-trim")
            _log.info("trimming idle instance %s (%s)", record.name, chosen.cause)
            ref = destroy(self.ctx, record, mark_deleting=True)
            if chosen.cause is Cause.IN_THE_WAY:  # under the lock an Allocate on this GPU observes under
                self.ctx.choices.cleared(chosen.gpu_uuid, chosen.instance.placement)
        return Trimmed(ref, str(chosen.cause))

    def _decide(self, gpus: list[str], busy: set[str], *, list_missing: bool = True) -> list[Trim]:
        """What the policy trims now over ``gpus``: what is over the placements the client keeps free
        (``keep_free``) first, then per GPU (ttl, cap, a per-GPU reserve), then what is in a blind
        scheduler's way (``in_the_way``), then the node's reserve.

        Under a GPU lock ``list_missing`` is False: a GPU never listed raises ``NotListedError`` instead
        of taking its lock, which may sort before the one held (the deadlock this once was)."""
        s = self.settings
        views: list[GpuView] = [
            gpu_views.gpu_view(self.ctx, g, busy=busy, list_missing=list_missing) for g in gpus
        ]
        pending = gpu_views.pending_reservations(self.ctx)
        if nxt := keep_free(views, self.ctx.keep_free, pending=pending):
            return nxt
        # The GPUs a KeepFree client allocates are its own: the reserve and in_the_way guess what a
        # scheduler takes next, and would destroy IDLE instances that client's scheduler is about to
        # be given (its slices list them warm).
        client = self.ctx.keep_free.gpus
        reserve = {}
        if wanted := self._reserved:
            reserve = {
                g: {p.name: p.placements for p in self.ctx.inventory.profiles(g) if p.name in wanted}
                for g in gpus
                if g not in client
            }
        per_gpu = trim(
            views,
            self.clock(),
            ttl_s=s.ttl_s,
            max_idle_per_gpu=s.max_idle_per_gpu,
            reserve=reserve if s.reserve_per_gpu else None,
            pending=pending,
        )
        if per_gpu or not reserve or s.reserve_per_gpu:
            return per_gpu
        guessed = [v for v in views if v.gpu_uuid not in client]
        return in_the_way(guessed, self.ctx.choices, reserve, pending=pending) or node_reserve(
            guessed, reserve, pending=pending
        )

    def _runs_processes(self, mig_uuid: str | None) -> bool:
        """A process on the instance (a pod in its grace period) spares it; an NVML error too."""
        if mig_uuid is None:
            return False
        try:
            with nvml_errors(f"count processes on {mig_uuid}"):
                return self.ctx.port.mig_device_processes(mig_uuid) > 0
        except (SidecarError, NvmlError) as exc:
            _log.warning("cannot count processes on %s, not trimming it: %s", mig_uuid, exc)
            return True
