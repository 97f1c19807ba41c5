"""Every named crash point x every scenario that reaches it: crash, restart, Recover, invariants.

A crash here is ``crashpoints.raising_at``: the point raises ``Crashed`` (a BaseException, so no
undo or ERROR mark runs on its way out, as after a kill -9), and the test then does what a restart
does (``restart``: hardware and files stay, memory goes) and calls Recover with the pods that still
hold allocations. ``tests/e2e/test_recovery_e2e.py`` kills real processes at the create and reclaim
points; this matrix covers every scenario in process, so it stays fast.

A scenario is one entry in ``SCENARIOS``: what it sets up (without a crash point armed), the call
that must reach each of its points, and a retry of that call once the sidecar is back. Every point
in ``crashpoints.POINTS`` must be reached by some scenario (``test_every_crash_point_is_reached``),
and every case checks that its point was reached, so a new point needs a scenario here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
from lifecycle_world import World, restart
from matrix_world import FOREVER, Held, before, check, probe_reuse, settle, standard_start

from sidecar import crashpoints, errors
from sidecar.nvml.port import NVML_ERROR_INSUFFICIENT_RESOURCES, NVML_ERROR_UNKNOWN
from sidecar.reconciler import Reconciler

CREATE = (
    "after-record-creating",
    "after-create-gi",
    "after-record-gi",
    "after-create-ci",
    "after-write-cdi",
)
DESTROY = ("after-record-deleting", "after-destroy-ci", "after-destroy-gi", "after-remove-cdi")
UNDO = ("after-destroy-ci", "after-destroy-gi")  # an undo records no DELETING and leaves CDI to its caller

Step = Callable[[World, Held], object]


def nothing(world: World, held: Held) -> None:
    """No setup beyond the standard start."""


@dataclass(frozen=True)
class Scenario:
    name: str
    points: tuple[str, ...]
    setup: Step
    trigger: Step  # must reach each of ``points``
    retry: Step = nothing  # once recovered: the same request again must work
    adopt: bool = False


# -- the scenarios ------------------------------------------------------------------------------------


def create(world: World, held: Held) -> None:
    held.allocate("pod-new", (0, "3g.40gb", 4, 4))


def idle_in_the_way(world: World, held: Held) -> None:
    held.allocate("pod-old", (0, "1g.10gb", 4, 1))
    held.release("pod-old")


def two_devices_second_fails(world: World, held: Held) -> None:
    world.hw.inject_fault("create-gi", NVML_ERROR_INSUFFICIENT_RESOURCES, after=1, times=FOREVER)
    with pytest.raises(errors.NvmlFailure):
        held.allocate("pod-two", (0, "3g.40gb", 4, 4), (1, "1g.10gb", 0, 1))


def two_devices(world: World, held: Held) -> None:
    held.allocate("pod-two", (0, "3g.40gb", 4, 4), (1, "1g.10gb", 0, 1))


def ci_create_fails(world: World, held: Held) -> None:
    world.hw.inject_fault("create-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
    with pytest.raises(errors.NvmlFailure):
        held.allocate("pod-undo", (0, "2g.20gb", 2, 2))


def create_2g(world: World, held: Held) -> None:
    held.allocate("pod-undo", (0, "2g.20gb", 2, 2))


def reclaim_left_error(world: World, held: Held) -> None:
    """An idle instance whose reclaim failed at the CI destroy: ERROR, with its CI and GI."""
    idle_in_the_way(world, held)
    world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
    with pytest.raises(errors.NvmlFailure):
        create(world, held)
    world.hw.clear_faults()


def reconcile(world: World, held: Held) -> None:
    Reconciler(world.lifecycle).run_once()


def orphan_gi(world: World, held: Held) -> None:
    world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)


def crashed_inside_a_create(world: World, held: Held) -> None:
    """What a kill -9 between creating the CI and recording it leaves: a CREATING record."""
    with crashpoints.raising_at("after-create-ci"), pytest.raises(crashpoints.Crashed):
        create(world, held)


def recover(world: World, held: Held, *, adopt: bool = False) -> None:
    restart(world, adopt=adopt).recover(held.active())


def recover_adopting(world: World, held: Held) -> None:
    recover(world, held, adopt=True)


SCENARIOS = [
    Scenario("create", CREATE, nothing, create, create),
    Scenario("reclaim", DESTROY + CREATE, idle_in_the_way, create, create),
    Scenario("rollback of a multi-device allocate", DESTROY, nothing, two_devices_second_fails, two_devices),
    Scenario("undo of a failed create", UNDO, nothing, ci_create_fails, create_2g),
    Scenario("reconciler retry", DESTROY[1:], reclaim_left_error, reconcile, create),
    Scenario("recover removing an orphan GI", DESTROY, orphan_gi, recover_adopting, adopt=True),
    Scenario("recover undoing a crashed create", DESTROY, crashed_inside_a_create, recover, create),
]  # fmt: skip

CASES = [pytest.param(s, p, id=f"{s.name}@{p}") for s in SCENARIOS for p in s.points]


def test_every_crash_point_is_reached_by_some_scenario() -> None:
    reached = {p for s in SCENARIOS for p in s.points}
    assert set(crashpoints.POINTS) - reached == set()
    assert reached <= set(crashpoints.POINTS)


@pytest.mark.parametrize(("scenario", "point"), CASES)
def test_a_crash_then_restart_and_recover_keeps_the_invariants(
    cdi_world: World, scenario: Scenario, point: str
) -> None:
    world = cdi_world
    held = standard_start(world)
    scenario.setup(world, held)
    was = before(world, held)

    with crashpoints.raising_at(point), pytest.raises(crashpoints.Crashed):
        scenario.trigger(world, held)  # the point is reached, or this fails

    world.hw.clear_faults()
    restart(world, adopt=scenario.adopt).recover(held.active())
    check(world, was, settled=False)
    settle(world, was)
    scenario.retry(world, held)
    check(world, was, settled=True)
    probe_reuse(world, held)
    check(world, was, settled=True)
