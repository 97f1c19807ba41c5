"""``port.XidEvents`` over pynvml: NVML's event API for critical Xids, beside the port's adapter.

Kept out of ``PynvmlBackend`` because nothing on a request's path uses it: one thread
(``sidecar.lifecycle.xid_watch``) creates an event set, registers the GPUs and waits. Over the
simulator the same calls reach its C ABI (``sim.events``), which ``sim xid`` feeds. A wait is never
retried: TIMEOUT is its normal answer when nothing happened. NVML puts 0xFFFFFFFF in the event's GI
and CI IDs when it is about the whole GPU; the event's ``device`` is the parent GPU.
"""

from __future__ import annotations

from typing import Any

import pynvml

from sidecar.nvml.calls import mapped
from sidecar.nvml.port import NVML_ERROR_TIMEOUT, XID_ALL_INSTANCES, NvmlError, XidEvent


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlXidEvents:
    """Critical Xid events through pynvml (NVML must be initialised: the backend's lifetime)."""

    def watch_xids(self, gpu_uuids: list[str]) -> object:
        with mapped("create an event set"):
            event_set = pynvml.nvmlEventSetCreate()
        try:
            for uuid in gpu_uuids:
                with mapped(f"register critical Xid events of {uuid}"):
                    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
        except BaseException:
            self.stop_watching(event_set)
            raise
        return event_set

    def wait_xid(self, watch: object, timeout_ms: int) -> XidEvent | None:
        try:
            with mapped("wait for an Xid event"):
                data = pynvml.nvmlEventSetWait_v2(watch, timeout_ms)
        except NvmlError as exc:
            if exc.code == NVML_ERROR_TIMEOUT:
                return None
            raise
        if not int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
            return None
        with mapped("read the UUID of an Xid event's GPU"):
            uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return XidEvent(
            gpu_uuid=uuid,
            xid=int(data.eventData),
            gpu_instance_id=None if gi == XID_ALL_INSTANCES else gi,
            compute_instance_id=None if XID_ALL_INSTANCES in {gi, ci} else ci,
        )

    def stop_watching(self, watch: object) -> None:
        with mapped("free an event set"):
            pynvml.nvmlEventSetFree(watch)
