"""The simulated event API: ``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``,
``nvmlEventSetWait_v2`` and ``nvmlEventSetFree``, for critical Xid events.

An event set lives in the process that created it, as on a real driver: its registrations (GPU
indices) and its cursor (the serial of the last Xid it delivered) are kept here, not in the shared
state. The Xids themselves are in the shared state (``SimState.xids``, raised by ``sim xid`` from
another process), so a sidecar's wait sees an operator's Xid at its next poll. A set delivers only
Xids raised after it was created, each once, oldest first; a wait with none answers TIMEOUT after
its timeout, as NVML does. The wait polls the state outside the store's lock (``wait``), so a
waiting thread never holds up another caller.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Any

import pynvml

from sidecar.nvml.port import NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_TIMEOUT, NVML_SUCCESS
from sidecar.nvml.sim.cabi import KIND_GPU, as_int, gpu_of, handle, handle_value, query, set_pointer, target
from sidecar.nvml.sim.state import XID_ALL, XIDS_KEPT, SimError, SimXid, StateView

if TYPE_CHECKING:
    from sidecar.nvml.sim.store import StateStore

KIND_EVENT_SET = 5
WAIT_SYMBOL = "nvmlEventSetWait_v2"
POLL_S = 0.02


class _EventSet:
    __slots__ = ("cursor", "gpus")

    def __init__(self, cursor: int) -> None:
        self.cursor = cursor  # the serial of the newest Xid this set has delivered or skipped
        self.gpus: set[int] = set()  # GPU indices registered for critical Xid events


_sets: dict[int, _EventSet] = {}
_sets_lock = threading.Lock()
_serials = itertools.count(1)


def _event_set(h: Any) -> _EventSet:
    value = handle_value(h)
    with _sets_lock:
        found = _sets.get(value) if value >> 60 == KIND_EVENT_SET else None
    if found is None:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, "unknown event set")
    return found


@query("nvmlEventSetCreate")
def _create(state: StateView, out: Any) -> int:
    value = handle(KIND_EVENT_SET, 0, next(_serials))
    with _sets_lock:
        _sets[value] = _EventSet(cursor=state.next_xid_serial - 1)
    set_pointer(target(out), value)
    return NVML_SUCCESS


@query("nvmlDeviceRegisterEvents")
def _register(state: StateView, device: Any, event_types: Any, event_set: Any) -> int:
    gpu = gpu_of(state, device)
    found = _event_set(event_set)
    if as_int(event_types) & pynvml.nvmlEventTypeXidCriticalError:
        found.gpus.add(gpu.index)
    return NVML_SUCCESS


@query("nvmlEventSetFree")
def _free(state: StateView, event_set: Any) -> int:
    value = handle_value(event_set)
    with _sets_lock:
        if _sets.pop(value, None) is None:
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, "unknown event set")
    return NVML_SUCCESS


def _next(view: StateView, found: _EventSet) -> SimXid | None:
    """The oldest Xid after the set's cursor on a registered GPU; moves the cursor past it."""
    for xid in view.xids:
        if xid.serial <= found.cursor:
            continue
        found.cursor = xid.serial
        if xid.gpu in found.gpus:
            return xid
    return None


def raise_xid(
    store: StateStore, gpu_index: int, xid: int, gi: int | None = None, ci: int | None = None
) -> int:
    """An Xid on a GPU (``gi``/``ci`` None: the whole GPU), for every event set registered for
    critical Xids on it; what ``sim xid`` does. Returns its serial."""
    if not 0 <= xid < 2**64 or (ci is not None and gi is None):
        raise ValueError("an Xid is a code in 0..2^64-1 (NVML's event data), and --ci needs --gi")
    with store.transaction() as state:
        if not 0 <= gpu_index < len(state.gpus):
            raise ValueError(f"no GPU at index {gpu_index}")
        serial = state.next_xid_serial
        state.next_xid_serial += 1
        state.xids.append(
            SimXid(serial, gpu_index, xid, XID_ALL if gi is None else gi, XID_ALL if ci is None else ci)
        )
        del state.xids[:-XIDS_KEPT]
    return serial


def wait(store: StateStore, event_set: Any, data: Any, timeout_ms: Any) -> int:
    """``nvmlEventSetWait_v2`` on ``store``'s state: counted once, polled outside the lock until an Xid
    or the timeout."""
    deadline = time.monotonic() + as_int(timeout_ms) / 1000
    call: str | None = WAIT_SYMBOL
    while True:
        with store.query(call=call) as q:
            call = None  # the polls after the first are the driver's own waiting, not calls
            try:
                found = _event_set(event_set)
            except SimError as exc:
                return exc.code
            xid = _next(q.view, found)
        if xid is not None:
            out = target(data)
            set_pointer(out.device, handle(KIND_GPU, xid.gpu))  # the parent GPU, as NVML reports it
            out.eventType = pynvml.nvmlEventTypeXidCriticalError
            out.eventData = xid.xid
            out.gpuInstanceId = xid.gi
            out.computeInstanceId = xid.ci
            return NVML_SUCCESS
        left = deadline - time.monotonic()
        if left <= 0:
            return NVML_ERROR_TIMEOUT
        time.sleep(min(left, POLL_S))
