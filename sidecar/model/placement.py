"""Which placements are legal, which instances overlap them, and what blocks a new one (pure).

Nothing here talks to NVML or the disk: ``lifecycle`` gathers the live GI layout of one GPU and the
owned records of that GPU, and asks this module what stands in the way of a placement. Keeping the
decision pure lets it be tested with plain values over every case of the state machine.

Facts the logic rests on:

* A placement is ``[start, start + size)`` in *memory* slices. Two GIs on one GPU may never share a
  memory slice; the driver refuses an overlapping create with INSUFFICIENT_RESOURCES, never with
  "already exists".
* The possible placements of a profile are static (independent of what is occupied), so legality is
  simply membership in that list.
* GI IDs are reused by the driver and follow the placement (``giId = (S/size - 1) + start/size`` on
  real drivers), so a GI that is re-created at the same placement gets the same ID. An ID alone never
  proves ownership; a live GI is *owned* only when a record on that GPU names the same GI ID, GI
  profile ID and placement (the MIG UUID check happens where a CI is looked at).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from sidecar.model.domain import OwnerKind, State
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import GpuInstanceInfo, GpuInstanceProfile, Placement

FOREIGN = "foreign"


class Blocker(msgspec.Struct, frozen=True):
    """Something that occupies memory slices a requested placement needs and must not be destroyed.

    ``kind`` is ``"foreign"`` for a live GI no record owns, otherwise the state of the owning record
    (ACTIVE, ERROR, CREATING, DELETING). ``guarded_by`` says why an IDLE or ERROR instance, which
    could otherwise be destroyed for the request, must stay (``pending.Guards.why``).
    """

    kind: str
    placement: Placement
    gpu_instance_id: int | None = None
    record: OwnershipRecord | None = None
    guarded_by: str = ""

    def metadata(self) -> dict[str, str]:
        """The ``google.rpc.ErrorInfo`` metadata that names this blocker in a PLACEMENT_BUSY error."""
        meta = {"blocker": self.kind, "placement": str(self.placement)}
        if self.gpu_instance_id is not None:
            meta["gpu_instance_id"] = str(self.gpu_instance_id)
        if self.record is not None:
            meta["profile"] = self.record.profile
            if self.record.mig_uuid:
                meta["mig_uuid"] = self.record.mig_uuid
            if self.record.owner is not None:
                owner = self.record.owner
                meta["owner"] = str(owner.key)
                meta["claim_uid" if owner.kind is OwnerKind.CLAIM else "pod_uid"] = owner.uid
        if self.guarded_by:
            meta["guarded_by"] = self.guarded_by
        return meta

    def describe(self) -> str:
        if self.kind == FOREIGN:
            return f"foreign GPU instance {self.gpu_instance_id} at {self.placement}"
        assert self.record is not None
        mig = self.record.mig_uuid or "no MIG UUID"
        guarded = f", kept: {self.guarded_by}" if self.guarded_by else ""
        return f"{self.kind} instance {self.record.profile}@{self.placement} ({mig}{guarded})"


class PlacementPlan(msgspec.Struct, frozen=True):
    """What a placement needs: either blockers (nothing may be destroyed) or IDLE records to reclaim.

    ``idle_behind`` is what ``reclaim`` would be without the blockers (empty when not busy): the
    decision needs it when every blocker is an ERROR instance it may retry inline."""

    blockers: tuple[Blocker, ...] = ()
    reclaim: tuple[OwnershipRecord, ...] = ()
    idle_behind: tuple[OwnershipRecord, ...] = ()

    @property
    def busy(self) -> bool:
        return bool(self.blockers)


def is_legal(profile: GpuInstanceProfile, placement: Placement) -> bool:
    """A placement is legal for a profile exactly when NVML lists it among the possible placements."""
    return placement in profile.placements


def owns(record: OwnershipRecord, gi: GpuInstanceInfo) -> bool:
    """True when ``record`` claims the live GI ``gi``: same GPU, GI ID, GI profile ID and placement.

    The ID alone is not enough: the driver hands the same ID to whatever is created at that spot next.
    """
    return (
        record.gpu_uuid == gi.gpu_uuid
        and record.gpu_instance_id == gi.id
        and record.gi_profile_id == gi.profile_id
        and record.placement == gi.placement
    )


def owner_of(gi: GpuInstanceInfo, records: Iterable[OwnershipRecord]) -> OwnershipRecord | None:
    for record in records:
        if owns(record, gi):
            return record
    return None


def foreign_instances(
    live: Sequence[GpuInstanceInfo], records: Iterable[OwnershipRecord]
) -> list[GpuInstanceInfo]:
    """The live GIs no record claims, in the order given (NVML lists them by GI ID)."""
    owned = list(records)
    return [gi for gi in live if owner_of(gi, owned) is None]


def plan_placement(
    placement: Placement,
    live: Sequence[GpuInstanceInfo],
    records: Iterable[OwnershipRecord],
) -> PlacementPlan:
    """Decide what stands between ``placement`` and a create on one GPU.

    ``live`` is the GI layout NVML reports now, ``records`` the owned records of the same GPU (the
    caller filters by GPU). Records are judged by their *recorded* placement whether or not their GI is
    live, so an instance that is half created, half destroyed or in ERROR blocks its slices even when
    the hardware no longer shows it: the sidecar only reuses slices it has proven free.

    Only IDLE instances may be reclaimed. If anything else overlaps, the plan lists every blocker and
    reclaims nothing: a request either gets its placement by destroying only idle cache, or changes
    nothing at all.
    """
    owned = list(records)
    blockers: list[Blocker] = []
    reclaim: list[OwnershipRecord] = []
    for gi in live:
        if gi.placement.overlaps(placement) and owner_of(gi, owned) is None:
            blockers.append(Blocker(FOREIGN, gi.placement, gi.id))
    for record in sorted(owned, key=lambda r: (r.placement.start, r.placement.size)):
        if not record.placement.overlaps(placement):
            continue
        if record.state is State.IDLE:
            reclaim.append(record)
        else:
            blockers.append(Blocker(str(record.state), record.placement, record.gpu_instance_id, record))
    if blockers:
        return PlacementPlan(blockers=tuple(blockers), idle_behind=tuple(reclaim))
    return PlacementPlan(reclaim=tuple(reclaim))


def first_overlap(placements: Sequence[tuple[str, Placement]]) -> tuple[int, int] | None:
    """Indices of the first two entries on the same GPU (first item) whose placements overlap."""
    for i, (gpu_a, a) in enumerate(placements):
        for j in range(i + 1, len(placements)):
            gpu_b, b = placements[j]
            if gpu_a == gpu_b and a.overlaps(b):
                return i, j
    return None
