"""The state of the simulated hardware and the rules that change it (where it lives: ``store``).

The state is *the hardware*: GPUs with their MIG mode, GPU instances, compute instances, MIG UUIDs,
plus the operator's knobs (busy markers, injected faults, lost GPUs, latency, how the driver fills
``nvmlComputeInstanceInfo_t.device``).

The rules (``create_gi``, ``destroy_gi`` …) are plain functions over the state that raise
``SimError(code)`` with the ``nvmlReturn_t`` a real driver returns; the library (``library``) turns
them into C-style return codes, and the Python test knobs share them, so an instance created by a
knob obeys the same placement and overlap rules as one created through NVML.

The state structs are mutable on purpose: they are the machine, changed in place under the lock and
encoded whole; values handed out to callers (``layout``) are frozen copies. The C functions that only
read (queries: ``cabi.query``) get a frozen mirror instead (``StateView``: the same fields, tuples for
lists), decoded from the same bytes: a query that tried to change the hardware would fail at once,
so a store may skip looking for a change after one. The helpers below take either form.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import overload

import msgspec

from sidecar.nvml import profiles
from sidecar.nvml.port import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
)

STATE_VERSION = 1
# A namespace for MIG UUIDs: version-5 UUIDs like the ones real R470+ drivers print.
_MIG_NAMESPACE = uuid.UUID("6f1b7c2e-3d4a-5b6c-8d9e-0a1b2c3d4e5f")


class SimError(Exception):
    """A simulated NVML failure: ``code`` is the nvmlReturn_t the call returns."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (nvml code {code})")
        self.code = code
        self.message = message


class SimCi(msgspec.Struct):
    id: int
    profile_id: int
    start: int  # compute slices inside the GI
    size: int
    mig_uuid: str
    serial: int


class SimGi(msgspec.Struct):
    id: int
    profile_id: int
    start: int  # memory slices
    size: int
    serial: int
    cis: list[SimCi] = msgspec.field(default_factory=list)


class SimGpu(msgspec.Struct):
    index: int
    uuid: str
    model: str  # profiles.MODELS key
    minor: int
    mig_current: bool
    mig_pending: bool
    lost: bool = False
    gis: list[SimGi] = msgspec.field(default_factory=list)


class SimFault(msgspec.Struct):
    """Fail matching calls with ``code``: skip ``after`` matching calls, then fail ``times`` of them."""

    op: str  # a C function name, an alias (create-gi …) or "any"
    code: int
    after: int = 0
    times: int = 1


class SimXid(msgspec.Struct, frozen=True):
    """One Xid the operator raised (``sim xid``): ``serial`` orders them for every event set, which
    delivers those raised after it was registered. ``gi``/``ci`` as NVML's event carries them:
    ``XID_ALL`` (0xFFFFFFFF) for the whole GPU."""

    serial: int
    gpu: int  # GPU index
    xid: int
    gi: int
    ci: int


XID_ALL = 0xFFFFFFFF
XIDS_KEPT = 256  # the newest raised Xids the state keeps; an event set slower than that misses some


class SimState(msgspec.Struct):
    version: int = STATE_VERSION
    boot_id: str = ""
    next_serial: int = 1
    gpus: list[SimGpu] = msgspec.field(default_factory=list)
    busy: list[str] = msgspec.field(default_factory=list)  # MIG or GPU UUIDs with a running process
    faults: list[SimFault] = msgspec.field(default_factory=list)
    latency: dict[str, float] = msgspec.field(default_factory=dict)  # op (name or alias) -> seconds
    # nvmlComputeInstanceGetInfo().device: the MIG device (what tested drivers return) or, when set,
    # the parent GPU (what nvml.h documents)
    ci_info_device_is_parent: bool = False
    xids: list[SimXid] = msgspec.field(default_factory=list)  # the newest raised, oldest first
    next_xid_serial: int = 1


# -- the frozen mirror a query reads --------------------------------------------------------------------


class CiView(msgspec.Struct, frozen=True):
    id: int
    profile_id: int
    start: int
    size: int
    mig_uuid: str
    serial: int


class GiView(msgspec.Struct, frozen=True):
    id: int
    profile_id: int
    start: int
    size: int
    serial: int
    cis: tuple[CiView, ...] = ()


class GpuView(msgspec.Struct, frozen=True):
    index: int
    uuid: str
    model: str
    minor: int
    mig_current: bool
    mig_pending: bool
    lost: bool = False
    gis: tuple[GiView, ...] = ()


class FaultView(msgspec.Struct, frozen=True):
    op: str
    code: int
    after: int = 0
    times: int = 1


class StateView(msgspec.Struct, frozen=True):
    """``SimState`` as a query sees it: every field, none assignable, no list to append to. It must
    encode to the same bytes as the state it was decoded from (a test holds it to that), so a field
    added to ``SimState`` is added here too."""

    version: int = STATE_VERSION
    boot_id: str = ""
    next_serial: int = 1
    gpus: tuple[GpuView, ...] = ()
    busy: tuple[str, ...] = ()
    faults: tuple[FaultView, ...] = ()
    latency: Mapping[str, float] = msgspec.field(default_factory=dict)
    ci_info_device_is_parent: bool = False
    xids: tuple[SimXid, ...] = ()
    next_xid_serial: int = 1


