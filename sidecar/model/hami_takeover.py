"""Taking over what HAMi's in-process lifecycle owns, at Recover, without a drain (pure).

A node switched from HAMi's own dynamic MIG lifecycle to this sidecar has live instances, pods on
some of them, HAMi's ownership records in the state directory and HAMi's CDI specs in the CDI
directory (formats in ``hami_files``). ``plan_takeover`` decides, from plain values, what becomes of
each of HAMi's files; recovery applies the decision.

Per HAMi record file, one outcome (never two, so no file is both kept and converted):

- **convert**: it decodes, and the live GI at exactly its placement on its parent GPU matches it in
  everything the sidecar checks of its own records (profile name, GI ID, exactly one CI, the
  full-size CI profile, CI ID, MIG UUID). It becomes a sidecar record - ``ACTIVE`` with the
  allocation as owner when the pod list names that runtime identity, ``IDLE`` otherwise - and
  HAMi's file is removed only after that record is durable.
- **finish**: as convert, but the sidecar already holds a record of that very instance (same MIG
  UUID) that comes from this takeover: a crash came between writing ours (marked as taken over) and
  removing HAMi's, or the pod list's adoption made it in this very recovery (its record is written
  with the mark in the same write). Only HAMi's file is removed.
- **conflict** (a keep): the sidecar already owned that instance by a record of its own from before
  (not taken over from HAMi; ``own_records``). The sidecar's record wins as it is, provenance
  unchanged; HAMi's file stays for the operator and the conflict is named in ``errors``.
- **keep**: anything else - it does not decode, has another version, is misnamed, its GPU is not
  visible, or the live hardware contradicts it. The file stays untouched and is named in
  ``errors``; the instance it points at (when one can be found) stays foreign: never reused, never
  adopted, never destroyed. Two HAMi files pointing at one instance are both kept.

HAMi's CDI specs: a running container re-resolves its CDI names when kubelet restarts it, so the spec
of an instance that is ``ACTIVE`` stays until that instance is destroyed (teardown removes it then).
So does the spec of any live instance the sidecar does not own. Specs of ``IDLE`` owned instances
(reuse hands out the sidecar's own spec) and strays (no live instance) are removed - but only once
the takeover is complete: no HAMi record file is kept, so nothing of HAMi's is left to judge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from sidecar.model.domain import ActiveAllocation, Identity, State
from sidecar.model.hami_files import (
    HamiRecord,
    HamiRecordError,
    HamiSpec,
    RecordHint,
    decode_record,
    hami_record_hint,
)
from sidecar.model.ownership import OwnershipRecord, live_record
from sidecar.nvml.port import ComputeInstanceInfo, GpuInfo, GpuInstanceInfo, GpuInstanceProfile

TAKEN_OVER_FROM = "hami"  # ``OwnershipRecord.taken_over_from`` of a converted record


class LiveGpuInstanceView(Protocol):
    """One GI as NVML lists it, with every CI in it (recovery's ``LiveGpuInstance``)."""

    @property
    def info(self) -> GpuInstanceInfo: ...

    @property
    def compute_instances(self) -> Sequence[ComputeInstanceInfo]: ...


class LiveGpuView(Protocol):
    """One GPU with its profile table and live layout (recovery's ``LiveGpu``)."""

    @property
    def info(self) -> GpuInfo: ...

    @property
    def profiles(self) -> Sequence[GpuInstanceProfile]: ...

    @property
    def gpu_instances(self) -> Sequence[LiveGpuInstanceView]: ...


class HamiRecordFile(msgspec.Struct, frozen=True):
    """One ``hami-owned-*.json`` as read: the record, or why it is not one and where it points."""

    filename: str
    record: HamiRecord | None = None
    why: str = ""
    hint: RecordHint = RecordHint()

    @property
    def pointer(self) -> RecordHint:
        """Where the file points: its record's instance, or what an undecodable one still names."""
        if self.record is None:
            return self.hint
        return RecordHint(self.record.mig_uuid, self.record.parent_gpu_uuid, self.record.where)


def read_record_file(filename: str, data: bytes) -> HamiRecordFile:
    """The bytes of a HAMi record file, decoded strictly, or the reason and a lenient hint."""
    try:
        return HamiRecordFile(filename, record=decode_record(filename, data))
    except HamiRecordError as exc:
        return HamiRecordFile(filename, why=exc.why, hint=hami_record_hint(data))


@dataclass(frozen=True, kw_only=True)
class TakeoverInputs:
    """What the decision needs; recovery's gather and plan supply it, tests write it by hand."""

    hami_records: Sequence[HamiRecordFile] = ()
    hami_specs: Sequence[HamiSpec] = ()
    gpus: Sequence[LiveGpuView] = ()
    active: Sequence[ActiveAllocation] = ()
    # The sidecar's records as recovery holds them so far (its own, restored or adopted).
    owned: Sequence[OwnershipRecord] = ()
    # GIs recovery has already decided otherwise (a kept or corrupt record of its own): never taken.
    claimed: frozenset[tuple[str, int]] = frozenset()
    # MIG UUIDs of the sidecar's own records from before this recovery that were not taken over from
    # HAMi: an instance the sidecar owned by its own right, which a HAMi file never relabels.
    own_records: frozenset[str] = frozenset()
    cdi_devices: dict[str, str] = field(default_factory=dict)  # MIG UUID -> the sidecar's CDI name
    boot_id: str = ""
    now: str = ""
    generation: int = 0  # the fresh generation a conversion is stamped with


class Convert(msgspec.Struct, frozen=True):
    """Write ``record`` durably, then remove HAMi's ``filename``."""

    filename: str
    record: OwnershipRecord


class Finish(msgspec.Struct, frozen=True):
    """The sidecar's record ``record_name`` already holds the instance: remove HAMi's ``filename``."""

    filename: str
    record_name: str
    mig_uuid: str


class Keep(msgspec.Struct, frozen=True):
    """Leave HAMi's ``filename`` untouched; ``foreign`` are the GIs (GPU UUID, GI ID) it points at."""

    filename: str
    why: str
    foreign: tuple[tuple[str, int], ...] = ()


class TakeoverPlan(msgspec.Struct, frozen=True, kw_only=True):
    converted: tuple[Convert, ...] = ()
    finished: tuple[Finish, ...] = ()
    kept: tuple[Keep, ...] = ()
    keep_specs: tuple[HamiSpec, ...] = ()
    remove_specs: tuple[HamiSpec, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """No HAMi record is left to judge: every one was converted or finished."""
        return not self.kept

    @property
    def foreign(self) -> frozenset[tuple[str, int]]:
        return frozenset(gi for keep in self.kept for gi in keep.foreign)


class _Found(msgspec.Struct, frozen=True):
    """A decoded record verified against the live GI it names."""

    file: HamiRecordFile
    record: HamiRecord
    gi: tuple[str, int]
    live: GpuInstanceInfo
    ci: ComputeInstanceInfo


def pointed_at(gpus: Sequence[LiveGpuView], hint: RecordHint) -> list[tuple[str, int]]:
    """The live GIs (GPU UUID, GI ID) a HAMi file may speak for: the one holding its MIG UUID, the
    one at its placement on its GPU. A file that is kept leaves both foreign."""
    gis: list[tuple[str, int]] = []
    for gpu in gpus:
        for gi in gpu.gpu_instances:
            holds_uuid = bool(hint.mig_uuid) and any(
                ci.mig_uuid == hint.mig_uuid for ci in gi.compute_instances
            )
            at_placement = gpu.info.uuid == hint.gpu_uuid and gi.info.placement == hint.placement
            if holds_uuid or at_placement:
                gis.append((gpu.info.uuid, gi.info.id))
    return gis


def plan_takeover(inputs: TakeoverInputs) -> TakeoverPlan:
    """Decide every HAMi record and spec (module docstring); pure."""
    return _Planner(inputs).run()


class _Planner:
    def __init__(self, inputs: TakeoverInputs) -> None:
        self.inputs = inputs
        self.gpus = {gpu.info.uuid: gpu for gpu in inputs.gpus}
        self.owned_by_uuid = {r.mig_uuid: r for r in inputs.owned if r.mig_uuid}
        self.owned_gis = {
            (r.gpu_uuid, r.gpu_instance_id) for r in inputs.owned if r.gpu_instance_id is not None
        }
        self.kept: list[Keep] = []

    def run(self) -> TakeoverPlan:
        found: list[_Found] = []
        for file in sorted(self.inputs.hami_records, key=lambda f: f.filename):
            if file.record is None:
                self.keep(file.filename, file.why, self.hinted(file.hint))
                continue
            verified = self.verify(file, file.record)
            if isinstance(verified, _Found):
                found.append(verified)
        # A GI a kept file points at is not taken on another file's word either.
        disputed = {gi for keep in self.kept for gi in keep.foreign}
        disputed |= {f.gi for f in found if sum(g.gi == f.gi for g in found) > 1}
        converted: list[Convert] = []
        finished: list[Finish] = []
        for f in found:
            if f.gi in disputed:
                self.keep(
                    f.file.filename, "another HAMi record file points at the same GPU instance", (f.gi,)
                )
                continue
            own = self.owned_by_uuid.get(f.record.mig_uuid)
            if own is not None and f.record.mig_uuid in self.inputs.own_records:
                self.keep(
                    f.file.filename,
                    f"it names {f.record.mig_uuid}, which the sidecar already owns by its own record"
                    f" {own.name} ({own.state}); the sidecar's record stays as it is and the file is left"
                    " for the operator",
                    (),
                )
                continue
            if own is not None:
                finished.append(Finish(f.file.filename, own.name, f.record.mig_uuid))
                continue
            converted.append(Convert(f.file.filename, self.convert(f)))
        keep_specs, remove_specs = self.specs(converted)
        errors = tuple(
            f"HAMi ownership record {k.filename} is kept untouched: {k.why}"
            + (f"; GPU instances {sorted(k.foreign)} stay foreign" if k.foreign else "")
            for k in self.kept
        )
        return TakeoverPlan(
            converted=tuple(converted),
            finished=tuple(finished),
            kept=tuple(self.kept),
            keep_specs=keep_specs,
            remove_specs=remove_specs,
            errors=errors,
        )

    def keep(self, filename: str, why: str, gis: Sequence[tuple[str, int]]) -> None:
        # GIs the sidecar owns (adopted for a listed pod, or restored from its own record) stay its own.
        foreign = tuple(sorted({gi for gi in gis if gi not in self.owned_gis}))
        self.kept.append(Keep(filename, why, foreign))

    def hinted(self, hint: RecordHint) -> list[tuple[str, int]]:
        return pointed_at(self.inputs.gpus, hint)

    def verify(self, file: HamiRecordFile, record: HamiRecord) -> _Found | None:
        """The verified instance, or None after keeping the file with the contradiction."""
        related = self.hinted(file.pointer)
        gpu = self.gpus.get(record.parent_gpu_uuid)
        if gpu is None:
            self.keep(file.filename, f"its GPU {record.parent_gpu_uuid} is not visible", related)
            return None
        if not gpu.info.mig_current:
            self.keep(file.filename, f"MIG is disabled on its GPU {record.parent_gpu_uuid}", related)
            return None
        gi = next((g for g in gpu.gpu_instances if g.info.placement == record.where), None)
        if gi is None:
            self.keep(file.filename, f"no GPU instance is at its placement {record.where}", related)
            return None
        why = _mismatch(gpu, gi, record)
        if why is not None:
            self.keep(file.filename, f"the live GPU instance {gi.info.id} contradicts it: {why}", related)
            return None
        where = (gpu.info.uuid, gi.info.id)
        if where in self.inputs.claimed:
            self.keep(file.filename, "its GPU instance is held aside by the sidecar's own record", ())
            return None
        return _Found(file, record, where, gi.info, gi.compute_instances[0])  # _mismatch checked it

    def convert(self, found: _Found) -> OwnershipRecord:
        record, inputs = found.record, self.inputs
        identity = Identity(record.gpu_instance_id, record.compute_instance_id, record.mig_uuid)
        holder = next(
            (
                a
                for a in inputs.active
                if a.identity is not None
                and a.identity.names(identity)
                and a.reservation.gpu_uuid == record.parent_gpu_uuid
            ),
            None,
        )
        return live_record(
            record.profile,
            found.live,
            found.ci,
            state=State.ACTIVE if holder is not None else State.IDLE,
            owner=holder.owner if holder is not None else None,
            activated_generation=inputs.generation if holder is not None else 0,
            idled_generation=0 if holder is not None else inputs.generation,
            cdi_device=inputs.cdi_devices.get(record.mig_uuid, ""),
            boot_id=inputs.boot_id,
            since=inputs.now,
            taken_over_from=TAKEN_OVER_FROM,
        )

    def specs(self, converted: Sequence[Convert]) -> tuple[tuple[HamiSpec, ...], tuple[HamiSpec, ...]]:
        records = [*self.inputs.owned, *(c.record for c in converted)]
        by_uuid = {r.mig_uuid: r for r in records if r.mig_uuid}
        live = {
            ci.mig_uuid for gpu in self.inputs.gpus for gi in gpu.gpu_instances for ci in gi.compute_instances
        }
        complete = not self.kept
        keep: list[HamiSpec] = []
        remove: list[HamiSpec] = []
        for spec in sorted(self.inputs.hami_specs, key=lambda s: s.filename):
            own = by_uuid.get(spec.mig_uuid)
            # Unowned: only a stray goes (a live one is foreign). Owned: only IDLE; ACTIVE, ERROR and
            # DELETING instances keep it until teardown destroys them and removes it.
            removable = spec.mig_uuid not in live if own is None else own.state is State.IDLE
            (remove if removable and complete else keep).append(spec)
        return tuple(keep), tuple(remove)


def _profile(gpu: LiveGpuView, profile_id: int) -> GpuInstanceProfile | None:
    return next((p for p in gpu.profiles if p.id == profile_id), None)


def _mismatch(gpu: LiveGpuView, gi: LiveGpuInstanceView, record: HamiRecord) -> str | None:
    """Why the live GI at the record's placement is not the record's instance, or None."""
    profile = _profile(gpu, gi.info.profile_id)
    live_name = profile.name if profile is not None else f"profile-id-{gi.info.profile_id}"
    if profile is None or live_name != record.profile:
        return f"it has profile {live_name}, the record says {record.profile}"
    if gi.info.id != record.gpu_instance_id:
        return f"its GPU instance ID is {gi.info.id}, the record says {record.gpu_instance_id}"
    cis = gi.compute_instances
    if len(cis) != 1:
        return f"it has {len(cis)} compute instances, not one"
    ci = cis[0]
    if ci.id != record.compute_instance_id:
        return f"its compute instance ID is {ci.id}, the record says {record.compute_instance_id}"
    if ci.mig_uuid != record.mig_uuid:
        return f"its MIG UUID is {ci.mig_uuid}, the record says {record.mig_uuid}"
    if ci.profile_id != profile.ci_profile_id:
        return f"its compute instance {ci.id} is not the full-size one"
    return None
