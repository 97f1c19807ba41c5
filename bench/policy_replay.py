#!/usr/bin/env python3
"""Replays ``trace.py``'s seeded trace over the sidecar's pure decisions, with no sidecar (not a test).

The ``advised`` scheduler (``advice.rank_placements``, the best class on the lowest GPU) and the node
reserve (``idle_policy.node_reserve``) are the sidecar's own functions, so the ``reserve`` and ``none``
rows have the GI creations, reclaims and unschedulable pods of ``trace.py``'s advised rows. Other
rows are release policies that are not in the sidecar: trims thresholded on the chance that a
profile's next event is an arrival, two clairvoyant ones that read the trace's future (bounds,
not policies), and a warm pool that creates idle instances in the background. Latency is the
model's at real scale; the mean ratio is against eager, where every Allocate is one create.

The results: ``bench/README.md``; what each row is, the runs and what they showed: ``bench/HISTORY.md``,
"policy_replay.py".
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from msgspec.structs import replace
from trace_state import MEMORY_SLICES
from trace_workload import GPUS, LOAD, MIX, MODEL_S, OTHER_S, Pod, make_trace

from sidecar.model.advice import Cost, GpuView, OwnedInstance, RankedPlacement, rank_placements
from sidecar.model.domain import State
from sidecar.model.idle_policy import Cause, IdleSettings, Trim, node_reserve
from sidecar.nvml.port import Placement
from sidecar.nvml.tables.hopper import H100_80GB

# Real-scale model of one Allocate: a create is the GI and CI creates plus six other calls (the MIG
# mode, two read-backs, the MIG UUID proof); a reclaim adds a CI and a GI destroy per victim.
CREATE_S = MODEL_S["create-gi"] + MODEL_S["create-ci"] + 6 * OTHER_S
DESTROY_S = MODEL_S["destroy-ci"] + MODEL_S["destroy-gi"]
REUSE_S = 3 * OTHER_S
PLACEMENTS = {
    p.name: tuple(Placement(s, p.size) for s in p.starts) for p in H100_80GB.profiles if p.name in dict(MIX)
}
RESERVE = {f"gpu-{g}": PLACEMENTS for g in range(GPUS)}
# Every profile of the GPU, as an operator who lists all the scheduler allows would name them.
EVERY_PROFILE = {p.name: tuple(Placement(s, p.size) for s in p.starts) for p in H100_80GB.profiles}
ASKED_WITHIN_S = 3600.0  # --idle-reserve auto's default window, in trace seconds


@dataclass
class Node:
    """The replayed node: owned instances per GPU by placement, the clock, the live pods per profile."""

    trace: list[Pod]
    owned: dict[str, dict[Placement, OwnedInstance]] = field(default_factory=dict)
    events: list[tuple[float, int, int]] = field(default_factory=list)
    now: float = 0.0
    tick: int = 0
    active: Counter[str] = field(default_factory=Counter)
    # Live pods of each profile, integrated over time (pod-seconds, so not a count).
    area: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    asked: dict[str, float] = field(default_factory=dict)  # profile -> its last arrival, served or not

    def advance(self, now: float) -> None:
        for profile, live in self.active.items():
            self.area[profile] += live * (now - self.now)
        self.now = now

    def measured_load(self, profile: str) -> float:
        """The time average of the profile's live pods so far: its offered load, by Little's law,
        as the sidecar could measure it from its own Allocates and Releases."""
        return self.area[profile] / self.now if self.now else 0.0

    def views(self) -> list[GpuView]:
        return [
            GpuView(g, MEMORY_SLICES, owned=tuple(sorted(by.values(), key=lambda i: i.placement.start)))
            for g, by in self.owned.items()
        ]

    def idle(self) -> Counter[str]:
        return Counter(i.profile for by in self.owned.values() for i in by.values() if i.state is State.IDLE)


Policy = Callable[[Node], list[Trim]]
Gate = Callable[[Node, str], bool]  # whether the warm pool (or a thresholded trim) serves a profile now


def advised(profile: str, views: Sequence[GpuView]) -> tuple[RankedPlacement, str] | None:
    """The best class of each GPU's ranking, the lowest GPU on ties (``trace_state``'s advised)."""
    best: tuple[RankedPlacement, str] | None = None
    for v in views:
        top = next(
            (r for r in rank_placements(profile, PLACEMENTS[profile], v) if r.cost != Cost.BLOCKED), None
        )
        if top is not None and (best is None or top.cost < best[0].cost):
            best = (top, v.gpu_uuid)
        if best is not None and best[0].cost == Cost.REUSE:
            break
    return best


def reserve(node: Node) -> list[Trim]:
    """The sidecar's node reserve, as ``--idle-reserve`` runs it."""
    return node_reserve(node.views(), RESERVE)


