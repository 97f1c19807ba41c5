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
from hami_format import write_record, write_spec
from lifecycle_world import Dev, World, restart
from matrix_world import FOREVER, Held, before, check, probe_reuse, settle, standard_start

from sidecar.lifecycle import crashpoints
from sidecar.lifecycle.idle_trim import IdleTrimmer
from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Identity, Outcome, Owner, PodRef, Reservation, State
from sidecar.model.idle_policy import IdleSettings
from sidecar.nvml.port import NVML_ERROR_INSUFFICIENT_RESOURCES, NVML_ERROR_UNKNOWN, Placement

CREATE = (
    "after-record-creating",
    "after-create-gi",
    "after-record-gi",
    "after-create-ci",
    "after-write-cdi",
)
DESTROY = ("after-record-deleting", "after-destroy-ci", "after-destroy-gi", "after-remove-cdi")
UNDO = ("after-destroy-ci", "after-destroy-gi")  # an undo records no DELETING and leaves CDI to its caller
TAKEOVER = ("after-takeover-record", "after-remove-hami-record")
UNDONE = (*DESTROY, "after-undo-destroy-one")  # an UndoAllocate destroys what it created as a reclaim does
IDLED = ("after-undo-idle-one",)
RECLAIMED = (*DESTROY, "after-reclaim-idle-one")
DISABLED = (*RECLAIMED, "after-reclaim-for-disable")
TRIMMED = ("before-idle-trim", *DESTROY)
RETRIED = (*DESTROY[1:], "after-inline-error-retry", *CREATE)  # an ERROR record is not marked DELETING
TTL = 600.0
FAR_FUTURE = 1e12  # the trim's clock: every IDLE instance is past the TTL

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


# UndoAllocate: the plugin rolls back an Allocate whose annotation patch failed, so no pod lists it
# (the setup allocates past ``held``) and Recover after a crash in the undo is not told of it either.


def unlisted_created(world: World, held: Held) -> None:
    world.allocate("pod-undo", (0, "3g.40gb", 4, 4))


def unlisted_reused(world: World, held: Held) -> None:
    idle_in_the_way(world, held)
    world.allocate("pod-undo", (0, "1g.10gb", 4, 1))


def created_and_reused(world: World, held: Held) -> None:
    idle_in_the_way(world, held)
    world.allocate("pod-undo", (0, "1g.10gb", 4, 1), (1, "3g.40gb", 0, 4))


def undo(world: World, held: Held) -> None:
    world.lifecycle.undo_allocate("pod-undo", 0)


def undo_then_create(world: World, held: Held) -> None:
    """The undo repeated finds nothing ACTIVE for the key; the placements it freed are usable."""
    assert world.lifecycle.undo_allocate("pod-undo", 0) == ([], [])
    assert not [r for r in world.record_files().values() if r.owner and r.owner.pod.uid == "pod-undo"]
    create(world, held)
    held.allocate("pod-after-undo", (1, "3g.40gb", 0, 4))


# ReclaimIdle and SetMigMode(enabled=false, reclaim_idle=true)


def idle(world: World, held: Held, label: str, device: Dev) -> None:
    held.named[label] = held.allocate(f"pod-{label}", device).devices[0].identity.mig_uuid
    held.release(f"pod-{label}")


def two_idle_on_gpu0(world: World, held: Held) -> None:
    idle(world, held, "a", (0, "1g.10gb", 4, 1))
    idle(world, held, "b", (0, "2g.20gb", 2, 2))


def reclaim_named(world: World, held: Held) -> None:
    world.lifecycle.reclaim_idle(world.uuid(0), [held.named["a"]])


def reclaim_named_again(world: World, held: Held) -> None:
    """Repeated once the first is recovered: it is gone (UnknownInstance then), the other IDLE one kept."""
    with pytest.raises(errors.UnknownInstance):
        reclaim_named(world, held)
    assert held.named["a"] not in world.live_mig_uuids()
    assert [r.state for r in world.record_files().values() if r.mig_uuid == held.named["b"]] == [State.IDLE]


def reclaim_all(world: World, held: Held) -> None:
    world.lifecycle.reclaim_idle(world.uuid(0))
    assert not [r for r in world.record_files().values() if r.state is State.IDLE]


def two_idle_on_gpu1(world: World, held: Held) -> None:
    idle(world, held, "a", (1, "1g.10gb", 0, 1))
    idle(world, held, "b", (1, "3g.40gb", 4, 4))


def disable_mig_on_gpu1(world: World, held: Held) -> None:
    current, pending, _ = world.lifecycle.set_mig_mode(world.uuid(1), False, reclaim_idle=True)
    assert (current, pending) == (False, False)
    assert not world.ctx.table.on_gpu(world.uuid(1))


# The background idle trim on a fake clock


def trim_past_the_ttl(world: World, held: Held) -> None:
    trimmer = IdleTrimmer(world.ctx, IdleSettings(ttl_s=TTL), clock=lambda: FAR_FUTURE)
    Reconciler(world.lifecycle, idle=trimmer).run_once()
    assert not [r for r in world.record_files().values() if r.state is State.IDLE]


# Recover taking over what HAMi's own lifecycle made: an instance a listed pod runs on, an IDLE one


