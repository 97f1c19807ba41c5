"""What the hardware is: cached GPU facts and profile tables, the live layout advice reads, GetState.

Allocations never trust a cached layout: each reads the live GI layout of its GPU, so anything
created outside the sidecar blocks its placement (PLACEMENT_BUSY) at once. The read-only advice
(``RankPlacements``) and the idle policy read the *layout view* instead: the GI listing of each GPU
as last seen, which costs them no NVML call. It is kept current three ways: every GI listing the
lifecycle makes anyway (an Allocate's, a destroy's, GetState's, a refused create's) replaces it
(``LayoutRecordingPort``), the sidecar's own GI creates and destroys edit it, and the reconciler lists every
MIG-enabled GPU once per interval (``gpu_views.refresh_layout``). So advice lags a change outside the
sidecar by one reconciler interval at most, and not at all once any call has listed that GPU. Which
of the listed GIs are foreign is judged when the view is read, against the records then
(``foreign_view``), so a listing taken before a record changed never makes an owned GI foreign.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import msgspec

from sidecar.lifecycle.locks import Locks
from sidecar.model import placement
from sidecar.model.domain import ForeignInstance, State
from sidecar.model.errors import MigDisabled, SidecarError, UnknownGpu, UnknownProfile, nvml_errors
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import (
    ComputeInstanceInfo,
    GpuInfo,
    GpuInstanceInfo,
    GpuInstanceProfile,
    IdleProof,
    NvmlError,
    NvmlPort,
    Placement,
)
from sidecar.store.cdi import CdiSpecs
from sidecar.store.generation import Generations
from sidecar.store.table import RecordTable

_log = logging.getLogger(__name__)


class GpuSnapshot(msgspec.Struct, frozen=True):
    gpu: GpuInfo
    busy: bool
    instances: tuple[OwnershipRecord, ...]
    foreign: tuple[ForeignInstance, ...]
    # Why the GPU could not be read ("" when it could): its foreign GIs are then unknown, and a
    # client must not take any of it for free (GetState's ``GpuState.unreadable``).
    unreadable: str = ""


class StateSnapshot(msgspec.Struct, frozen=True):
    generation: int
    gpus: tuple[GpuSnapshot, ...]
    pending_cdi_removals: tuple[str, ...]


class Inventory:
    """Static GPU facts and profile tables, cached; MIG mode is always read live."""

    def __init__(self, port: LayoutRecordingPort) -> None:
        self._profiles: dict[str, tuple[GpuInstanceProfile, ...]] = {}
        # GPU UUID -> (MIG mode, its profile table) for recovery: re-read only when the mode changes.
        self._recovery_profiles: dict[str, tuple[bool, tuple[GpuInstanceProfile, ...]]] = {}
        self._gpus: dict[str, GpuInfo] = {}
        self.port = port  # its ``layout`` is the layout view

    def gpu_info(self, gpu_uuid: str) -> GpuInfo:
        """Static facts of a GPU (index, minor, model) from a cached GPU list; UnknownGpu if absent.

        The MIG mode in the cached value is stale by design; callers that need it use ``port.gpu``."""
        info = self._gpus.get(gpu_uuid)
        if info is None:
            with nvml_errors("list GPUs"):
                gpus = self.port.gpus()
            self._gpus = {g.uuid: g for g in gpus}
            info = self._gpus.get(gpu_uuid)
        if info is None:
            raise UnknownGpu(f"no GPU with UUID {gpu_uuid!r} on this node", {"gpu_uuid": gpu_uuid})
        return info

    def profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        """The GPU's GI profiles (cached per GPU after the first successful read). UnknownGpu if absent."""
        cached = self._profiles.get(gpu_uuid)
        if cached is None:
            self.gpu_info(gpu_uuid)
            with nvml_errors(f"read GPU instance profiles of {gpu_uuid}"):
                read = tuple(self.port.gpu_instance_profiles(gpu_uuid))
            if read:  # an empty answer (driver not ready) is not worth remembering
                self._profiles[gpu_uuid] = read
            cached = read
        return list(cached)

    def known_gpus(self) -> list[GpuInfo]:
        """The GPUs of the last successful listing, by index (their MIG mode as it was then)."""
        return sorted(self._gpus.values(), key=lambda g: g.index)

    def remember(self, gpus: Sequence[GpuInfo]) -> None:
        """A successful listing of every GPU replaces the cached one."""
        self._gpus = {g.uuid: g for g in gpus}

    def profiled_gpus(self) -> list[str]:
        """The GPUs whose profile table has been read (``profiles``), by UUID."""
        return sorted(self._profiles)

    def cached_placements(self, name: str) -> dict[str, tuple[Placement, ...]]:
        """GPU -> the legal placements of the profile ``name``, from the profile tables read so far."""
        return {g: p.placements for g, ps in self._profiles.items() for p in ps if p.name == name}

    def profiles_at_mode(self, info: GpuInfo) -> tuple[GpuInstanceProfile, ...]:
        """The profile table of ``info``'s GPU, read once per MIG mode (recovery's gather).

        The table is a fixed hardware fact while the mode stays the same, so a repeated Recover does
        not re-read it; ``info`` carries the mode just read live, and a different mode re-reads it.
        Raises NvmlError. Safe from several threads at once: each GPU has its own key."""
        cached = self._recovery_profiles.get(info.uuid)
        if cached is not None:
            if cached[0] == info.mig_current:
                return cached[1]
            del self._recovery_profiles[info.uuid]  # the mode changed: the table read before is void
        read = tuple(self.port.gpu_instance_profiles(info.uuid))
        if read:  # an empty answer (driver not ready) is not worth remembering
            self._recovery_profiles[info.uuid] = (info.mig_current, read)
        return read

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

    def profile_name(self, gpu_uuid: str, profile_id: int) -> str:
        profile = self.profile_by_id(gpu_uuid, profile_id)
        return profile.name if profile else f"profile-id-{profile_id}"

    def forget(self, gpu_uuid: str) -> None:
        """A mode change may unbind or reset the device: its minor and profiles are read afresh."""
        self._gpus.pop(gpu_uuid, None)
        self._profiles.pop(gpu_uuid, None)
        self.port.layout.pop(gpu_uuid, None)

    def foreign_view(
        self, gpu_uuid: str, owned: Sequence[OwnershipRecord]
    ) -> tuple[ForeignInstance, ...] | None:
        """The GIs of the GPU's layout view that no record in ``owned`` claims; None before the GPU
        was first listed. No NVML call: profile names come from the cached tables only."""
        live = self.port.layout.get(gpu_uuid)
        if live is None:
            return None
        return tuple(
            ForeignInstance(gpu_uuid, self._cached_profile_name(gpu_uuid, gi.profile_id), gi.placement, gi.id)
            for gi in placement.foreign_instances(live, owned)
        )

    def forget_foreign(self) -> None:
        """Recoverer may adopt foreign GIs or leave records aside: the next advice lists afresh."""
        self.port.layout.clear()

    def _cached_profile_name(self, gpu_uuid: str, profile_id: int) -> str:
        tables = (self._profiles.get(gpu_uuid, ()), self._recovery_profiles.get(gpu_uuid, (False, ()))[1])
        for table in tables:
            for profile in table:
                if profile.id == profile_id:
                    return profile.name
        return f"profile-id-{profile_id}"

    def require_mig_enabled(self, gpu_uuid: str) -> GpuInfo:
        """The GPU as NVML describes it now; MigDisabled unless MIG is enabled now and stays enabled
        after the next reset."""
        with nvml_errors(f"read MIG mode of {gpu_uuid}"):
            live = self.port.gpu(gpu_uuid)
        return require_enabled(live)

    def prove_idle_enabled(self, gpu_uuid: str, mig_uuid: str) -> IdleProof:
        """``require_mig_enabled`` and then the lookup of ``mig_uuid`` with its processes, in one
        port call (``NvmlPort.prove_idle``); the lookup's failure is in the proof, for the caller."""
        with nvml_errors(f"read MIG mode of {gpu_uuid}"):
            proof = self.port.prove_idle(gpu_uuid, mig_uuid)
        require_enabled(proof.gpu)
        return proof


