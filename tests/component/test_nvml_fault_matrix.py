"""Every NVML operation x {IN_USE, INSUFFICIENT_RESOURCES, NOT_FOUND, GPU_IS_LOST, UNKNOWN, TIMEOUT}
x every RPC that reaches it: the invariants hold, and the same call works once the fault clears
(an entry with a ``retry`` also asserts there what the call must have achieved by then).

An RPC is exercised through the lifecycle call its handler makes (``server`` only maps errors). The
operations an RPC reaches are not listed by hand: the call runs once unfaulted on its own hardware
and the simulator's call counts say which operations it made, and how often. Each case then starts
again from the same setup with NVML failing from the n-th call of that operation on (for each of its
first ``OCCURRENCES`` calls) until the fault is cleared, so every call site is the first to fail
once. The call must succeed or fail with NVML_ERROR (UNAVAILABLE, retried by the client), never
anything else, and leave the invariants of ``matrix_world``; cleared, one reconciler round and the
same call again must work. A new RPC is one entry in ``RPCS``; an operation in ``OPERATIONS`` that
no RPC reaches fails ``test_every_operation_is_reached_by_some_rpc``, and a case whose call makes no
NVML call, or never meets the fault it injects, fails. Release and SyncActive make no NVML call, so
they are not in ``RPCS``; the last test holds them to working while every NVML call fails.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from lifecycle_world import World, active_of, build_world, restart
from matrix_world import Held, before, check, probe_reuse, settle, standard_start

from sidecar.lifecycle.idle_trim import IdleTrimmer
from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, State
from sidecar.model.idle_policy import IdleSettings
from sidecar.nvml.sim import OP_ALIASES, uninstall

FOREVER = 1000
FAR_FUTURE = 1e12  # the idle trim's clock: every IDLE instance is past its TTL
OCCURRENCES = 3  # the first calls of an operation a case starts failing at; bounds the matrix
CODES = ["IN_USE", "INSUFFICIENT_RESOURCES", "NOT_FOUND", "GPU_IS_LOST", "UNKNOWN", "TIMEOUT"]
OPERATIONS = (
    "create-gi",
    "create-ci",
    "destroy-ci",
    "destroy-gi",
    "get-gpu-instances",
    "get-gpu-instance",
    "get-compute-instances",
    "get-compute-instance",
    "processes",
    "set-mig-mode",
)

Step = Callable[[World, Held], object]


def nothing(world: World, held: Held) -> None:
    """No setup beyond the standard start."""


@dataclass(frozen=True)
class Rpc:
    name: str
    setup: Step
    call: Step  # the same call is the retry once the fault clears
    retry: Step | None = None  # a retry that also asserts what the call, fault cleared, must achieve


def idle_at_4_1(world: World, held: Held) -> None:
    held.allocate("pod-old", (0, "1g.10gb", 4, 1))
    held.release("pod-old")


def allocate_3g(world: World, held: Held) -> None:
    held.allocate("pod-new", (0, "3g.40gb", 4, 4))


def allocate_reuse(world: World, held: Held) -> None:
    held.allocate("pod-new", (0, "1g.10gb", 4, 1))


def allocate_two(world: World, held: Held) -> None:
    held.allocate("pod-two", (0, "3g.40gb", 4, 4), (1, "1g.10gb", 0, 1))


def get_state(world: World, held: Held) -> None:
    world.lifecycle.snapshot()


def list_gpus(world: World, held: Held) -> None:
    for gpu in world.port.gpus():
        world.lifecycle.gpu_busy(gpu.uuid)


def error_and_orphan(world: World, held: Held) -> None:
    """An idle instance left ERROR by a failed reclaim, and an orphan GI for adoption to remove."""
    idle_at_4_1(world, held)
    world.hw.inject_fault("destroy-ci", "UNKNOWN", times=FOREVER)
    with pytest.raises(errors.NvmlFailure):
        allocate_3g(world, held)
    world.hw.clear_faults()
    world.hw.create_instance(1, "3g.40gb", 4, 4, with_ci=False)


def recover(world: World, held: Held) -> None:
    restart(world, adopt=True).recover(held.active())


def reconcile(world: World, held: Held) -> None:
    Reconciler(world.lifecycle).run_once()


def unlisted_created_and_reused(world: World, held: Held) -> None:
    """An Allocate the plugin then undoes: one instance reused, one created, no pod lists it."""
    idle_at_4_1(world, held)
    world.allocate("pod-undo", (0, "1g.10gb", 4, 1), (1, "3g.40gb", 0, 4))


def undo_allocate(world: World, held: Held) -> None:
    world.lifecycle.undo_allocate("pod-undo", 0)
    assert not [r for r in world.lifecycle.instances() if r.owner and r.owner.pod.uid == "pod-undo"]


def two_idle(world: World, held: Held, gpu: int) -> None:
    for n, device in enumerate([(gpu, "1g.10gb", 0, 1), (gpu, "3g.40gb", 4, 4)]):
        held.named[f"idle-{n}"] = held.allocate(f"pod-idle-{n}", device).devices[0].identity.mig_uuid
        held.release(f"pod-idle-{n}")


def two_idle_on_gpu1(world: World, held: Held) -> None:
    two_idle(world, held, 1)


def idle_names(world: World) -> list[str]:
    return [r.name for r in world.lifecycle.instances() if r.state is State.IDLE]


def reclaim_idle_all(world: World, held: Held) -> None:
    world.lifecycle.reclaim_idle(world.uuid(1))
    assert not [r for r in world.ctx.table.on_gpu(world.uuid(1)) if r.state is State.IDLE]


def reclaim_idle_named(world: World, held: Held) -> None:
    world.lifecycle.reclaim_idle(world.uuid(1), [held.named["idle-0"]])


def reclaim_idle_named_again(world: World, held: Held) -> None:
    """After an attempt that left it ERROR (the reconciler then destroyed it) the answer is
    UnknownInstance; either way it is gone, and the other IDLE instance is not."""
    mig = held.named["idle-0"]
    with contextlib.suppress(errors.UnknownInstance):
        reclaim_idle_named(world, held)
    assert mig not in world.live_mig_uuids()
    assert held.named["idle-1"] in world.live_mig_uuids()


def mig_disabled_on_gpu1(world: World, held: Held) -> None:
    world.lifecycle.set_mig_mode(world.uuid(1), False)


def enable_mig(world: World, held: Held) -> None:
    assert world.lifecycle.set_mig_mode(world.uuid(1), True)[:2] == (True, True)


def disable_mig_reclaiming(world: World, held: Held) -> None:
    assert world.lifecycle.set_mig_mode(world.uuid(1), False, reclaim_idle=True)[:2] == (False, False)
    assert not world.ctx.table.on_gpu(world.uuid(1))


def rank_placements(world: World, held: Held) -> None:
    assert world.lifecycle.rank_placements(world.uuid(0), "3g.40gb")


def idle_trim(world: World, held: Held) -> None:
    """A trim that meets a fault logs and skips it; once cleared, a round trims every IDLE one."""
    trimmer = IdleTrimmer(world.ctx, IdleSettings(ttl_s=600.0), clock=lambda: FAR_FUTURE)
    Reconciler(world.lifecycle, idle=trimmer).run_once()


def idle_trim_done(world: World, held: Held) -> None:
    idle_trim(world, held)
    assert not idle_names(world)


RPCS = [
    Rpc("Allocate creating", nothing, allocate_3g),
    Rpc("Allocate reclaiming", idle_at_4_1, allocate_3g),
    Rpc("Allocate reusing", idle_at_4_1, allocate_reuse),
    Rpc("Allocate two devices", nothing, allocate_two),
    Rpc("GetState", idle_at_4_1, get_state),
    Rpc("ListGpus", idle_at_4_1, list_gpus),
    Rpc("Recover", error_and_orphan, recover),
    Rpc("reconciler retry", error_and_orphan, reconcile),
    Rpc("UndoAllocate", unlisted_created_and_reused, undo_allocate),
    Rpc("ReclaimIdle of all", two_idle_on_gpu1, reclaim_idle_all),
    Rpc("ReclaimIdle of one", two_idle_on_gpu1, reclaim_idle_named, reclaim_idle_named_again),
    Rpc("SetMigMode enable", mig_disabled_on_gpu1, enable_mig),
    Rpc("SetMigMode disable reclaiming", two_idle_on_gpu1, disable_mig_reclaiming),
    Rpc("RankPlacements", idle_at_4_1, rank_placements),
    Rpc("idle trim", two_idle_on_gpu1, idle_trim, idle_trim_done),
]


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """Where the cases' files go: memory-backed when the system has /dev/shm, because every record
    write is fsynced and the matrix writes thousands of them."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        yield tmp_path
        return
    root = Path(tempfile.mkdtemp(prefix="hms-faults-", dir=shm))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def fresh(path: Path, rpc: Rpc) -> Iterator[tuple[World, Held]]:
    path.mkdir(parents=True)
    world = build_world(path, cdi_enabled=True)
    try:
        held = standard_start(world)
        rpc.setup(world, held)
        yield world, held
    finally:
        world.records.close()
        uninstall()