def hami_instance(world: World, device: Dev) -> Identity:
    """Create the instance as HAMi did and leave HAMi's record and CDI spec of it."""
    g, profile, start, size = device
    world.hw.create_instance(g, profile, start, size)
    gi = next(gi for gi in world.port.gpu_instances(world.uuid(g)) if gi.placement == Placement(start, size))
    [ci] = world.port.compute_instances(world.uuid(g), gi.id)
    world.cdi_dir.mkdir(parents=True, exist_ok=True)
    write_record(world.records.directory, ci.mig_uuid, world.uuid(g), profile, start, size, gi.id, ci.id)
    write_spec(world.cdi_dir, ci.mig_uuid, world.uuid(g), world.gpus[g].minor, gi.id, ci.id)
    return Identity(gi.id, ci.id, ci.mig_uuid)


def hami_active_and_idle(world: World, held: Held) -> None:
    running: Dev = (1, "3g.40gb", 4, 4)
    identity = hami_instance(world, running)
    g, profile, start, size = running
    held.listed.append(
        ActiveAllocation(
            owner=Owner(PodRef("pod-hami", "default", "name-pod-hami"), "main", 0, 0),
            reservation=Reservation(world.uuid(g), profile, Placement(start, size)),
            identity=identity,
        )
    )
    held.named["idle"] = hami_instance(world, (1, "1g.10gb", 0, 1)).mig_uuid


def reuse_the_idle_one(world: World, held: Held) -> None:
    """Taken over IDLE, the instance is the sidecar's to hand out."""
    got = held.allocate("pod-reuse", (1, "1g.10gb", 0, 1)).devices[0]
    assert (got.outcome, got.identity.mig_uuid) == (Outcome.REUSED, held.named["idle"])


# An Allocate retrying an ERROR instance in its way; a SyncActive taking pending reservations; a destroy
# that keeps a file at the spec's path that is not the sidecar's


def pending_for_the_idle_one(world: World, held: Held) -> None:
    """The scheduler reserved the IDLE instance at 4:1 for pod-q, which is not allocated yet."""
    reservation = Reservation(world.uuid(0), "1g.10gb", Placement(4, 1))
    owner = Owner(PodRef("pod-q", "default", "name-pod-q"), "main", 0, 0)
    pending = ActiveAllocation(owner=owner, reservation=reservation, identity=None)
    world.lifecycle.sync_active(world.lifecycle.generation, [*held.active(), pending])


def pending_then_its_allocate(world: World, held: Held) -> None:
    """The list again, then the reservation's own Allocate: the IDLE instance it guarded, reused."""
    pending_for_the_idle_one(world, held)
    got = held.allocate("pod-q", (0, "1g.10gb", 4, 1)).devices[0]
    assert got.outcome is Outcome.REUSED


def foreign_file_at_the_idle_spec(world: World, held: Held) -> None:
    """Another writer's spec (another kind) sits where the IDLE instance's spec was."""
    idle_in_the_way(world, held)
    [rec] = [r for r in world.record_files().values() if r.state is State.IDLE]
    assert rec.mig_uuid is not None
    other = b'{"cdiVersion":"0.6.0","kind":"example.com/other","devices":[{"name":"x","containerEdits":{}}]}'
    world.cdi.spec_path(rec.mig_uuid).write_bytes(other)


SCENARIOS = [
    Scenario("create", CREATE, nothing, create, create),
    Scenario("reclaim", DESTROY + CREATE, idle_in_the_way, create, create),
    Scenario("rollback of a multi-device allocate", DESTROY, nothing, two_devices_second_fails, two_devices),
    Scenario("undo of a failed create", UNDO, nothing, ci_create_fails, create_2g),
    Scenario("reconciler retry", DESTROY[1:], reclaim_left_error, reconcile, create),
    Scenario("recover removing an orphan GI", DESTROY, orphan_gi, recover_adopting, adopt=True),
    Scenario("recover undoing a crashed create", DESTROY, crashed_inside_a_create, recover, create),
    Scenario("undo of a created instance", UNDONE, unlisted_created, undo, undo_then_create),
    Scenario("undo of a reused instance", IDLED, unlisted_reused, undo, undo_then_create),
    Scenario("undo of created and reused", (*UNDONE, *IDLED), created_and_reused, undo, undo_then_create),
    Scenario("ReclaimIdle of one", RECLAIMED, two_idle_on_gpu0, reclaim_named, reclaim_named_again),
    Scenario("ReclaimIdle of all", RECLAIMED, two_idle_on_gpu0, reclaim_all, reclaim_all),
    Scenario("SetMigMode reclaiming", DISABLED, two_idle_on_gpu1, disable_mig_on_gpu1, disable_mig_on_gpu1),
    Scenario("idle trim past the TTL", TRIMMED, two_idle_on_gpu0, trim_past_the_ttl, trim_past_the_ttl),
    Scenario("Recover taking over HAMi", TAKEOVER, hami_active_and_idle, recover, reuse_the_idle_one),
    Scenario("inline retry of an ERROR instance", RETRIED, reclaim_left_error, create, create),
    Scenario("SyncActive with a pending reservation", ("after-sync-pending",), idle_in_the_way,
             pending_for_the_idle_one, pending_then_its_allocate),
    Scenario("reclaim keeping a foreign CDI file", ("after-foreign-cdi-kept",), foreign_file_at_the_idle_spec,
             create, create),
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
