"""Which IDLE instances the background reconciler destroys: the idle policy off the Allocate path, pure.

The idle cache pays when a request lands on an idle instance, and costs the tail when a request has to
destroy one before its create. This decision moves that destroy off the pod's critical path. It runs
over plain values (the ``advice`` module's ``GpuView`` per GPU, the clock reading ``now``); the caller
destroys what it returns through the same recorded, crash-safe teardown as any reclaim. Three causes,
each off unless set (``IdleSettings()`` trims nothing; ``serve``'s own default is the ``auto`` reserve,
``config.py``):

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

Causes apply in that order, each seeing the instances the earlier ones chose as gone; an instance is
trimmed at most once, under the first cause that chose it. Never trimmed: anything not IDLE (ACTIVE,
ERROR, CREATING, DELETING), foreign GIs (never in ``owned``), an IDLE instance marked ``busy`` (a
process runs on it) and one protected by a pending reservation (``pending``, or the view's own).
"""

from __future__ import annotations

import enum
from collections import Counter
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
