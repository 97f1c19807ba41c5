"""The one state machine of an owned instance: the legal transitions and the function that takes them.

Every state change of an ``OwnershipRecord`` goes through ``transition`` (an existing record) or
``enter`` (a record that starts existing); both check the edge against ``TRANSITIONS`` and raise
``IllegalTransition`` for any other. The lifecycle's writes (``table``), recovery's planner and
recovery's apply step all build their records here, so no code path can invent an edge. Pure.

Removing a record is not a state change: ``teardown.delete_after_destroy`` says when a record may go.
Updates that keep the state (a GI ID recorded while CREATING) are plain ``msgspec.structs.replace``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from sidecar.model.domain import State
from sidecar.model.ownership import OwnershipRecord

C, A, I, D, E = State.CREATING, State.ACTIVE, State.IDLE, State.DELETING, State.ERROR  # noqa: E741

TRANSITIONS: dict[tuple[State | None, State], str] = {
    (None, C): "Allocate records its intent before creating anything",
    (C, A): "the create finished: GI, CI and CDI spec exist",
    (I, A): "an IDLE instance is reused (Allocate) or reactivated (SyncActive)",
    (A, I): "Release, SyncActive, the rollback of a reuse, or recovery restoring it",
    (I, I): "recovery restores an IDLE instance as it is (fresh CDI name, error cleared)",
    (I, D): "an IDLE instance is reclaimed for another placement",
    (A, D): "the rollback of a failed allocation destroys the instance it created, or a release"
    " destroys a faulted one (an Xid named it)",
    (C, D): "recovery undoes a create a crash interrupted",
    (D, D): "a destroy restarted (recovery finishing a DELETING record) re-stamps it",
    (E, D): "recovery destroys the bare GI of a failed create's ERROR record",
    (C, E): "a create and its undo failed",
    (A, E): "recovery could not record an adoption, or finds a faulted one no pod holds",
    (I, E): "a reused instance failed its live verification, or an Xid faulted it",
    (D, E): "a destroy failed (or the record could not be deleted after it)",
    (E, E): "another attempt at an ERROR instance failed",
}
"""Edges every writer may take, each with the reason it exists."""

RECOVERY_TRANSITIONS: dict[tuple[State | None, State], str] = {
    (None, A): "an active allocation matches a live instance no record describes",
    (None, I): "adopt_existing adopts a foreign instance with one full-size CI",
    (None, D): "adopt_existing removes a foreign GI without a CI",
    (A, A): "an active allocation names an instance recorded ACTIVE (owner kept or replaced)",
    (D, A): "an active allocation names the instance a DELETING record describes",
    (E, A): "an active allocation names an ERROR instance recovery itself failed to record",
}
"""Edges only startup recovery takes: the live hardware matching a pod outranks a record's state."""


class IllegalTransition(Exception):  # noqa: N818 - reads as the fact it reports
    """A state change the state machine does not allow: a bug, never a runtime condition."""


def now_rfc3339() -> str:
    """The ``since`` timestamp of a record: RFC 3339, UTC, microseconds (the one format)."""
    # isoformat of an aware UTC time always ends "+00:00"; it costs half of an equivalent strftime.
    return datetime.now(UTC).isoformat(timespec="microseconds")[:-6] + "Z"


def is_legal(before: State | None, after: State, *, recovery: bool = False) -> bool:
    """Whether ``before -> after`` is an edge (``None``: the record does not exist yet)."""
    edge = (before, after)
    return edge in TRANSITIONS or (recovery and edge in RECOVERY_TRANSITIONS)


def check(before: State | None, after: State, *, recovery: bool = False) -> None:
    """IllegalTransition unless ``before -> after`` is an edge."""
    if not is_legal(before, after, recovery=recovery):
        who = "recovery" if recovery else "the lifecycle"
        raise IllegalTransition(f"{before or 'nothing'} -> {after} is not a transition {who} may take")


def transition(
    record: OwnershipRecord, to: State, *, since: str, recovery: bool = False, **changes: Any
) -> OwnershipRecord:
    """``record`` in state ``to``, stamped ``since``, with ``changes`` applied; checked first."""
    check(record.state, to, recovery=recovery)
    return msgspec.structs.replace(record, state=to, since=since, **changes)


def enter(
    record: OwnershipRecord, *, replacing: OwnershipRecord | None = None, recovery: bool = False
) -> OwnershipRecord:
    """``record``, built whole, checked as the successor of ``replacing`` (None: it is new)."""
    check(replacing.state if replacing is not None else None, record.state, recovery=recovery)
    return record
