"""What recovery's plan decides: steps of primitive actions, the table and the report (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from sidecar.model.domain import ActiveAllocation, Identity, InstanceRef
from sidecar.model.ownership import OwnershipRecord


class RecoveryReport(msgspec.Struct, frozen=True):
    """Mirrors RecoverResponse.

    ``Plan.report`` says what the plan would do if every step succeeded; the report ``Recoverer``
    returns says what happened (``settle_report``): an instance is listed as adopted, restored,
    removed or dropped only when that step succeeded. A step that failed is named in ``errors`` (its
    instance is ERROR, or foreign), and an instance a step left foreign is in ``preserved_foreign``."""

    adopted_active: tuple[InstanceRef, ...] = ()
    restored_idle: tuple[InstanceRef, ...] = ()
    preserved_foreign: tuple[InstanceRef, ...] = ()
    adopted_foreign: tuple[InstanceRef, ...] = ()
    removed_orphan_gis: tuple[InstanceRef, ...] = ()
    dropped_stale_records: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


class PutRecord(msgspec.Struct, frozen=True, tag=True):
    record: OwnershipRecord


class DeleteRecord(msgspec.Struct, frozen=True, tag=True):
    name: str


class DestroyOwned(msgspec.Struct, frozen=True, tag=True):
    """Permanently destroy an owned instance through ``teardown.destroy_owned``.

    That helper is the one records-first destroy of the code base: it records DELETING, re-reads the
    live GI/CI and destroys only what still matches the record (a second check against anything that
    changed since gather), removes the CDI file (queued on failure) and deletes the record. ``record``
    carries every ID the planner verified, so a crash half-way leaves a DELETING record that the next
    recovery can finish.

    ``require_idle_gpu`` (orphan removals): the step stops and the GI stays foreign when a process runs
    on the GPU right before the destroy. The orphan rule's "no running process" was read at gather and
    a process may have started since (recovery's GPU locks keep only this sidecar out). An NVML error
    counts as busy, as for ListGpus."""

    record: OwnershipRecord
    require_idle_gpu: bool = False


class EnsureCdi(msgspec.Struct, frozen=True, tag=True):
    """Write the spec of a live owned instance unless an identical one exists.

    It is the last action of the step that records the instance, so it runs only once the record is
    on disk. A spec that cannot be written is reported and does not fail the step: the instance is
    recorded and verified, and a reuse or the next recovery writes the spec again."""

    gpu_minor: int
    identity: Identity


class RemoveCdi(msgspec.Struct, frozen=True, tag=True):
    """Remove the spec file of ``mig_uuid``: the one gather found (``path``), else the derived name."""

    mig_uuid: str
    path: str = ""


class RemoveHamiRecord(msgspec.Struct, frozen=True, tag=True):
    """Remove HAMi's ownership record ``filename`` of ``mig_uuid`` once the sidecar's record
    ``record_name`` of that instance is on disk (re-read first: a step whose record write failed never
    gets here, and one whose record is gone does not remove HAMi's file)."""

    filename: str
    record_name: str
    mig_uuid: str


class RemoveHamiSpec(msgspec.Struct, frozen=True, tag=True):
    """Remove HAMi's CDI spec of ``mig_uuid`` if the file is still HAMi's (re-read first)."""

    mig_uuid: str


Action = PutRecord | DeleteRecord | DestroyOwned | EnsureCdi | RemoveCdi | RemoveHamiRecord | RemoveHamiSpec

# The lists of the report that steps feed: each names what a step did, so it holds an entry only
# once that step has succeeded. ``preserved_foreign`` and ``errors`` are fed by the planner directly
# (and by apply, for steps that fail or leave their instance foreign).
ReportList = Literal[
    "adopted_active", "restored_idle", "adopted_foreign", "removed_orphan_gis", "dropped_stale_records"
]
_REPORT_LISTS: tuple[ReportList, ...] = (
    "adopted_active",
    "restored_idle",
    "adopted_foreign",
    "removed_orphan_gis",
    "dropped_stale_records",
)


class Reported(msgspec.Struct, frozen=True):
    """The entry a step adds to one list of the report (``into``) when every one of its actions succeeded:
    an ``InstanceRef``, or a record name for ``dropped_stale_records``."""

    into: ReportList
    entry: InstanceRef | str


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """Actions about one subject, applied in order; the first failure stops the step.

    ``record_name`` names the table entry the step is about (None for CDI-only steps). On failure,
    ``on_failure`` (when set) is written as an ``ERROR`` record and replaces the table entry: the
    instance is kept and never reused. Without it the entry is dropped from the table (an adoption that
    could not be recorded leaves the instance foreign). A step that finds its instance is not ours to
    destroy after all (``ComputeInstanceNotOurs``, a busy GPU under ``require_idle_gpu``) leaves it
    foreign either way. ``foreign_ref`` is how the report names the instance when the step leaves it
    foreign: it is listed in ``preserved_foreign``. ``reported`` is the entry the step adds to the
    report (adopted, restored, removed or dropped) once all its actions succeeded; a step that fails
    or leaves its instance foreign adds none (``settle_report``). The instance's ``EnsureCdi``, if
    any, is the step's last action."""

    subject: str
    actions: tuple[Action, ...] = ()
    record_name: str | None = None
    on_failure: OwnershipRecord | None = None
    foreign_ref: InstanceRef | None = None
    reported: Reported | None = None


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    steps: tuple[Step, ...]
    table: tuple[OwnershipRecord, ...]  # the owned records once every step succeeded
    report: RecoveryReport
    generation: int
    generation_ceiling: int = 0  # carried from ``Inputs``: apply raises it before any activation
    # MIG UUIDs the active allocations name: the plugin's view of what live pods hold, which guards
    # ERROR instances from the reconciler until the first SyncActive brings a fresher view. A repeated
    # Recover leaves out those it refused to the listed pod (the table knows it does not hold them).
    referenced_mig_uuids: frozenset[str] = frozenset()
    # The pending reservations of the pod list (entries without runtime identity), for the lifecycle.
    pending: tuple[ActiveAllocation, ...] = ()

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(action for step in self.steps for action in step.actions)


def settle_report(
    report: RecoveryReport,
    *,
    done: Iterable[Step],
    left_foreign: Iterable[Step] = (),
    failures: Iterable[str] = (),
) -> RecoveryReport:
    """``report`` as it reads once steps have run: it lists only what actually happened.

    The lists steps feed (adopted, restored, removed, dropped) are rebuilt from the ``reported`` entries
    of the ``done`` steps (every action succeeded), in step order: a step that failed into ERROR adds
    nothing there (its failure is in ``failures``), nor does one left foreign, which is listed in
    ``preserved_foreign`` after the planner's foreign instances. Each step carries its own entry, so a
    step that did not happen never takes away the entry of another one that names the same record or
    instance. ``failures`` follow the planner's ``errors``. Pure; ``plan`` uses it with every step done."""
    lists: dict[str, list[InstanceRef | str]] = {name: [] for name in _REPORT_LISTS}
    for step in done:
        if step.reported is not None:
            lists[step.reported.into].append(step.reported.entry)
    foreign = [step.foreign_ref for step in left_foreign if step.foreign_ref is not None]
    return msgspec.structs.replace(
        report,
        **{name: tuple(entries) for name, entries in lists.items()},
        preserved_foreign=(*report.preserved_foreign, *foreign),
        errors=(*report.errors, *failures),
    )
