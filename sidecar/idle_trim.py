"""The idle policy applied: the reconciler's background trim of IDLE instances (issue: idle policy).

``idle_policy.trim`` decides over plain values; this module gathers them (``views.gpu_view``) and
applies the answer through the recorded teardown (IDLE -> DELETING -> CI and GI destroyed -> CDI spec
removed -> record deleted), so a crash anywhere in a trim leaves what recovery finishes like any
reclaim. One instance at a time, each under its GPU lock, and the decision is taken again under that
lock just before the destroy: an Allocate that reused the instance, a pending reservation that came
meanwhile, or a process found running on it (one NVML call per victim) each spare it. ACTIVE, ERROR,
CREATING/DELETING and foreign instances are never candidates (``idle_policy.trimmable``), so the lock
is held for one destroy at most and an Allocate on that GPU waits for that one only.

``clock`` is injected (seconds since the epoch, the scale of the records' ``since`` stamps), so tests
move time instead of sleeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from sidecar import crashpoints, views
from sidecar.advice import GpuView
from sidecar.context import Context
from sidecar.domain import InstanceRef, State
from sidecar.errors import SidecarError, nvml_errors
from sidecar.idle_policy import IdleSettings, Trim, trim
from sidecar.nvml.port import NvmlError
from sidecar.ownership import record_name
from sidecar.teardown import destroy

_log = logging.getLogger(__name__)


class Trimmed(msgspec.Struct, frozen=True):
    ref: InstanceRef
    cause: str


class IdleTrimmer:
    """One pass of the idle policy over every GPU with owned instances."""

    def __init__(
        self,
        ctx: Context,
        settings: IdleSettings,
        *,
        clock: Callable[[], float] = time.time,
        on_trim: Callable[[str], None] = lambda cause: None,
    ) -> None:
        self.ctx = ctx
        self.settings = settings
        self.clock = clock
        self.on_trim = on_trim

    def run_once(self) -> list[Trimmed]:
        """Trim what the policy chooses now; a GPU whose view or destroy fails is skipped (logged)."""
        if not self.settings.enabled or not self.ctx.recovered:
            return []
        out: list[Trimmed] = []
        for gpu in sorted({r.gpu_uuid for r in self.ctx.table.instances()}):
            try:
                out += self._trim_gpu(gpu)
            except SidecarError as exc:
                _log.warning("idle trim on %s stopped: %s", gpu, exc)
        return out

    def _trim_gpu(self, gpu: str) -> list[Trimmed]:
        if self.settings.reserve:
            views.refresh_foreign(self.ctx, gpu)  # the reserve ranks placements: foreign GIs count
        busy: set[str] = set()
        out: list[Trimmed] = []
        # Each round destroys one instance at most, and an instance found busy is never chosen again,
        # so the loop ends within (IDLE instances + 1) rounds.
        while True:
            with self.ctx.locks.gpu(gpu):
                chosen = self._decide(gpu, busy)
                if chosen is None:
                    return out
                record = self.ctx.table.get(chosen_name(gpu, chosen))
                if record is None or record.state is not State.IDLE:  # decided under this lock: never
                    return out
                if self._runs_processes(record.mig_uuid):
                    busy.add(record.mig_uuid or "")
                    continue
                crashpoints.crashpoint("before-idle-trim")
                _log.info("trimming idle instance %s (%s)", record.name, chosen.cause)
                ref = destroy(self.ctx, record, mark_deleting=True)
            self.on_trim(str(chosen.cause))
            out.append(Trimmed(ref, str(chosen.cause)))

    def _decide(self, gpu: str, busy: set[str]) -> Trim | None:
        """The first instance the policy trims on ``gpu`` now (call with its lock held)."""
        view: GpuView = views.gpu_view(self.ctx, gpu, busy=busy)
        pending = views.pending_reservations(self.ctx)
        s = self.settings
        reserve = {}
        if s.reserve:
            profiles = self.ctx.inventory.profiles(gpu)
            reserve = {gpu: {p.name: p.placements for p in profiles if p.name in s.reserve}}
        chosen = trim(
            [view],
            self.clock(),
            ttl_s=s.ttl_s,
            max_idle_per_gpu=s.max_idle_per_gpu,
            reserve=reserve,
            pending=pending,
        )
        return chosen[0] if chosen else None

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


def chosen_name(gpu: str, chosen: Trim) -> str:
    """The record name of the instance a ``Trim`` names (one record per GPU and placement)."""
    return record_name(gpu, chosen.instance.placement)


__all__ = ["IdleTrimmer", "Trimmed"]
