"""The pure core of startup recovery: what gather reads, what ``plan`` decides, and ``plan`` itself.

This module is the "functional core" half of recovery (architecture section 6): plain frozen values
in (``Inputs``), plain frozen values out (``Plan``: ``Step``s of primitive ``Action``s, the table of
owned records and the ``RecoveryReport``). It imports value types and pure functions only - no NVML
port, no record store, no CDI writer, no lifecycle, no clock - so every rule below can be tested on
plain data and read without following any I/O. Gathering the inputs, applying a plan and the
``Recovery`` class that runs the three phases live in ``sidecar.recovery``, which re-exports these
names.

``plan`` applies the rules below, in order. An active allocation that does not match the live hardware
exactly raises ``errors.UnverifiableState`` before a single action exists; otherwise the result lists
the ``Step``s to apply (records first, so that a crash in the middle of applying leaves work the next
recovery can finish), the table of owned records and the report.

The rules (spec "Restart recovery", the CDI lifecycle, and the ownership requirement):

1. Each active allocation must match a live GI/CI exactly: GPU, profile (name -> the GI's profile ID),
   placement, GI ID, CI ID, MIG UUID, and a single full-size CI. The record becomes ``ACTIVE`` with the
   allocation as owner. Any mismatch, an allocation without runtime identity, two allocations naming one
   instance, or one key naming two reservations -> ``UnverifiableState``. In a Recover repeated once
   the sidecar has recovered, the table is newer than the pod list: an instance ACTIVE for another key
   now (released and reused since the list was taken) stays with that key, a key that holds another
   instance now is not given a second one, an instance IDLE now stays IDLE (released since the
   list was taken, as far as a Recover without a generation can tell; SyncActive, which is fenced,
   reactivates it for a pod that still holds it), and an instance ERROR now (its destroy failed)
   stays ERROR, never reused, unless its record's owner is the listed allocation (recovery's own
   adoption of that pod, whose record could not be written); each is reported in ``errors``, and the
   MIG UUIDs so refused do not guard ERROR instances from the reconciler.
2. A valid record is matched against the live GI at *exactly* its placement. ``IDLE``/``ACTIVE`` records
   whose GI and CI verify are restored ``IDLE`` - except ``ACTIVE`` ones in a Recover repeated once
   the sidecar has recovered: those stay ``ACTIVE``. One that goes IDLE here (or is adopted IDLE by
   rule 4) is stamped with the recovery's fresh generation, as a release stamps its own (SyncActive's
   reactivation fence). A repeated Recover has no generation fence, and
   its pod list may predate an Allocate or a Release since; releasing and reactivating are
   SyncActive's job, which is fenced. A repeated Recover still adopts the other listed
   allocations, restores, finishes and repairs all the rest.
   ``CREATING`` records are undone and ``DELETING`` ones finished, destroying only what verifies as
   theirs. ``ERROR`` records stay ``ERROR``, except one without a GI ID (a create made the GI, then
   it and its undo failed to read it): its bare GI is destroyed as for ``CREATING``. Only a record
   whose create issued the CI create (``CREATING``, or ``ERROR`` after a failed undo:
   ``may_own_unrecorded_ci``) may own a CI it never recorded (the create stopped between making the
   CI and recording it); any other record without a CI ID stands for a bare GI, and a CI in that GI
   is someone else's (the rule ``Lifecycle``'s destroy applies too).
   A record without a boot ID (every writer stamps one: it was made or edited by hand) is kept
   aside whatever its state: on disk untouched with its CDI file, out of the table, the GI at its
   placement foreign, reported in ``errors``; nothing is destroyed or dropped on its word (an active
   allocation that verifies against the live instance there still adopts it, by rule 1).
   A record of this boot on a GPU NVML does not list is kept on disk untouched with its CDI file,
   out of the table, and reported in ``errors``: the GPU may only be hidden and come back, and
   nothing verifies its instance is gone (one of an earlier boot there is dropped as stale). A
   record whose GI is gone (including after a reboot) is dropped with its CDI file. A record from
   an earlier boot (a non-empty boot ID that is not this one) is stale unless a live CI in the GI at
   its placement has exactly its MIG UUID: GI IDs are reused and placements repeat, so placement,
   profile and GI ID prove nothing across a reboot. A stale record is dropped with its CDI file and
   claims nothing: the GI there is left to rule 4 (foreign, or adopted). A record that contradicts
   the live GI at its placement is kept on disk for the operator and that GI is foreign - unless it
   comes from an earlier boot, in which case it is dropped as stale.
3. A corrupt record file is never touched; live GIs overlapping the placement in its file name are
   foreign (never reused, never adopted, never destroyed).
4. Live GIs nobody claims are foreign and preserved. With ``adopt_existing``: a GI with exactly one
   full-size CI gets an ``IDLE`` record; a GI without a CI is destroyed only on a GPU with no active
   allocation, no instance that stays ``ACTIVE`` and no running process.
5. CDI: every live owned ``ACTIVE``/``IDLE`` instance gets its spec ensured (rewritten if missing or
   different) in the step that records it, after its record, so an instance whose record could not
   be written is not published; spec files of this sidecar's kind whose MIG UUID is no live owned
   instance are removed (the file found by content, whatever its name), except those of instances
   preserved because of a kept or corrupt record (the operator may restore the record).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from sidecar import errors
from sidecar.domain import (
    ActiveAllocation,
    Identity,
    InstanceRef,
    Placement,
    Reservation,
    State,
)
from sidecar.nvml.port import (
    ComputeInstanceInfo,
    GpuInfo,
    GpuInstanceInfo,
    GpuInstanceProfile,
)
from sidecar.ownership import OwnershipRecord, parse_record_name, record_name


class RecoveryReport(msgspec.Struct, frozen=True):
    """Mirrors RecoverResponse.

    ``Plan.report`` says what the plan would do if every step succeeded; the report ``Recovery``
    returns says what happened (``settle_report``): an instance is listed as adopted, restored,
    removed or dropped only when that step succeeded. A step that failed is named in ``errors`` (its
    instance is ERROR, or foreign), and an instance a step left foreign is in ``preserved_foreign``."""

    adopted_active: tuple[InstanceRef, ...] = ()
    restored_idle: tuple[InstanceRef, ...] = ()
    preserved_foreign: tuple[InstanceRef, ...] = ()
    adopted_foreign: tuple[InstanceRef, ...] = ()
    removed_orphan_gis: tuple[InstanceRef, ...] = ()
    dropped_stale_records: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


# -- what gather reads ------------------------------------------------------------------------------


class LiveGpuInstance(msgspec.Struct, frozen=True):
    """One GI as NVML lists it, with every CI inside it."""

    info: GpuInstanceInfo
    compute_instances: tuple[ComputeInstanceInfo, ...] = ()


class LiveGpu(msgspec.Struct, frozen=True):
    """One physical GPU: its profile table and, when MIG is enabled, its live layout."""

    info: GpuInfo
    profiles: tuple[GpuInstanceProfile, ...] = ()
    gpu_instances: tuple[LiveGpuInstance, ...] = ()
    processes: int = 0


class CorruptFile(msgspec.Struct, frozen=True):
    """A record file that exists but cannot be trusted (``records.CorruptRecord``, as a plain value)."""

    name: str
    why: str


class Inputs(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``plan`` decides from. Plain values only; ``gather`` builds it, tests write it by hand."""

    active: tuple[ActiveAllocation, ...] = ()
    records: tuple[OwnershipRecord, ...] = ()
    corrupt: tuple[CorruptFile, ...] = ()
    gpus: tuple[LiveGpu, ...] = ()
    cdi_files: tuple[str, ...] = ()  # MIG UUIDs that have a spec file of this sidecar's kind
    # MIG UUID -> the file it was found in (found by content: the name may differ from the derived one)
    cdi_paths: dict[str, str] = msgspec.field(default_factory=dict)
    # MIG UUID -> qualified CDI device name of every live CI ("" or absent with CDI disabled)
    cdi_devices: dict[str, str] = msgspec.field(default_factory=dict)
    boot_id: str = ""
    adopt_existing: bool = False
    # True for a Recover repeated while the sidecar serves: its pod list may be older than the
    # activations since, and it carries no generation fence, so it never demotes ACTIVE to IDLE.
    recovered: bool = False
    generation: int = 0  # the lifecycle's generation before recovery (at least the stored ceiling)
    generation_ceiling: int = 0  # what the ``generation`` file holds (0 when missing: a first run)
    now: str = ""  # RFC 3339 UTC, stamped into ``since`` of records whose state changes


