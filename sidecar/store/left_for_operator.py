"""Record files left for the operator, and the rule that they keep their placement busy.

A corrupt record file, or one without a boot id (made or edited by hand), is never overwritten or
deleted automatically; its name still says which placement it was written for, so no create may
go there until the operator has dealt with the file (``docs/architecture.md``, "The state directory").
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from sidecar.model.errors import PlacementBusy
from sidecar.model.ownership import parse_record_name
from sidecar.nvml.port import Placement
from sidecar.store.table import RecordTable


class LeftForTheOperator(msgspec.Struct, frozen=True):
    """A record file left for the operator, at the placement its name was written for."""

    placement: Placement
    path: Path
    why: str
    blocker: str  # ``corrupt_record`` or ``record_without_boot_id``


def records_for_the_operator(table: RecordTable, gpu_uuid: str) -> list[LeftForTheOperator]:
    """The record files on the GPU that a create must not go over: a corrupt one, or one without a
    boot id. From the table's copy of what is on disk outside it, so no directory is scanned."""
    valid, corrupt = table.left_aside()
    left: list[tuple[str, Path, str, str]] = [
        (name, exc.path, exc.why, "corrupt_record") for name, exc in corrupt.items()
    ]
    left += [
        (name, table.records.path(name), "it carries no boot id", "record_without_boot_id")
        for name, r in valid.items()
        if not r.boot_id
    ]
    found: list[LeftForTheOperator] = []
    for name, path, why, blocker in sorted(left):
        where = parse_record_name(name)
        if where is not None and where[0] == gpu_uuid:
            found.append(LeftForTheOperator(where[1], path, why, blocker))
    return found


def require_no_record_for_the_operator(table: RecordTable, gpu_uuid: str, wanted: Placement) -> None:
    """PlacementBusy when a record file left for the operator names a placement on the GPU that
    overlaps ``wanted``.

    A create at its placement could not write its own record, or would silently replace the
    operator's, a problem no retry clears; and the instance the file stood for may still be live.
    Recoverer keeps the GIs there foreign for the same reason, and nothing is reclaimed for a request
    that must fail anyway."""
    for left in records_for_the_operator(table, gpu_uuid):
        if not left.placement.overlaps(wanted):
            continue
        raise PlacementBusy(
            f"placement {wanted} on {gpu_uuid} overlaps {left.placement}, named by the ownership record"
            f" {left.path} ({left.why}); it is left for the operator to inspect and remove",
            {
                "blocker": left.blocker,
                "file": str(left.path),
                "gpu_uuid": gpu_uuid,
                "placement": str(left.placement),
            },
        )
