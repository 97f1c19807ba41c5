"""What a critical Xid does to the instances it names: none of them is ever handed out again.

A cache of released instances adds a risk destroy-on-release does not have: a warm instance whose GI
saw a hardware fault handed to the next pod. An event names one GI (and CI) of a GPU, or the whole
GPU (0xFFFFFFFF). Under the GPU's lock every owned
instance it names is marked on its record (``xid``, durable like every record write):

* ACTIVE: stays ACTIVE (its pod still runs there); its release destroys it instead of keeping it
  IDLE (``release.release_faulted``, for Release and SyncActive alike), and recovery keeps the mark
  with the very instance (same MIG UUID) an active allocation names, and turns a faulted one no pod
  holds into ERROR instead of restoring it IDLE;
* IDLE: goes ERROR, never reused; the reconciler destroys it once no pod references it, its CDI
  spec after the hardware, as for any ERROR;
* CREATING, DELETING, ERROR: left as they are (a destroy is on its way or the state is never reused).

A foreign GI the event names is reported (``FaultReport.foreign``, and in the log), never touched. An
Xid in the ignored set (``--xid-ignore``; by default ``port.XID_APPLICATION_ERRORS``, the NVIDIA device
plugin's application errors 13, 31, 43, 45, 68, 109) changes nothing.
"""

from __future__ import annotations

import logging

import msgspec

from sidecar.lifecycle import gpu_views
from sidecar.lifecycle.context import LifecycleContext
from sidecar.model.domain import InstanceRef, State
from sidecar.model.errors import SidecarError
from sidecar.model.ownership import OwnershipRecord, instance_ref
from sidecar.model.states import now_rfc3339, transition
from sidecar.nvml.port import XidEvent

_log = logging.getLogger(__name__)


class FaultReport(msgspec.Struct, frozen=True):
    """What one event did: the owned instances it faulted now, and the foreign GIs it named."""

    xid: int
    gpu_uuid: str
    counted: bool  # False: an ignored Xid, nothing changed
    faulted: tuple[InstanceRef, ...] = ()
    foreign: tuple[int, ...] = ()  # GI IDs
    changed: tuple[OwnershipRecord, ...] = ()  # the faulted instances' records as now written


def names(event: XidEvent, record: OwnershipRecord) -> bool:
    """Whether the event names the instance: its GPU, and its GI (and CI) unless it names them all."""
    if record.gpu_uuid != event.gpu_uuid:
        return False
    if event.gpu_instance_id is None:
        return True
    if record.gpu_instance_id != event.gpu_instance_id:
        return False
    return event.compute_instance_id is None or record.compute_instance_id in (
        None,
        event.compute_instance_id,
    )


def faulted(record: OwnershipRecord, xid: int) -> OwnershipRecord | None:
    """The record an Xid leaves (None: unchanged). The first Xid stays the one recorded."""
    stamp = record.xid or xid
    if record.state is State.ACTIVE:
        return None if record.xid else msgspec.structs.replace(record, xid=stamp)
    if record.state is State.IDLE:
        return transition(
            record,
            State.ERROR,
            since=now_rfc3339(),
            last_error=f"Xid {stamp} on its GPU instance: never reused, destroyed by the reconciler",
            xid=stamp,
        )
    return None


def apply_xid(ctx: LifecycleContext, event: XidEvent, ignored: frozenset[int]) -> FaultReport:
    """Mark what the event names (module docstring); before recovery, only the report."""
    if event.xid in ignored:
        return FaultReport(event.xid, event.gpu_uuid, counted=False)
    out: list[InstanceRef] = []
    written: list[OwnershipRecord] = []
    with ctx.locks.gpu(event.gpu_uuid):
        for record in ctx.table.on_gpu(event.gpu_uuid):
            if not names(event, record):
                continue
            changed = faulted(record, event.xid)
            if changed is None:
                continue
            try:
                ctx.table.put(changed)
            except SidecarError as exc:
                _log.error("cannot record Xid %d on %s: %s", event.xid, record.name, exc)
                if changed.state is State.ERROR:  # kept in memory: this process never reuses it
                    ctx.table.fail(record, changed.last_error)
                continue
            out.append(instance_ref(changed))
            written.append(changed)
        try:
            seen = gpu_views.foreign(ctx, event.gpu_uuid)
        except SidecarError as exc:
            _log.warning("foreign instances of %s not listed for Xid %d: %s", event.gpu_uuid, event.xid, exc)
            seen = ()
        foreign = tuple(
            gi.gpu_instance_id
            for gi in seen
            if event.gpu_instance_id is None or gi.gpu_instance_id == event.gpu_instance_id
        )
    return FaultReport(
        event.xid, event.gpu_uuid, counted=True, faulted=tuple(out), foreign=foreign, changed=tuple(written)
    )
