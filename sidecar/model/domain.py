"""Value types of the MIG lifecycle, shared by every module.

What *should* exist (a reservation: GPU, profile, placement) is kept apart from what *does* exist
(a live identity: GI ID, CI ID, MIG UUID). GI/CI IDs are reused by the driver; only the MIG UUID
proves that an instance is the same one that was created.

All types are frozen msgspec Structs: cheap to build, hashable, and the ownership record format
(``records``) is built from them, so field names here are part of the on-disk format. New fields
must have defaults; existing field types never change.
"""

from __future__ import annotations

import enum
import re

import msgspec

from sidecar.nvml.port import Placement

# Unanchored: every check is ``fullmatch``, as ``$`` also matches before a final newline.
GPU_UUID_RE = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
MIG_UUID_RE = re.compile(r"MIG-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# Profile names as NVML reports them without the "MIG " prefix: 1g.10gb, 1g.10gb+me, 1g.20gb, 7g.80gb,
# 1c.3g.40gb is a CI name and never a GI profile.
PROFILE_NAME_RE = re.compile(r"[1-8]g\.[0-9]+gb(\+me(\.all)?|-me|\+gfx)?")
# Kubernetes UIDs are RFC 4122 UUIDs, but tests and other clients may use any DNS-label-like string.
POD_UID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class State(enum.StrEnum):
    """Lifecycle state of an owned instance (README, "States of an owned instance")."""

    CREATING = "CREATING"
    ACTIVE = "ACTIVE"
    IDLE = "IDLE"
    DELETING = "DELETING"
    ERROR = "ERROR"


class PodRef(msgspec.Struct, frozen=True):
    uid: str
    namespace: str = ""
    name: str = ""


class AllocationKey(msgspec.Struct, frozen=True):
    """Who holds an instance. Repeating an Allocate with the same key converges on the same instance."""

    pod_uid: str
    container_index: int
    device_index: int

    def __str__(self) -> str:
        return f"{self.pod_uid}/{self.container_index}/{self.device_index}"


class Owner(msgspec.Struct, frozen=True):
    """The allocation that holds an ACTIVE instance, as the plugin described it."""

    pod: PodRef
    container_name: str
    container_index: int
    device_index: int

    @property
    def key(self) -> AllocationKey:
        return AllocationKey(self.pod.uid, self.container_index, self.device_index)


class Reservation(msgspec.Struct, frozen=True):
    """What the scheduler chose: exactly this GPU, full profile name and placement."""

    gpu_uuid: str
    profile: str
    placement: Placement

    def __str__(self) -> str:
        return f"{self.gpu_uuid}/{self.profile}@{self.placement}"


class Identity(msgspec.Struct, frozen=True):
    """The live identity of a complete instance (one GI with exactly one full-size CI)."""

    gpu_instance_id: int
    compute_instance_id: int
    mig_uuid: str

    @property
    def ids_told(self) -> bool:
        """False when GI and CI IDs are both 0: the contract's "not told" (a pod list that knows the
        instance by its MIG UUID alone)."""
        return self.gpu_instance_id != 0 or self.compute_instance_id != 0

    def names(self, live: Identity) -> bool:
        """Whether this identity, as a pod list gives it, names the instance whose identity is
        ``live``: the same MIG UUID (the driver never mints one twice), and the same GI and CI IDs
        when they are told. The one acceptance rule of ``Recover`` and ``SyncActive``."""
        if self.mig_uuid != live.mig_uuid:
            return False
        return not self.ids_told or (
            self.gpu_instance_id == live.gpu_instance_id
            and self.compute_instance_id == live.compute_instance_id
        )


class InstanceRef(msgspec.Struct, frozen=True):
    """A reservation plus the identity it had; what responses list (``InstanceRef`` in the contract)."""

    reservation: Reservation
    identity: Identity | None = None


class ActiveAllocation(msgspec.Struct, frozen=True):
    """An allocation the plugin knows to be live (from ``hami.io/vgpu-mig-allocations``)."""

    owner: Owner
    reservation: Reservation
    identity: Identity | None = None

    @property
    def key(self) -> AllocationKey:
        return self.owner.key


class DeviceRequest(msgspec.Struct, frozen=True):
    device_index: int
    reservation: Reservation


class AllocateRequest(msgspec.Struct, frozen=True):
    pod: PodRef
    container_name: str
    container_index: int
    devices: tuple[DeviceRequest, ...]


class Outcome(enum.StrEnum):
    CREATED = "CREATED"
    REUSED = "REUSED"
    ALREADY_ALLOCATED = "ALREADY_ALLOCATED"


class AllocatedDevice(msgspec.Struct, frozen=True):
    device_index: int
    reservation: Reservation
    identity: Identity
    cdi_device: str
    outcome: Outcome


class AllocateResult(msgspec.Struct, frozen=True):
    devices: tuple[AllocatedDevice, ...]
    reclaimed: tuple[InstanceRef, ...] = ()


class ForeignInstance(msgspec.Struct, frozen=True):
    """A GI on the hardware (maybe with a CI) that no valid ownership record claims. Never touched."""

    gpu_uuid: str
    profile: str
    placement: Placement
    gpu_instance_id: int
    compute_instance_id: int | None = None
    mig_uuid: str | None = None
    # Before the first Recover the table is empty, so the sidecar's own instances list here; the
    # record on disk that names this one (not yet verified), so ``status`` does not call it foreign.
    recorded_as: str = ""
