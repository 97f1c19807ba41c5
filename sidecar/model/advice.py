"""Reuse-aware placement advice for one profile on one GPU (``RankPlacements``), pure.

The scheduler picks a placement; the sidecar realizes it. A placement where an IDLE instance of the
profile already sits costs no NVML create at all, a free one costs one create, and one covered by idle
cache costs a destroy *and* a create in series on the pod's critical path. This module ranks every
legal placement of a profile by that cost, from plain values the server gathers without touching
NVML (the owned instances as recorded, the foreign GIs of its last listing, the records left aside for
the operator, the placements in flight, the scheduler's pending reservations). Nothing here does I/O,
so it is cheap enough to call on every registration loop and testable with plain values.

The classes, best first, follow what ``Allocate`` would do there:

* REUSE — an IDLE instance of exactly this profile at exactly this placement, and nothing else on
  those slices;
* FREE — nothing at all overlaps;
* RECLAIM — only IDLE instances overlap (listed): ``Allocate`` destroys them, then creates;
* BLOCKED — an ACTIVE, ERROR, CREATING or DELETING instance, a foreign GI, a record left aside, a
  placement in flight, a pending reservation, or an IDLE instance running processes overlaps.
  ``Allocate`` would answer PLACEMENT_BUSY (or INSTANCE_IN_USE); the first blocker is named.

A pending reservation is a placement the scheduler has already promised to another pod: it blocks
like an occupant, whether an IDLE instance sits there or not, so advice never steers a second pod
onto it (and never counts the IDLE instance it protects as reusable or reclaimable: the same
``pending.Guards.keeps`` that Allocate, ReclaimIdle, the MIG disable, the idle policy and the
reconciler consult).

The foreign GIs come from the inventory's layout view, never from a listing of its own: the last GI
listing of the GPU, which every listing the lifecycle makes anyway replaces (``LayoutRecordingPort``: an
Allocate's, a destroy's, GetState's, a refused create's), which the sidecar's own GI creates and
destroys edit, and which the reconciler lists afresh once per interval. Which listed GIs are foreign
is judged when the view is read, against the records then, so a listing taken before a record changed
never makes an owned GI foreign.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import msgspec
from msgspec.structs import replace

from sidecar.model.domain import ForeignInstance, Reservation, State
from sidecar.model.pending import Guards
from sidecar.nvml.port import Placement


class Cost(enum.IntEnum):
    """The class of a placement; the values are the contract's ``PlacementCost`` numbers."""

    REUSE = 1
    FREE = 2
    RECLAIM = 3
    BLOCKED = 4


# Blocker kinds beside the instance states (ACTIVE, ERROR, CREATING, DELETING).
FOREIGN = "foreign"
RESERVED = "reserved"
IN_USE = "in_use"


class OwnedInstance(msgspec.Struct, frozen=True):
    """An owned instance as the records describe it (the fields advice and the idle policy need).

    ``last_used`` is when it last stopped serving a pod (seconds on the caller's clock; for an IDLE
    instance, the time it went IDLE). ``busy`` is true when a process is known to run on it."""

    profile: str
    placement: Placement
    state: State
    mig_uuid: str = ""
    gpu_instance_id: int | None = None
    last_used: float = 0.0
    busy: bool = False
    compute_instance_id: int | None = None

    def describe(self) -> str:
        return f"{self.state} {self.profile}@{self.placement} ({self.mig_uuid or 'no MIG UUID'})"


class Hold(msgspec.Struct, frozen=True):
    """Slices that are not free for another reason: a record left aside for the operator, a create in
    flight that has no record yet. ``kind`` names it in a BLOCKED answer (``corrupt_record``, ...)."""

    placement: Placement
    kind: str
    detail: str = ""


class GpuView(msgspec.Struct, frozen=True):
    """Everything that occupies one GPU's memory slices, as plain values.

    ``memory_slices`` is the GPU's size on the memory-slice axis (8 on an H100: the size of its
    full-GPU placement); ``pending`` holds the scheduler's pending reservations on this GPU."""

    gpu_uuid: str
    memory_slices: int
    owned: tuple[OwnedInstance, ...] = ()
    foreign: tuple[ForeignInstance, ...] = ()
    holds: tuple[Hold, ...] = ()
    pending: tuple[Reservation, ...] = ()


class RankedPlacement(msgspec.Struct, frozen=True):
    """One legal placement with its cost class and what the free region looks like after it.

    ``free_slices_after`` follows the contract (IDLE slices counted as free); ``free_run_after`` and
    ``strict_free_after`` are the tie-breakers (IDLE slices counted as occupied, see ``rank_key``)."""

    placement: Placement
    cost: Cost
    idle_mig_uuid: str = ""
    reclaim: tuple[OwnedInstance, ...] = ()
    free_slices_after: int = 0
    free_run_after: int = 0
    strict_free_after: int = 0
    blocker: str = ""
    blockers: tuple[str, ...] = ()


class _Occupant(msgspec.Struct, frozen=True):
    placement: Placement
    kind: str  # a State for owned instances, otherwise FOREIGN, RESERVED or a Hold's kind
    detail: str
    instance: OwnedInstance | None = None  # set exactly for an IDLE instance that may be reused/reclaimed


