"""What the crash-point and NVML-fault matrices share: the pods a test holds and the invariants.

The invariants, checked on the simulated hardware, the record files and the CDI files:

* no leaked GI/CI: every live GI is claimed by a record (ID, placement) or was foreign before the
  operation (then exactly as it was);
* no lost record: every instance held ACTIVE before is ACTIVE after, with the same MIG UUID;
* nothing unverified is kept reusable: an ACTIVE or IDLE record names exactly the live GI and its
  one CI (ID and MIG UUID), and its CDI spec is the one ``CdiSpecs`` renders; no CDI file without a
  record; after a settle no record is ERROR, CREATING or DELETING;
* every IDLE instance is handed out as REUSED with its own MIG UUID, and a foreign GI blocks its GPU;
* HAMi's files (a takeover at Recover): while an instance a HAMi record named before lives, exactly
  one of the sidecar's record of it and HAMi's file claims it (never both, never neither); one a
  listed pod held is ACTIVE for that pod with the same MIG UUID; once no HAMi record is left, no
  HAMi CDI spec is left without its live instance or for an instance taken over IDLE, and the spec
  of one taken over ACTIVE stays while it is ACTIVE (its container re-resolves the name).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from lifecycle_world import Dev, LiveGi, World, active_of

from sidecar.lifecycle.reconciler import Reconciler
from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, AllocateResult, Outcome, State
from sidecar.model.hami_takeover import read_record_file
from sidecar.model.ownership import OwnershipRecord, record_name
from sidecar.store.cdi import ForeignSpecFile
from sidecar.store.hami_records import record_files as hami_record_files

FOREVER = 1000  # more attempts than any bounded retry makes
# A foreign instance (made by an operator) on the A100 every scenario starts with, and the profile
# that covers that whole GPU: an Allocate of it must be refused, never reclaim the foreign one.
FOREIGN: Dev = (2, "1g.5gb", 0, 1)
WHOLE_FOREIGN_GPU: Dev = (2, "7g.40gb", 0, 8)
KEEP: Dev = (0, "1g.10gb", 0, 1)  # held ACTIVE by pod-keep through every scenario


@dataclass
class Held:
    """The pods that hold allocations (what the plugin reads from pod annotations for Recover)."""

    world: World
    pods: dict[str, AllocateResult] = field(default_factory=dict)
    # Pod-list entries of pods that run on instances HAMi's own lifecycle made (no Allocate here).
    listed: list[ActiveAllocation] = field(default_factory=list)
    # MIG UUIDs a scenario's setup picks for its trigger and retry to name, by a label of its own.
    named: dict[str, str] = field(default_factory=dict)

    def allocate(self, pod: str, *devices: Dev) -> AllocateResult:
        result = self.world.allocate(pod, *devices)
        self.pods[pod] = result
        return result

    def release(self, pod: str) -> None:
        self.world.lifecycle.release(pod)
        self.pods.pop(pod, None)

    def active(self) -> list[ActiveAllocation]:
        return [a for pod, result in self.pods.items() for a in active_of(pod, result)] + self.listed


@dataclass(frozen=True)
class Before:
    foreign: frozenset[LiveGi]
    active: dict[str, str]  # record name -> MIG UUID of every ACTIVE instance a listed pod holds
    hami: dict[str, bool] = field(default_factory=dict)  # HAMi record's MIG UUID -> a listed pod holds it
    # CDI files that are neither the sidecar's nor HAMi's (another writer's): never removed, never ours
    others: frozenset[str] = frozenset()


def standard_start(world: World) -> Held:
    """A foreign instance on the A100 and pod-keep ACTIVE on GPU 0: what every scenario must keep."""
    g, profile, start, size = FOREIGN
    world.hw.create_instance(g, profile, start, size)
    held = Held(world)
    held.allocate("pod-keep", KEEP)
    return held


def _mig_uuid(allocation: ActiveAllocation) -> str:
    """A held allocation comes from a successful Allocate, which always names the instance it made."""
    assert allocation.identity is not None, allocation
    return allocation.identity.mig_uuid


def before(world: World, held: Held) -> Before:
    records = world.record_files().values()
    claimed = {(r.gpu_uuid, r.gpu_instance_id) for r in records}
    foreign = frozenset(gi for gi in world.layout() if (world.uuid(gi[0]), gi[1]) not in claimed)
    listed = {_mig_uuid(a) for a in held.active()}
    active = {r.name: r.mig_uuid for r in records if r.state is State.ACTIVE and r.mig_uuid in listed}
    hami = {mig: mig in listed for mig in hami_records(world)}
    # A pod on an instance HAMi made holds it ACTIVE once it is taken over, under the sidecar's name.
    for a in held.active():
        if _mig_uuid(a) in hami:
            active[record_name(a.reservation.gpu_uuid, a.reservation.placement)] = _mig_uuid(a)
    return Before(foreign, {k: v for k, v in active.items() if v is not None}, hami, others_cdi(world))


def others_cdi(world: World) -> frozenset[str]:
    """The CDI files another writer put there: not HAMi's, and not the sidecar's spec of an instance
    it records (``owned_bytes`` judges what sits at such a spec's path)."""
    if not world.cdi.enabled:
        return frozenset()
    ours = {
        world.cdi.spec_path(r.mig_uuid).name: r.mig_uuid for r in world.record_files().values() if r.mig_uuid
    }
    hami = {s.filename for s in world.cdi.hami_specs()}
    others = set()
    for name in world.cdi_files() - hami:
        mig_uuid = ours.get(name)
        try:
            if mig_uuid is None or world.cdi.owned_bytes(world.cdi_dir / name, mig_uuid) is None:
                others.add(name)
        except ForeignSpecFile:
            others.add(name)
    return frozenset(others)


def hami_records(world: World) -> set[str]:
    """The MIG UUIDs HAMi's record files in the state directory name (each decodes: the tests write
    them as HAMi does)."""
    found = set()
    for name, data in hami_record_files(world.records.directory):
        file = read_record_file(name, data)
        assert file.record is not None, f"{name}: {file.why}"
        found.add(file.record.mig_uuid)
    return found


def check(world: World, was: Before, *, settled: bool) -> None:
    """The invariants of the module docstring; ``settled``: faults cleared and the reconciler ran."""
    files = world.record_files()
    assert {r.name: r for r in world.lifecycle.instances()} == files, "table and files differ"
    live = {(world.uuid(gi[0]), gi[1]): gi for gi in world.layout()}
    claimed: set[tuple[str, int]] = set()
    for r in files.values():
        assert r.state in {State.ACTIVE, State.IDLE, State.ERROR}, f"{r.name} left {r.state}"
        assert not settled or r.state is not State.ERROR, f"{r.name} still ERROR: {r.last_error}"
        key = (r.gpu_uuid, r.gpu_instance_id)
        if r.gpu_instance_id is None or key not in live:
            assert r.state is State.ERROR, f"{r.name} ({r.state}) names no live GI"
            continue
        _, _, _, placement, cis = live[key]
        assert placement == str(r.placement), f"{r.name} names GI {r.gpu_instance_id} at {placement}"
        claimed.add(key)
        if r.state is not State.ERROR:
            assert cis == ((r.compute_instance_id, r.mig_uuid),), f"{r.name} does not match {cis}"
    for key, gi in live.items():
        assert key in claimed or gi in was.foreign, f"leaked GI {gi}"
    for name, mig_uuid in was.active.items():
        kept = files.get(name)
        assert kept is not None, f"lost {name}"
        assert (kept.state, kept.mig_uuid) == (State.ACTIVE, mig_uuid), f"{name} changed"
    check_hami(world, was, files)
    if world.cdi.enabled:
        known = {world.cdi.spec_path(r.mig_uuid).name for r in files.values() if r.mig_uuid is not None}
        known |= {s.filename for s in world.cdi.hami_specs()}  # judged by check_hami
        assert was.others <= world.cdi_files(), f"another writer's CDI files removed: {was.others}"
        known |= was.others
        assert world.cdi_files() <= known, f"stray CDI files {world.cdi_files() - known}"
        for r in files.values():
            if r.state is not State.ERROR and r.identity is not None:
                g = next(gpu.index for gpu in world.gpus if gpu.uuid == r.gpu_uuid)
                assert world.cdi_spec_is_current(g, r.identity), f"CDI spec of {r.name} is not current"


def check_hami(world: World, was: Before, files: dict[str, OwnershipRecord]) -> None:
    """The HAMi invariants of the module docstring."""
    theirs = hami_records(world)
    live = world.live_mig_uuids()
    for mig in was.hami:
        ours = [r.name for r in files.values() if r.mig_uuid == mig]
        claims = len(ours) + (mig in theirs)
        assert claims == 1 if mig in live else claims <= 1, f"{mig}: records {ours}, HAMi's {mig in theirs}"
    if theirs:
        return  # a takeover left incomplete keeps every HAMi spec
    state = {r.mig_uuid: r.state for r in files.values() if r.mig_uuid is not None}
    specs = {s.mig_uuid for s in world.cdi.hami_specs()}
    for mig in specs:
        assert mig in live, f"HAMi's CDI spec of {mig} is left without its instance"
        taken_over_idle = not was.hami.get(mig, True) and mig in state
        assert not taken_over_idle, f"HAMi's CDI spec of {mig}, taken over IDLE, is left"
    for mig, held_by_pod in was.hami.items():
        if held_by_pod and state.get(mig) is State.ACTIVE:
            assert mig in specs, f"HAMi's CDI spec of {mig} is gone while its pod runs"


def settle(world: World, was: Before) -> None:
    """Faults gone: one reconciler round clears every ERROR instance; then the settled invariants."""
    world.hw.clear_faults()
    Reconciler(world.lifecycle).run_once()
    check(world, was, settled=True)


def probe_reuse(world: World, held: Held) -> None:
    """Every IDLE instance comes back REUSED with its own MIG UUID; a foreign GI blocks its GPU."""
    for n, r in enumerate(sorted(world.record_files().values(), key=lambda r: r.name)):
        if r.state is not State.IDLE:
            continue
        g = next(gpu.index for gpu in world.gpus if gpu.uuid == r.gpu_uuid)
        got = held.allocate(f"probe-{n}", (g, r.profile, r.placement.start, r.placement.size)).devices[0]
        assert (got.outcome, got.identity.mig_uuid) == (Outcome.REUSED, r.mig_uuid)
    if any(gi[0] == WHOLE_FOREIGN_GPU[0] for gi in before(world, held).foreign):
        layout = world.layout()
        with pytest.raises(errors.PlacementBusy):
            held.allocate("probe-foreign", WHOLE_FOREIGN_GPU)
        assert world.layout() == layout
