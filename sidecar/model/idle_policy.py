"""Which IDLE instances the background reconciler destroys: the idle policy off the Allocate path, pure.

The idle cache pays when a request lands on an idle instance, and costs the tail when a request has to
destroy one before its create. This decision moves that destroy off the pod's critical path. It runs
over plain values (the ``advice`` module's ``GpuView`` per GPU, the clock reading ``now``); the caller
destroys what it returns through the same recorded, crash-safe teardown as any reclaim. Three causes
and one that comes with the reserve, each off unless set (``IdleSettings()`` trims nothing;
``serve``'s own default is the ``auto`` reserve, ``sidecar.config.flags``):

* ``ttl`` — an instance idle for longer than ``ttl_s`` seconds;
* ``max_idle`` — more than ``max_idle_per_gpu`` IDLE instances on one GPU: the least recently used go
  until the count fits (instances that may not be trimmed still count);
* ``reserve`` — for each profile the GPU's scheduler allows (``reserve``: GPU -> profile -> its legal
  placements), when no placement is ready (REUSE or FREE in ``advice.rank_placements``), the idle
  instances of one RECLAIM placement go, so the next request for that profile finds it FREE. The
  placement chosen is the one whose victims' profiles keep the most idle copies (``_victim_key``:
  a request reuses *any* idle copy of its profile, so destroying one of many costs the next hit
  little and destroying the last costs it for sure), then the one whose most recently used victim
  is the oldest (least recently used cache first), then the one with fewer victims, then the
  advice order.

With a reserve (named or ``auto``, once per node), one more cause comes before it:

* ``in_the_way`` — the scheduler lands on IDLE instances (HAMi without the scheduler change cannot
  see them: it places a request by what the pods hold), so whatever the node keeps free elsewhere,
  its next Allocate on an occupied GPU destroys one inline first (p99 was about 2x eager destroy's
  in ``bench/trace.py`` without this cause). ``Choices`` learns from the Allocates where it places
  each profile, on which GPU, and whether it avoids IDLE instances (``Choices.blind``); when it does
  not, for each reserved profile, on each GPU it may choose next, the IDLE instances overlapping the
  placement it is expected to choose there go, unless an IDLE copy of the profile sits exactly there.
  What a blind scheduler would have destroyed inside its Allocate is then destroyed before it comes;
  it costs cache where a guess does not come true (the trace's rows: ``bench/README.md``). HAMi with
  the helper at ``idle-first`` avoids IDLE instances and this trims nothing for it; at the helper's
  default (the GPU policy kept) it lands on them when the policy's GPU has no free placement, and
  this engages for it as well.

With or without any of them, one more the client asks for, first of all:

* ``next`` — a client that publishes its devices in the order its scheduler takes them (the DRA
  kubelet plugin) names, per profile, the placement a request that finds no IDLE instance of it gets
  next (``KeepFree``: the placements as of a moment). The IDLE instances over one go, so that request
  creates at once; an Allocate there would have destroyed them inline first. One that went IDLE after
  the client named the placement stays: the client has not seen it, and its next naming decides.
  Nothing goes when something else overlaps the placement too (destroying the IDLE ones would not
  free it).

Causes apply in that order, each seeing the instances the earlier ones chose as gone; an instance is
trimmed at most once, under the first cause that chose it. Never trimmed: anything not IDLE (ACTIVE,
ERROR, CREATING, DELETING), foreign GIs (never in ``owned``), an IDLE instance marked ``busy`` (a
process runs on it) and one protected by a pending reservation (``pending``, or the view's own).
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence

import msgspec
from msgspec.structs import replace

from sidecar.model.advice import Cost, GpuView, OwnedInstance, rank_placements
from sidecar.model.domain import Reservation, State
from sidecar.model.pending import Guards
from sidecar.nvml.port import Placement


class Cause(enum.StrEnum):
    TTL = "ttl"
    MAX_IDLE = "max_idle"
    RESERVE = "reserve"
    IN_THE_WAY = "in_the_way"
    NEXT = "next"


class IdleSettings(msgspec.Struct, frozen=True):
    """The idle policy (every cause off in this struct's defaults: nothing is trimmed).

    ``reserve`` names the profiles the scheduler allows, for which a free placement is kept ready:
    somewhere on the node (``node_reserve``), or on every GPU with ``reserve_per_gpu`` (profiles a
    GPU does not have are ignored on it). With ``reserve_asked_within_s`` instead, the reserve is
    for the profiles Allocates asked for in that many seconds up to now (``reserved``)."""

    ttl_s: float | None = None
    max_idle_per_gpu: int | None = None
    reserve: tuple[str, ...] = ()
    reserve_per_gpu: bool = False
    reserve_asked_within_s: float | None = None

    @property
    def enabled(self) -> bool:
        return (
            self.ttl_s is not None
            or self.max_idle_per_gpu is not None
            or bool(self.reserve)
            or self.reserve_asked_within_s is not None
        )

    def reserved(self, asked: Mapping[str, float], now: float) -> tuple[str, ...]:
        """The profiles the reserve keeps ready now: the named ones, or those ``asked`` (profile ->
        when an Allocate last asked for it) within ``reserve_asked_within_s`` of ``now``, by name."""
        window = self.reserve_asked_within_s
        if window is None:
            return self.reserve
        return tuple(sorted(p for p, at in asked.items() if now - at <= window))


class KeepFree(msgspec.Struct, frozen=True):
    """The placements a client's scheduler takes next, each for its profile on its GPU, as the client
    named them at ``at`` (the trimmer's clock: seconds since the epoch), and the GPUs that scheduler
    allocates (``gpus``), whose IDLE instances are the client's to keep or free."""

    next: tuple[Reservation, ...] = ()
    at: float = 0.0
    gpus: frozenset[str] = frozenset()


class Trim(msgspec.Struct, frozen=True):
    """Destroy ``instance`` on ``gpu_uuid`` because of ``cause`` (``profile``: the reserve it frees)."""

    gpu_uuid: str
    instance: OwnedInstance
    cause: Cause
    profile: str = ""


def _protected(view: GpuView, pending: Collection[Reservation]) -> frozenset[Reservation]:
    return frozenset(r for r in (*pending, *view.pending) if r.gpu_uuid == view.gpu_uuid)


def trimmable(view: GpuView, inst: OwnedInstance, protected: Collection[Reservation]) -> bool:
    """IDLE, no process on it, and no guard keeps it (``pending.Guards.keeps``: a pending
    reservation at exactly its reservation)."""
    guards = Guards.of_reservations(protected)
    return (
        inst.state is State.IDLE
        and not inst.busy
        and guards.keeps(Reservation(view.gpu_uuid, inst.profile, inst.placement), inst.state, inst.mig_uuid)
        is None
    )


def _lru(instances: Sequence[OwnedInstance]) -> list[OwnedInstance]:
    """Least recently used first; the lower placement breaks ties so the answer is deterministic."""
    return sorted(instances, key=lambda i: (i.last_used, i.placement.start, i.placement.size))


def _copies(views: Sequence[GpuView], pending: Collection[Reservation]) -> Counter[str]:
    """Idle instances a request could reuse, per profile, over ``views``."""
    out: Counter[str] = Counter()
    for view in views:
        protected = _protected(view, pending)
        out.update(i.profile for i in view.owned if trimmable(view, i, protected))
    return out


def _victim_key(victims: Sequence[OwnedInstance], copies: Counter[str]) -> tuple[int, float, int]:
    """Smallest best among the victim sets that free a reserve: the scarcest victim's profile keeps
    the most idle copies, then the least recently used, then the fewest victims."""
    return (
        -min(copies[v.profile] for v in victims),
        max(v.last_used for v in victims),
        len(victims),
    )


def _reserve_trims(
    view: GpuView, profile: str, placements: Sequence[Placement], protected: frozenset[Reservation]
) -> tuple[OwnedInstance, ...]:
    """The idle instances to destroy so that ``profile`` has a ready placement; () if it has one or none
    can be made ready by destroying idle instances only."""
    view = replace(view, pending=tuple(protected))
    ranked = rank_placements(profile, placements, view)
    if any(r.cost in (Cost.REUSE, Cost.FREE) for r in ranked):
        return ()
    options = [(i, r) for i, r in enumerate(ranked) if r.cost is Cost.RECLAIM]
    if not options:
        return ()
    copies = _copies([view], ())
    _, best = min(options, key=lambda o: (*_victim_key(o[1].reclaim, copies), o[0]))
    return best.reclaim


def trim(
    views: Sequence[GpuView],
    now: float,
    *,
    ttl_s: float | None = None,
    max_idle_per_gpu: int | None = None,
    reserve: Mapping[str, Mapping[str, Sequence[Placement]]] | None = None,
    pending: Collection[Reservation] = (),
) -> list[Trim]:
    """The IDLE instances to destroy now, per GPU in the order of ``views``, each with its cause."""
    out: list[Trim] = []
    for view in views:
        mine = (reserve or {}).get(view.gpu_uuid, {})
        out += _trim_gpu(view, now, ttl_s=ttl_s, max_idle=max_idle_per_gpu, reserve=mine, pending=pending)
    return out


def _trim_gpu(
    view: GpuView,
    now: float,
    *,
    ttl_s: float | None,
    max_idle: int | None,
    reserve: Mapping[str, Sequence[Placement]],
    pending: Collection[Reservation],
) -> list[Trim]:
    protected = _protected(view, pending)
    out: list[Trim] = []
    gone: set[OwnedInstance] = set()
    candidates = [i for i in view.owned if trimmable(view, i, protected)]
    if ttl_s is not None:
        out += [Trim(view.gpu_uuid, i, Cause.TTL) for i in _lru(candidates) if now - i.last_used > ttl_s]
        gone |= {t.instance for t in out}
    if max_idle is not None:
        idle_left = [i for i in view.owned if i.state is State.IDLE and i not in gone]
        excess = max(len(idle_left) - max(max_idle, 0), 0)
        over = _lru([i for i in candidates if i not in gone])[:excess]
        out += [Trim(view.gpu_uuid, i, Cause.MAX_IDLE) for i in over]
        gone |= set(over)
    for profile, placements in reserve.items():
        left = replace(view, owned=tuple(i for i in view.owned if i not in gone))
        victims = _reserve_trims(left, profile, placements, protected)
        out += [Trim(view.gpu_uuid, i, Cause.RESERVE, profile) for i in victims]
        gone |= set(victims)
    return out


def keep_free(
    views: Sequence[GpuView], keep: KeepFree, *, pending: Collection[Reservation] = ()
) -> list[Trim]:
    """The IDLE instances over the placements ``keep`` names (cause ``next``), in its order: for each,
    when only IDLE instances that may be trimmed and that went IDLE before ``keep.at`` overlap it, all
    of them; nothing for a placement already free or holding an IDLE copy of its profile, or one
    something else overlaps as well."""
    by_gpu = {v.gpu_uuid: v for v in views}
    out: list[Trim] = []
    gone: set[tuple[str, OwnedInstance]] = set()
    for want in keep.next:
        view = by_gpu.get(want.gpu_uuid)
        if view is None:
            continue
        protected = _protected(view, pending)
        left = replace(
            view,
            owned=tuple(i for i in view.owned if (view.gpu_uuid, i) not in gone),
            pending=tuple(protected),
        )
        (ranked,) = rank_placements(want.profile, [want.placement], left)
        victims = ranked.reclaim if ranked.cost is Cost.RECLAIM else ()
        if not victims or not all(trimmable(left, i, protected) and i.last_used < keep.at for i in victims):
            continue
        out += [Trim(view.gpu_uuid, i, Cause.NEXT, want.profile) for i in victims]
        gone |= {(view.gpu_uuid, i) for i in victims}
    return out


def node_reserve(
    views: Sequence[GpuView],
    reserve: Mapping[str, Mapping[str, Sequence[Placement]]],
    *,
    pending: Collection[Reservation] = (),
) -> list[Trim]:
    """The free reserve over a whole node: per profile (``reserve``: GPU -> profile -> placements),
    trim only when *no* GPU has a ready placement (REUSE or FREE) for it, and then the idle instances
    of one RECLAIM placement on the node, chosen as ``_reserve_trims`` chooses within a GPU
    (``_victim_key`` with the idle copies counted over the node, then the lower GPU in ``views``
    order).

    A reuse-aware scheduler picks among the node's GPUs, so one ready placement per profile on the
    node keeps its next request off the destroy-then-create path; keeping one on every GPU destroys
    far more idle cache for the same effect (the trace benchmark measures both)."""
    out: list[Trim] = []
    gone: set[tuple[str, OwnedInstance]] = set()
    profiles = dict.fromkeys(name for by_profile in reserve.values() for name in by_profile)
    for profile in profiles:
        options: list[tuple[tuple[int, float, int, int, int], str, tuple[OwnedInstance, ...]]] = []
        ready = False
        left_views = [
            replace(v, owned=tuple(i for i in v.owned if (v.gpu_uuid, i) not in gone)) for v in views
        ]
        copies = _copies(left_views, pending)
        for g, view in enumerate(views):
            placements = reserve.get(view.gpu_uuid, {}).get(profile)
            if not placements:
                continue
            protected = _protected(view, pending)
            left = replace(
                view,
                owned=tuple(i for i in view.owned if (view.gpu_uuid, i) not in gone),
                pending=tuple(protected),
            )
            ranked = rank_placements(profile, placements, left)
            if any(r.cost in (Cost.REUSE, Cost.FREE) for r in ranked):
                ready = True
                break
            for n, r in enumerate(ranked):
                if r.cost is Cost.RECLAIM:
                    key = (*_victim_key(r.reclaim, copies), g, n)
                    options.append((key, view.gpu_uuid, r.reclaim))
        if ready or not options:
            continue
        _, gpu, victims = min(options, key=lambda o: o[0])
        out += [Trim(gpu, v, Cause.RESERVE, profile) for v in victims]
        gone |= {(gpu, v) for v in victims}
    return out


# -- a scheduler blind to IDLE instances ------------------------------------------------------------

BLIND_WINDOW = 50  # the last Allocates on a GPU with IDLE instances (or ones cleared for it)
BLIND_MIN = 8  # of them, at least this many before the verdict
BLIND_SHARE = 0.2  # the share of those that landed on one: the scheduler does not avoid IDLE instances


class Choices:
    """What the node's scheduler chose, learned from the Allocates it sent (memory only).

    ``observe`` takes one Allocate's device: the profile, the GPU and placement asked for, and every
    GPU as the table held it just before. It learns two things a scheduler that cannot see IDLE
    instances chooses by, since it sees only what the pods hold:

    * the placement: the chosen one beats every other legal one left *open* on its GPU by all but
      IDLE instances (``open_to``, what such a scheduler chose among);
    * the GPU: it was met before every other GPU with an open placement for the profile that the
      pods hold differently (``held_profiles``: HAMi scores a GPU by what its pods hold, and its
      spread and binpack policies meet the least or the most held first); and whether it was the
      least or the most held by memory slices (``held_slices``), for pairs never compared.

    It also keeps the verdict ``blind``: of the last Allocates on a GPU holding IDLE instances, the
    share that landed on one other than an exact copy (the Allocate destroys it inline), or on the
    placement of one ``in_the_way`` destroyed for it (``cleared``: it would have). HAMi with the
    scheduler helper avoids IDLE instances when the GPU has room elsewhere; HAMi alone cannot see
    them and lands on them often."""

    def __init__(self) -> None:
        self.beats: Counter[tuple[str, Placement, Placement]] = Counter()
        self.chosen: Counter[tuple[str, Placement]] = Counter()
        self.least = 0  # choices of a least held GPU among GPUs held unequally
        self.most = 0  # choices of a most held one
        self.held_beats: Counter[tuple[tuple[str, ...], tuple[str, ...]]] = Counter()
        self.landed: deque[bool] = deque(maxlen=BLIND_WINDOW)
        self.cleared_on: dict[str, set[Placement]] = {}

    def observe(
        self,
        profile: str,
        gpu_uuid: str,
        chosen: Placement,
        views: Sequence[GpuView],
        placements: Mapping[str, Sequence[Placement]],
    ) -> None:
        """One device of an Allocate: ``chosen`` for ``profile`` on ``gpu_uuid``; ``views``: the
        node's GPUs before the Allocate changes them, in the order of their indexes, ``placements``:
        GPU -> the profile's legal placements there."""
        view = next((v for v in views if v.gpu_uuid == gpu_uuid), GpuView(gpu_uuid, 0))
        self.chosen[profile, chosen] += 1
        for other in open_to(placements.get(gpu_uuid, ()), view):
            if other != chosen:
                self.beats[profile, chosen, other] += 1
        found = _candidates(views, placements)
        loads = {v.gpu_uuid: held_slices(v) for v in found}
        if gpu_uuid in loads and len(set(loads.values())) > 1:
            self.least += loads[gpu_uuid] == min(loads.values())
            self.most += loads[gpu_uuid] == max(loads.values())
        if gpu_uuid in loads:
            mine = held_profiles(view)
            for theirs in {held_profiles(v) for v in found} - {mine}:
                self.held_beats[mine, theirs] += 1
        idle = [i for i in view.owned if i.state is State.IDLE]
        cleared = self.cleared_on.get(gpu_uuid, set())
        if not idle and not cleared:
            return
        exact = any(i.profile == profile and i.placement == chosen for i in idle)
        on_idle = not exact and any(i.placement.overlaps(chosen) for i in idle)
        on_cleared = {c for c in tuple(cleared) if c.overlaps(chosen)}  # a copy, taken in one C call
        self.landed.append(on_idle or bool(on_cleared))
        cleared -= on_cleared

    def cleared(self, gpu_uuid: str, placement: Placement) -> None:
        """``in_the_way`` destroyed the IDLE instance at ``placement`` on ``gpu_uuid``."""
        self.cleared_on.setdefault(gpu_uuid, set()).add(placement)

    @property
    def blind(self) -> bool:
        """The scheduler does not avoid IDLE instances: at least ``BLIND_SHARE`` of the last Allocates
        on a GPU with IDLE instances landed on one (or on one cleared for it)."""
        seen = len(self.landed)
        return seen >= BLIND_MIN and sum(self.landed) >= BLIND_SHARE * seen

    def expected(self, profile: str, open_: Sequence[Placement]) -> Placement | None:
        """The placement the scheduler is expected to choose for ``profile`` among ``open_``: the only
        one, or the one that beat the most others there (more often than it lost to each), then the
        one chosen most often; None before any of them was chosen."""
        if len(open_) == 1:
            return open_[0]

        def wins(q: Placement) -> int:
            return sum(1 for r in open_ if r != q and self.beats[profile, q, r] > self.beats[profile, r, q])

        best = max(open_, key=lambda q: (wins(q), self.chosen[profile, q], -q.start), default=None)
        if best is None or self.chosen[profile, best] == 0:
            return None
        return best

    def targets(
        self, views: Sequence[GpuView], placements: Mapping[str, Sequence[Placement]]
    ) -> list[GpuView]:
        """The GPUs the scheduler may choose next for a profile (``placements``: GPU -> its legal
        placements): of those with an open placement, each that no other is met before
        (``_before``); all of them when that leaves none."""
        found = _candidates(views, placements)
        return [c for c in found if not any(self._before(d, c) for d in found)] or found

    def _before(self, a: GpuView, b: GpuView) -> bool:
        """The scheduler meets ``a`` before ``b``: by what the pods hold on each (``held_profiles``),
        as it chose between those before; never compared, by ``held_slices`` in the direction it
        chose at least twice as often as the other."""
        ha, hb = held_profiles(a), held_profiles(b)
        if ha == hb:
            return False
        won, lost = self.held_beats[ha, hb], self.held_beats[hb, ha]
        if won != lost:
            return won > lost
        if max(self.least, self.most) <= 2 * min(self.least, self.most):
            return False
        sa, sb = held_slices(a), held_slices(b)
        return sa < sb if self.least > self.most else sa > sb


def held_profiles(view: GpuView) -> tuple[str, ...]:
    """The profiles of what the pods hold on the GPU (every instance but an IDLE one), sorted."""
    return tuple(sorted(i.profile for i in view.owned if i.state is not State.IDLE))


def held_slices(view: GpuView) -> int:
    """The memory slices of the GPU what the pods hold (every instance but an IDLE one) occupies."""
    return sum(i.placement.size for i in view.owned if i.state is not State.IDLE)


def open_to(placements: Sequence[Placement], view: GpuView) -> list[Placement]:
    """The placements no instance but an IDLE one occupies (owned, foreign or pending)."""
    taken = [i.placement for i in view.owned if i.state is not State.IDLE]
    taken += [f.placement for f in view.foreign] + [r.placement for r in view.pending]
    return [p for p in placements if not any(p.overlaps(t) for t in taken)]


def _candidates(views: Sequence[GpuView], placements: Mapping[str, Sequence[Placement]]) -> list[GpuView]:
    return [v for v in views if open_to(placements.get(v.gpu_uuid, ()), v)]


def in_the_way(
    views: Sequence[GpuView],
    choices: Choices,
    reserve: Mapping[str, Mapping[str, Sequence[Placement]]],
    *,
    pending: Collection[Reservation] = (),
) -> list[Trim]:
    """With a scheduler that cannot see IDLE instances (``Choices.blind``): for each profile of
    ``reserve`` (GPU -> profile -> placements), on each GPU the scheduler may choose next for it
    (``Choices.targets``), the IDLE instances that overlap the placement it is expected to choose
    there (``Choices.expected`` among ``open_to``), unless an IDLE instance of that profile sits
    exactly there (the request reuses it). Such a scheduler lands on them whatever the node keeps
    free elsewhere, and its Allocate would destroy them inline first; destroyed now, it only creates."""
    if not choices.blind:
        return []
    out: list[Trim] = []
    gone: set[tuple[str, OwnedInstance]] = set()
    profiles = dict.fromkeys(name for by_profile in reserve.values() for name in by_profile)
    for profile in profiles:
        placements = {g: by[profile] for g, by in reserve.items() if profile in by}
        for view in choices.targets(views, placements):
            p = choices.expected(profile, open_to(placements[view.gpu_uuid], view))
            if p is None:
                continue
            idle = [i for i in view.owned if i.state is State.IDLE and (view.gpu_uuid, i) not in gone]
            if any(i.profile == profile and i.placement == p for i in idle):
                continue
            protected = _protected(view, pending)
            victims = [i for i in _lru(idle) if i.placement.overlaps(p) and trimmable(view, i, protected)]
            out += [Trim(view.gpu_uuid, i, Cause.IN_THE_WAY, profile) for i in victims]
            gone |= {(view.gpu_uuid, i) for i in victims}
    return out
