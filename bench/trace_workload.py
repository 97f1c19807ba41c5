"""The seeded pod trace and the real-scale latency model, shared by ``trace.py`` (which runs the trace
through a real sidecar) and ``policy_replay.py`` (which replays it over the sidecar's pure decisions).

The trace: Poisson arrivals, exponential lifetimes, one MIG device per pod from a profile mix of 50 %
1g.10gb, 30 % 2g.20gb, 20 % 3g.40gb on 8 H100-80GB, sized by Little's law so that ``LOAD`` of the
memory slices are held on average. The latency model: what each simulator operation takes at real
scale (``MODEL_S``, every other call ``OTHER_S``), set on the simulated hardware scaled down for a
run and read back at real scale.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from trace_state import MEMORY_SLICES

from sidecar.nvml.sim import OP_ALIASES, SimulatedHardware

GPUS = 8
MIX = (("1g.10gb", 0.5), ("2g.20gb", 0.3), ("3g.40gb", 0.2))
LOAD = 0.6  # mean share of memory slices held by live pods (--load)
MEAN_LIFETIME = 600.0  # trace seconds; only ratios of trace times matter
# Real-scale latency model (seconds) by simulator operation; every other call takes OTHER_S.
MODEL_S = {"create-gi": 0.800, "create-ci": 0.200, "destroy-ci": 0.200, "destroy-gi": 0.400}
OTHER_S = 0.001


def real_delay(fn: str) -> float:
    if fn == "nvmlErrorString":  # the simulator never delays it
        return 0.0
    for op, seconds in MODEL_S.items():
        if fn in OP_ALIASES[op]:
            return seconds
    return OTHER_S


def own_delay(calls: dict[str, int], reclaimed: int) -> float:
    """The real-scale delay of an Allocate's own NVML calls among ``calls`` (counted from just before
    the request to just after the answer).

    The sidecar wakes its background reconciler just before it answers, so a trim it starts can land
    in that window. A trim only destroys; the Allocate itself destroys one CI and one GI per instance
    it reports reclaimed (one CI per GI in this trace), so destroys beyond that are the trim's and are
    left out. A trim's other calls (its listing, process check and live check; about ten at 1 ms)
    cannot be told apart and stay in."""
    out = 0.0
    for fn, n in calls.items():
        destroys = any(fn in OP_ALIASES[op] for op in ("destroy-ci", "destroy-gi"))
        out += real_delay(fn) * (min(n, reclaimed) if destroys else n)
    return out


def set_latency_model(hw: SimulatedHardware, scale: float) -> None:
    """Delays add up per call ("any" plus the operation's own), so each operation gets model - other."""
    hw.set_latency("any", OTHER_S * scale)
    for op, seconds in MODEL_S.items():
        hw.set_latency(op, (seconds - OTHER_S) * scale)


# -- the trace -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    uid: str
    profile: str
    arrive: float
    leave: float


def make_trace(pods: int, seed: int, load: float = LOAD) -> list[Pod]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible trace, nothing secret
    size = {"1g.10gb": 1, "2g.20gb": 2, "3g.40gb": 4}
    mean_slices = sum(size[p] * w for p, w in MIX)
    rate = load * GPUS * MEMORY_SLICES / mean_slices / MEAN_LIFETIME  # Little's law
    names, weights = [p for p, _ in MIX], [w for _, w in MIX]
    out, t = [], 0.0
    for i in range(pods):
        t += rng.expovariate(rate)
        profile = rng.choices(names, weights)[0]
        out.append(Pod(f"p{i}", profile, t, t + rng.expovariate(1 / MEAN_LIFETIME)))
    return out