# -- what plan decides ------------------------------------------------------------------------------


class PutRecord(msgspec.Struct, frozen=True, tag=True):
    record: OwnershipRecord


class DeleteRecord(msgspec.Struct, frozen=True, tag=True):
    name: str


class DestroyOwned(msgspec.Struct, frozen=True, tag=True):
    """Permanently destroy an owned instance through ``Lifecycle.destroy_owned``.

    That helper is the one records-first destroy of the code base: it records DELETING, re-reads the
    live GI/CI and destroys only what still matches the record (a second check against anything that
    changed since gather), removes the CDI file (queued on failure) and deletes the record. ``record``
    carries every ID the planner verified, so a crash half-way leaves a DELETING record that the next
    recovery can finish.

    ``require_idle_gpu`` (orphan removals): the step stops and the GI stays foreign when a process runs
    on the GPU right before the destroy. The orphan rule's "no running process" was read at gather and
    a process may have started since (recovery's GPU locks keep only this sidecar out). An NVML error
    counts as busy, as for ListGpus."""

    record: OwnershipRecord
    require_idle_gpu: bool = False


class EnsureCdi(msgspec.Struct, frozen=True, tag=True):
    """Write the spec of a live owned instance unless an identical one exists.

    It is the last action of the step that records the instance, so it runs only once the record is
    on disk. A spec that cannot be written is reported and does not fail the step: the instance is
    recorded and verified, and a reuse or the next recovery writes the spec again."""

    gpu_minor: int
    identity: Identity


class RemoveCdi(msgspec.Struct, frozen=True, tag=True):
    """Remove the spec file of ``mig_uuid``: the one gather found (``path``), else the derived name."""

    mig_uuid: str
    path: str = ""


Action = PutRecord | DeleteRecord | DestroyOwned | EnsureCdi | RemoveCdi

# The lists of the report that steps feed: each names what a step did, so it holds an entry only
# once that step has succeeded. ``preserved_foreign`` and ``errors`` are fed by the planner directly
# (and by apply, for steps that fail or leave their instance foreign).
ReportList = Literal[
    "adopted_active", "restored_idle", "adopted_foreign", "removed_orphan_gis", "dropped_stale_records"
]
_REPORT_LISTS: tuple[ReportList, ...] = (
    "adopted_active",
    "restored_idle",
    "adopted_foreign",
    "removed_orphan_gis",
    "dropped_stale_records",
)