def reserve_every_profile(node: Node) -> list[Trim]:
    """The node reserve with every profile of the GPU named (``--idle-reserve`` listing them all)."""
    return node_reserve(node.views(), dict.fromkeys(RESERVE, EVERY_PROFILE))


def reserve_asked(node: Node) -> list[Trim]:
    """``--idle-reserve auto``: the profiles asked for within ``ASKED_WITHIN_S``, of every profile."""
    asked = IdleSettings(reserve_asked_within_s=ASKED_WITHIN_S).reserved(node.asked, node.now)
    wanted = {p: EVERY_PROFILE[p] for p in asked}
    return node_reserve(node.views(), dict.fromkeys(RESERVE, wanted))


def offered_load(_: Node, profile: str) -> float:
    """Mean live pods of ``profile`` in the trace: its share of the pods ``make_trace`` keeps live
    (the load of memory slices over the mix's mean slices per pod, by Little's law)."""
    size = {p.name: p.size for p in H100_80GB.profiles}
    live = LOAD * GPUS * MEMORY_SLICES / sum(size[p] * w for p, w in MIX)
    return live * dict(MIX)[profile]


def _trims_for(
    node: Node, wanted: Callable[[str], bool], key: Callable[[tuple[OwnedInstance, ...]], float]
) -> list[Trim]:
    """The first profile ``wanted`` with no ready placement on the node, freed by the option of the
    smallest ``key`` (then, as the sidecar's reserve, the least recently used, the fewest victims,
    the lower GPU and rank)."""
    views = node.views()
    for profile, placements in PLACEMENTS.items():
        if not wanted(profile):
            continue
        options = []
        for g, v in enumerate(views):
            ranked = rank_placements(profile, placements, v)
            if any(r.cost in (Cost.REUSE, Cost.FREE) for r in ranked):
                break
            options += [
                (
                    (key(r.reclaim), max(i.last_used for i in r.reclaim), len(r.reclaim), g, n),
                    v.gpu_uuid,
                    r.reclaim,
                )
                for n, r in enumerate(ranked)
                if r.cost is Cost.RECLAIM
            ]
        else:
            if options:
                _, gpu, victims = min(options, key=lambda o: o[0])
                return [Trim(gpu, i, Cause.RESERVE, profile) for i in victims]
    return []


def _most_copies(node: Node) -> Callable[[tuple[OwnedInstance, ...]], float]:
    idle = node.idle()
    return lambda victims: -min(idle[v.profile] for v in victims)


def threshold(theta: float) -> Policy:
    """Trim for a profile only when its next event is an arrival with probability >= ``theta``.

    Each profile's live pods are an M/M/infinity queue (Poisson arrivals, exponential lifetimes), so
    that probability is load / (load + live pods), and nothing else in the past predicts it better."""

    gate = arrival_first(theta, offered_load)

    def policy(node: Node) -> list[Trim]:
        return _trims_for(node, lambda p: gate(node, p), _most_copies(node))

    return policy


def _next_is_arrival(node: Node, profile: str) -> bool:
    nxt = min(((t, kind) for t, kind, i in node.events if node.trace[i].profile == profile), default=None)
    return nxt is not None and nxt[1] == 1


