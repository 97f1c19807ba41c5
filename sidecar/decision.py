"""The allocation decision for one device, over plain values (pure).

``allocate`` gathers what the decision needs (what the key holds, the IDLE instance at the
reservation, the placement plan of the live layout) and applies what ``decide`` returns. Rules:

- a key holds one instance: holding another reservation is a KEY_CONFLICT (``Conflict``);
- a complete ACTIVE instance the key holds is answered as it is (``AlreadyHeld``);
- an IDLE instance at exactly the reservation is reused (``Reuse``);
- otherwise the instance is created, reclaiming only IDLE instances in the way (``Create``), or,
  when anything else is in the way, nothing changes (``Busy``, see ``placement.plan_placement``).
"""

from __future__ import annotations

import msgspec

from sidecar.domain import Reservation, State
from sidecar.ownership import OwnershipRecord
from sidecar.placement import Blocker, PlacementPlan


class Conflict(msgspec.Struct, frozen=True):
    held: OwnershipRecord


class AlreadyHeld(msgspec.Struct, frozen=True):
    record: OwnershipRecord


class Reuse(msgspec.Struct, frozen=True):
    record: OwnershipRecord


class Create(msgspec.Struct, frozen=True):
    reclaim: tuple[OwnershipRecord, ...] = ()


class Busy(msgspec.Struct, frozen=True):
    blockers: tuple[Blocker, ...]

    @property
    def blocker(self) -> Blocker:
        return self.blockers[0]


Decision = Conflict | AlreadyHeld | Reuse | Create | Busy


def reusable(reservation: Reservation, at_reservation: OwnershipRecord | None) -> OwnershipRecord | None:
    """The record at the reservation's name when it is IDLE for exactly this reservation."""
    if (
        at_reservation is not None
        and at_reservation.state is State.IDLE
        and at_reservation.reservation == reservation
    ):
        return at_reservation
    return None


def needs_placement(
    reservation: Reservation, held_by_key: OwnershipRecord | None, at_reservation: OwnershipRecord | None
) -> bool:
    """True when ``decide`` needs a placement plan: the device is neither held nor reusable."""
    return not isinstance(
        decide(reservation, held_by_key, at_reservation, None), (Conflict, AlreadyHeld, Reuse)
    )


def decide(
    reservation: Reservation,
    held_by_key: OwnershipRecord | None,
    at_reservation: OwnershipRecord | None,
    placement_plan: PlacementPlan | None,
) -> Decision:
    """What one device of an Allocate does.

    ``held_by_key``: what the device's key holds (ACTIVE or CREATING for it). ``at_reservation``:
    the owned record named like the reservation, if any. ``placement_plan``: what stands in the
    way of a create (only needed when ``needs_placement``; None before it is gathered gives
    ``Create()`` with nothing to reclaim, which the caller must not apply)."""
    if held_by_key is not None and held_by_key.reservation != reservation:
        return Conflict(held_by_key)
    if held_by_key is not None and held_by_key.state is State.ACTIVE and held_by_key.identity is not None:
        return AlreadyHeld(held_by_key)
    idle = reusable(reservation, at_reservation)
    if idle is not None:
        return Reuse(idle)
    if placement_plan is None:
        return Create()
    if placement_plan.busy:
        return Busy(placement_plan.blockers)
    return Create(reclaim=placement_plan.reclaim)


__all__ = [
    "AlreadyHeld",
    "Busy",
    "Conflict",
    "Create",
    "Decision",
    "Reuse",
    "decide",
    "needs_placement",
    "reusable",
]