class Reported(msgspec.Struct, frozen=True):
    """The entry a step adds to one list of the report (``into``) when every one of its actions succeeded:
    an ``InstanceRef``, or a record name for ``dropped_stale_records``."""

    into: ReportList
    entry: InstanceRef | str


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """Actions about one subject, applied in order; the first failure stops the step.

    ``record_name`` names the table entry the step is about (None for CDI-only steps). On failure,
    ``on_failure`` (when set) is written as an ``ERROR`` record and replaces the table entry: the
    instance is kept and never reused. Without it the entry is dropped from the table (an adoption that
    could not be recorded leaves the instance foreign). A step that finds its instance is not ours to
    destroy after all (``ComputeInstanceNotOurs``, a busy GPU under ``require_idle_gpu``) leaves it
    foreign either way. ``foreign_ref`` is how the report names the instance when the step leaves it
    foreign: it is listed in ``preserved_foreign``. ``reported`` is the entry the step adds to the
    report (adopted, restored, removed or dropped) once all its actions succeeded; a step that fails
    or leaves its instance foreign adds none (``settle_report``). The instance's ``EnsureCdi``, if
    any, is the step's last action."""

    subject: str
    actions: tuple[Action, ...] = ()
    record_name: str | None = None
    on_failure: OwnershipRecord | None = None
    foreign_ref: InstanceRef | None = None
    reported: Reported | None = None


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    steps: tuple[Step, ...]
    table: tuple[OwnershipRecord, ...]  # the owned records once every step succeeded
    report: RecoveryReport
    generation: int
    generation_ceiling: int = 0  # carried from ``Inputs``: apply raises it before any activation
    # MIG UUIDs the active allocations name: the plugin's view of what live pods hold, which guards
    # ERROR instances from the reconciler until the first SyncActive brings a fresher view. A repeated
    # Recover leaves out those it refused to the listed pod (the table knows it does not hold them).
    referenced_mig_uuids: frozenset[str] = frozenset()

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(action for step in self.steps for action in step.actions)


def settle_report(
    report: RecoveryReport,
    *,
    done: Iterable[Step],
    left_foreign: Iterable[Step] = (),
    failures: Iterable[str] = (),
) -> RecoveryReport:
    """``report`` as it reads once steps have run: it lists only what actually happened.

    The lists steps feed (adopted, restored, removed, dropped) are rebuilt from the ``reported`` entries
    of the ``done`` steps (every action succeeded), in step order: a step that failed into ERROR adds
    nothing there (its failure is in ``failures``), nor does one left foreign, which is listed in
    ``preserved_foreign`` after the planner's foreign instances. Each step carries its own entry, so a
    step that did not happen never takes away the entry of another one that names the same record or
    instance. ``failures`` follow the planner's ``errors``. Pure; ``plan`` uses it with every step done."""
    lists: dict[str, list[InstanceRef | str]] = {name: [] for name in _REPORT_LISTS}
    for step in done:
        if step.reported is not None:
            lists[step.reported.into].append(step.reported.entry)
    foreign = [step.foreign_ref for step in left_foreign if step.foreign_ref is not None]
    return msgspec.structs.replace(
        report,
        **{name: tuple(entries) for name, entries in lists.items()},
        preserved_foreign=(*report.preserved_foreign, *foreign),
        errors=(*report.errors, *failures),
    )


# -- the pure planner -------------------------------------------------------------------------------

_LIVE_STATES = (State.ACTIVE, State.IDLE)


placement_from_record_name = parse_record_name


def _ref(gpu_uuid: str, profile: str, gi: LiveGpuInstance) -> InstanceRef:
    identity = None
    if len(gi.compute_instances) == 1:
        ci = gi.compute_instances[0]
        identity = Identity(gi.info.id, ci.id, ci.mig_uuid)
    return InstanceRef(Reservation(gpu_uuid, profile, gi.info.placement), identity)


def _record_ref(record: OwnershipRecord) -> InstanceRef:
    return InstanceRef(record.reservation, record.identity)