def require_enabled(live: GpuInfo) -> GpuInfo:
    """``live``, or MigDisabled unless its MIG mode is enabled now and after the next reset."""
    gpu_uuid = live.uuid
    if not (live.mig_current and live.mig_pending):
        raise MigDisabled(
            f"MIG is not enabled on {gpu_uuid} (current={live.mig_current}, pending={live.mig_pending})",
            {"gpu_uuid": gpu_uuid, "current": str(live.mig_current), "pending": str(live.mig_pending)},
        )
    return live


class LayoutRecordingPort:
    """The port the lifecycle talks to: NVML as it is, with every GI listing and every GI create and
    destroy also kept in ``layout``, the advice's layout view (module docstring). It adds no NVML call.

    A decorator of ``NvmlPort`` like ``MeteredPort`` below it; the composition root stacks both."""

    def __init__(self, inner: NvmlPort) -> None:
        self.inner = inner
        self.layout: dict[str, tuple[GpuInstanceInfo, ...]] = {}  # GPU UUID -> its GIs as last seen

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceInfo]:
        """The listing becomes the GPU's layout view."""
        live = self.inner.gpu_instances(gpu_uuid)
        self.layout[gpu_uuid] = tuple(live)
        return live

    def create_gpu_instance(self, gpu_uuid: str, profile_id: int, placement: Placement) -> GpuInstanceInfo:
        """The view gains the new GI (a GPU never listed stays unlisted)."""
        gi = self.inner.create_gpu_instance(gpu_uuid, profile_id, placement)
        live = self.layout.get(gpu_uuid)
        if live is not None:
            self.layout[gpu_uuid] = (*(g for g in live if g.id != gi.id), gi)
        return gi

    def destroy_gpu_instance(self, gpu_uuid: str, gpu_instance_id: int) -> None:
        """The view loses the GI."""
        self.inner.destroy_gpu_instance(gpu_uuid, gpu_instance_id)
        live = self.layout.get(gpu_uuid)
        if live is not None:
            self.layout[gpu_uuid] = tuple(g for g in live if g.id != gpu_instance_id)

    # Every other port method, forwarded as it is.
    def gpus(self) -> list[GpuInfo]:
        return self.inner.gpus()

    def gpu(self, gpu_uuid: str) -> GpuInfo:
        return self.inner.gpu(gpu_uuid)

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> int:
        return self.inner.set_mig_mode(gpu_uuid, enabled)

    def gpu_instance_profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        return self.inner.gpu_instance_profiles(gpu_uuid)

    def compute_instances(self, gpu_uuid: str, gpu_instance_id: int) -> list[ComputeInstanceInfo]:
        return self.inner.compute_instances(gpu_uuid, gpu_instance_id)

    def create_compute_instance(
        self, gpu_uuid: str, gpu_instance_id: int, ci_profile_id: int
    ) -> ComputeInstanceInfo:
        return self.inner.create_compute_instance(gpu_uuid, gpu_instance_id, ci_profile_id)

    def destroy_compute_instance(self, gpu_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        self.inner.destroy_compute_instance(gpu_uuid, gpu_instance_id, compute_instance_id)

    def mig_device_processes(self, mig_uuid: str) -> int:
        return self.inner.mig_device_processes(mig_uuid)

    def prove_idle(self, gpu_uuid: str, mig_uuid: str) -> IdleProof:
        return self.inner.prove_idle(gpu_uuid, mig_uuid)

    def gpu_processes(self, gpu_uuid: str) -> int:
        return self.inner.gpu_processes(gpu_uuid)


def gpu_busy(port: NvmlPort, table: RecordTable, gpu_uuid: str) -> bool:
    """An ACTIVE instance or a running process on the GPU; an NVML error counts as busy."""
    if any(r.gpu_uuid == gpu_uuid and r.state is State.ACTIVE for r in table.instances()):
        return True
    try:
        return port.gpu_processes(gpu_uuid) > 0
    except NvmlError:
        return True


def snapshot(
    inventory: Inventory,
    table: RecordTable,
    locks: Locks,
    generations: Generations,
    cdi: CdiSpecs,
    *,
    recovered: bool = True,
) -> StateSnapshot:
    """Everything GetState shows. Each GPU is read under its lock so no half-done create shows up
    as a foreign instance.

    What cannot be read of one GPU costs that GPU only: a GPU whose GI listing fails, or, when the
    listing of all GPUs fails (NVML lists them by index, so one lost GPU fails it), whose own read
    fails, is answered ``unreadable`` with NVML's reason, its records and the facts last read, and
    the others as usual. Only with no GPU ever listed does the whole call fail.

    Before the first Recover (``recovered`` False) the table is empty: the record files on disk are
    read (read only) so that each live instance a record describes is marked ``recorded_as``."""
    port = inventory.port
    unverified = {} if recovered else _records_on_disk(table)
    out: list[GpuSnapshot] = []
    for gpu, why in _gpus_each(inventory):
        unreadable = why
        with locks.gpu(gpu.uuid):
            owned = tuple(sorted(table.on_gpu(gpu.uuid), key=lambda r: (r.placement.start, r.placement.size)))
            foreign: list[ForeignInstance] = []
            if gpu.mig_current and not unreadable:
                try:
                    foreign = [_mark_recorded(f, unverified) for f in _foreign(inventory, gpu.uuid, owned)]
                except (NvmlError, SidecarError) as exc:
                    _log.warning("cannot list foreign instances of %s: %s", gpu.uuid, exc)
                    unreadable = f"list GPU instances of {gpu.uuid}: {exc}"
            busy = gpu_busy(port, table, gpu.uuid)
        out.append(
            GpuSnapshot(gpu=gpu, busy=busy, instances=owned, foreign=tuple(foreign), unreadable=unreadable)
        )
    return StateSnapshot(
        generation=generations.current,
        gpus=tuple(out),
        pending_cdi_removals=tuple(cdi.pending_removals()),
    )


def _gpus_each(inventory: Inventory) -> list[tuple[GpuInfo, str]]:
    """Every GPU with why it cannot be read ("" when it can): the listing of all when it works,
    else each GPU last listed read on its own. NvmlFailure when neither names a GPU."""
    try:
        with nvml_errors("list GPUs"):
            gpus = inventory.port.gpus()
    except SidecarError as listing:
        known = inventory.known_gpus()
        if not known:
            raise
        _log.warning("%s: reading each GPU last listed on its own", listing)
        out: list[tuple[GpuInfo, str]] = []
        for info in known:
            try:
                with nvml_errors(f"read GPU {info.uuid}"):
                    out.append((inventory.port.gpu(info.uuid), ""))
            except SidecarError as exc:
                out.append((info, str(exc)))
        return out
    inventory.remember(gpus)
    return [(g, "") for g in gpus]


def _foreign(inventory: Inventory, gpu_uuid: str, owned: Sequence[OwnershipRecord]) -> list[ForeignInstance]:
    port = inventory.port
    out: list[ForeignInstance] = []
    for gi in placement.foreign_instances(port.gpu_instances(gpu_uuid), owned):
        profile = inventory.profile_by_id(gpu_uuid, gi.profile_id)
        cis = port.compute_instances(gpu_uuid, gi.id)
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


def _records_on_disk(table: RecordTable) -> dict[tuple[str, int], OwnershipRecord]:
    """The valid record files by (GPU UUID, GI ID); none when the directory cannot be read (logged)."""
    try:
        valid, _ = table.records.load_all()
    except SidecarError as exc:
        _log.warning("cannot read the ownership records for GetState: %s", exc)
        return {}
    return {(r.gpu_uuid, r.gpu_instance_id): r for r in valid.values() if r.gpu_instance_id is not None}


def _mark_recorded(
    foreign: ForeignInstance, records: Mapping[tuple[str, int], OwnershipRecord]
) -> ForeignInstance:
    """``foreign`` with ``recorded_as`` set when a record names exactly this GI (placement and MIG UUID
    too); Recover, not this, decides whether the record holds."""
    record = records.get((foreign.gpu_uuid, foreign.gpu_instance_id))
    if record is None or record.placement != foreign.placement:
        return foreign
    if record.mig_uuid is not None and foreign.mig_uuid != record.mig_uuid:
        return foreign
    return msgspec.structs.replace(foreign, recorded_as=record.name)