def calls_made(tmp_path: Path, rpc: Rpc) -> dict[str, int]:
    """How often the unfaulted call makes each operation of ``OPERATIONS``."""
    with fresh(tmp_path / "count", rpc) as (world, held):
        world.hw.reset_call_counts()
        rpc.call(world, held)
        counts = world.hw.call_counts()
    made = {op: sum(counts.get(fn, 0) for fn in OP_ALIASES[op]) for op in OPERATIONS}
    return {op: n for op, n in made.items() if n}


def test_every_operation_is_reached_by_some_rpc(scratch: Path) -> None:
    reached = {op for n, rpc in enumerate(RPCS) for op in calls_made(scratch / str(n), rpc)}
    assert set(OPERATIONS) - reached == set()


def answer(rpc: Rpc, world: World, held: Held) -> tuple[str, errors.Code] | None:
    """None when the call succeeds; the reason and code of the SidecarError it fails with."""
    try:
        rpc.call(world, held)
    except errors.SidecarError as exc:
        return exc.reason, exc.code
    return None


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("rpc", RPCS, ids=[r.name for r in RPCS])
def test_a_fault_keeps_the_invariants_and_the_call_works_once_it_clears(
    scratch: Path, rpc: Rpc, code: str
) -> None:
    made = calls_made(scratch, rpc)
    assert made, f"{rpc.name} makes no NVML call: the matrix has nothing of it to fault"
    for op, count in made.items():
        for n in range(min(count, OCCURRENCES)):
            case = f"{rpc.name}: {op} answers {code} from its call {n} on"
            with fresh(scratch / f"{op}-{n}", rpc) as (world, held):
                was = before(world, held)
                world.hw.inject_fault(op, code, after=n, times=FOREVER)
                failed = answer(rpc, world, held)
                assert [f.times for f in world.hw.faults()] != [FOREVER], f"{case}: the fault was never met"
                assert failed in {None, ("NVML_ERROR", errors.Code.UNAVAILABLE)}, f"{case}: {failed}"
                world.hw.clear_faults()
                if world.lifecycle.recovered:
                    check(world, was, settled=False)
                else:
                    recover(world, held)
                settle(world, was)
                (rpc.retry or rpc.call)(world, held)
                check(world, was, settled=True)
                probe_reuse(world, held)