class _Planner:
    """Holds the bookkeeping of one ``plan`` call; every method is pure over ``self.inputs``."""

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self.gpus = {gpu.info.uuid: gpu for gpu in inputs.gpus}
        self.claimed: set[tuple[str, int]] = set()  # (GPU UUID, GI ID) already decided
        self.protected_cdi: set[str] = set()  # MIG UUIDs whose spec file must stay
        self.removed_cdi: set[str] = set()
        self.steps: list[Step] = []
        self.table: dict[str, OwnershipRecord] = {}
        # The report's other lists come from the steps (``Step.reported``, ``settle_report``).
        self.preserved_foreign: list[InstanceRef] = []
        self.errors: list[str] = []
        # MIG UUIDs of listed allocations a repeated Recover did not give to the listed pod.
        self.refused: set[str] = set()
        self.generation = max(
            [
                inputs.generation,
                *(r.activated_generation for r in inputs.records),
                *(r.idled_generation for r in inputs.records),
            ]
        )
        # The one fresh generation this recovery hands out, to every instance it activates or
        # restores IDLE; the plan's generation moves to it once one is handed out.
        self.fresh_generation = self.generation + 1
        self.handed_out = False

    # -- lookups -----------------------------------------------------------------------------------
    def profile_of(self, gpu_uuid: str, profile_id: int) -> GpuInstanceProfile | None:
        gpu = self.gpus.get(gpu_uuid)
        if gpu is None:
            return None
        return next((p for p in gpu.profiles if p.id == profile_id), None)

    def profile_name(self, gpu_uuid: str, profile_id: int) -> str:
        profile = self.profile_of(gpu_uuid, profile_id)
        return profile.name if profile is not None else f"profile-id-{profile_id}"

    def gi_at(self, gpu_uuid: str, placement: Placement) -> LiveGpuInstance | None:
        gpu = self.gpus.get(gpu_uuid)
        if gpu is None:
            return None
        return next((gi for gi in gpu.gpu_instances if gi.info.placement == placement), None)

    def cdi_name(self, mig_uuid: str | None) -> str:
        return self.inputs.cdi_devices.get(mig_uuid, "") if mig_uuid else ""

    def remove_cdi(self, mig_uuid: str | None) -> tuple[Action, ...]:
        """A RemoveCdi for a spec file that exists and was not removed yet (kept files excepted)."""
        if not mig_uuid or mig_uuid not in self.inputs.cdi_files or mig_uuid in self.removed_cdi:
            return ()
        self.removed_cdi.add(mig_uuid)
        return (RemoveCdi(mig_uuid, self.inputs.cdi_paths.get(mig_uuid, "")),)

    # -- rule 1: active allocations ------------------------------------------------------------------
    def adopt_active(self) -> None:
        by_key: dict[object, ActiveAllocation] = {}
        by_instance: dict[tuple[str, int], ActiveAllocation] = {}
        unverifiable: list[str] = []
        keys: set[str] = set()
        for alloc in self.inputs.active:
            seen = by_key.get(alloc.key)
            if seen is not None:
                if seen.reservation != alloc.reservation or seen.identity != alloc.identity:
                    keys.add(str(alloc.key))
                    unverifiable.append(
                        f"allocation {alloc.key} is listed twice with different reservations or identities"
                    )
                continue
            by_key[alloc.key] = alloc
            why = self.verify_active(alloc)
            if why is not None:
                keys.add(str(alloc.key))
                unverifiable.append(f"allocation {alloc.key} ({alloc.reservation}): {why}")
                continue
            assert alloc.identity is not None
            instance = (alloc.reservation.gpu_uuid, alloc.identity.gpu_instance_id)
            other = by_instance.get(instance)
            if other is not None:
                keys.update((str(other.key), str(alloc.key)))
                unverifiable.append(
                    f"allocations {other.key} and {alloc.key} both claim GPU instance "
                    f"{instance[1]} on {instance[0]}"
                )
                continue
            by_instance[instance] = alloc
        if unverifiable:
            raise errors.UnverifiableState(
                "startup recovery cannot verify the active allocations against the hardware; nothing was "
                "modified: " + "; ".join(unverifiable),
                {"allocations": ",".join(sorted(keys))},
            )
        corrupt_names = {c.name for c in self.inputs.corrupt}
        existing = {r.name: r for r in self.inputs.records}
        for (gpu_uuid, gi_id), alloc in by_instance.items():
            assert alloc.identity is not None
            gi = self.gi_at(gpu_uuid, alloc.reservation.placement)
            assert gi is not None
            ci = gi.compute_instances[0]
            name = record_name(gpu_uuid, alloc.reservation.placement)
            if self.inputs.recovered and (
                self.stays_error(alloc, existing.get(name))
                or self.held_by_another_key(alloc, existing.get(name), name)
                or self.stays_idle(alloc, existing.get(name))
            ):
                self.refused.add(alloc.identity.mig_uuid)
                continue
            self.claimed.add((gpu_uuid, gi_id))
            if name in corrupt_names:
                # The hardware matches the pod, but the record file is corrupt and must not be
                # overwritten: the instance stays foreign until the operator deals with the file.
                self.protected_cdi.add(ci.mig_uuid)
                self.preserved_foreign.append(_ref(gpu_uuid, alloc.reservation.profile, gi))
                self.errors.append(
                    f"allocation {alloc.key} matches the live instance {ci.mig_uuid}, but its ownership "
                    f"record {name} is corrupt; the instance is preserved as foreign"
                )
                continue
            old = existing.get(name)
            keep_activation = (
                old is not None
                and old.state is State.ACTIVE
                and old.owner == alloc.owner
                and old.identity == alloc.identity
            )
            idled = 0
            if keep_activation:
                assert old is not None
                activated, since, boot = old.activated_generation, old.since, old.boot_id
                idled = old.idled_generation
            else:
                self.handed_out = True
                activated, since = self.fresh_generation, self.inputs.now
                boot = old.boot_id if old is not None and old.mig_uuid == ci.mig_uuid else self.inputs.boot_id
            record = OwnershipRecord(
                gpu_uuid=gpu_uuid,
                profile=alloc.reservation.profile,
                gi_profile_id=gi.info.profile_id,
                ci_profile_id=ci.profile_id,
                placement=alloc.reservation.placement,
                state=State.ACTIVE,
                gpu_instance_id=gi.info.id,
                compute_instance_id=ci.id,
                mig_uuid=ci.mig_uuid,
                owner=alloc.owner,
                activated_generation=activated,
                idled_generation=idled,
                cdi_device=self.cdi_name(ci.mig_uuid),
                boot_id=boot or self.inputs.boot_id,
                since=since,
            )
            actions: tuple[Action, ...] = () if old == record else (PutRecord(record),)
            self.steps.append(
                Step(
                    subject=f"adopt {alloc.key}",
                    actions=actions,
                    record_name=name,
                    on_failure=record,
                    reported=Reported("adopted_active", _record_ref(record)),
                )
            )
            self.table[name] = record

    def held_by_another_key(self, alloc: ActiveAllocation, old: OwnershipRecord | None, name: str) -> bool:
        """True (and an error line) when a repeated Recover must not hand this instance to ``alloc``.

        Once the sidecar serves, the pod list of a repeated Recover may be older than a release and
        a reuse since: the instance it names may be ACTIVE for a newer pod now (same GI, CI and MIG
        UUID, since reuse keeps them), or the listed key may hold another instance now. The table is
        newer than the list, so the instance stays as it is (ACTIVE with its current owner, or IDLE,
        restored by rule 2) - the same rule SyncActive follows for an IDLE instance it reactivates.
        Before the first Recover there is no newer truth than the pod list, and this never applies.
        """
        assert alloc.identity is not None
        res = alloc.reservation
        where = f"{alloc.identity.mig_uuid} at {res.placement} on {res.gpu_uuid}"
        if (
            old is not None
            and old.state is State.ACTIVE
            and old.owner is not None
            and old.owner.key != alloc.key
        ):
            self.table[name] = old
            self.claimed.add((old.gpu_uuid, alloc.identity.gpu_instance_id))
            self.steps.append(Step(subject=f"keep {name} ACTIVE for {old.owner.key}", record_name=name))
            self.errors.append(
                f"allocation {alloc.key} names the instance {where}, which is ACTIVE for {old.owner.key} "
                f"now (released and reused since the pod list was taken); it stays with {old.owner.key}"
            )
            return True
        if old is not None and old.state is State.ACTIVE:
            return False  # this key holds it already
        other = next(
            (
                r
                for r in self.inputs.records
                if r.name != name
                and r.state is State.ACTIVE
                and r.owner is not None
                and r.owner.key == alloc.key
            ),
            None,
        )
        if other is None:
            return False
        self.errors.append(
            f"allocation {alloc.key} names the instance {where}, but {alloc.key} holds {other.mig_uuid} at "
            f"{other.placement} now; one key never holds two instances, so it is not activated for it"
        )
        return True

    def stays_error(self, alloc: ActiveAllocation, old: OwnershipRecord | None) -> bool:
        """True (and an error line) when a repeated Recover names an instance that is ERROR now.

        ERROR is an instance whose destroy failed (a reclaim of an IDLE instance, an undo): the spec
        keeps it ERROR, never reuses it, and the reconciler retries the destroy. The pod list of a
        repeated Recover may predate the release after which it was reclaimed; adopting it ACTIVE
        would stop those retries, and once a SyncActive idled it an Allocate would reuse an instance
        whose destroy failed. So it stays ERROR (rule 2 keeps it) - unless its owner is the listed
        allocation's: then it is recovery's own adoption of that pod whose record could not be
        written (apply records the failed step ERROR with the allocation as owner), and the pod
        really holds it. A refused MIG UUID is left out of the plan's referenced ones, so the
        reconciler keeps retrying the destroy."""
        if old is None or old.state is not State.ERROR or old.owner == alloc.owner:
            return False
        assert alloc.identity is not None
        res = alloc.reservation
        holder = f"it was {old.owner.key}'s" if old.owner is not None else "it had no owner"
        self.errors.append(
            f"allocation {alloc.key} names the ERROR instance {alloc.identity.mig_uuid} at {res.placement} "
            f"on {res.gpu_uuid} (record {old.name}, {holder}); a repeated Recover never adopts an "
            "instance whose destroy failed for another owner, since its pod list may predate the "
            "release: it stays ERROR, is never reused, and the reconciler retries its destroy"
        )
        return True

    def stays_idle(self, alloc: ActiveAllocation, old: OwnershipRecord | None) -> bool:
        """True (and an error line) when a repeated Recover names an instance that is IDLE now.

        The pod list of a repeated Recover may predate the release that idled the instance, and
        Recover carries no generation to tell: reactivating it would hand it back to a pod that is
        gone, and the next pod's Allocate would find it busy. It stays IDLE (rule 2 restores it);
        SyncActive, which is fenced by the generation, reactivates it for a pod that still holds it.
        """
        if old is None or old.state is not State.IDLE:
            return False
        assert alloc.identity is not None
        res = alloc.reservation
        self.errors.append(
            f"allocation {alloc.key} names the IDLE instance {alloc.identity.mig_uuid} at {res.placement} "
            f"on {res.gpu_uuid} (record {old.name}); a repeated Recover never reactivates an IDLE "
            "instance, since its pod list may predate the release: it stays IDLE, and SyncActive "
            "reactivates it if the pod still holds it"
        )
        return True

    def verify_active(self, alloc: ActiveAllocation) -> str | None:
        """Why an allocation does not match the live hardware exactly, or None when it does."""
        identity, reservation = alloc.identity, alloc.reservation
        if identity is None or not identity.mig_uuid:
            return "the allocation carries no runtime identity (MIG UUID, GI ID, CI ID)"
        gpu = self.gpus.get(reservation.gpu_uuid)
        if gpu is None:
            return f"GPU {reservation.gpu_uuid} is not on this node"
        if not gpu.info.mig_current:
            return f"MIG is disabled on GPU {reservation.gpu_uuid}"
        gi = next((g for g in gpu.gpu_instances if g.info.id == identity.gpu_instance_id), None)
        if gi is None:
            return f"GPU instance {identity.gpu_instance_id} does not exist"
        profile = self.profile_of(reservation.gpu_uuid, gi.info.profile_id)
        live_name = profile.name if profile is not None else f"profile-id-{gi.info.profile_id}"
        if live_name != reservation.profile:
            return f"GPU instance {gi.info.id} has profile {live_name}, not {reservation.profile}"
        if gi.info.placement != reservation.placement:
            return (
                f"GPU instance {gi.info.id} is at placement {gi.info.placement}, not {reservation.placement}"
            )
        if len(gi.compute_instances) != 1:
            return f"GPU instance {gi.info.id} has {len(gi.compute_instances)} compute instances, not one"
        ci = gi.compute_instances[0]
        if ci.id != identity.compute_instance_id:
            return f"compute instance is {ci.id}, not {identity.compute_instance_id}"
        if ci.mig_uuid != identity.mig_uuid:
            return f"the live MIG UUID is {ci.mig_uuid}, not {identity.mig_uuid}"
        assert profile is not None
        if ci.profile_id != profile.ci_profile_id:
            return f"compute instance {ci.id} is not the full-size one of its GPU instance"
        return None

    # -- rule 2: valid records -----------------------------------------------------------------------
    def reconcile_records(self) -> None:
        for record in sorted(self.inputs.records, key=lambda r: r.name):
            if record.name in self.table:
                continue  # adopted by an active allocation
            if not record.boot_id:
                self.keep_unstamped(record)
                continue
            earlier_boot = record.boot_id != self.inputs.boot_id
            if record.gpu_uuid not in self.gpus:
                if earlier_boot:
                    self.drop(record, "it is from an earlier boot and its GPU is not visible")
                else:
                    self.keep_unseen(record)
                continue
            gi = self.gi_at(record.gpu_uuid, record.placement)
            if gi is None:
                self.drop(record, "its GPU instance no longer exists")
                continue
            if earlier_boot and not any(ci.mig_uuid == record.mig_uuid for ci in gi.compute_instances):
                # GI IDs are reused and placements repeat: after a reboot a GI someone else made can
                # match this record in everything but the MIG UUID, which only its own instance has.
                # Without that proof the record describes nothing live; the GI is left unclaimed.
                self.drop(record, "it is from an earlier boot and no live compute instance has its MIG UUID")
                continue
            why = self.record_mismatch(record, gi)
            if why is not None:
                if earlier_boot:
                    self.drop(record, f"it is from an earlier boot and {why}")
                    continue
                self.keep_aside(record, gi, why)
                continue
            self.claimed.add((record.gpu_uuid, gi.info.id))
            if record.state is State.ACTIVE and self.inputs.recovered:
                self.keep_active(record)
            elif record.state in _LIVE_STATES:
                self.restore_idle(record, gi)
            elif record.state is State.ERROR and record.gpu_instance_id is not None:
                self.keep_error(record)
            else:
                self.finish_destroy(record, gi)

    def record_mismatch(self, record: OwnershipRecord, gi: LiveGpuInstance) -> str | None:
        """Why the live GI at the record's placement is not the record's instance, or None."""
        live_profile = self.profile_name(record.gpu_uuid, gi.info.profile_id)
        if gi.info.profile_id != record.gi_profile_id or live_profile != record.profile:
            return f"the live GPU instance has profile {live_profile}, the record says {record.profile}"
        if record.gpu_instance_id is None:
            # A crash between creating the GI and recording its ID. The CREATING record was written
            # before the create, for exactly this placement and profile, and nobody else creates GIs
            # here (the ownership requirement), so a bare GI there is the one it made. A GI that
            # already has a CI was completed by someone: that is not what this record describes.
            # ERROR without a GI ID is the same case: the create made the GI and failed, and its
            # undo failed to find the GI too.
            if record.state in (State.CREATING, State.ERROR) and not gi.compute_instances:
                return None
            return f"the record has no GPU instance ID to verify live GPU instance {gi.info.id} against"
        if gi.info.id != record.gpu_instance_id:
            return f"the live GPU instance ID is {gi.info.id}, the record says {record.gpu_instance_id}"
        cis = gi.compute_instances
        if record.state in _LIVE_STATES:
            if record.identity is None:
                return "the record has no complete identity"
            if len(cis) != 1:
                return f"the live GPU instance has {len(cis)} compute instances, not one"
            if cis[0].id != record.compute_instance_id or cis[0].mig_uuid != record.mig_uuid:
                return (
                    f"the live compute instance is {cis[0].id} {cis[0].mig_uuid}, the record says "
                    f"{record.compute_instance_id} {record.mig_uuid}"
                )
            return None
        # CREATING, DELETING, ERROR: a partial instance is expected; what exists must be its own.
        if len(cis) > 1:
            return f"the live GPU instance has {len(cis)} compute instances"
        if not cis:
            return None
        ci = cis[0]
        if record.compute_instance_id is None and not record.may_own_unrecorded_ci:
            # The rule lifecycle's destroy applies too (ComputeInstanceNotOurs): only a record whose
            # create issued the CI create (CREATING, or ERROR after a failed undo) may own a CI it never
            # recorded. Any other record without a CI ID is written only for a GI that had no CI when
            # its destroy was decided (an orphan GI being removed, a bare GI a create left). Nothing of
            # ours creates a CI in such a GI, so this one was made since by someone else.
            return (
                f"the live GPU instance has compute instance {ci.id} {ci.mig_uuid}, but the record "
                f"({record.state}) stands for a bare GPU instance"
            )
        if record.compute_instance_id is None:
            # Crash between creating the CI and recording it: a full-size CI inside a GI verified as
            # ours can only be ours (the ownership requirement: nobody else creates CIs here).
            if ci.profile_id != record.ci_profile_id:
                return f"the live compute instance {ci.id} has another compute profile"
            if record.mig_uuid and ci.mig_uuid != record.mig_uuid:
                return f"the live compute instance is {ci.mig_uuid}, the record says {record.mig_uuid}"
            return None
        if ci.id != record.compute_instance_id or (record.mig_uuid and ci.mig_uuid != record.mig_uuid):
            return (
                f"the live compute instance is {ci.id} {ci.mig_uuid}, the record says "
                f"{record.compute_instance_id} {record.mig_uuid}"
            )
        return None

    def drop(self, record: OwnershipRecord, why: str) -> None:
        actions = (*self.remove_cdi(record.mig_uuid), DeleteRecord(record.name))
        self.steps.append(
            Step(
                subject=f"drop {record.name}: {why}",
                actions=actions,
                reported=Reported("dropped_stale_records", record.name),
            )
        )

    def keep_unseen(self, record: OwnershipRecord) -> None:
        """A record of this boot on a GPU NVML does not list stays on disk as it is, with its CDI spec.

        The GPU may be hidden only (a device filter, a reset in progress) and come back with the
        instance: nothing verifies the instance is gone, so ownership is not given up. The record is
        not in the table (nothing can use a GPU that is not there); the next Recover that sees the
        GPU judges it as usual."""
        if record.mig_uuid:
            self.protected_cdi.add(record.mig_uuid)
        self.errors.append(
            f"GPU {record.gpu_uuid} is not visible; record kept: ownership record {record.name} "
            f"({record.state}) and its CDI spec stay as they are until a Recover sees the GPU again"
        )

    def keep_unstamped(self, record: OwnershipRecord) -> None:
        """A record without a boot ID is kept aside, whatever its state, and never acted upon.

        Every writer stamps the boot ID, so such a record was made or edited by hand: nothing tells
        whether it is of this boot (then a CREATING or DELETING one would destroy the GI at its
        placement) or of an earlier one (then it would be dropped as stale). On the safe side it is
        neither: it stays on disk untouched with its CDI spec, out of the table, and the GI at its
        placement (if any) is foreign - preserved, never reused, never adopted. ``records verify``
        lists it apart (``no_boot_id``) for the operator, who removes or fixes it."""
        if record.mig_uuid:
            self.protected_cdi.add(record.mig_uuid)
        gi = self.gi_at(record.gpu_uuid, record.placement)
        kept = ""
        if gi is not None and (record.gpu_uuid, gi.info.id) not in self.claimed:
            self.claimed.add((record.gpu_uuid, gi.info.id))
            self.protected_cdi.update(ci.mig_uuid for ci in gi.compute_instances)
            self.preserved_foreign.append(
                _ref(record.gpu_uuid, self.profile_name(record.gpu_uuid, gi.info.profile_id), gi)
            )
            kept = f"; the GPU instance {gi.info.id} at its placement is preserved as foreign"
        self.errors.append(
            f"ownership record {record.name} ({record.state}) carries no boot ID, so nothing tells which "
            "boot wrote it (this sidecar stamps one in every record); it is left untouched for the "
            f"operator{kept}"
        )

    def keep_aside(self, record: OwnershipRecord, gi: LiveGpuInstance, why: str) -> None:
        self.claimed.add((record.gpu_uuid, gi.info.id))
        if record.mig_uuid:
            self.protected_cdi.add(record.mig_uuid)
        for ci in gi.compute_instances:
            self.protected_cdi.add(ci.mig_uuid)
        self.preserved_foreign.append(
            _ref(record.gpu_uuid, self.profile_name(record.gpu_uuid, gi.info.profile_id), gi)
        )
        self.errors.append(
            f"ownership record {record.name} ({record.state}) contradicts the live GPU instance "
            f"{gi.info.id} at {record.placement} on {record.gpu_uuid}: {why}; the instance is preserved as "
            "foreign and the record is kept for the operator"
        )

    def restore_idle(self, record: OwnershipRecord, gi: LiveGpuInstance) -> None:
        changed = record.state is not State.IDLE
        if changed:
            # Going IDLE takes a fresh generation, as a release does (SyncActive's reactivation fence).
            self.handed_out = True
        restored = msgspec.structs.replace(
            record,
            state=State.IDLE,
            owner=None,
            last_error="",
            cdi_device=self.cdi_name(record.mig_uuid),
            idled_generation=self.fresh_generation if changed else record.idled_generation,
            since=self.inputs.now if changed else record.since,
        )
        actions: tuple[Action, ...] = () if restored == record else (PutRecord(restored),)
        ref = _ref(record.gpu_uuid, record.profile, gi)
        # No ``on_failure``: an ERROR entry would have the reconciler destroy a healthy instance. When
        # the record cannot be written, the instance is foreign for this process life and the record
        # on disk stays as it was, so a later Recover with a working state directory restores it.
        self.steps.append(
            Step(
                subject=f"restore {record.name}",
                actions=actions,
                record_name=record.name,
                foreign_ref=ref,
                reported=Reported("restored_idle", ref),
            )
        )
        self.table[record.name] = restored

    def keep_active(self, record: OwnershipRecord) -> None:
        """A repeated Recover leaves a verified ACTIVE instance as it is (rule 2's exception)."""
        self.table[record.name] = record
        self.steps.append(Step(subject=f"keep {record.name} ACTIVE", record_name=record.name))

    def keep_error(self, record: OwnershipRecord) -> None:
        """ERROR stays ERROR: the reconciler retries the destroy; its CDI file goes only after that."""
        if record.mig_uuid:
            self.protected_cdi.add(record.mig_uuid)
        self.table[record.name] = record
        self.steps.append(Step(subject=f"keep {record.name} in ERROR", record_name=record.name))

    def finish_destroy(self, record: OwnershipRecord, gi: LiveGpuInstance) -> None:
        """Undo a CREATING record (or an ERROR one a failed create left without a GI ID) or finish a
        DELETING one; the record carries the verified live IDs."""
        ci = gi.compute_instances[0] if gi.compute_instances else None
        deleting = msgspec.structs.replace(
            record,
            state=State.DELETING,
            gpu_instance_id=gi.info.id,
            compute_instance_id=ci.id if ci is not None else record.compute_instance_id,
            mig_uuid=ci.mig_uuid if ci is not None else record.mig_uuid,
            ci_create_issued=False,
            since=record.since if record.state is State.DELETING else self.inputs.now,
        )
        if deleting.mig_uuid:
            self.removed_cdi.add(deleting.mig_uuid)  # destroy_owned removes it after the hardware
        verb = "finish deleting" if record.state is State.DELETING else "undo"
        self.steps.append(
            Step(
                subject=f"{verb} {record.name}",
                actions=(DestroyOwned(deleting),),
                record_name=record.name,
                on_failure=deleting,
                foreign_ref=_ref(record.gpu_uuid, self.profile_name(record.gpu_uuid, gi.info.profile_id), gi),
                reported=Reported("dropped_stale_records", record.name),
            )
        )

    # -- rule 3: corrupt records ---------------------------------------------------------------------
    def preserve_corrupt(self) -> None:
        for corrupt in sorted(self.inputs.corrupt, key=lambda c: c.name):
            where = placement_from_record_name(corrupt.name)
            if where is None:
                self.errors.append(
                    f"ownership record {corrupt.name} is corrupt ({corrupt.why}) and its name names no "
                    "placement; it is left untouched"
                )
                continue
            gpu_uuid, placement = where
            gpu = self.gpus.get(gpu_uuid)
            preserved: list[int] = []
            for gi in gpu.gpu_instances if gpu is not None else ():
                if not gi.info.placement.overlaps(placement) or (gpu_uuid, gi.info.id) in self.claimed:
                    continue
                self.claimed.add((gpu_uuid, gi.info.id))
                self.protected_cdi.update(ci.mig_uuid for ci in gi.compute_instances)
                self.preserved_foreign.append(
                    _ref(gpu_uuid, self.profile_name(gpu_uuid, gi.info.profile_id), gi)
                )
                preserved.append(gi.info.id)
            kept = f"; GPU instances {preserved} are preserved as foreign" if preserved else ""
            self.errors.append(
                f"ownership record {corrupt.name} is corrupt ({corrupt.why}); it is left untouched{kept}"
            )

    # -- rule 4: unowned live instances --------------------------------------------------------------
    def handle_unowned(self) -> None:
        # Busy: a listed allocation, or an instance that stays ACTIVE (a repeated Recover keeps
        # ACTIVE records its possibly older pod list does not name). Runs after rules 1-3 fill the table.
        active_gpus = {alloc.reservation.gpu_uuid for alloc in self.inputs.active} | {
            r.gpu_uuid for r in self.table.values() if r.state is State.ACTIVE
        }
        for gpu in self.inputs.gpus:
            uuid = gpu.info.uuid
            for gi in gpu.gpu_instances:
                if (uuid, gi.info.id) in self.claimed:
                    continue
                self.claimed.add((uuid, gi.info.id))
                profile = self.profile_of(uuid, gi.info.profile_id)
                name = profile.name if profile is not None else f"profile-id-{gi.info.profile_id}"
                ref = _ref(uuid, name, gi)
                if not self.inputs.adopt_existing or profile is None:
                    self.preserved_foreign.append(ref)
                    continue
                cis = gi.compute_instances
                if len(cis) == 1 and cis[0].profile_id == profile.ci_profile_id:
                    self.adopt_foreign(gpu, profile, gi, cis[0], ref)
                elif not cis and uuid not in active_gpus and gpu.processes == 0:
                    self.remove_orphan(gpu, profile, gi, ref)
                else:
                    self.preserved_foreign.append(ref)

    def adopt_foreign(
        self,
        gpu: LiveGpu,
        profile: GpuInstanceProfile,
        gi: LiveGpuInstance,
        ci: ComputeInstanceInfo,
        ref: InstanceRef,
    ) -> None:
        record = OwnershipRecord(
            gpu_uuid=gpu.info.uuid,
            profile=profile.name,
            gi_profile_id=profile.id,
            ci_profile_id=ci.profile_id,
            placement=gi.info.placement,
            state=State.IDLE,
            gpu_instance_id=gi.info.id,
            compute_instance_id=ci.id,
            mig_uuid=ci.mig_uuid,
            cdi_device=self.cdi_name(ci.mig_uuid),
            idled_generation=self.fresh_generation,
            boot_id=self.inputs.boot_id,
            since=self.inputs.now,
        )
        self.handed_out = True
        # No ``on_failure``: an adoption that cannot be recorded leaves the instance foreign, and the
        # report names it there (``foreign_ref``), not as adopted.
        self.steps.append(
            Step(
                subject=f"adopt foreign {record.name}",
                actions=(PutRecord(record),),
                record_name=record.name,
                foreign_ref=ref,
                reported=Reported("adopted_foreign", ref),
            )
        )
        self.table[record.name] = record

    def remove_orphan(
        self, gpu: LiveGpu, profile: GpuInstanceProfile, gi: LiveGpuInstance, ref: InstanceRef
    ) -> None:
        """Destroy an unowned GI without a CI, records first: a crash mid-way leaves a DELETING record."""
        record = OwnershipRecord(
            gpu_uuid=gpu.info.uuid,
            profile=profile.name,
            gi_profile_id=profile.id,
            ci_profile_id=profile.ci_profile_id,
            placement=gi.info.placement,
            state=State.DELETING,
            gpu_instance_id=gi.info.id,
            boot_id=self.inputs.boot_id,
            since=self.inputs.now,
        )
        self.steps.append(
            Step(
                subject=f"remove orphan GPU instance {gi.info.id} on {gpu.info.uuid}",
                actions=(DestroyOwned(record, require_idle_gpu=True),),
                record_name=record.name,
                on_failure=record,
                foreign_ref=ref,
                reported=Reported("removed_orphan_gis", ref),
            )
        )

    # -- rule 5: CDI ---------------------------------------------------------------------------------
    def reconcile_cdi(self) -> None:
        live_owned: set[str] = set()
        # The spec is written in the step that records the instance, after its record: a step stops at
        # its first failure, so an instance whose record could not be written (left foreign) is never
        # published. A spec that cannot be written does not fail the step (see ``EnsureCdi``).
        step_of = {step.record_name: i for i, step in enumerate(self.steps) if step.record_name is not None}
        for name, record in sorted(self.table.items()):
            identity = record.identity
            if identity is None:
                continue
            live_owned.add(identity.mig_uuid)
            if record.state not in _LIVE_STATES or not self.cdi_name(identity.mig_uuid):
                continue
            ensure = EnsureCdi(self.gpus[record.gpu_uuid].info.minor, identity)
            index = step_of.get(name)
            if index is None:
                self.steps.append(Step(subject=f"ensure CDI spec of {name}", actions=(ensure,)))
                continue
            step = self.steps[index]
            self.steps[index] = msgspec.structs.replace(step, actions=(*step.actions, ensure))
        for mig_uuid in sorted(self.inputs.cdi_files):
            if mig_uuid in live_owned or mig_uuid in self.protected_cdi:
                continue
            actions = self.remove_cdi(mig_uuid)
            if actions:
                self.steps.append(Step(subject=f"remove CDI spec of {mig_uuid}", actions=actions))

    def result(self) -> Plan:
        generation = self.fresh_generation if self.handed_out else self.generation
        report = settle_report(
            RecoveryReport(preserved_foreign=tuple(self.preserved_foreign), errors=tuple(self.errors)),
            done=self.steps,
        )
        return Plan(
            steps=tuple(self.steps),
            table=tuple(record for _, record in sorted(self.table.items())),
            report=report,
            generation=generation,
            generation_ceiling=self.inputs.generation_ceiling,
            referenced_mig_uuids=frozenset(
                a.identity.mig_uuid for a in self.inputs.active if a.identity is not None
            )
            - self.refused,
        )


def plan(inputs: Inputs) -> Plan:
    """Decide what recovery does, from plain values only (no I/O).

    Raises ``errors.UnverifiableState`` when an active allocation does not match the live hardware
    exactly; then there is no plan and nothing may be modified."""
    planner = _Planner(inputs)
    planner.adopt_active()
    planner.reconcile_records()
    planner.preserve_corrupt()
    planner.handle_unowned()
    planner.reconcile_cdi()
    return planner.result()


__all__ = [
    "Action",
    "CorruptFile",
    "DeleteRecord",
    "DestroyOwned",
    "EnsureCdi",
    "Inputs",
    "LiveGpu",
    "LiveGpuInstance",
    "Plan",
    "PutRecord",
    "RecoveryReport",
    "RemoveCdi",
    "ReportList",
    "Reported",
    "Step",
    "placement_from_record_name",
    "plan",
    "settle_report",
]
