"""Startup recovery (architecture section 6): gather -> plan (pure) -> apply.

STUB — the interface below is fixed (server and the composition root are written against it); the
bodies are filled in by the recovery work.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from sidecar.cdi import CdiSpecs
from sidecar.domain import ActiveAllocation, InstanceRef
from sidecar.lifecycle import Lifecycle
from sidecar.nvml.port import NvmlPort
from sidecar.records import RecordStore


class RecoveryReport(msgspec.Struct, frozen=True):
    """Mirrors RecoverResponse."""

    adopted_active: tuple[InstanceRef, ...] = ()
    restored_idle: tuple[InstanceRef, ...] = ()
    preserved_foreign: tuple[InstanceRef, ...] = ()
    adopted_foreign: tuple[InstanceRef, ...] = ()
    removed_orphan_gis: tuple[InstanceRef, ...] = ()
    dropped_stale_records: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


class Recovery:
    def __init__(
        self,
        lifecycle: Lifecycle,
        port: NvmlPort,
        records: RecordStore,
        cdi: CdiSpecs,
        boot_id: str,
        adopt_existing: bool,
    ) -> None:
        self.lifecycle = lifecycle
        self.port = port
        self.records = records
        self.cdi = cdi
        self.boot_id = boot_id
        self.adopt_existing = adopt_existing

    def recover(self, active: Sequence[ActiveAllocation]) -> RecoveryReport:
        """Idempotent. Raises errors.UnverifiableState / errors.NvmlFailure and then modifies nothing."""
        raise NotImplementedError