def occupants(view: GpuView) -> list[_Occupant]:
    """Every occupant of the GPU's slices, IDLE instances that may be touched marked with ``instance``."""
    guards = Guards.of_reservations(r for r in view.pending if r.gpu_uuid == view.gpu_uuid)
    out: list[_Occupant] = [
        _Occupant(r.placement, RESERVED, f"pending reservation {r.profile}@{r.placement}")
        for r in view.pending
        if r.gpu_uuid == view.gpu_uuid
    ]
    for inst in view.owned:
        if inst.state is not State.IDLE:
            out.append(_Occupant(inst.placement, str(inst.state), inst.describe()))
        elif inst.busy:
            out.append(_Occupant(inst.placement, IN_USE, f"{inst.describe()} running processes"))
        elif (
            guards.keeps(Reservation(view.gpu_uuid, inst.profile, inst.placement), inst.state, inst.mig_uuid)
            is None
        ):
            out.append(_Occupant(inst.placement, str(State.IDLE), inst.describe(), inst))
        # An IDLE instance a guard keeps (``pending.Guards``) is covered by the RESERVED occupant above.
    for f in view.foreign:
        out.append(
            _Occupant(f.placement, FOREIGN, f"foreign GPU instance {f.gpu_instance_id} at {f.placement}")
        )
    for h in view.holds:
        out.append(_Occupant(h.placement, h.kind, h.detail or f"{h.kind} at {h.placement}"))
    return out


def free_region(memory_slices: int, taken: Iterable[Placement]) -> tuple[int, int]:
    """(longest contiguous run of free memory slices, total free slices) with ``taken`` occupied."""
    used = [False] * memory_slices
    for p in taken:
        for s in range(max(p.start, 0), min(p.end, memory_slices)):
            used[s] = True
    longest = run = 0
    for u in used:
        run = 0 if u else run + 1
        longest = max(longest, run)
    return longest, used.count(False)


def classify(profile: str, placement: Placement, view: GpuView, occ: Sequence[_Occupant]) -> RankedPlacement:
    """The cost class of one placement and the free region it leaves."""
    hit = sorted(
        (o for o in occ if o.placement.overlaps(placement)), key=lambda o: (o.placement.start, o.kind)
    )
    blockers = [o for o in hit if o.instance is None]
    idle = tuple(o.instance for o in hit if o.instance is not None)
    # Slices occupied after an Allocate here: the placement itself and every occupant it does not
    # destroy. IDLE instances elsewhere stay occupied for the tie-break (``rank_key``).
    kept = [o.placement for o in occ if o.instance is None or not o.placement.overlaps(placement)]
    run, strict = free_region(view.memory_slices, [placement, *kept])
    non_idle = [o.placement for o in occ if o.instance is None]
    _, loose = free_region(view.memory_slices, [placement, *non_idle])
    base = RankedPlacement(
        placement, Cost.FREE, free_slices_after=loose, free_run_after=run, strict_free_after=strict
    )
    if blockers:
        return replace(
            base, cost=Cost.BLOCKED, blocker=blockers[0].kind, blockers=tuple(o.detail for o in blockers)
        )
    if len(idle) == 1 and idle[0].profile == profile and idle[0].placement == placement:
        return replace(base, cost=Cost.REUSE, idle_mig_uuid=idle[0].mig_uuid)
    if idle:
        return replace(base, cost=Cost.RECLAIM, reclaim=idle)
    return base


def rank_key(r: RankedPlacement) -> tuple[int, int, int, int, int, int]:
    """Sort key, smallest best: the cost class, then (RECLAIM only) how many instances it destroys,
    then the free region left, then the lower placement.

    * The number of victims comes first within RECLAIM because each one is a CI and a GI destroy in
      series on the pod's critical path, and a lost cached instance; preferring a larger free region
      would otherwise favour destroying *more* idle cache.
    * The free region is the longest contiguous run of memory slices left free after the Allocate,
      counting IDLE instances that stay as occupied: a contiguous run is what a larger profile needs
      (placements are aligned ranges, so scattered free slices fit nothing big), and idle slices are
      not free without a destroy — exactly the cost this advice exists to avoid. Best fit by this
      measure packs small instances together and keeps room for a FREE large one.
    * Then the total of such free slices (more room for several small ones), then the lower start
      (deterministic, and matches the order NVML lists placements in).
    """
    victims = len(r.reclaim) if r.cost is Cost.RECLAIM else 0
    return (
        int(r.cost),
        victims,
        -r.free_run_after,
        -r.strict_free_after,
        r.placement.start,
        r.placement.size,
    )


def rank_placements(profile: str, placements: Sequence[Placement], view: GpuView) -> list[RankedPlacement]:
    """Every placement in ``placements`` (the profile's legal ones, from the profile table) ranked
    best first for a new request of ``profile`` on the GPU ``view`` describes. Duplicates collapse."""
    occ = occupants(view)
    ranked = [classify(profile, p, view, occ) for p in dict.fromkeys(placements)]
    return sorted(ranked, key=rank_key)


__all__ = [
    "FOREIGN",
    "IN_USE",
    "RESERVED",
    "Cost",
    "GpuView",
    "Hold",
    "OwnedInstance",
    "RankedPlacement",
    "classify",
    "free_region",
    "occupants",
    "rank_key",
    "rank_placements",
]
