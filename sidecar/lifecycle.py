"""Allocate / Release / SyncActive transactions over owned MIG instances (architecture section 5).

``Lifecycle`` owns the in-memory table of owned instances (record name -> OwnershipRecord, mirroring
the record files exactly), one lock per GPU (GPUs proceed in parallel), the ``generation`` (bumped on
every activation and every instance going IDLE, the fence of SyncActive) and the ``recovered`` gate.
Every record change goes through the RecordStore *before* the in-memory table changes; intent is
recorded before each NVML mutation and completion after it.
Foreign instances are never cached: every allocation reads the live GI layout of its GPU, so anything
created outside the sidecar blocks its placement (PLACEMENT_BUSY) at once.

Locking, in the only order it is ever taken (so nothing deadlocks):

1. the allocation keys of a request are *claimed* (a second request with one of the same keys waits
   until the first is done, then sees ALREADY_ALLOCATED instead of racing it);
2. the GPU locks of every GPU the operation touches, in sorted UUID order (re-entrant, so public
   helpers that take a GPU lock may be called from inside a transaction);
3. the short table lock that guards the dict and the generation counter (never held across I/O).

One deliberate deviation from "the table mirrors the files": when an instance must go to ERROR and the
record write fails too, the in-memory table still says ERROR. Failing closed matters more than the
mirror: the instance keeps blocking its placement and the reconciler rewrites the record on its next
attempt.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from sidecar import crashpoints, placement
from sidecar.cdi import CdiSpecs
from sidecar.domain import (
    MIG_UUID_RE,
    POD_UID_RE,
    ActiveAllocation,
    AllocatedDevice,
    AllocateRequest,
    AllocateResult,
    AllocationKey,
    DeviceRequest,
    ForeignInstance,
    Identity,
    InstanceRef,
    Outcome,
    Owner,
    Placement,
    Reservation,
    State,
)
from sidecar.errors import (
    Code,
    InstanceInUse,
    InvalidRequest,
    KeyConflict,
    MigDisabled,
    NotRecovered,
    NvmlFailure,
    PlacementBusy,
    SidecarError,
    StateWriteFailed,
    UnknownGpu,
    UnknownProfile,
    UnverifiableState,
)
from sidecar.errors import IllegalPlacement as IllegalPlacementError
from sidecar.nvml.port import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_RESET_REQUIRED,
    NVML_SUCCESS,
    GpuInfo,
    GpuInstanceInfo,
    GpuInstanceProfile,
    NvmlError,
    NvmlPort,
)
from sidecar.records import CorruptRecord, OwnershipRecord, RecordStore, record_name
from sidecar.recovery_plan import placement_from_record_name

_log = logging.getLogger(__name__)

GENERATION_BLOCK = 1024
"""How far the durable generation ceiling moves at a time: one small file write per this many
activations and idles, and at most this many numbers skipped per restart (they stay readable)."""


def now_rfc3339() -> str:
    """The ``since`` timestamp of a record: RFC 3339, UTC, microseconds."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def instance_ref(record: OwnershipRecord) -> InstanceRef:
    """The contract's InstanceRef for an owned instance (identity None while incomplete)."""
    return InstanceRef(record.reservation, record.identity)


@contextlib.contextmanager
def nvml_errors(operation: str) -> Iterator[None]:
    """The one boundary where ``NvmlError`` becomes the domain's ``NvmlFailure`` (cause kept)."""
    try:
        yield
    except NvmlError as exc:
        raise NvmlFailure(
            f"{operation}: {exc.message} (nvml code {exc.code})",
            {"nvml_code": str(exc.code), "operation": exc.operation},
        ) from exc


def _corrupt(name: str, exc: CorruptRecord) -> UnverifiableState:
    """A record file that became corrupt under a live record: the operator's to inspect, never
    overwritten or deleted. UNVERIFIABLE_STATE (FAILED_PRECONDITION), not STATE_WRITE_FAILED
    (UNAVAILABLE): no retry clears it, so the client must not wait for one."""
    return UnverifiableState(
        f"ownership record {exc.path} is corrupt ({exc.why}); it is left for the operator to inspect"
        " and nothing was written over it",
        {"record": name, "file": str(exc.path)},
    )


def _raise_first(failures: Sequence[SidecarError]) -> None:
    """The first failure of a batch, once every other instance of it has been dealt with.

    A retryable one (UNAVAILABLE) comes first: the client repeats the call, which finishes the rest,
    and the failure no retry clears (a corrupt record file) is answered once only it is left."""
    if failures:
        first = next((f for f in failures if f.code is Code.UNAVAILABLE), failures[0])
        if len(failures) > 1:
            first.message = f"{first.message} (and {len(failures) - 1} more, logged)"
            first.args = (first.message,)
        raise first


class ComputeInstanceNotOurs(UnverifiableState):
    """A destroy found a CI in a GPU instance whose record stands for a bare GI: not ours to destroy.

    A record without a CI ID that may not own an unrecorded CI (``may_own_unrecorded_ci``: not CREATING,
    and its create's CI create not pending an answer; an orphan GI being removed, a bare GI a crashed
    create left, either of them in ERROR after a failed destroy) was written for a GI that had no CI when
    its destroy was decided: a failed create's undo records the CI its create made, or that there is none
    (``_with_created_ci``), before it destroys anything. Nothing of ours creates a CI in such a GI, so one
    there now was made by someone else. The destroy leaves everything as it is: the record stays on disk
    for the operator and the instance leaves the table (foreign: preserved, never reused, blocking its
    placement), which is what recovery's planner decides by the same rule when it sees such a CI at
    gather."""


class GpuSnapshot(msgspec.Struct, frozen=True):
    gpu: GpuInfo
    busy: bool
    instances: tuple[OwnershipRecord, ...]
    foreign: tuple[ForeignInstance, ...]


class StateSnapshot(msgspec.Struct, frozen=True):
    generation: int
    gpus: tuple[GpuSnapshot, ...]
    pending_cdi_removals: tuple[str, ...]


class _Validated(msgspec.Struct, frozen=True):
    """One device of a request after validation: everything later steps need, read once."""

    device: DeviceRequest
    key: AllocationKey
    owner: Owner
    gpu: GpuInfo
    profile: GpuInstanceProfile


class _Done(msgspec.Struct, frozen=True):
    """What one device of an allocation did, so a later failure can roll it back."""

    allocated: AllocatedDevice
    record_name: str