def arrival_first(theta: float, load: Callable[[Node, str], float]) -> Gate:
    """Pass a profile only when its next event is an arrival with probability >= ``theta``, that is
    load / (load + live pods), with the load from ``load``."""

    def gate(node: Node, profile: str) -> bool:
        rho = load(node, profile)
        return rho > 0 and rho / (rho + node.active[profile]) >= theta

    return gate


def clairvoyant(*, victims: bool) -> Policy:
    """Trim for a profile only when its next event is an arrival (read from the trace's future); with
    ``victims``, also destroy the copies whose profile's next miss is furthest away (Belady)."""
    arrivals: dict[str, list[float]] = {}

    def policy(node: Node) -> list[Trim]:
        if not arrivals:
            for pod in node.trace:
                arrivals.setdefault(pod.profile, []).append(pod.arrive)
        idle = node.idle()

        def next_miss(chosen: tuple[OwnedInstance, ...]) -> float:
            soonest = math.inf
            for profile, n in Counter(v.profile for v in chosen).items():
                times = arrivals[profile]
                j = bisect.bisect_right(times, node.now) + idle[profile] - n
                soonest = min(soonest, times[j] if j < len(times) else math.inf)
            return -soonest

        key = next_miss if victims else _most_copies(node)
        return _trims_for(node, lambda p: _next_is_arrival(node, p), key)

    return policy


@dataclass
class Row:
    name: str
    served: int = 0
    creates: int = 0
    background: int = 0
    inline: int = 0
    unschedulable: int = 0
    latency: list[float] = field(default_factory=list)


def replay(
    name: str, trace: list[Pod], policy: Policy | None, *, warm: Sequence[str] = (), gate: Gate | None = None
) -> Row:
    """One pass over the trace; after every event ``policy`` trims until it returns nothing, then (the
    warm pool) each profile of ``warm`` with no idle copy, and that ``gate`` lets through, gets one
    created in the background on its advised FREE placement, when that leaves the reserve nothing
    to trim."""
    node = Node(trace, owned={g: {} for g in RESERVE})
    node.events = [(p.arrive, 1, i) for i, p in enumerate(trace)]
    heapq.heapify(node.events)
    live: dict[int, tuple[str, Placement]] = {}
    row = Row(name)
    while node.events:
        now, kind, i = heapq.heappop(node.events)
        node.advance(now)
        node.tick += 1
        pod = trace[i]
        if kind == 1:
            node.asked[pod.profile] = now  # an arrival asks, whether it is served or not
        if kind == 0:
            gpu, at = live.pop(i)
            node.owned[gpu][at] = replace(node.owned[gpu][at], state=State.IDLE, last_used=node.tick)
            node.active[pod.profile] -= 1
        elif (best := advised(pod.profile, node.views())) is None:
            row.unschedulable += 1
        else:
            ranked, gpu = best
            row.served += 1
            node.active[pod.profile] += 1
            if ranked.cost is Cost.REUSE:
                row.latency.append(REUSE_S)
                node.owned[gpu][ranked.placement] = replace(
                    node.owned[gpu][ranked.placement], state=State.ACTIVE
                )
            else:
                row.creates += 1
                row.inline += bool(ranked.reclaim)
                for v in ranked.reclaim:
                    del node.owned[gpu][v.placement]
                row.latency.append(CREATE_S + DESTROY_S * len(ranked.reclaim))
                node.owned[gpu][ranked.placement] = OwnedInstance(
                    pod.profile, ranked.placement, State.ACTIVE, f"m{i}"
                )
            live[i] = (gpu, ranked.placement)
            heapq.heappush(node.events, (pod.leave, 0, i))
        while policy is not None and (trims := policy(node)):
            for t in trims:
                del node.owned[t.gpu_uuid][t.instance.placement]
        while warm and _warm_one(node, [p for p in warm if gate is None or gate(node, p)]):
            row.background += 1
    return row