_VIEW_DECODER = msgspec.json.Decoder(StateView)


def decode_view(raw: bytes) -> StateView:
    """The frozen view of the encoded state ``raw``; its latency table is a read-only mapping too."""
    view = _VIEW_DECODER.decode(raw)
    msgspec.structs.force_setattr(view, "latency", MappingProxyType(view.latency))
    return view


AnyState = SimState | StateView
AnyGpu = SimGpu | GpuView
AnyGi = SimGi | GiView
AnyCi = SimCi | CiView


# -- building and numbering ---------------------------------------------------------------------------


def new_state(gpus: list[tuple[str, int]], mig_enabled: bool = True) -> SimState:
    """A freshly booted node: GPUs in the given order, minor = index, no instances."""
    state = SimState(boot_id=str(uuid.uuid4()))
    for key, count in gpus:
        m = profiles.model(key)
        for _ in range(count):
            index = len(state.gpus)
            state.gpus.append(
                SimGpu(
                    index=index,
                    uuid=f"GPU-{uuid.uuid4()}",
                    model=m.key,
                    minor=index,
                    mig_current=mig_enabled,
                    mig_pending=mig_enabled,
                )
            )
    return state


def take_serial(state: SimState) -> int:
    serial = state.next_serial
    state.next_serial += 1
    return serial


def model_of(gpu: AnyGpu) -> profiles.GpuProduct:
    return profiles.model(gpu.model)


def require_mig(gpu: AnyGpu) -> None:
    if not gpu.mig_current:
        raise SimError(NVML_ERROR_NOT_SUPPORTED, f"MIG mode is disabled on GPU {gpu.index}")


def gi_profile(gpu: AnyGpu, profile_id: int) -> profiles.GiProfile:
    p = model_of(gpu).profile_by_id(profile_id)
    if p is None:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"GPU {gpu.index} has no GI profile ID {profile_id}")
    return p


@overload
def find_gi(gpu: SimGpu, gi_id: int) -> SimGi: ...
@overload
def find_gi(gpu: GpuView, gi_id: int) -> GiView: ...
def find_gi(gpu: AnyGpu, gi_id: int) -> AnyGi:
    for gi in gpu.gis:
        if gi.id == gi_id:
            return gi
    raise SimError(NVML_ERROR_NOT_FOUND, f"GPU {gpu.index} has no GPU instance {gi_id}")


def find_ci(gpu: AnyGpu, gi: AnyGi, ci_id: int) -> AnyCi:
    for ci in gi.cis:
        if ci.id == ci_id:
            return ci
    raise SimError(NVML_ERROR_NOT_FOUND, f"GPU {gpu.index} GI {gi.id} has no compute instance {ci_id}")


def mig_devices(gpu: AnyGpu) -> list[tuple[AnyGi, AnyCi]]:
    """MIG devices are compute instances, enumerated in (GI ID, CI ID) order; a bare GI is none."""
    gis: list[AnyGi] = sorted(gpu.gis, key=lambda g: g.id)
    return [(gi, ci) for gi in gis for ci in _cis_by_id(gi)]


def _cis_by_id(gi: AnyGi) -> list[AnyCi]:
    return sorted(gi.cis, key=lambda c: c.id)


def free_placements(gpu: AnyGpu, profile: profiles.GiProfile) -> list[int]:
    """Legal starts of ``profile`` that overlap no existing GI."""
    return [
        s
        for s in profile.starts
        if all(s + profile.size <= gi.start or gi.start + gi.size <= s for gi in gpu.gis)
    ]


def remaining_capacity(gpu: AnyGpu, profile: profiles.GiProfile) -> int:
    existing = sum(1 for gi in gpu.gis if gi.profile_id == profile.id)
    return max(0, min(profile.instance_count - existing, len(free_placements(gpu, profile))))


def auto_placement(gpu: AnyGpu, profile: profiles.GiProfile) -> int:
    """The start the driver picks when none is given: block the fewest still-free placements of other
    profiles, lowest start on a tie. Real drivers change this policy between releases; the sidecar
    never relies on it (it always passes a placement)."""
    free = free_placements(gpu, profile)
    if not free:
        raise SimError(NVML_ERROR_INSUFFICIENT_RESOURCES, f"no free placement for {profile.name}")
    others = [p for p in model_of(gpu).profiles if p.id != profile.id]

    def blocked(start: int) -> int:
        return sum(
            1
            for p in others
            for s in free_placements(gpu, p)
            if s < start + profile.size and start < s + p.size
        )

    return min(free, key=lambda s: (blocked(s), s))


# -- the rules ----------------------------------------------------------------------------------------


