"""Pending reservations, and what guards an owned instance from being destroyed now (pure).

A pending reservation is an ``ActiveAllocation`` without runtime identity: the scheduler reserved
the GPU, profile and placement for a pod, the plugin has not allocated it yet. It guards an IDLE or
ERROR instance at exactly that reservation from every path that would take it from that pod: another
pod's Allocate reusing it, placement pressure, ``ReclaimIdle`` and the reclaim before a MIG disable
(unless the operator forces them), the idle policy, the reconciler's ERROR retry and an Allocate's
inline ERROR retry; a MIG disable is refused while any reservation is on the GPU. It lasts until
that key's Allocate comes (the reservation is then the key's own) or the reservation leaves the
plugin's list: ``SyncActive``'s list replaces
the set, ``Recover`` sets it, and a successful ``Allocate`` consumes its keys' entries. The set
lives in memory only: the plugin sends it again with every list.

An ERROR instance whose MIG UUID a live pod holds (``RecordTable.referenced``) is guarded the same way:
destroying a device under a running container is worse than keeping a broken one.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import msgspec

from sidecar.model.domain import ActiveAllocation, AllocationKey, Reservation, State
from sidecar.model.ownership import OwnershipRecord


class PendingReservation(msgspec.Struct, frozen=True):
    """``key`` None: a reservation known only by its place (the idle policy's plain values); it
    guards against every requester."""

    key: AllocationKey | None
    reservation: Reservation

    def holder(self) -> str:
        """Who holds it, in an error's words: the key, or "the scheduler" when only its place is known."""
        return "the scheduler" if self.key is None else str(self.key)


def pending_of(active: Iterable[ActiveAllocation]) -> frozenset[PendingReservation]:
    """The pending reservations of a pod list: the entries without runtime identity."""
    return frozenset(PendingReservation(a.key, a.reservation) for a in active if a.identity is None)


class Guards(msgspec.Struct, frozen=True):
    """What keeps an owned instance from being destroyed or handed to another pod now, as plain values.

    The one rule every path consults (``keeps``): Allocate's decision (reuse, reclaim, the inline
    ERROR retry), ``ReclaimIdle``, the reclaim before a MIG disable, the reconciler's ERROR retry,
    the idle policy and the advice. ``requester`` is the key of the Allocate asking (None for
    everything else): its own pending reservation does not guard against it, since that Allocate is
    what the reservation waited for. ``force`` is the operator's override of ``ReclaimIdle`` and
    ``SetMigMode``: pending reservations guard nothing then (a live pod's ERROR instance still does,
    and no reclaim touches an ERROR instance anyway)."""

    referenced: frozenset[str] = frozenset()
    pending: frozenset[PendingReservation] = frozenset()
    requester: AllocationKey | None = None
    force: bool = False

    @classmethod
    def of_reservations(cls, reservations: Iterable[Reservation]) -> Guards:
        """Guards of reservations known by place only (no key: they guard against everyone)."""
        return cls(pending=frozenset(PendingReservation(None, r) for r in reservations))

    def keeps(self, reservation: Reservation, state: State, mig_uuid: str | None) -> str | None:
        """Why the instance at ``reservation`` in ``state`` must be left alone (an error's wording),
        or None when it may be destroyed or handed to the requester."""
        if state is State.ERROR and mig_uuid and mig_uuid in self.referenced:
            return "a live pod holds it (the last pod list names its MIG UUID)"
        if state not in (State.IDLE, State.ERROR):
            return None
        holder = self.reserved_by(reservation)
        return None if holder is None else f"pending reservation of {holder}"

    def why(self, record: OwnershipRecord) -> str | None:
        """``keeps`` for an owned record."""
        return self.keeps(record.reservation, record.state, record.mig_uuid)

    def reserved_by(self, reservation: Reservation) -> str | None:
        """Who (another key, or "the scheduler") holds a pending reservation at exactly ``reservation``."""
        if not self.pending:  # the common case: nothing is pending, nothing to sort
            return None
        for p in sorted(self._guarding(), key=lambda p: str(p.key)):
            if p.reservation == reservation:
                return p.holder()
        return None

    def on_gpu(self, gpu_uuid: str) -> tuple[PendingReservation, ...]:
        """The pending reservations on a GPU that guard against this requester (none with ``force``):
        a MIG disable is refused while there is one, since the scheduler placed a pod there."""
        return tuple(
            sorted(
                (p for p in self._guarding() if p.reservation.gpu_uuid == gpu_uuid),
                key=lambda p: (str(p.key), p.reservation.placement.start),
            )
        )

    def _guarding(self) -> Iterator[PendingReservation]:
        """The pending reservations that guard against this requester: not its own, none with force."""
        if not self.force:
            yield from (p for p in self.pending if p.key is None or p.key != self.requester)


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

    def guards(
        self, referenced: frozenset[str], requester: AllocationKey | None = None, *, force: bool = False
    ) -> Guards:
        return Guards(referenced, self.current, requester, force)


__all__ = ["Guards", "PendingReservation", "PendingSet", "pending_of"]
