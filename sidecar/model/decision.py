"""The allocation decision for one device, over plain values (pure).

``allocate`` gathers what the decision needs (what the key holds, the IDLE instance at the
reservation, the placement plan of the live layout) and applies what ``decide`` returns. Rules:

- a key holds one instance: holding another reservation is a KEY_CONFLICT (``Conflict``);
- a complete ACTIVE instance the key holds is answered as it is (``AlreadyHeld``);
- an IDLE instance at exactly the reservation is reused (``Reuse``), unless a guard keeps it for
  another key's pending reservation (``pending.Guards``): then it is a blocker (``Busy``);
- otherwise the instance is created, reclaiming only IDLE instances in the way (``Create``), or,
  when anything else is in the way, nothing changes (``Busy``, see ``placement.plan_placement``);
- an ERROR instance in the way (at exactly the reservation or overlapping it) is the reconciler's
  retry done now: it is destroyed first (``Create.retry``), unless a guard keeps it
  (``pending.Guards``: a live pod holds it, or another key's pending reservation is at exactly its
  spot); a guarded IDLE instance is not reclaimed either. A guarded instance is a blocker (``Busy``).
"""

from __future__ import annotations

import msgspec

from sidecar.model.domain import Reservation, State
from sidecar.model.ownership import OwnershipRecord
from sidecar.model.pending import Guards
from sidecar.model.placement import Blocker, PlacementPlan


class Conflict(msgspec.Struct, frozen=True):
    held: OwnershipRecord


class AlreadyHeld(msgspec.Struct, frozen=True):
    record: OwnershipRecord


class Reuse(msgspec.Struct, frozen=True):
    record: OwnershipRecord


class Create(msgspec.Struct, frozen=True):
    """Create the instance: first destroy the ERROR instances in ``retry``, then reclaim ``reclaim``."""

    reclaim: tuple[OwnershipRecord, ...] = ()
    retry: tuple[OwnershipRecord, ...] = ()


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


def decide(
    reservation: Reservation,
    held_by_key: OwnershipRecord | None,
    at_reservation: OwnershipRecord | None,
    placement_plan: PlacementPlan | None,
    guards: Guards | None = None,
) -> Decision:
    """What one device of an Allocate does.

    ``held_by_key``: what the device's key holds (ACTIVE or CREATING for it). ``at_reservation``:
    the owned record named like the reservation, if any. ``placement_plan``: what stands in the
    way of a create (needed only when the device is neither held nor reusable; None before it is
    gathered gives ``Create()`` with nothing to reclaim, which the caller must not apply).
    ``guards``: what keeps an IDLE or ERROR instance in the way from being destroyed (none when
    omitted)."""
    if held_by_key is not None and held_by_key.reservation != reservation:
        return Conflict(held_by_key)
    if held_by_key is not None and held_by_key.state is State.ACTIVE and held_by_key.identity is not None:
        return AlreadyHeld(held_by_key)
    guards = guards or Guards()
    idle = reusable(reservation, at_reservation)
    if idle is not None:
        why = guards.why(idle)
        if why is not None:
            return Busy((Blocker(str(idle.state), idle.placement, idle.gpu_instance_id, idle, why),))
        return Reuse(idle)
    if placement_plan is None:
        return Create()
    return make_room(placement_plan, guards)


def make_room(plan: PlacementPlan, guards: Guards) -> Create | Busy:
    """``Create`` when every blocker is an unguarded ERROR instance (retried first) and no IDLE
    instance in the way is guarded; ``Busy`` with every blocker otherwise (the ones no retry can
    move first, so the error names them), and nothing is destroyed."""
    hard: list[Blocker] = []
    retry: list[OwnershipRecord] = []
    for blocker in plan.blockers:
        record = blocker.record
        why = guards.why(record) if record is not None and record.state is State.ERROR else None
        if record is not None and record.state is State.ERROR and why is None:
            retry.append(record)
        elif why is not None:
            hard.append(msgspec.structs.replace(blocker, guarded_by=why))
        else:
            hard.append(blocker)
    reclaim: list[OwnershipRecord] = []
    for record in plan.reclaim or plan.idle_behind:
        why = guards.why(record)
        if why is None:
            reclaim.append(record)
        else:
            hard.append(Blocker(str(record.state), record.placement, record.gpu_instance_id, record, why))
    if hard:
        retryable = [Blocker(str(r.state), r.placement, r.gpu_instance_id, r) for r in retry]
        return Busy((*hard, *retryable))
    return Create(reclaim=tuple(reclaim), retry=tuple(retry))
