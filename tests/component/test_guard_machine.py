"""A hypothesis state machine over the pending-reservation guards (``pending.Guards``).

Pending reservations come and go (SyncActive), pods allocate and release, operators reclaim (one
named instance or all, forced or not), disable and enable MIG, the idle policy and the reconciler
run, in any order. After every step: no instance a pending reservation kept before the step was
handed to another pod or destroyed, unless that step was forced. A failed call is fine (a refusal is
the guard at work); a lost or stolen instance is not.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from lifecycle_world import Dev, World, build_world

from sidecar.lifecycle.idle_trim import IdleTrimmer
from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model.domain import ActiveAllocation, AllocationKey, Owner, PodRef, Reservation, State
from sidecar.model.errors import SidecarError
from sidecar.model.idle_policy import IdleSettings
from sidecar.model.ownership import record_name
from sidecar.nvml.port import Placement
from sidecar.nvml.sim import uninstall

PODS = ("p0", "p1", "p2", "r0", "r1")
RESERVERS = ("r0", "r1")
SPOTS: tuple[tuple[str, int, int], ...] = (
    ("1g.10gb", 0, 1),
    ("1g.10gb", 1, 1),
    ("1g.10gb", 2, 1),
    ("1g.10gb", 3, 1),
    ("2g.20gb", 0, 2),
    ("2g.20gb", 2, 2),
    ("3g.40gb", 0, 4),
)
Kept = tuple[AllocationKey, str, str, State]  # (the reserving key, MIG UUID, record name, its state)


class GuardMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="guards"))
        self.world: World = build_world(self.root, cdi_enabled=True)
        self.before: list[Kept] = []
        self.forced = False

    def teardown(self) -> None:
        self.world.records.close()
        uninstall()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- what the guards keep, before a step ------------------------------------------------------------
    def kept(self) -> list[Kept]:
        ctx = self.world.ctx
        out: list[Kept] = []
        for p in sorted(ctx.pending.current, key=lambda p: (str(p.key), str(p.reservation))):
            res = p.reservation
            rec = ctx.table.get(record_name(res.gpu_uuid, res.placement))
            if (
                p.key is not None
                and rec is not None
                and rec.reservation == res
                and rec.state in (State.IDLE, State.ERROR)
                and rec.mig_uuid
            ):
                out.append((p.key, rec.mig_uuid, rec.name, rec.state))
        return out

    def step(self, forced: bool = False, by: AllocationKey | None = None) -> None:
        """Before a step: what the guards keep now. ``by``: the key of an Allocate, whose own pending
        reservation it is what the reservation waited for (it may take or replace that instance)."""
        self.before = [k for k in self.kept() if k[0] != by]
        self.forced = forced

    @invariant()
    def no_reserved_instance_is_stolen_or_destroyed(self) -> None:
        if self.forced:
            return
        table = self.world.ctx.table
        live = self.world.live_mig_uuids()
        for key, mig, name, _ in self.before:
            rec = table.get(name)
            assert rec is not None, f"the instance {mig} reserved for {key} lost its record"
            assert rec.mig_uuid == mig, f"the instance {mig} reserved for {key} was replaced"
            assert mig in live, f"the instance {mig} reserved for {key} was destroyed"
            if rec.state is State.ACTIVE:
                assert rec.owner is not None
                assert rec.owner.key == key, f"{mig} reserved for {key} went to {rec.owner.key}"

    # -- the steps ----------------------------------------------------------------------------------
    def _dev(self, spot: tuple[str, int, int]) -> Dev:
        profile, start, size = spot
        return (0, profile, start, size)

    @rule(pod=st.sampled_from(PODS), spot=st.sampled_from(SPOTS))
    def allocate(self, pod: str, spot: tuple[str, int, int]) -> None:
        self.step(by=AllocationKey(pod, 0, 0))
        with contextlib.suppress(SidecarError):
            self.world.allocate(pod, self._dev(spot))

    @rule(pod=st.sampled_from(PODS), spot=st.sampled_from(SPOTS))
    def cache_an_instance(self, pod: str, spot: tuple[str, int, int]) -> None:
        """Allocate and release at once: an IDLE instance for the scheduler to place a pod on."""
        self.step(by=AllocationKey(pod, 0, 0))
        try:
            self.world.allocate(pod, self._dev(spot))
        except SidecarError:
            return
        self.world.lifecycle.release(pod)

    @rule(data=st.data(), pod=st.sampled_from(PODS), exact=st.booleans())
    def intrude(self, data: st.DataObject, pod: str, exact: bool) -> None:
        """Another pod asks for a reserved instance's spot, or for one overlapping it."""
        reserved = sorted(p.reservation.placement.start for p in self.world.ctx.pending.current)
        if not reserved:
            return
        start = data.draw(st.sampled_from(reserved))
        spots = [s for s in SPOTS if (s[1] == start if exact else s[1] <= start < s[1] + s[2])]
        self.step(by=AllocationKey(pod, 0, 0))
        with contextlib.suppress(SidecarError):
            self.world.allocate(pod, self._dev(data.draw(st.sampled_from(spots))))

    @rule(pod=st.sampled_from(PODS))
    def release(self, pod: str) -> None:
        self.step()
        self.world.lifecycle.release(pod)

    @rule(reserved=st.lists(st.tuples(st.sampled_from(RESERVERS), st.sampled_from(SPOTS)), max_size=2))
    def sync_active(self, reserved: list[tuple[str, tuple[str, int, int]]]) -> None:
        """The plugin's pod list: every ACTIVE instance as its pod holds it, plus pending reservations."""
        self.step()
        self._sync(reserved)

    @rule(data=st.data(), pod=st.sampled_from(RESERVERS))
    def reserve_an_idle_instance(self, data: st.DataObject, pod: str) -> None:
        """The scheduler places a pod on an IDLE (or ERROR) instance: the case the guards exist for."""
        spots = self._idle_spots()
        if not spots:  # make one first
            spot = data.draw(st.sampled_from(SPOTS))
            try:
                self.world.allocate("p2", self._dev(spot))
            except SidecarError:
                return
            self.world.lifecycle.release("p2")
            spots = self._idle_spots()
        self.step()
        self._sync([(pod, data.draw(st.sampled_from(spots)))])

    def _idle_spots(self) -> list[tuple[str, int, int]]:
        return sorted(
            (r.profile, r.placement.start, r.placement.size)
            for r in self.world.lifecycle.instances()
            if r.state in (State.IDLE, State.ERROR)
        )

    def _sync(self, reserved: list[tuple[str, tuple[str, int, int]]]) -> None:
        lifecycle = self.world.lifecycle
        active = [
            ActiveAllocation(r.owner, r.reservation, r.identity)
            for r in lifecycle.instances()
            if r.state is State.ACTIVE and r.owner is not None
        ]
        listed = {a.key for a in active}
        for pod, (profile, start, size) in reserved:
            owner = Owner(PodRef(pod, "default", f"name-{pod}"), "main", 0, 0)
            if owner.key in listed:
                continue
            listed.add(owner.key)
            active.append(
                ActiveAllocation(owner, Reservation(self.world.uuid(0), profile, Placement(start, size)))
            )
        lifecycle.sync_active(lifecycle.generation, active)

    @rule(force=st.booleans())
    def reclaim_all(self, force: bool) -> None:
        self.step(forced=force)
        try:
            done = self.world.lifecycle.reclaim_idle(self.world.uuid(0), force=force)
        except SidecarError:
            return
        if not force:
            kept = {mig for _, mig, _, state in self.before if state is State.IDLE}
            assert {ref.identity.mig_uuid for ref in done.kept if ref.identity} == kept

    @rule(data=st.data(), force=st.booleans())
    def reclaim_named(self, data: st.DataObject, force: bool) -> None:
        # Drawn by record name (placement-derived): MIG UUIDs are fresh on every run, and a draw must
        # not depend on them (hypothesis replays the same choices).
        by_name = {r.name: r.mig_uuid for r in self.world.lifecycle.instances() if r.mig_uuid}
        reserved = sorted(name for _, _, name, _ in self.kept() if name in by_name)
        names = reserved or sorted(by_name)
        if not names:
            return
        mig = by_name[data.draw(st.sampled_from(names))]
        self.step(forced=force)
        with contextlib.suppress(SidecarError):
            self.world.lifecycle.reclaim_idle(self.world.uuid(0), [mig], force=force)

    @rule(reclaim=st.booleans(), force=st.booleans())
    def disable(self, reclaim: bool, force: bool) -> None:
        """A disable, after every pod left (only IDLE instances are in its way then)."""
        for r in self.world.lifecycle.instances():
            if r.owner is not None:
                self.world.lifecycle.release(r.owner.pod.uid)
        self.step(forced=force)
        with contextlib.suppress(SidecarError):
            self.world.lifecycle.set_mig_mode(self.world.uuid(0), False, reclaim_idle=reclaim, force=force)

    @rule(data=st.data(), reclaim=st.booleans())
    def disable_under_a_reservation(self, data: st.DataObject, reclaim: bool) -> None:
        """The operator's disable while the scheduler has placed a pod on an IDLE instance."""
        self.reserve_an_idle_instance(data, "r1")
        for r in self.world.lifecycle.instances():
            if r.owner is not None:
                self.world.lifecycle.release(r.owner.pod.uid)
        self.step()
        with contextlib.suppress(SidecarError):
            self.world.lifecycle.set_mig_mode(self.world.uuid(0), False, reclaim_idle=reclaim)

    @rule()
    def enable(self) -> None:
        self.step()
        with contextlib.suppress(SidecarError):
            self.world.lifecycle.set_mig_mode(self.world.uuid(0), True)

    @rule()
    def idle_policy_and_reconciler(self) -> None:
        """The most eager policy there is (every IDLE instance is past its TTL and over the cap)."""
        self.step()
        ctx = self.world.ctx
        trimmer = IdleTrimmer(ctx, IdleSettings(ttl_s=0.0, max_idle_per_gpu=0), clock=lambda: 4e9)
        Reconciler(self.world.lifecycle, idle=trimmer).run_once()

    @rule(data=st.data())
    def a_destroy_fails(self, data: st.DataObject) -> None:
        """An IDLE instance turns ERROR (its destroy failed once): the inline and background retries
        must respect the guards too."""
        idle = sorted(
            (r for r in self.world.lifecycle.instances() if r.state is State.IDLE), key=lambda r: r.name
        )
        if not idle:
            return
        record = data.draw(st.sampled_from(idle))
        self.step()
        self.world.ctx.table.fail(record, "a destroy failed (test)")


GuardMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestGuards = GuardMachine.TestCase