class Lifecycle:
    def __init__(
        self,
        port: NvmlPort,
        records: RecordStore,
        cdi: CdiSpecs,
        boot_id: str,
    ) -> None:
        self.port = port
        self.records = records
        self.cdi = cdi
        self.boot_id = boot_id
        self.recovered = False
        self.generation = 0
        self._table: dict[str, OwnershipRecord] = {}
        self._table_lock = threading.Lock()
        self._keys = threading.Condition(threading.Lock())
        self._claimed: set[AllocationKey] = set()
        self._gpu_locks: dict[str, threading.RLock] = {}
        self._gpu_locks_guard = threading.Lock()
        self._profile_cache: dict[str, tuple[GpuInstanceProfile, ...]] = {}
        self._gpu_cache: dict[str, GpuInfo] = {}
        self._referenced_mig_uuids: frozenset[str] = frozenset()
        # The highest generation that may be handed out without raising the durable ceiling first,
        # and the lock that serializes raising it (held across that one small write, nothing else).
        self._generation_ceiling = 0
        self._generation_lock = threading.Lock()

    # -- queries -------------------------------------------------------------------------------------
    def gpu_info(self, gpu_uuid: str) -> GpuInfo:
        """Static facts of a GPU (index, minor, model) from a cached GPU list; UnknownGpu if absent.

        The MIG mode in the cached value is stale by design; callers that need it use ``port.gpu``."""
        info = self._gpu_cache.get(gpu_uuid)
        if info is None:
            with nvml_errors("list GPUs"):
                gpus = self.port.gpus()
            self._gpu_cache = {g.uuid: g for g in gpus}
            info = self._gpu_cache.get(gpu_uuid)
        if info is None:
            raise UnknownGpu(f"no GPU with UUID {gpu_uuid!r} on this node", {"gpu_uuid": gpu_uuid})
        return info

    def profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        """The GPU's GI profiles (cached per GPU after the first successful read). UnknownGpu if absent."""
        cached = self._profile_cache.get(gpu_uuid)
        if cached is None:
            self.gpu_info(gpu_uuid)
            with nvml_errors(f"read GPU instance profiles of {gpu_uuid}"):
                read = tuple(self.port.gpu_instance_profiles(gpu_uuid))
            if read:  # an empty answer (driver not ready) is not worth remembering
                self._profile_cache[gpu_uuid] = read
            cached = read
        return list(cached)

    def resolve_profile(self, gpu_uuid: str, name: str) -> GpuInstanceProfile:
        """Full profile name -> profile; UnknownProfile if the GPU has no such profile."""
        for profile in self.profiles(gpu_uuid):
            if profile.name == name:
                return profile
        raise UnknownProfile(
            f"GPU {gpu_uuid} has no MIG profile {name!r}", {"gpu_uuid": gpu_uuid, "profile": name}
        )

    def profile_by_id(self, gpu_uuid: str, profile_id: int) -> GpuInstanceProfile | None:
        for profile in self.profiles(gpu_uuid):
            if profile.id == profile_id:
                return profile
        return None

    def gpu_busy(self, gpu_uuid: str) -> bool:
        """An ACTIVE instance or a running process on the GPU; an NVML error counts as busy."""
        if any(r.gpu_uuid == gpu_uuid and r.state is State.ACTIVE for r in self.instances()):
            return True
        try:
            return self.port.gpu_processes(gpu_uuid) > 0
        except NvmlError:
            return True

    def instances(self) -> list[OwnershipRecord]:
        """A copy of the owned-instance table."""
        with self._table_lock:
            return list(self._table.values())

    def record(self, name: str) -> OwnershipRecord | None:
        with self._table_lock:
            return self._table.get(name)

    def snapshot(self) -> StateSnapshot:
        """Everything GetState shows. Each GPU is read under its lock so no half-done create shows up
        as a foreign instance; an NVML error on one GPU leaves its foreign list empty (logged)."""
        with nvml_errors("list GPUs"):
            gpus = self.port.gpus()
        out: list[GpuSnapshot] = []
        for gpu in gpus:
            with self._gpu_lock(gpu.uuid):
                owned = tuple(
                    sorted(
                        (r for r in self.instances() if r.gpu_uuid == gpu.uuid),
                        key=lambda r: (r.placement.start, r.placement.size),
                    )
                )
                foreign: list[ForeignInstance] = []
                if gpu.mig_current:
                    try:
                        foreign = self._foreign(gpu.uuid, owned)
                    except (NvmlError, SidecarError) as exc:
                        _log.warning("cannot list foreign instances of %s: %s", gpu.uuid, exc)
                busy = self.gpu_busy(gpu.uuid)
            out.append(GpuSnapshot(gpu=gpu, busy=busy, instances=owned, foreign=tuple(foreign)))
        return StateSnapshot(
            generation=self.generation,
            gpus=tuple(out),
            pending_cdi_removals=tuple(self.cdi.pending_removals()),
        )

    def _foreign(self, gpu_uuid: str, owned: Sequence[OwnershipRecord]) -> list[ForeignInstance]:
        out: list[ForeignInstance] = []
        for gi in placement.foreign_instances(self.port.gpu_instances(gpu_uuid), owned):
            profile = self.profile_by_id(gpu_uuid, gi.profile_id)
            cis = self.port.compute_instances(gpu_uuid, gi.id)
            out.append(
                ForeignInstance(
                    gpu_uuid=gpu_uuid,
                    profile=profile.name if profile else f"profile-id-{gi.profile_id}",
                    placement=gi.placement,
                    gpu_instance_id=gi.id,
                    compute_instance_id=cis[0].id if cis else None,
                    mig_uuid=cis[0].mig_uuid if cis else None,
                )
            )
        return out

    # -- transactions (each raises errors.NotRecovered until ``recovered``) -----------------------------
    def allocate(self, request: AllocateRequest) -> AllocateResult:
        """All or nothing across the devices of the request (architecture section 5)."""
        self._require_recovered()
        validated = self._validate(request)
        with self._claim([v.key for v in validated]), self._gpu_locks_for(v.gpu.uuid for v in validated):
            # Validation ran before the locks: a SetMigMode(disable) may have finished in between, and
            # then the first NVML call would fail NOT_SUPPORTED (NVML_ERROR, retried by the client)
            # where MIG_DISABLED is the truth. One cheap mode read per GPU, under its lock; its answer
            # replaces the GPU facts validation read, since a mode change may renumber the device
            # (the CDI spec is rendered from its minor number).
            now = {uuid: self._require_mig_enabled(uuid) for uuid in sorted({v.gpu.uuid for v in validated})}
            validated = [msgspec.structs.replace(v, gpu=now[v.gpu.uuid]) for v in validated]
            self._check_key_conflicts(validated)
            # Every device's placement is judged before any device changes anything: a request that
            # must fail with PLACEMENT_BUSY or INSTANCE_IN_USE for a later device would otherwise have
            # reclaimed idle instances for an earlier one already, and a rollback cannot bring those
            # back. The devices of one request never overlap (validated), so what an earlier device
            # creates or reclaims cannot change the verdict for a later one.
            # The same holds for a reusable instance that still runs processes (INSTANCE_IN_USE), so it
            # is checked here too when an earlier device may reclaim; ``_reuse`` checks it again after
            # verifying the instance live.
            reclaims = False
            for v in validated:
                if self._needs_room(v) and self._room_for(v):
                    reclaims = True
            for v in validated if reclaims else ():
                reusable = self._reusable(v)
                if reusable is not None and self._already_held(v) is None:
                    self._require_no_processes(reusable)
            done: list[_Done] = []
            reclaimed: list[InstanceRef] = []
            try:
                for v in validated:
                    done.append(self._allocate_one(v, reclaimed))
            except Exception:
                self._roll_back(done)
                raise
            return AllocateResult(devices=tuple(d.allocated for d in done), reclaimed=tuple(reclaimed))

    def release(self, pod_uid: str) -> list[InstanceRef]:
        """A confirmed pod release: its ACTIVE instances become IDLE. Never destroys; unknown pod = []."""
        self._require_recovered()
        if not POD_UID_RE.match(pod_uid):
            raise InvalidRequest(f"pod uid {pod_uid!r} is not a valid UID", {"pod_uid": pod_uid})
        targets = [
            r
            for r in self.instances()
            if r.state is State.ACTIVE and r.owner is not None and r.owner.pod.uid == pod_uid
        ]
        released: list[InstanceRef] = []
        failures: list[SidecarError] = []
        with self._gpu_locks_for(r.gpu_uuid for r in targets):
            for r in targets:
                current = self.record(r.name)
                if current is None or current.state is not State.ACTIVE or current.owner != r.owner:
                    continue  # changed while we waited for the lock
                if self._put_each(failures, self._idle, current):
                    released.append(instance_ref(current))
        _raise_first(failures)
        return released

    def sync_active(
        self, generation: int, active: Sequence[ActiveAllocation]
    ) -> tuple[list[InstanceRef], list[InstanceRef]]:
        """Returns (idled, reactivated).

        Level-triggered release from a fresh pod list: an ACTIVE instance whose key is not listed and
        that was activated at or before ``generation`` becomes IDLE (one activated later raced the pod
        list and is left alone). An IDLE instance whose reservation and MIG UUID are listed, and that
        went IDLE at or before ``generation``, is held by a live pod after all and becomes ACTIVE again
        with that owner; one that went IDLE later (a Release, or a newer SyncActive) was released after
        the list was taken, which still names the pod that is gone, and stays IDLE. Listed entries that
        match nothing are ignored. Never destroys anything.

        A ``generation`` larger than any handed out is no fence at all (every instance would count as
        activated before the list, those an Allocate activated meanwhile too): InvalidRequest, and
        nothing changes.
        """
        self._require_recovered()
        handed_out = self.generation
        if generation > handed_out:
            raise InvalidRequest(
                f"generation {generation} was never handed out (the current one is {handed_out}); read"
                " it with GetInfo before listing pods",
                {"generation": str(generation), "current": str(handed_out)},
            )
        listed_keys = {a.key for a in active}
        by_identity: dict[tuple[Reservation, str], ActiveAllocation] = {
            (a.reservation, a.identity.mig_uuid): a for a in active if a.identity is not None
        }
        self._referenced_mig_uuids = frozenset(mig for _, mig in by_identity)
        table = self.instances()
        to_idle = [
            r
            for r in table
            if r.state is State.ACTIVE
            and r.owner is not None
            and r.owner.key not in listed_keys
            and r.activated_generation <= generation
        ]
        to_activate = [
            (r, by_identity[(r.reservation, r.mig_uuid)])
            for r in table
            if r.state is State.IDLE
            and r.mig_uuid is not None
            and (r.reservation, r.mig_uuid) in by_identity
            and r.idled_generation <= generation
        ]
        idled: list[InstanceRef] = []
        reactivated: list[InstanceRef] = []
        failures: list[SidecarError] = []
        gpus = [r.gpu_uuid for r in to_idle] + [r.gpu_uuid for r, _ in to_activate]
        # A reactivation gives an allocation key an instance, as Allocate does: it claims the key first
        # (the same order Allocate takes), so an Allocate of that key on another GPU is either done (and
        # the key holds its instance) or has not begun, never half-way past its key check.
        keys = sorted({alloc.key for _, alloc in to_activate}, key=str)
        with self._claim(keys), self._gpu_locks_for(gpus):
            for r in to_idle:
                current = self.record(r.name)
                if (
                    current is None
                    or current.state is not State.ACTIVE
                    or current.owner != r.owner
                    or current.activated_generation > generation
                ):
                    continue
                if self._put_each(failures, self._idle, current):
                    idled.append(instance_ref(current))
            for r, alloc in to_activate:
                current = self.record(r.name)
                if (
                    current is None
                    or current.state is not State.IDLE
                    or current.mig_uuid != r.mig_uuid
                    or current.idled_generation > generation
                ):
                    continue
                if self._active_for_key(alloc.key) is not None:
                    continue  # that key already holds another instance; never give it two
                if self._put_each(failures, functools.partial(self._activate, owner=alloc.owner), current):
                    reactivated.append(instance_ref(current))
        _raise_first(failures)
        return idled, reactivated

    def _put_each(
        self,
        failures: list[SidecarError],
        change: Callable[[OwnershipRecord], OwnershipRecord],
        record: OwnershipRecord,
    ) -> bool:
        """One instance's change in a batch (Release, SyncActive): a failure is kept for the end of the
        batch instead of stopping it, so one corrupt record file or failed write does not keep every
        other instance from changing state. True when the change was made."""
        try:
            self._put(change(record))
        except SidecarError as exc:
            _log.error("%s", exc)
            failures.append(exc)
            return False
        return True

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> tuple[bool, bool, bool]:
        """Returns (current, pending, needs_reset). Refuses (PlacementBusy) to disable while any GI exists,
        and answers InstanceInUse when the driver refuses the change because a process runs on the GPU.

        PLACEMENT_BUSY (FAILED_PRECONDITION) rather than INVALID_REQUEST because the request is well
        formed and becomes valid once the instances are gone; the metadata names ``blocker`` =
        ``gpu_instances`` and how many there are.
        """
        self._require_recovered()
        self.gpu_info(gpu_uuid)
        with self._gpu_lock(gpu_uuid):
            if not enabled:
                owned = [r for r in self.instances() if r.gpu_uuid == gpu_uuid]
                live: list[GpuInstanceInfo] = []
                with nvml_errors(f"read MIG mode of {gpu_uuid}"):
                    current = self.port.gpu(gpu_uuid)
                if current.mig_current:
                    with nvml_errors(f"list GPU instances of {gpu_uuid}"):
                        live = self.port.gpu_instances(gpu_uuid)
                if live or owned:
                    raise PlacementBusy(
                        f"cannot disable MIG on {gpu_uuid}: {len(live)} GPU instances exist"
                        f" and {len(owned)} are owned",
                        {
                            "blocker": "gpu_instances",
                            "gpu_uuid": gpu_uuid,
                            "count": str(max(len(live), len(owned))),
                        },
                    )
            wanted = "enabled" if enabled else "disabled"
            with nvml_errors(f"set MIG mode of {gpu_uuid} to {wanted}"):
                before = self.port.gpu(gpu_uuid)
                try:
                    status = self.port.set_mig_mode(gpu_uuid, enabled)
                finally:
                    # The driver may unbind or reset the device for a mode change: its minor number
                    # and profile table are read afresh next time, whatever the outcome.
                    self._gpu_cache.pop(gpu_uuid, None)
                    self._profile_cache.pop(gpu_uuid, None)
                after = self.port.gpu(gpu_uuid)
                if status == NVML_ERROR_IN_USE and after.mig_pending != before.mig_pending:
                    # The driver refused to activate the change but still recorded it as pending (a
                    # later reset would apply it, and a pending disable already refuses allocations).
                    # Put back the pending mode found before this call (a change pending from earlier,
                    # say an Ampere enable awaiting its reset, stays), so that the refusal means what
                    # UNAVAILABLE says: nothing changed.
                    self.port.set_mig_mode(gpu_uuid, before.mig_pending)
                    after = self.port.gpu(gpu_uuid)
            self._check_mig_mode_status(gpu_uuid, wanted, status, after)
        return after.mig_current, after.mig_pending, after.mig_current != after.mig_pending

    @staticmethod
    def _check_mig_mode_status(gpu_uuid: str, wanted: str, status: int, after: GpuInfo) -> None:
        """The activation status ``nvmlDeviceSetMigMode`` reports beside its own return code.

        SUCCESS: applied. RESET_REQUIRED: recorded as pending, applied by the next GPU reset (Ampere),
        a success with ``needs_reset``. IN_USE: refused because a process runs on the GPU
        (INSTANCE_IN_USE, UNAVAILABLE: it may succeed once the process ends). Anything else fails
        closed as NVML_ERROR with the code."""
        if status in (NVML_SUCCESS, NVML_ERROR_RESET_REQUIRED):
            return
        if status == NVML_ERROR_IN_USE:
            raise InstanceInUse(
                f"cannot set MIG mode of {gpu_uuid} to {wanted}: a process runs on the GPU; the mode"
                " stays as it was",
                {
                    "gpu_uuid": gpu_uuid,
                    "mig_current": str(after.mig_current).lower(),
                    "mig_pending": str(after.mig_pending).lower(),
                },
            )
        raise NvmlFailure(
            f"set MIG mode of {gpu_uuid} to {wanted}: the driver refused the change (activation status"
            f" {status})",
            {"nvml_code": str(status), "operation": f"set MIG mode of {gpu_uuid} to {wanted}"},
        )

    # -- used by recovery and the reconciler ---------------------------------------------------------
    def install(
        self,
        records: Sequence[OwnershipRecord],
        generation: int,
        *,
        referenced_mig_uuids: Iterable[str] = (),
    ) -> None:
        """Replace the table with recovered records (under every GPU lock) and mark recovered.

        ``referenced_mig_uuids`` are the MIG UUIDs the recovery's active allocations name. They stand
        in for the last SyncActive until the first one arrives: without them the reconciler would
        destroy an ERROR instance (say, one whose record could not be written during recovery) that a
        live pod holds.

        The generation becomes the largest of the given one, the current one and every record's
        ``activated_generation`` and ``idled_generation``, so it never goes backwards across restarts
        (a SyncActive fenced with an old generation must not idle an instance activated since, nor
        reactivate one idled since).
        """
        with self.exclusive(r.gpu_uuid for r in records):
            with self._table_lock:
                self._table = {r.name: r for r in records}
                self._referenced_mig_uuids = frozenset(referenced_mig_uuids)
                self.generation = max(
                    [
                        generation,
                        self.generation,
                        *(r.activated_generation for r in records),
                        *(r.idled_generation for r in records),
                    ]
                )
            self.recovered = True

    @contextlib.contextmanager
    def exclusive(self, gpu_uuids: Iterable[str] = ()) -> Iterator[None]:
        """Hold the lock of every known GPU and of ``gpu_uuids``: no transaction runs meanwhile.

        Recovery holds this from gather to install, so a Recover repeated while the sidecar serves
        never plans over a half-finished Allocate (its CREATING record would look like a crash)."""
        with self._gpu_locks_guard:
            known = list(self._gpu_locks)
        with self._gpu_locks_for([*known, *gpu_uuids]):
            yield

    def destroy_owned(self, record: OwnershipRecord, *, mark_deleting: bool = True) -> InstanceRef:
        """Permanently destroy an owned instance, records first (takes the GPU lock).

        DELETING is recorded before the hardware is touched (skipped for ERROR records and with
        ``mark_deleting=False``), then CI and GI are destroyed (already gone counts as done), then the
        CDI file is removed (queued on failure, never fails the call), then the record is deleted.
        A destroy that fails puts the record in ERROR with ``last_error`` and raises ``NvmlFailure``
        (or ``UnverifiableState`` when the live instance at the recorded IDs is not this one). The
        record need not be in the table (recovery calls this before ``install``).
        """
        with self._gpu_lock(record.gpu_uuid):
            return self._destroy_owned(record, mark_deleting=mark_deleting)

    def _with_created_gi(self, record: OwnershipRecord) -> OwnershipRecord:
        """``record`` with the GI ID of the bare GI its create made but never reported, if there is one.

        A create can make the GI and still fail: reading the new GI's info fails after
        ``nvmlDeviceCreateGpuInstanceWithPlacement`` succeeded, or a TIMEOUT retry of the whole create
        meets the GI the first attempt made (INSUFFICIENT_RESOURCES). The placement was proven free
        under the GPU lock before the create, so a GI at exactly this placement with this GI profile,
        without a CI and claimed by no other record, is the one this record made. Anything else is left
        alone. Raises NvmlError. Call with the GPU lock held.
        """
        if record.gpu_instance_id is not None:
            return record
        others = [r for r in self.instances() if r.gpu_uuid == record.gpu_uuid and r.name != record.name]
        for gi in self.port.gpu_instances(record.gpu_uuid):
            if (
                gi.placement == record.placement
                and gi.profile_id == record.gi_profile_id
                and placement.owner_of(gi, others) is None
            ):
                if not self.port.compute_instances(record.gpu_uuid, gi.id):
                    return msgspec.structs.replace(record, gpu_instance_id=gi.id)
                break
        return record

    def _with_created_ci(self, record: OwnershipRecord) -> OwnershipRecord:
        """``record`` with the ID and MIG UUID of the CI its create made but never reported, if any.

        A create can make the CI and still fail: reading the new CI's info fails after
        ``nvmlGpuInstanceCreateComputeInstance`` succeeded, or a TIMEOUT retry meets the CI the first
        attempt made. The GI is this record's (its create made it, the placement proven free under the
        GPU lock), and only this create makes a CI in it, so its one CI is ours. Recording it before
        the undo destroys anything means a failed undo leaves an ERROR record with the full identity,
        which the reconciler destroys like any other. A GI seen without a CI clears
        ``ci_create_issued``: from then on the record stands for a bare GI, and a CI found in it later
        is refused as someone else's (``ComputeInstanceNotOurs``). Raises NvmlError. Call with the GPU
        lock held.
        """
        if record.gpu_instance_id is None or record.compute_instance_id is not None:
            return record
        gi = next(
            (g for g in self.port.gpu_instances(record.gpu_uuid) if g.id == record.gpu_instance_id), None
        )
        if gi is None or not placement.owns(record, gi):
            return record
        cis = self.port.compute_instances(record.gpu_uuid, gi.id)
        if not cis:
            return msgspec.structs.replace(record, ci_create_issued=False)
        if len(cis) != 1 or cis[0].profile_id != record.ci_profile_id:
            return record  # not the one full-size CI this create makes: nothing to name it by
        return msgspec.structs.replace(
            record, compute_instance_id=cis[0].id, mig_uuid=cis[0].mig_uuid, ci_create_issued=False
        )

    def retry_error(self, name: str) -> InstanceRef | None:
        """One reconciler attempt at an ERROR instance; returns its ref once destroyed, None if skipped.

        Skipped: the record is gone or no longer ERROR, or the plugin's last SyncActive still lists its
        MIG UUID as held by a pod. A failure keeps it ERROR with the new ``last_error`` and raises.
        """
        current = self.record(name)
        if current is None:
            return None
        with self._gpu_lock(current.gpu_uuid):
            current = self.record(name)
            if current is None or current.state is not State.ERROR:
                return None
            if current.mig_uuid is not None and current.mig_uuid in self._referenced_mig_uuids:
                return None
            if current.gpu_instance_id is None:
                current = self._find_created_gi(current)
            return self._destroy_owned(current, mark_deleting=False)

    def _find_created_gi(self, record: OwnershipRecord) -> OwnershipRecord:
        """The GI of an ERROR record without a GI ID, found again before anything is destroyed.

        Such a record is a create that made its GI and failed, and whose undo could not find the GI
        (``_with_created_gi`` failed as well). Without a GI ID the destroy has nothing to destroy and
        would delete the record while the bare GI lives on, owned by nobody. So the search runs again
        here: found, the record names it and the destroy proceeds; nothing at exactly the record's
        placement and profile, the GI is gone and the record may go. A GI there that the search cannot
        claim (someone made a CI in it) might still be the one the create made: it is left alone and
        the record stays ERROR (UnverifiableState), as it does when the search fails (NvmlFailure).
        Call with the GPU lock held.
        """
        try:
            with nvml_errors(f"find the GPU instance the failed create of {record.name} made"):
                found = self._with_created_gi(record)
                if found.gpu_instance_id is not None:
                    return found
                there = [
                    gi.id
                    for gi in self.port.gpu_instances(record.gpu_uuid)
                    if gi.placement == record.placement and gi.profile_id == record.gi_profile_id
                ]
            if there:
                raise UnverifiableState(
                    f"GPU instance {there[0]} at {record.placement} on {record.gpu_uuid} may be the one the"
                    f" failed create of {record.name} made, but it has a compute instance now; nothing was"
                    " destroyed and the record stays in ERROR",
                    {"record": record.name, "gpu_uuid": record.gpu_uuid, "gpu_instance_id": str(there[0])},
                )
        except SidecarError as exc:
            self._fail(record, str(exc))
            raise
        return found

    @property
    def referenced_mig_uuids(self) -> frozenset[str]:
        """MIG UUIDs held by live pods: the last SyncActive's list (before the first: the last Recover's)."""
        return self._referenced_mig_uuids

    # -- internals: validation -------------------------------------------------------------------------
    def _require_recovered(self) -> None:
        if not self.recovered:
            raise NotRecovered("startup recovery has not succeeded yet; call Recover first")

    def _validate(self, request: AllocateRequest) -> list[_Validated]:
        """Everything that can be checked without changing anything, for every device, first."""
        pod = request.pod
        if not POD_UID_RE.match(pod.uid):
            raise InvalidRequest(f"pod uid {pod.uid!r} is not a valid UID", {"pod_uid": pod.uid})
        if request.container_index < 0:
            raise InvalidRequest(f"container index {request.container_index} is negative")
        if not request.devices:
            raise InvalidRequest("the request names no devices")
        indices = [d.device_index for d in request.devices]
        if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
            raise InvalidRequest(f"device indices {indices} must be distinct and non-negative")
        out: list[_Validated] = []
        for d in request.devices:
            res = d.reservation
            gpu = self.gpu_info(res.gpu_uuid)
            self._require_mig_enabled(res.gpu_uuid)
            profile = self.resolve_profile(res.gpu_uuid, res.profile)
            if not placement.is_legal(profile, res.placement):
                legal = ",".join(str(p) for p in profile.placements)
                raise IllegalPlacementError(
                    f"placement {res.placement} is not legal for {res.profile} on {res.gpu_uuid}"
                    f" (legal: {legal})",
                    {
                        "gpu_uuid": res.gpu_uuid,
                        "profile": res.profile,
                        "placement": str(res.placement),
                        "legal": legal,
                    },
                )
            owner = Owner(pod, request.container_name, request.container_index, d.device_index)
            out.append(_Validated(device=d, key=owner.key, owner=owner, gpu=gpu, profile=profile))
        clash = placement.first_overlap([(v.gpu.uuid, v.device.reservation.placement) for v in out])
        if clash is not None:
            a, b = (out[i].device for i in clash)
            raise InvalidRequest(
                f"devices {a.device_index} and {b.device_index} overlap on {a.reservation.gpu_uuid}"
                f" ({a.reservation.placement} and {b.reservation.placement})"
            )
        return out

    def _require_mig_enabled(self, gpu_uuid: str) -> GpuInfo:
        """The GPU as NVML describes it now; MigDisabled unless MIG is enabled now and stays enabled
        after the next reset."""
        with nvml_errors(f"read MIG mode of {gpu_uuid}"):
            live = self.port.gpu(gpu_uuid)
        if not (live.mig_current and live.mig_pending):
            raise MigDisabled(
                f"MIG is not enabled on {gpu_uuid} (current={live.mig_current}, pending={live.mig_pending})",
                {
                    "gpu_uuid": gpu_uuid,
                    "current": str(live.mig_current),
                    "pending": str(live.mig_pending),
                },
            )
        return live

    def _check_key_conflicts(self, validated: Sequence[_Validated]) -> None:
        for v in validated:
            self._held_by_key(v)

    def _held_by_key(self, v: _Validated) -> OwnershipRecord | None:
        """What the device's key holds (ACTIVE or CREATING); KeyConflict when that is another reservation."""
        held = self._active_for_key(v.key)
        if held is not None and held.reservation != v.device.reservation:
            raise KeyConflict(
                f"allocation {v.key} already holds {held.reservation}, not {v.device.reservation}",
                {
                    "key": str(v.key),
                    "held": str(held.reservation),
                    "requested": str(v.device.reservation),
                },
            )
        return held

    def _active_for_key(self, key: AllocationKey) -> OwnershipRecord | None:
        for r in self.instances():
            if r.state in (State.ACTIVE, State.CREATING) and r.owner is not None and r.owner.key == key:
                return r
        return None

    # -- internals: one device -------------------------------------------------------------------------
    def _already_held(self, v: _Validated) -> OwnershipRecord | None:
        held = self._held_by_key(v)  # checked again here: never answer with another reservation
        if held is not None and held.state is State.ACTIVE and held.identity is not None:
            return held
        return None

    def _reusable(self, v: _Validated) -> OwnershipRecord | None:
        res = v.device.reservation
        same_spot = self.record(_record_name(res))
        if same_spot is not None and same_spot.state is State.IDLE and same_spot.reservation == res:
            return same_spot
        return None

    def _needs_room(self, v: _Validated) -> bool:
        """True when the device will be created (neither already held by its key nor reusable)."""
        return self._already_held(v) is None and self._reusable(v) is None

    def _allocate_one(self, v: _Validated, reclaimed: list[InstanceRef]) -> _Done:
        held = self._already_held(v)
        if held is not None:
            return _Done(self._allocated(v, held, Outcome.ALREADY_ALLOCATED), held.name)
        same_spot = self._reusable(v)
        if same_spot is not None:
            return _Done(self._allocated(v, self._reuse(v, same_spot), Outcome.REUSED), same_spot.name)
        self._make_room(v, reclaimed)
        created = self._create(v)
        return _Done(self._allocated(v, created, Outcome.CREATED), created.name)

    def _allocated(self, v: _Validated, record: OwnershipRecord, outcome: Outcome) -> AllocatedDevice:
        identity = record.identity
        assert identity is not None  # ACTIVE records are complete by construction
        return AllocatedDevice(
            device_index=v.device.device_index,
            reservation=record.reservation,
            identity=identity,
            cdi_device=record.cdi_device,
            outcome=outcome,
        )

    def _reuse(self, v: _Validated, record: OwnershipRecord) -> OwnershipRecord:
        """Verify an IDLE instance live, make sure its CDI file is right, hand it to the new owner."""
        # Only a real identity mismatch condemns the instance. An NVML error says nothing about it:
        # ERROR would make the reconciler destroy a healthy instance, so it stays IDLE and the
        # request fails with NVML_ERROR (the client retries the same key).
        try:
            with nvml_errors(f"verify idle instance {record.name}"):
                self._verify_live(record)
        except UnverifiableState as exc:
            self._fail(record, f"reuse verification failed: {exc}")
            raise
        self._require_no_processes(record)
        identity = record.identity
        assert identity is not None
        cdi_device = self.cdi.ensure(v.gpu.minor, identity)
        active = self._activate(msgspec.structs.replace(record, cdi_device=cdi_device), v.owner)
        self._put(active)
        return active

    def _require_no_processes(self, record: OwnershipRecord) -> None:
        """InstanceInUse while a process runs on an idle instance (a pod in its grace period).

        Handing it to a new pod would make two pods share one device. Nothing changes: the instance
        stays IDLE and the client retries the same key later. An NVML error fails closed the same way.
        """
        if record.mig_uuid is None:
            return
        with nvml_errors(f"count processes on {record.mig_uuid}"):
            running = self.port.mig_device_processes(record.mig_uuid)
        if running > 0:
            raise InstanceInUse(
                f"idle instance {record.mig_uuid} at {record.placement} still runs {running} processes",
                {"mig_uuid": record.mig_uuid, "processes": str(running), "gpu_uuid": record.gpu_uuid},
            )

    def _verify_live(self, record: OwnershipRecord) -> None:
        """GI with the recorded ID, profile and placement; exactly one CI, the recorded one, same MIG UUID."""
        gpu = record.gpu_uuid
        gi = next((g for g in self.port.gpu_instances(gpu) if g.id == record.gpu_instance_id), None)
        if gi is None or not placement.owns(record, gi):
            raise UnverifiableState(
                f"GPU instance {record.gpu_instance_id} of {record.name} is gone or changed"
                f" (live: {gi.placement if gi else 'none'})",
                {"record": record.name},
            )
        cis = self.port.compute_instances(gpu, gi.id)
        if len(cis) != 1 or cis[0].id != record.compute_instance_id or cis[0].mig_uuid != record.mig_uuid:
            live = ", ".join(f"CI {c.id} {c.mig_uuid}" for c in cis) or "none"
            raise UnverifiableState(
                f"compute instance of {record.name} does not match its record"
                f" (recorded CI {record.compute_instance_id} {record.mig_uuid}; live: {live})",
                {"record": record.name, "mig_uuid": record.mig_uuid or ""},
            )

    def _make_room(self, v: _Validated, reclaimed: list[InstanceRef]) -> None:
        """Reclaim the IDLE instances overlapping the placement, or refuse without touching anything."""
        for r in self._room_for(v):
            reclaimed.append(self._destroy_owned(r, mark_deleting=True))

    def _room_for(self, v: _Validated) -> tuple[OwnershipRecord, ...]:
        """The IDLE instances to reclaim for the placement; PlacementBusy / InstanceInUse otherwise.

        Reads only: the record files left for the operator, the live layout, the owned records and the process
        counts of the candidates."""
        gpu = v.gpu.uuid
        res = v.device.reservation
        self._require_no_record_for_the_operator(gpu, res.placement)
        with nvml_errors(f"list GPU instances of {gpu}"):
            live = self.port.gpu_instances(gpu)
        owned = [r for r in self.instances() if r.gpu_uuid == gpu]
        plan = placement.plan_placement(res.placement, live, owned)
        if plan.busy:
            first = plan.blockers[0]
            raise PlacementBusy(
                f"placement {res.placement} on {gpu} is held by {first.describe()}",
                {**first.metadata(), "gpu_uuid": gpu, "blockers": str(len(plan.blockers))},
            )
        for r in plan.reclaim:  # every one is checked before any is destroyed (all are on ``gpu``)
            self._require_no_processes(r)
        return plan.reclaim

    def _require_no_record_for_the_operator(self, gpu_uuid: str, wanted: Placement) -> None:
        """PlacementBusy when a record file left for the operator names a placement on the GPU that
        overlaps ``wanted``: a corrupt one, or one without a boot id (made or edited by hand).

        Neither is ever overwritten or deleted automatically (records.py, recovery): a create at its
        placement could not write its own record, or would silently replace the operator's, a problem
        no retry clears; and the instance the file stood for may still be live. Its name says which
        placement it was written for (recovery keeps the GIs there foreign for the same reason), so the
        placement stays busy until the operator has dealt with the file, and nothing is reclaimed for a
        request that must fail anyway."""
        valid, corrupt = self.records.load_all()
        left: list[tuple[str, Path, str, str]] = [
            (name, exc.path, exc.why, "corrupt_record") for name, exc in corrupt.items()
        ]
        left += [
            (name, self.records.path(name), "it carries no boot id", "record_without_boot_id")
            for name, r in valid.items()
            if not r.boot_id and self.record(name) is None
        ]
        for name, path, why, blocker in sorted(left):
            where = placement_from_record_name(name)
            if where is None or where[0] != gpu_uuid or not where[1].overlaps(wanted):
                continue
            raise PlacementBusy(
                f"placement {wanted} on {gpu_uuid} overlaps {where[1]}, named by the ownership record"
                f" {path} ({why}); it is left for the operator to inspect and remove",
                {"blocker": blocker, "file": str(path), "gpu_uuid": gpu_uuid, "placement": str(where[1])},
            )

    def _drop_records_left_aside(self, gpu_uuid: str, wanted: Placement) -> None:
        """Delete the record files recovery left aside at placements overlapping ``wanted``, with their specs.

        Recovery keeps some records on disk, out of the table: those of a GPU NVML did not list (in
        case it comes back with its instances) and those that contradicted the live instance at their
        placement. When a create overlaps such a record, the live layout read under the GPU lock has
        just shown the placement free: no GI of that record exists any more (one would overlap, and
        the request would be PLACEMENT_BUSY). Records without a boot id never get here: they keep
        their placement busy (``_require_no_record_for_the_operator``). The record and its CDI spec
        go (a failed spec removal is queued), so neither is overwritten silently nor left behind
        describing an instance that is gone. Call with the GPU lock held, after the placement was
        proven free."""
        valid, _ = self.records.load_all()
        aside = [
            r
            for name, r in sorted(valid.items())
            if r.gpu_uuid == gpu_uuid and r.placement.overlaps(wanted) and self.record(name) is None
        ]
        for r in aside:
            _log.warning(
                "dropping record %s, left aside while its GPU was not visible: its placement is free now",
                r.name,
            )
            if self.cdi.enabled and r.mig_uuid is not None and MIG_UUID_RE.match(r.mig_uuid):
                self.cdi.remove(r.mig_uuid)
            self._delete(r.name)

    def _create(self, v: _Validated) -> OwnershipRecord:
        """Record CREATING -> GI -> record -> CI -> record -> CDI -> ACTIVE; undo on any failure."""
        res = v.device.reservation
        gpu = v.gpu.uuid
        rec = OwnershipRecord(
            gpu_uuid=gpu,
            profile=res.profile,
            gi_profile_id=v.profile.id,
            ci_profile_id=v.profile.ci_profile_id,
            placement=res.placement,
            state=State.CREATING,
            owner=v.owner,
            boot_id=self.boot_id,
            since=now_rfc3339(),
        )
        self._drop_records_left_aside(gpu, res.placement)
        self._put(rec)
        crashpoints.crashpoint("after-record-creating")
        known = rec
        try:
            with nvml_errors(f"create GPU instance {res.profile} at {res.placement} on {gpu}"):
                gi = self.port.create_gpu_instance(gpu, v.profile.id, res.placement)
            crashpoints.crashpoint("after-create-gi")
            known = msgspec.structs.replace(known, gpu_instance_id=gi.id, ci_create_issued=True)
            self._put(known)
            crashpoints.crashpoint("after-record-gi")
            with nvml_errors(f"create compute instance {v.profile.ci_profile_id} in GI {gi.id} on {gpu}"):
                ci = self.port.create_compute_instance(gpu, gi.id, v.profile.ci_profile_id)
            crashpoints.crashpoint("after-create-ci")
            known = msgspec.structs.replace(
                known, compute_instance_id=ci.id, mig_uuid=ci.mig_uuid, ci_create_issued=False
            )
            self._put(known)
            crashpoints.crashpoint("after-record-ci")
            if not MIG_UUID_RE.match(ci.mig_uuid):
                # R450/R460 drivers answer MIG-GPU-<uuid>/<gi>/<ci>: built from reused IDs, it cannot
                # prove "same instance" later, and it is no valid CDI name. Fail closed; undo below.
                raise UnverifiableState(
                    f"the driver names the new compute instance {ci.id} in GPU instance {gi.id} on {gpu}"
                    f" {ci.mig_uuid!r}, not MIG-<uuid> (a driver older than R470?)",
                    {"gpu_uuid": gpu, "mig_uuid": ci.mig_uuid},
                )
            identity = Identity(gi.id, ci.id, ci.mig_uuid)
            cdi_device = self.cdi.ensure(v.gpu.minor, identity)
            crashpoints.crashpoint("after-write-cdi")
            active = self._activate(msgspec.structs.replace(known, cdi_device=cdi_device), v.owner)
            self._put(active)
        except Exception as exc:
            self._undo_create(known, exc)
            raise
        return active

    def _undo_create(self, known: OwnershipRecord, cause: Exception) -> None:
        """Undo what one create made, newest first. An undo that fails leaves ERROR with what is known.

        The CDI spec goes whenever the MIG UUID is known, written or not as far as the create could
        tell: ``CdiSpecs.ensure`` renames the file into place before it syncs the directory, so a
        failed sync fails the write with the file already there (a missing file counts as removed)."""
        _log.warning("create of %s failed (%s); undoing", known.name, cause)
        try:
            with nvml_errors(f"undo create of {known.name}"):
                known = self._with_created_ci(self._with_created_gi(known))
                self._destroy_hardware(known)
        except SidecarError as exc:
            self._fail(known, f"create failed ({cause}) and its undo failed too: {exc}")
            return
        mig_uuid = known.mig_uuid
        if (
            self.cdi.enabled
            and mig_uuid is not None
            and MIG_UUID_RE.match(mig_uuid)  # a legacy MIG-GPU-... name never had a spec file
            and not self.cdi.remove(mig_uuid)
        ):
            _log.warning("CDI removal for %s failed; queued for the reconciler", mig_uuid)
        try:
            self._delete(known.name)
        except SidecarError as exc:
            # The hardware is gone; a CREATING record left on disk is finished by recovery.
            _log.error("cannot delete record %s after undoing its create: %s", known.name, exc)
            with self._table_lock:
                self._table.pop(known.name, None)

    def _roll_back(self, done: Sequence[_Done]) -> None:
        """Undo the devices an allocation already finished: created ones destroyed, reused ones IDLE."""
        for d in reversed(done):
            outcome = d.allocated.outcome
            record = self.record(d.record_name)
            if record is None or outcome is Outcome.ALREADY_ALLOCATED:
                continue
            try:
                if outcome is Outcome.CREATED:
                    self._destroy_owned(record, mark_deleting=True)
                else:
                    self._put(self._idle(record))
            except SidecarError as exc:
                _log.error("rollback of %s (%s) failed: %s", record.name, outcome, exc)

    # -- internals: destruction ------------------------------------------------------------------------
    def _destroy_owned(self, record: OwnershipRecord, *, mark_deleting: bool) -> InstanceRef:
        rec = record
        if mark_deleting and rec.state is not State.ERROR:
            rec = msgspec.structs.replace(rec, state=State.DELETING, since=now_rfc3339())
            self._put(rec)
            crashpoints.crashpoint("after-record-deleting")
        try:
            with nvml_errors(f"destroy instance {rec.profile}@{rec.placement} on {rec.gpu_uuid}"):
                self._destroy_hardware(rec)
        except ComputeInstanceNotOurs as exc:
            # Not ERROR: the reconciler would retry a destroy that must never happen. The record on
            # disk stays as it is for the operator; the next recovery preserves the GI as foreign too.
            _log.error("instance %s is foreign now: %s", rec.name, exc)
            with self._table_lock:
                self._table.pop(rec.name, None)
            raise
        except SidecarError as exc:
            self._fail(rec, str(exc))
            raise
        if rec.mig_uuid is not None and not self.cdi.remove(rec.mig_uuid):
            _log.warning("CDI removal for %s failed; queued for the reconciler", rec.mig_uuid)
        crashpoints.crashpoint("after-remove-cdi")
        try:
            self._delete(rec.name)
        except SidecarError as exc:
            # The hardware is gone but the record is not. A DELETING entry would block its slices
            # until a restart (the reconciler retries ERROR only), so it becomes ERROR: the reconciler
            # finds the instance gone and deletes the record once the state directory works again.
            self._fail(rec, f"destroyed, but deleting its record failed: {exc}")
            raise
        return instance_ref(record)

    def _destroy_hardware(self, rec: OwnershipRecord) -> None:
        """Destroy the CI then the GI of an owned instance; what is already gone counts as done.

        The live GI must match the record (ID, profile, placement) — the driver reuses IDs, so a GI
        with our ID elsewhere is someone else's and ours is gone. A CI with our ID but another MIG UUID
        means the instance was re-created behind our back: refuse (UnverifiableState) rather than
        destroy what might be foreign. Without a recorded CI ID, a record whose create issued the CI
        create (CREATING, or ERROR after a failed undo: ``may_own_unrecorded_ci``) may have stopped
        between making the CI and recording it, so every CI in its GI is ours (its create or recovery
        verified the GI as the one it made). Any other record without a CI ID stands for a bare GI: a
        CI found there now refuses the destroy (``ComputeInstanceNotOurs``), whoever made it between
        the decision and this call. Raises NvmlError for NVML failures.
        """
        if rec.gpu_instance_id is None:
            return
        gpu = rec.gpu_uuid
        gi = next((g for g in self.port.gpu_instances(gpu) if g.id == rec.gpu_instance_id), None)
        if gi is None or not placement.owns(rec, gi):
            return
        cis = self.port.compute_instances(gpu, gi.id)
        if rec.compute_instance_id is None:
            if cis and not rec.may_own_unrecorded_ci:
                found = ", ".join(f"{c.id} {c.mig_uuid}" for c in cis)
                raise ComputeInstanceNotOurs(
                    f"GPU instance {gi.id} at {rec.placement} on {gpu} was recorded ({rec.name}, {rec.state})"
                    f" without a compute instance, but has compute instance {found} now, made by someone"
                    " else; nothing was destroyed, the instance is preserved as foreign and the record"
                    " is kept for the operator",
                    {"record": rec.name, "gpu_uuid": gpu, "gpu_instance_id": str(gi.id)},
                )
            targets = cis
        else:
            targets = [c for c in cis if c.id == rec.compute_instance_id]
            if any(c.mig_uuid != rec.mig_uuid for c in targets):
                raise UnverifiableState(
                    f"compute instance {rec.compute_instance_id} in GI {gi.id} on {gpu} has MIG UUID"
                    f" {targets[0].mig_uuid}, not the recorded {rec.mig_uuid}; not destroying it",
                    {"record": rec.name, "mig_uuid": rec.mig_uuid or ""},
                )
        for ci in targets:
            _tolerate_missing(self.port.destroy_compute_instance, gpu, gi.id, ci.id)
        crashpoints.crashpoint("after-destroy-ci")
        _tolerate_missing(self.port.destroy_gpu_instance, gpu, gi.id)
        crashpoints.crashpoint("after-destroy-gi")

    # -- internals: records and table -----------------------------------------------------------------
    def _put(self, record: OwnershipRecord) -> None:
        """Disk first, then the table. A corrupt file in the way is never overwritten (``_corrupt``)."""
        try:
            self.records.put(record)
        except CorruptRecord as exc:
            raise _corrupt(record.name, exc) from exc
        with self._table_lock:
            self._table[record.name] = record

    def _delete(self, name: str) -> None:
        try:
            self.records.delete(name)
        except CorruptRecord as exc:
            raise _corrupt(name, exc) from exc
        with self._table_lock:
            self._table.pop(name, None)

    def _fail(self, record: OwnershipRecord, message: str) -> None:
        """Put an instance in ERROR: kept, never reused, blocking its placement, retried later."""
        failed = msgspec.structs.replace(record, state=State.ERROR, last_error=message, since=now_rfc3339())
        _log.error("instance %s is now ERROR: %s", record.name, message)
        try:
            self.records.put(failed)
        except (StateWriteFailed, CorruptRecord) as exc:
            _log.error("cannot record ERROR for %s: %s (kept in memory)", record.name, exc)
        with self._table_lock:
            self._table[record.name] = failed

    def _activate(self, record: OwnershipRecord, owner: Owner) -> OwnershipRecord:
        generation = self._next_generation()
        return msgspec.structs.replace(
            record,
            state=State.ACTIVE,
            owner=owner,
            activated_generation=generation,
            last_error="",
            since=now_rfc3339(),
        )

    def _next_generation(self) -> int:
        """The generation of a new activation or idle, durably below the ceiling before anyone sees it.

        StateWriteFailed when the ceiling must rise and cannot: the change then fails (the caller
        undoes its work) rather than hand out a number a restart could hand out again."""
        with self._generation_lock:
            value = self.generation + 1
            if value > self._generation_ceiling:
                self._raise_ceiling(value)
            with self._table_lock:
                self.generation = value
            return value

    def reserve_generations(self, through: int, stored_ceiling: int = 0) -> None:
        """Make every generation up to ``through`` safe to hand out (recovery, before it activates).

        ``stored_ceiling`` is what the ``generation`` file held when recovery read it."""
        with self._generation_lock:
            self._generation_ceiling = max(self._generation_ceiling, stored_ceiling)
            if through > self._generation_ceiling:
                self._raise_ceiling(through)

    def _raise_ceiling(self, needed: int) -> None:
        """Durably move the ceiling a block past ``needed``. Call with ``_generation_lock`` held."""
        try:
            stored = self.records.raise_generation_ceiling(needed + GENERATION_BLOCK)
        except CorruptRecord as exc:
            raise StateWriteFailed(str(exc), {"file": str(exc.path)}) from exc
        self._generation_ceiling = stored

    def _idle(self, record: OwnershipRecord) -> OwnershipRecord:
        """``record`` IDLE, stamped with a fresh generation: SyncActive reactivates it only for a pod
        list taken after that generation was handed out (an older list still names the pod that is
        gone). StateWriteFailed as for ``_next_generation``."""
        return msgspec.structs.replace(
            record,
            state=State.IDLE,
            owner=None,
            idled_generation=self._next_generation(),
            since=now_rfc3339(),
        )

    # -- internals: locks ------------------------------------------------------------------------------
    def _gpu_lock(self, gpu_uuid: str) -> threading.RLock:
        with self._gpu_locks_guard:
            lock = self._gpu_locks.get(gpu_uuid)
            if lock is None:
                lock = self._gpu_locks[gpu_uuid] = threading.RLock()
            return lock

    @contextlib.contextmanager
    def _gpu_locks_for(self, gpu_uuids: Iterable[str]) -> Iterator[None]:
        """Take the locks of several GPUs in sorted UUID order, the one global order (no deadlock)."""
        with contextlib.ExitStack() as stack:
            for uuid in sorted(set(gpu_uuids)):
                stack.enter_context(self._gpu_lock(uuid))
            yield

    @contextlib.contextmanager
    def _claim(self, keys: Sequence[AllocationKey]) -> Iterator[None]:
        """Claim allocation keys for one request; waits while another request holds any of them."""
        wanted = set(keys)
        with self._keys:
            while wanted & self._claimed:
                self._keys.wait()
            self._claimed |= wanted
        try:
            yield
        finally:
            with self._keys:
                self._claimed -= wanted
                self._keys.notify_all()


def _record_name(res: Reservation) -> str:
    return record_name(res.gpu_uuid, res.placement)


def _tolerate_missing(call: Callable[..., None], *args: object) -> None:
    """Run a destroy; NOT_FOUND means it is already gone (the port looks objects up by ID afresh)."""
    try:
        call(*args)
    except NvmlError as exc:
        if not exc.not_found:
            raise