def create_gi(state: SimState, gpu: SimGpu, profile_id: int, start: int | None, size: int | None) -> SimGi:
    """nvmlDeviceCreateGpuInstance(WithPlacement): strict where the go-nvml mock is permissive.

    Placement not in the profile's list -> INVALID_ARGUMENT; instance count exhausted or overlap with
    an existing GI -> INSUFFICIENT_RESOURCES (real drivers never say "already exists")."""
    require_mig(gpu)
    profile = gi_profile(gpu, profile_id)
    if start is None:
        start = auto_placement(gpu, profile)
    elif start not in profile.starts or size != profile.size:
        raise SimError(
            NVML_ERROR_INVALID_ARGUMENT, f"placement {start}:{size} is not legal for {profile.name}"
        )
    existing = sum(1 for gi in gpu.gis if gi.profile_id == profile.id)
    if existing >= profile.instance_count:
        raise SimError(
            NVML_ERROR_INSUFFICIENT_RESOURCES,
            f"{profile.name}: all {profile.instance_count} instances exist",
        )
    if start not in free_placements(gpu, profile):
        raise SimError(
            NVML_ERROR_INSUFFICIENT_RESOURCES,
            f"placement {start}:{profile.size} overlaps an existing GPU instance",
        )
    gi = SimGi(
        id=profiles.gpu_instance_id(model_of(gpu).memory_slices, start, profile.size),
        profile_id=profile.id,
        start=start,
        size=profile.size,
        serial=take_serial(state),
    )
    gpu.gis.append(gi)
    gpu.gis.sort(key=lambda g: g.id)
    return gi


def ci_profile(gpu: AnyGpu, gi: AnyGi, ci_profile_id: int) -> profiles.CiProfile:
    if not 0 <= ci_profile_id < profiles.CI_PROFILE_COUNT:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"CI profile {ci_profile_id} out of range")
    gp = gi_profile(gpu, gi.profile_id)
    for cp in gp.ci_profiles:
        if cp.id == ci_profile_id:
            return cp
    raise SimError(NVML_ERROR_NOT_SUPPORTED, f"CI profile {ci_profile_id} is not supported in a {gp.name} GI")


def ci_free_starts(gi: AnyGi, cp: profiles.CiProfile) -> list[int]:
    end = cp.slice_count
    return [s for s in cp.starts if all(s + end <= c.start or c.start + c.size <= s for c in gi.cis)]


def create_ci(state: SimState, gpu: SimGpu, gi: SimGi, ci_profile_id: int, start: int | None = None) -> SimCi:
    """A CI in ``gi`` with a fresh MIG UUID; compute-slice overlap or count -> INSUFFICIENT_RESOURCES."""
    cp = ci_profile(gpu, gi, ci_profile_id)
    if start is not None and start not in cp.starts:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"CI placement {start} is not legal")
    if sum(1 for c in gi.cis if c.profile_id == cp.id) >= cp.instance_count:
        raise SimError(NVML_ERROR_INSUFFICIENT_RESOURCES, "all compute instances of that profile exist")
    free = ci_free_starts(gi, cp)
    if start is None:
        if not free:
            raise SimError(NVML_ERROR_INSUFFICIENT_RESOURCES, "no free compute slices in the GPU instance")
        start = free[0]
    elif start not in free:
        raise SimError(NVML_ERROR_INSUFFICIENT_RESOURCES, "CI placement overlaps another compute instance")
    used = {c.id for c in gi.cis}
    serial = take_serial(state)
    ci = SimCi(
        id=next(i for i in range(len(used) + 1) if i not in used),  # lowest free ID
        profile_id=cp.id,
        start=start,
        size=cp.slice_count,
        mig_uuid=f"MIG-{uuid.uuid5(_MIG_NAMESPACE, f'{gpu.uuid}/{state.boot_id}/{serial}')}",
        serial=serial,
    )
    gi.cis.append(ci)
    gi.cis.sort(key=lambda c: c.id)
    return ci


def destroy_ci(state: SimState, gpu: SimGpu, gi: SimGi, ci: SimCi) -> None:
    """IN_USE while a process runs on the MIG device."""
    if ci.mig_uuid in state.busy:
        raise SimError(NVML_ERROR_IN_USE, f"processes are running on {ci.mig_uuid}")
    gi.cis.remove(ci)


def destroy_gi(state: SimState, gpu: SimGpu, gi: SimGi) -> None:
    """IN_USE while it has compute instances (unlike the go-nvml mock) or processes."""
    if gi.cis:
        raise SimError(NVML_ERROR_IN_USE, f"GPU instance {gi.id} still has {len(gi.cis)} compute instance(s)")
    gpu.gis.remove(gi)


def reboot(state: SimState) -> None:
    """A node reboot: instances, busy markers and lost GPUs are gone, pending MIG modes apply."""
    state.boot_id = str(uuid.uuid4())
    state.busy.clear()
    for gpu in state.gpus:
        gpu.gis.clear()
        gpu.lost = False
        gpu.mig_current = gpu.mig_pending
