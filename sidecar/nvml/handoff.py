"""The handle of a GPU instance the adapter just used, handed to the one call on its GPU that follows.

A GI create is followed by the CI create in it, and a CI destroy by the destroy of its GI; each of
those would otherwise look the GI up by ID again (one NVML call). The handle is kept for exactly
the next mutating call on the same GPU: that call takes whatever is kept for its GPU, and uses it
only if it names the GI it works on. So a handle never outlives what the adapter did next on the
GPU (an error that stopped the follower, any other create or destroy there, a mode change), and a
stale one can reach the driver only if the GI changed outside the sidecar between two calls of one
teardown; the GI destroy falls back to a lookup by ID when the driver answers that a handle names
no GI.
"""

from __future__ import annotations

import threading
from typing import Any


class KeptGiHandles:
    """At most one kept GI handle per GPU. Thread-safe; mutating calls on one GPU are serialised by
    the lifecycle's GPU lock, so the next call on a GPU is well defined."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[str, tuple[int, Any]] = {}

    def keep(self, gpu_uuid: str, gpu_instance_id: int, handle: Any) -> None:
        """Hand ``handle`` (of GI ``gpu_instance_id``) to the next mutating call on ``gpu_uuid``."""
        with self._lock:
            self._kept[gpu_uuid] = (gpu_instance_id, handle)

    def take(self, gpu_uuid: str, gpu_instance_id: int) -> Any | None:
        """The handle kept for GI ``gpu_instance_id`` on ``gpu_uuid``, or None. Whatever was kept for
        the GPU is gone afterwards, handle of another GI included: every mutating call takes."""
        with self._lock:
            kept = self._kept.pop(gpu_uuid, None)
        if kept is None or kept[0] != gpu_instance_id:
            return None
        return kept[1]

    def drop(self, gpu_uuid: str) -> None:
        """Forget what was kept for ``gpu_uuid``: a mutating call that uses no kept handle."""
        with self._lock:
            self._kept.pop(gpu_uuid, None)
