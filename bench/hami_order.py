"""How HAMi's scheduler chooses the GPU and the placement of a one-device MIG request, modelled for
the trace benchmark, and the scheduler helper's re-ranking over it (not a test).

Written from reading HAMi's scheduler, not copied from it: the ``spread`` GPU order over pods'
reservations only (``meet_order``), v2.10's ``orderedMigPlacements`` (``v210_placements``), #2855's
scored placements (``scored_placements``), and this project's helper, Go package ``schedule``
(``rerank``).

What each function follows:

* the GPU order (``meet_order``), under either GPU policy: the scheduler scores every device of the
  node for the request (``ComputeScore``: slots used over the device's count, plus cores used over
  its total, plus memory used over its total, equal weights; what the request adds is the same on
  every GPU of one model) and sorts them; under the default ``spread`` policy the highest score
  sorts first, and the NVIDIA ``Fit`` walks the sorted list *from the end*, taking the first device
  that fits. So the least loaded GPU is met first and, among equal scores, the highest index (Go's
  sort of a list this short is an insertion sort, which keeps the annotation's index order among
  ties, and the walk reverses it). Under ``binpack`` the lowest score sorts first, so the busiest
  GPU is met first, ties again from the highest index. "Used" counts only pods' reservations: an
  IDLE instance is not in any of them.
* the placement at v2.10 (``v210_placements``): ``orderedMigPlacements`` re-sorts a profile's
  published placements by start, 1g and 3g profiles from the top, the others from the bottom, and
  ``selectMigPlacement`` takes the first that overlaps no reservation.
* the placement on HAMi master (#2855, merged after v2.10; ``scored_placements``): the card is split
  at its midpoint into two regions (one region when a placement straddles it); the region with the
  fewest published placements is the one reserved for region-sized profiles; each free placement
  is scored by the regions left wholly empty (more first), whether its size matches its region's
  role (matching first), its distance from the card's middle (farther first), then its start.
* the profile: HAMi picks the smallest allow-listed profile whose memory covers the request and
  that has a free placement, which in the trace is the one requested (why: ``bench/HISTORY.md``, "trace.py").

The helper (``rerank``) is this project's scheduler change (Go package ``schedule``): among the GPUs
and placements HAMi found fit, on a GPU the exact IDLE placement of the requested profile first, then
the fewest IDLE slices overwritten (a free placement overwrites none); the GPUs by the same key of
their best placement (a GPU holding that IDLE instance first, then one with a free placement, then
the fewest IDLE slices overwritten), as far as its preference lets the key move them: ``policy``
(``schedule.WithinPolicy``, the default) only among GPUs of equal use (``Device.level``), ``idle-first``
(``schedule.IdleFirst``) before the policy; "" keeps the placement key alone. HAMi's order breaks
every tie.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from sidecar.nvml.port import Placement


class Profile(msgspec.Struct, frozen=True):
    """One published profile, as ``hami.io/node-nvidia-register`` carries it."""

    name: str
    memory_mb: int
    core: int
    placements: tuple[Placement, ...]


class Device(msgspec.Struct, frozen=True):
    """One GPU as the scheduler sees it for one request: its published profiles (allow-listed) and
    the pods' reservations on it (``held``: profile and placement)."""

    uuid: str
    index: int
    count: int  # the largest instance count of a published profile
    total_mem: int
    total_core: int
    profiles: Mapping[str, Profile]
    held: tuple[tuple[str, Placement], ...]

    def score(self) -> float:
        used = len(self.held)
        mem = sum(self.profiles[p].memory_mb for p, _ in self.held if p in self.profiles)
        core = sum(self.profiles[p].core for p, _ in self.held if p in self.profiles)
        return used / self.count + core / self.total_core + mem / self.total_mem

    def level(self) -> tuple[int, int, int]:
        """What the score is computed from (slots, cores and memory used): the helper's ``policy``
        preference takes devices of equal levels as the policy's ties, as the Go helper does."""
        held = [self.profiles[p] for p, _ in self.held if p in self.profiles]
        return len(self.held), sum(p.core for p in held), sum(p.memory_mb for p in held)

    def fits(self, profile: str) -> bool:
        """Fit's own checks before the placement: a slot left, memory and cores left."""
        p = self.profiles.get(profile)
        if p is None or len(self.held) >= self.count:
            return False
        mem = sum(self.profiles[h].memory_mb for h, _ in self.held if h in self.profiles)
        return self.total_mem - mem >= p.memory_mb

    def free(self, profile: str) -> list[Placement]:
        taken = [p for _, p in self.held]
        return [p for p in self.profiles[profile].placements if not any(p.overlaps(t) for t in taken)]


def meet_order(devices: Sequence[Device], policy: str = "spread") -> list[Device]:
    """The order the NVIDIA Fit meets the devices: under ``spread`` the lowest score first, under
    ``binpack`` the highest; on equal scores the highest index (see the module docstring)."""
    ordered = sorted(devices, key=lambda d: d.index)  # the annotation's order
    sign = 1 if policy == "binpack" else -1
    ordered.sort(key=lambda d: sign * d.score())  # stable, as Go's insertion sort
    return ordered[::-1]