@pytest.mark.parametrize("code", CODES)
def test_release_and_sync_active_work_with_every_nvml_call_failing(scratch: Path, code: str) -> None:
    """Release and SyncActive change records only, never the hardware: with every NVML call failing (a
    GPU fallen off the bus) pod-keep let go by SyncActive, listed again, let go by Release and listed
    again is IDLE and ACTIVE on disk each time, and once the fault clears the hardware is unchanged."""
    with fresh(scratch / "no-nvml", Rpc("Release and SyncActive", idle_at_4_1, nothing)) as (world, held):
        was, layout = before(world, held), world.layout()
        keep = held.pods["pod-keep"]
        listed = active_of("pod-keep", keep)
        (name,) = [
            r.name for r in world.record_files().values() if r.mig_uuid == keep.devices[0].identity.mig_uuid
        ]
        others = {n: s for n, s in world.states().items() if n != name}
        world.hw.inject_fault("any", code, times=FOREVER)

        def sync(active: list[ActiveAllocation]) -> tuple[int, int]:
            idled, reactivated = world.lifecycle.sync_active(world.lifecycle.generation, active)
            return len(idled), len(reactivated)

        assert sync([]) == (1, 0)
        assert world.states()[name] is State.IDLE
        assert sync(listed) == (0, 1)
        assert world.states()[name] is State.ACTIVE
        assert [ref.identity for ref in world.lifecycle.release("pod-keep")] == [keep.devices[0].identity]
        assert world.states()[name] is State.IDLE
        assert sync(listed) == (0, 1)
        assert world.states() == {**others, name: State.ACTIVE}
        assert world.record_files()[name].owner == listed[0].owner
        world.hw.clear_faults()
        assert world.layout() == layout
        check(world, was, settled=True)
