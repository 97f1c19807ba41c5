"""Pending reservations, and what guards an owned instance from being destroyed now (pure).

A pending reservation is an ``ActiveAllocation`` without runtime identity: the scheduler reserved
the GPU, profile and placement for a pod, the plugin has not allocated it yet. It guards an IDLE or
ERROR instance at exactly that reservation from placement pressure, from the reconciler's ERROR
retry and from an Allocate's inline ERROR retry, until that key's Allocate comes (the reservation
is then the key's own) or the reservation leaves the plugin's list: ``SyncActive``'s list replaces
the set, ``Recover`` sets it, and a successful ``Allocate`` consumes its keys' entries. The set
lives in memory only: the plugin sends it again with every list.

An ERROR instance whose MIG UUID a live pod holds (``Table.referenced``) is guarded the same way:
destroying a device under a running container is worse than keeping a broken one.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from sidecar.model.domain import ActiveAllocation, AllocationKey, Reservation, State
from sidecar.model.ownership import OwnershipRecord


class PendingReservation(msgspec.Struct, frozen=True):
    key: AllocationKey
    reservation: Reservation


def pending_of(active: Iterable[ActiveAllocation]) -> frozenset[PendingReservation]:
    """The pending reservations of a pod list: the entries without runtime identity."""
    return frozenset(PendingReservation(a.key, a.reservation) for a in active if a.identity is None)


class Guards(msgspec.Struct, frozen=True):
    """What keeps an owned instance from being destroyed now, as plain values.

    ``requester`` is the key of the Allocate asking (None for the reconciler): its own pending
    reservation does not guard against it, since that Allocate is what the reservation waited for."""

    referenced: frozenset[str] = frozenset()
    pending: frozenset[PendingReservation] = frozenset()
    requester: AllocationKey | None = None

    def why(self, record: OwnershipRecord) -> str | None:
        """Why ``record`` must not be destroyed now (an error's wording), or None when it may be."""
        if record.state is State.ERROR and record.mig_uuid is not None and record.mig_uuid in self.referenced:
            return "a live pod holds it (the last pod list names its MIG UUID)"
        if record.state not in (State.IDLE, State.ERROR):
            return None
        for p in sorted(self.pending, key=lambda p: str(p.key)):
            if p.reservation == record.reservation and p.key != self.requester:
                return f"pending reservation of {p.key}"
        return None


class PendingSet:
    """The lifecycle's current pending reservations (one value, replaced whole).

    Replacing a frozenset attribute is atomic, so readers never see half a list; ``consume`` runs
    under the Allocate's key claim, and a SyncActive racing it at worst keeps an entry until the
    next list, which guards an instance a moment longer and nothing else."""

    def __init__(self) -> None:
        self.current: frozenset[PendingReservation] = frozenset()

    def replace(self, active: Iterable[ActiveAllocation]) -> None:
        self.current = pending_of(active)

    def consume(self, keys: Iterable[AllocationKey]) -> None:
        """The Allocate of these keys came: their reservations guard nothing any more."""
        done = set(keys)
        self.current = frozenset(p for p in self.current if p.key not in done)

    def guards(self, referenced: frozenset[str], requester: AllocationKey | None = None) -> Guards:
        return Guards(referenced, self.current, requester)


__all__ = ["Guards", "PendingReservation", "PendingSet", "pending_of"]