def _warm_one(node: Node, warm: Sequence[str]) -> bool:
    idle = node.idle()
    for profile in warm:
        if idle[profile]:
            continue
        for v in node.views():
            free = next(
                (r for r in rank_placements(profile, PLACEMENTS[profile], v) if r.cost is Cost.FREE), None
            )
            if free is None:
                continue
            node.owned[v.gpu_uuid][free.placement] = OwnedInstance(
                profile, free.placement, State.IDLE, f"w{node.tick}"
            )
            if not reserve(node):
                return True
            del node.owned[v.gpu_uuid][free.placement]
    return False


COLUMNS = (
    ("release policy (advised scheduler)", 36),
    ("served", 7),
    ("GI/pod", 8),
    ("bg/pod", 8),
    ("all/pod", 8),
    ("inline", 8),
    ("mean ms", 9),
    ("p99 ms", 8),
    ("mean/eager", 11),
    ("unsched", 8),
)


def report(rows: Sequence[Row]) -> None:
    """GI/pod: Allocates that create; bg/pod: background creates (the warm pool); inline: pods whose
    Allocate destroys idle cache before its create."""
    head = "".join(f"{name:<{w}}" if n == 0 else f"{name:>{w}}" for n, (name, w) in enumerate(COLUMNS))
    print(head)
    print("-" * len(head))
    for r in rows:
        n = r.served
        lat = sorted(r.latency)
        mean = sum(lat) / n
        cells = (
            r.name,
            str(n),
            f"{r.creates / n:.3f}",
            f"{r.background / n:.3f}",
            f"{(r.creates + r.background) / n:.3f}",
            f"{r.inline / n:.3f}",
            f"{mean * 1e3:.1f}",
            f"{lat[min(n - 1, round(0.99 * (n - 1)))] * 1e3:.0f}",
            f"{CREATE_S / mean:.2f}",
            str(r.unschedulable),
        )
        print(
            "".join(
                f"{c:<{w}}" if k == 0 else f"{c:>{w}}"
                for k, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--pods", type=int, default=2000, help="pods in the trace (default 2000, as trace.py)"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="*", default=[7], help="trace seeds (default 7, as trace.py)"
    )
    args = parser.parse_args()
    for seed in args.seeds:
        print(
            f"\n{args.pods} pods, seed {seed}; model: create {CREATE_S * 1e3:.0f} ms, "
            f"destroy {DESTROY_S * 1e3:.0f} ms per victim, reuse {REUSE_S * 1e3:.0f} ms"
        )
        trace = make_trace(args.pods, seed)
        policies: list[tuple[str, Policy | None, tuple[str, ...], Gate | None]] = [
            ("none (idle/advised)", None, (), None),
            ("reserve (idle+reserve/advised)", reserve, (), None),
            ("reserve, every profile named", reserve_every_profile, (), None),
            ("reserve auto (asked within 1 h)", reserve_asked, (), None),
            *((f"threshold {theta}", threshold(theta), (), None) for theta in (0.3, 0.35, 0.4)),
            ("clairvoyant when", clairvoyant(victims=False), (), None),
            ("clairvoyant when and victims", clairvoyant(victims=True), (), None),
            ("reserve + warm 1g.10gb", reserve, ("1g.10gb",), None),
            ("reserve + warm every profile", reserve, tuple(PLACEMENTS), None),
            *(
                (
                    f"reserve + warm gated {theta}",
                    reserve,
                    tuple(PLACEMENTS),
                    arrival_first(theta, offered_load),
                )
                for theta in (0.5, 0.52)
            ),
            (
                "reserve + warm gated 0.5, measured",
                reserve,
                tuple(PLACEMENTS),
                arrival_first(0.5, Node.measured_load),
            ),
        ]
        report([replay(name, trace, policy, warm=warm, gate=gate) for name, policy, warm, gate in policies])
    return 0


if __name__ == "__main__":
    sys.exit(main())
