"""The trace benchmark's client side: its copy of what ``GetState`` shows, kept from the RPC answers,
the wait for the background reserve, and the schedulers that decide over them (not a test).

A ``GetState`` lists every GPU's instances on the hardware (about a hundred NVML calls on 8 GPUs),
and the schedulers and the reserve's settle check asked for one before every decision: most of a
run's wall clock went there, none of it measured. Every change the benchmark causes comes back in an
answer (an Allocate names the device it created or reused and the IDLE instances it reclaimed; a
Release the instances it made IDLE; a ReclaimIdle the ones it destroyed), so the mirror follows them
exactly. The only change it cannot see is the background reserve's trim; ``Settler`` predicts it
with the sidecar's own reserve decision over the mirror and reloads the mirror from ``GetState`` when
one is due. ``differs`` compares the mirror with a ``GetState`` (``bench/trace.py --check`` does so
after every event; every run does so once at the end of a variant).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
import msgspec
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc
from hami_order import Device, Profile, hami_choice, helper_choice

from sidecar.model.advice import GpuView, OwnedInstance
from sidecar.model.domain import ForeignInstance, State
from sidecar.model.idle_policy import Choices, in_the_way, node_reserve, trim
from sidecar.nvml.port import Placement

MEMORY_SLICES = 8  # an H100-80GB's memory-slice axis

# gpu uuid -> profile -> legal placements, in DiscoverProfiles order
Placements = Mapping[str, Mapping[str, Sequence[Placement]]]


class Published(msgspec.Struct, frozen=True):
    """What HAMi's plugin publishes for one GPU in ``hami.io/node-nvidia-register``: its index, its
    memory, its count (the largest instance count of a published profile) and the allow-listed
    profiles (the trace's mix)."""

    index: int
    memory_mb: int
    count: int
    profiles: Mapping[str, Profile]


def placement(p: Any) -> Placement:
    return Placement(int(p.start), int(p.size))


def view_of(gpu: Any) -> GpuView:
    """One ``GpuState`` of a ``GetState`` answer as the plain values the schedulers and the reserve
    decision read (instances in GetState's order: by placement)."""
    return GpuView(
        gpu_uuid=gpu.gpu.uuid,
        memory_slices=MEMORY_SLICES,
        owned=tuple(
            OwnedInstance(
                i.profile, placement(i.placement), State(pb.InstanceState.Name(i.state)), i.mig_uuid
            )
            for i in gpu.instances
        ),
        foreign=tuple(
            ForeignInstance(gpu.gpu.uuid, f.profile, placement(f.placement), f.gpu_instance_id)
            for f in gpu.foreign
        ),
    )


class Mirror:
    """Per GPU (in ``ListGpus`` order), the owned instances by MIG UUID, as the RPC answers left them."""

    def __init__(self, gpus: Iterable[str]) -> None:
        self._owned: dict[str, dict[str, OwnedInstance]] = {g: {} for g in gpus}
        self._foreign: dict[str, tuple[ForeignInstance, ...]] = dict.fromkeys(self._owned, ())
        self._views: list[GpuView] | None = None

    def views(self) -> list[GpuView]:
        if self._views is None:
            self._views = [
                GpuView(
                    gpu_uuid=g,
                    memory_slices=MEMORY_SLICES,
                    owned=tuple(sorted(owned.values(), key=lambda i: (i.placement.start, i.placement.size))),
                    foreign=self._foreign[g],
                )
                for g, owned in self._owned.items()
            ]
        return self._views

    def allocated(self, response: Any) -> None:
        self.reclaimed(response.reclaimed)
        for d in response.devices:
            self._owned[d.gpu_uuid][d.mig_uuid] = OwnedInstance(
                d.profile, placement(d.placement), State.ACTIVE, d.mig_uuid
            )
        self._views = None

    def released(self, refs: Iterable[Any]) -> None:
        for r in refs:
            self._owned[r.gpu_uuid][r.mig_uuid] = OwnedInstance(
                r.profile, placement(r.placement), State.IDLE, r.mig_uuid
            )
        self._views = None

    def reclaimed(self, refs: Iterable[Any]) -> None:
        for r in refs:
            self._owned[r.gpu_uuid].pop(r.mig_uuid, None)
        self._views = None

    def load(self, state: Any) -> None:
        """Take the sidecar's word for it (after a background trim, or an RPC that failed)."""
        views = [view_of(g) for g in state.gpus]
        self._owned = {v.gpu_uuid: {i.mig_uuid: i for i in v.owned} for v in views}
        self._foreign = {v.gpu_uuid: v.foreign for v in views}
        self._views = None

    def differs(self, state: Any) -> str:
        """What a ``GetState`` answer shows that the mirror does not (empty when they agree)."""
        theirs, ours = [view_of(g) for g in state.gpus], self.views()
        if [v.gpu_uuid for v in theirs] != [v.gpu_uuid for v in ours]:
            return "GPU order differs from ListGpus"
        for t, o in zip(theirs, ours, strict=True):
            if set(t.owned) != set(o.owned) or t.foreign != o.foreign:
                return f"{t.gpu_uuid}: sidecar {t.owned} {t.foreign}, mirror {o.owned} {o.foreign}"
        return ""


def all_ready(views: Sequence[GpuView], reserve: Placements) -> bool:
    """Every profile of ``reserve`` has, on some GPU, an IDLE instance of it (REUSE) or a placement
    that nothing overlaps (FREE). Only for views without pending reservations or held records, as
    the mirror's are."""
    profiles = {name for by_profile in reserve.values() for name in by_profile}
    for view in views:
        taken = [i.placement for i in view.owned] + [f.placement for f in view.foreign]
        for name in list(profiles):
            legal = reserve.get(view.gpu_uuid, {}).get(name, ())
            if legal and (
                any(i.state is State.IDLE and i.profile == name for i in view.owned)
                or any(not any(p.overlaps(t) for t in taken) for p in legal)
            ):
                profiles.discard(name)
        if not profiles:
            return True
    return not profiles


class Settler:
    """Waits, after an event, until the sidecar's background free reserve has nothing left to do.

    In the trace's own time about 30 s pass between two events, far more than a trim takes; replayed
    back to back, the next event would otherwise race the trim the last one woke. Whether a trim is
    due is the sidecar's own pure reserve decision (``idle_policy.node_reserve``) over the mirror:
    when it chooses nothing, the round the event woke trims nothing and there is nothing to wait for.
    That decision trims only for a profile with no ready placement (REUSE or FREE) on the node, so
    when the mirror shows one for every profile (``all_ready``, cheap) it is not asked at all.
    The same goes for ``idle_policy.in_the_way``, over a ``Choices`` that learns what the sidecar's
    learns: the same Allocates (``observe``, before each is sent, over the mirror) and the same
    destroys of that cause (read from the answer the wait ends with).
    When it chooses something, ``GetState`` is asked until nothing is in flight and the same decision
    over its answer chooses nothing (each ask takes every GPU lock, so it waits behind a destroy
    rather than spinning), and the mirror takes that answer. False if that took over ``timeout_s``.

    ``quiet`` comes just before a timed Allocate: even a round that trims nothing is about a
    millisecond of Python on the sidecar's GIL, woken by the last event, and would otherwise run
    inside the Allocate it races. The sidecar answers a ``GetInfo`` only once its reconciler thread
    lets go of the GIL, so the Allocate that follows starts on a quiet sidecar (measured: without it,
    REUSED Allocates of the reserve rows took about 0.4-0.9 ms more at the median; a second
    ``GetInfo`` changes nothing, and on a sidecar without the reserve neither does the first)."""

    def __init__(
        self,
        stub: pb_grpc.MigSidecarStub,
        mirror: Mirror,
        reserve: Placements,
        timeout_s: float,
        *,
        auto: bool = False,
        per_gpu: bool = False,
    ) -> None:
        self.stub = stub
        self.per_gpu = per_gpu
        self.mirror = mirror
        self.all = reserve
        self.reserve = {} if auto else reserve
        self.auto = auto
        self.asked: set[str] = set()
        self.timeout_s = timeout_s
        self.waits = 0  # events after which a trim was due
        self.choices = Choices()  # the sidecar's own record of the scheduler's choices, kept alike

    def ask(self, profile: str) -> None:
        """An Allocate asked for ``profile``: with ``--idle-reserve auto`` the reserve keeps it ready
        from then on (its window, an hour by default, outlasts a whole run: a run takes minutes of
        wall clock, and in the trace's own time every profile of the mix is asked for every few
        minutes)."""
        if self.auto and profile not in self.asked:
            self.asked.add(profile)
            self.reserve = {
                g: {name: ps for name, ps in by.items() if name in self.asked} for g, by in self.all.items()
            }

    def observe(self, gpu: str, profile: str, where: Placement) -> None:
        """An Allocate is about to ask for ``where``: the same lesson the sidecar takes from it."""
        placements = {g: by[profile] for g, by in self.all.items() if profile in by}
        self.choices.observe(profile, gpu, where, self.mirror.views(), placements)

    def quiet(self) -> None:
        self.stub.GetInfo(pb.GetInfoRequest())

    def _due(self, views: Sequence[GpuView]) -> bool:
        """Whether the reserve (``--idle-reserve-per-gpu``: on every GPU, as ``trim`` decides) would
        trim over ``views``."""
        if self.per_gpu:
            return bool(trim(views, 0.0, reserve=self.reserve))
        if in_the_way(views, self.choices, self.reserve):
            return True
        return not all_ready(views, self.reserve) and bool(node_reserve(views, self.reserve))

    def settle(self) -> bool:
        views = self.mirror.views()
        if not self._due(views):
            return True
        self.waits += 1
        cleared = {(t.gpu_uuid, t.instance.placement) for t in in_the_way(views, self.choices, self.reserve)}
        before = {(v.gpu_uuid, i.placement) for v in views for i in v.owned if i.state is State.IDLE}
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            state = self.stub.GetState(pb.GetStateRequest())
            views = [view_of(g) for g in state.gpus]
            busy = any(i.state in (State.CREATING, State.DELETING) for v in views for i in v.owned)
            if not busy and not self._due(views):
                self.mirror.load(state)
                after = {(v.gpu_uuid, i.placement) for v in views for i in v.owned if i.state is State.IDLE}
                for gpu, p in cleared & (before - after):
                    self.choices.cleared(gpu, p)
                return True
        return False


class NotServedError(Exception):
    """The sidecar does not serve what a variant needs; the row prints n/a with this reason."""


# -- schedulers ------------------------------------------------------------------------------------

Choice = tuple[str, Placement]


class Scheduler:
    """Chooses a GPU and placement from the mirror of the sidecar's state (``Mirror``)."""

    name = ""
    refresh_s = 0.0  # trace seconds between a scheduler's copies of the idle annotation (``Hami``)

    def __init__(
        self,
        stub: pb_grpc.MigSidecarStub,
        placements: Placements,
        mirror: Mirror,
        published: Mapping[str, Published],
    ) -> None:
        self.stub = stub
        self.placements = placements
        self.mirror = mirror
        self.published = published

    def choose(self, profile: str) -> Choice | None:
        raise NotImplementedError

    def clock(self, now: float) -> None:
        """The trace time of the event about to run (before it runs); most schedulers need none."""


class FirstFit(Scheduler):
    """First GPU, first placement not under an ACTIVE (or foreign, or in-flight) instance; idle = free."""

    name = "first-fit"

    def choose(self, profile: str) -> Choice | None:
        for gpu in self.mirror.views():
            held = [i.placement for i in gpu.owned if i.state is not State.IDLE]
            held += [f.placement for f in gpu.foreign]
            for p in self.placements[gpu.gpu_uuid][profile]:
                if not any(p.overlaps(h) for h in held):
                    return gpu.gpu_uuid, p
        return None


class PreferIdle(Scheduler):
    """An exact IDLE match, then a free placement, then the fewest idle slices to reclaim (lowest GPU)."""

    name = "prefer-idle"

    def choose(self, profile: str) -> Choice | None:
        best: tuple[tuple[int, int, int], Choice] | None = None
        for g, gpu in enumerate(self.mirror.views()):
            idle = [i for i in gpu.owned if i.state is State.IDLE]
            held = [i.placement for i in gpu.owned if i.state is not State.IDLE]
            held += [f.placement for f in gpu.foreign]
            for p in self.placements[gpu.gpu_uuid][profile]:
                if any(p.overlaps(h) for h in held):
                    continue
                under = [i for i in idle if p.overlaps(i.placement)]
                exact = len(under) == 1 and under[0].profile == profile and under[0].placement == p
                cost = (0, 0) if exact else (1, 0) if not under else (2, sum(i.placement.size for i in under))
                key = (*cost, g)
                if best is None or key < best[0]:
                    best = key, (gpu.gpu_uuid, p)
        return None if best is None else best[1]


class Advised(Scheduler):
    """The best class over the GPUs, each GPU's own first entry of RankPlacements, lowest GPU on ties.

    Asks only the GPUs that can change that answer: REUSE beats every other class, so while the
    mirror holds an IDLE instance of the profile, the GPUs holding one are asked first, lowest first,
    up to the first REUSE; with none, every GPU lowest first up to the first FREE (the best class
    left). Should the mirror be wrong, the answer still comes from asking every GPU."""

    name = "advised"

    def choose(self, profile: str) -> Choice | None:
        views = self.mirror.views()
        holding = [
            v.gpu_uuid for v in views if any(i.state is State.IDLE and i.profile == profile for i in v.owned)
        ]
        if holding:
            found = self._best(profile, holding, pb.REUSE)
            if found is not None and found[0] == pb.REUSE:
                return found[1]
        found = self._best(profile, [v.gpu_uuid for v in views], pb.REUSE if holding else pb.FREE)
        return None if found is None else found[1]

    def _best(self, profile: str, uuids: Sequence[str], enough: int) -> tuple[int, Choice] | None:
        """(class, choice) of the best first entry over ``uuids`` in order; stops at class ``enough``."""
        best: tuple[int, Choice] | None = None
        for uuid in uuids:
            try:
                ranked = self.stub.RankPlacements(pb.RankPlacementsRequest(gpu_uuid=uuid, profile=profile))
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise NotServedError("RankPlacements not served") from err
                raise
            top = next((r for r in ranked.placements if r.cost != pb.BLOCKED), None)
            if top is not None and (best is None or top.cost < best[0]):
                best = top.cost, (uuid, placement(top.placement))
            if best is not None and best[0] <= enough:
                break
        return best


class Hami(Scheduler):
    """HAMi's scheduler (``hami_order``): the v2.10 placement order or #2855's scoring, each alone
    (``helper`` off: blind to IDLE instances, which it cannot see) or with the scheduler helper's
    re-ranking over the idle inventory the plugin publishes.

    The helper sees the inventory as HAMi's scheduler holds it: a copy of the node taken at its
    refresh, every ``refresh_s`` of trace time (HAMi's 15 s tick; the plugin publishes within 2 s of a
    change, left out here). ``clock`` takes the copy from the mirror when a tick has passed: it runs
    before every event, so the mirror then holds exactly the events before the tick. With
    ``refresh_s`` 0 the helper reads the mirror itself. Reservations (what HAMi counts as held) are
    always fresh, as HAMi reads them from the pods."""

    order = "2855"
    policy = "spread"
    helper = False
    gpu_key = "policy"
    refresh_s = 15.0
    _seen: dict[str, list[tuple[str, Placement]]] | None = None
    _next_tick = 0.0

    def _idle(self) -> dict[str, list[tuple[str, Placement]]]:
        return {
            v.gpu_uuid: [(i.profile, i.placement) for i in v.owned if i.state is State.IDLE]
            for v in self.mirror.views()
        }

    def clock(self, now: float) -> None:
        if self.helper and self.refresh_s > 0 and (self._seen is None or now >= self._next_tick):
            self._seen = self._idle()
            self._next_tick = (now // self.refresh_s + 1) * self.refresh_s

    def choose(self, profile: str) -> Choice | None:
        views = self.mirror.views()
        devices = []
        for v in views:
            pub = self.published[v.gpu_uuid]
            held = tuple((i.profile, i.placement) for i in v.owned if i.state is not State.IDLE)
            devices.append(Device(v.gpu_uuid, pub.index, pub.count, pub.memory_mb, 100, pub.profiles, held))
        if not self.helper:
            return hami_choice(devices, profile, self.order, self.policy)
        idle = self._idle() if self.refresh_s <= 0 or self._seen is None else self._seen
        return helper_choice(devices, profile, self.order, idle, policy=self.policy, gpu_key=self.gpu_key)


def _hami(order: str, policy: str, helper: str = "") -> type[Scheduler]:
    """HAMi at ``order`` under the GPU ``policy``; ``helper`` "" none, else the helper's preference
    (``policy``, its default, or ``idle-first``; ``placement-key``: the placement key alone)."""
    suffix = {
        "": "",
        "policy": "+helper",
        "idle-first": "+helper-idle-first",
        "placement-key": "+placement-key",
    }
    name = f"hami-{order}-{policy}{suffix[helper]}"
    key = "" if helper == "placement-key" else helper
    attrs = {"name": name, "order": order, "policy": policy, "helper": bool(helper), "gpu_key": key}
    return type(name, (Hami,), attrs)


HAMI_SCHEDULERS: tuple[type[Scheduler], ...] = tuple(
    _hami(order, policy, helper)
    for order in ("v2.10", "2855")
    for policy in ("spread", "binpack")
    for helper in ("", "policy", "idle-first", "placement-key")
)

_ALL: tuple[type[Scheduler], ...] = (FirstFit, PreferIdle, Advised, *HAMI_SCHEDULERS)
SCHEDULERS: dict[str, type[Scheduler]] = {s.name: s for s in _ALL}