def v210_placements(device: Device, profile: str) -> list[Placement]:
    """v2.10: the free placements in ``orderedMigPlacements``' order."""
    top = profile.startswith(("1g.", "3g."))
    ordered = sorted(device.profiles[profile].placements, key=lambda p: -p.start if top else p.start)
    free = set(device.free(profile))
    return [p for p in ordered if p in free]


def _regions(profiles: Mapping[str, Profile]) -> list[tuple[int, int]]:
    slices = max((p.end for prof in profiles.values() for p in prof.placements if p.size), default=0)
    whole = [(0, slices)]
    if slices < 2:
        return whole
    mid = slices // 2
    for prof in profiles.values():
        for p in prof.placements:
            if 0 < p.size < slices and p.start < mid < p.end:
                return whole
    return [(0, mid), (mid, slices)]


def _reserved(profiles: Mapping[str, Profile], regions: Sequence[tuple[int, int]]) -> int:
    """The region with the fewest published placements wholly inside it (the later one on ties)."""
    reserved, best = 0, -1
    for i, (lo, hi) in enumerate(regions):
        inside = [p for prof in profiles.values() for p in prof.placements if p.size]
        count = sum(1 for p in inside if lo <= p.start and p.end <= hi)
        if best < 0 or count <= best:
            reserved, best = i, count
    return reserved


def scored_placements(device: Device, profile: str) -> list[Placement]:
    """#2855: the free placements, best score first, the published order on equal scores."""
    regions = _regions(device.profiles)
    reserved = _reserved(device.profiles, regions)
    taken = [p for _, p in device.held]

    def key(c: Placement) -> tuple[int, int, int, int]:
        after = [*taken, c]
        empty = sum(1 for lo, hi in regions if not any(Placement(lo, hi - lo).overlaps(t) for t in after))
        mismatch, distance = 0, 0
        for i, (lo, hi) in enumerate(regions):
            if len(regions) < 2 or not (lo <= c.start and c.end <= hi):
                continue
            if (c.size == hi - lo) != (i == reserved):
                mismatch = 1
            distance = hi - c.end if i == 0 else c.start - lo
        return (-empty, mismatch, -distance, c.start)

    return sorted(device.free(profile), key=key)


ORDERS = {"v2.10": v210_placements, "2855": scored_placements}

Choice = tuple[str, Placement]


def hami_choice(devices: Sequence[Device], profile: str, order: str, policy: str = "spread") -> Choice | None:
    """HAMi alone: the first device met that fits and has a free placement, its first placement."""
    for d in meet_order(devices, policy):
        if d.fits(profile):
            ranked = ORDERS[order](d, profile)
            if ranked:
                return d.uuid, ranked[0]
    return None


def overwritten(idle: Sequence[tuple[str, Placement]], profile: str, p: Placement) -> int:
    """The placement key: -1 for the exact IDLE instance of profile, else the IDLE slices under p."""
    if (profile, p) in idle:
        return -1
    return sum(q.size for _, q in idle if q.overlaps(p))


def rerank(
    candidates: Sequence[tuple[str, tuple[int, int, int], Sequence[Placement]]],
    idle: Mapping[str, Sequence[tuple[str, Placement]]],
    profile: str,
    *,
    gpu_key: str = "policy",
) -> list[tuple[str, list[Placement]]]:
    """The helper over HAMi's candidates (GPUs in meet order with their levels, placements in
    HAMi's order): each GPU's placements by the placement key, then the GPUs by their best
    placement's key (the exact IDLE instance, then a free placement, then the fewest IDLE slices
    overwritten): over all of them (``gpu_key`` "idle-first"), only within each run of equal levels
    ("policy"), or not at all (""); stable, so HAMi's order breaks ties."""
    out = []
    for uuid, score, placements in candidates:
        on = idle.get(uuid, ())

        def key(p: Placement, on: Sequence[tuple[str, Placement]] = on) -> int:
            return overwritten(on, profile, p)

        out.append((uuid, score, sorted(placements, key=key)))

    def gpu(c: tuple[str, tuple[int, int, int], list[Placement]]) -> int:
        return overwritten(idle.get(c[0], ()), profile, c[2][0]) if c[2] else 1 << 30

    if gpu_key == "idle-first":
        out.sort(key=gpu)
    elif gpu_key == "policy":
        runs: list[list[tuple[str, tuple[int, int, int], list[Placement]]]] = []
        for c in out:
            if runs and runs[-1][-1][1] == c[1]:
                runs[-1].append(c)
            else:
                runs.append([c])
        out = [c for run in runs for c in sorted(run, key=gpu)]
    return [(uuid, placements) for uuid, _, placements in out]


def helper_choice(
    devices: Sequence[Device],
    profile: str,
    order: str,
    idle: Mapping[str, Sequence[tuple[str, Placement]]],
    *,
    policy: str = "spread",
    gpu_key: str = "policy",
) -> Choice | None:
    """HAMi with the helper: the candidates HAMi finds fit, re-ranked, the first taken."""
    candidates = []
    for d in meet_order(devices, policy):
        if d.fits(profile):
            ranked = ORDERS[order](d, profile)
            if ranked:
                candidates.append((d.uuid, d.level(), ranked))
    ranked_gpus = rerank(candidates, idle, profile, gpu_key=gpu_key)
    return None if not ranked_gpus else (ranked_gpus[0][0], ranked_gpus[0][1][0])
