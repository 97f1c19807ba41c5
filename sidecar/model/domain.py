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
# A ResourceClaim's uid is held to the same rule: it keys its instances as a pod's uid keys a pod's.
POD_UID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# A DRA request name as a claim's allocation result gives it: a DNS label ("gpu"), or two joined by
# "/" for a subrequest of a ``firstAvailable`` list ("gpu/small").
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
REQUEST_NAME_RE = re.compile(f"{_DNS_LABEL}(/{_DNS_LABEL})?")


class State(enum.StrEnum):
    """Lifecycle state of an owned instance (README, "States of an owned instance")."""

    CREATING = "CREATING"
    ACTIVE = "ACTIVE"
    IDLE = "IDLE"
    DELETING = "DELETING"
    ERROR = "ERROR"


class ObjectRef(msgspec.Struct, frozen=True):
    """A Kubernetes object as a client names it: its uid, and its namespace and name when told."""

    uid: str
    namespace: str = ""
    name: str = ""


class PodRef(ObjectRef, frozen=True):
    """A pod, the owner HAMi's device plugin names."""


class OwnerKind(enum.StrEnum):
    """Whose instance it is: a pod's container, through HAMi's device plugin, or a ResourceClaim's
    request, through a DRA kubelet plugin. The two kinds never touch each other's ACTIVE instances:
    a pod's Release, SyncActive, Recover's pod list and the undos see pod owners only, a claim's
    Release its own claim's instances only. An IDLE instance belongs to neither."""

    POD = "POD"
    CLAIM = "CLAIM"


class ClaimRef(ObjectRef, frozen=True):
    """A ResourceClaim (``resource.k8s.io``): its uid keys its instances, as a pod's uid does."""


class AllocationKey(msgspec.Struct, frozen=True):
    """Who holds an instance. Repeating an Allocate with the same key converges on the same instance.

    ``uid`` is the pod's or the claim's, and ``kind`` is part of the key: a pod and a claim with the
    same uid are two keys, so neither's Allocate finds the other's instance as its own. A claim has no
    containers (``container_index`` 0); its devices are told apart by ``device_index``."""

    uid: str
    container_index: int
    device_index: int
    kind: OwnerKind = OwnerKind.POD

    def __str__(self) -> str:
        if self.kind is OwnerKind.CLAIM:
            return f"claim {self.uid}/{self.device_index}"
        return f"{self.uid}/{self.container_index}/{self.device_index}"


class Owner(msgspec.Struct, frozen=True, omit_defaults=True):
    """The allocation that holds an ACTIVE instance, as the plugin described it.

    A record's owner is stored as this struct. ``pod``, ``container_name`` and ``container_index``
    predate claims and stay required, so a record of this kind decodes as strictly as before; a claim
    owner leaves them empty (``PodRef("")``, "", 0) and names its claim and request instead. The
    fields added for claims are left out of the encoding while they hold their defaults, so a pod's
    record is byte for byte what it was before owner kinds, and one written before them decodes as
    a pod's."""

    pod: PodRef
    container_name: str
    container_index: int
    device_index: int
    kind: OwnerKind = OwnerKind.POD
    claim: ClaimRef | None = None
    request: str = ""  # the claim's request this device answers ("gpu", "gpu/small")

    @classmethod
    def of_claim(cls, claim: ClaimRef, device_index: int, request: str) -> Owner:
        return cls(PodRef(""), "", 0, device_index, OwnerKind.CLAIM, claim, request)

    @property
    def uid(self) -> str:
        """The pod's or the claim's uid: what a Release names."""
        return self.claim.uid if self.claim is not None else self.pod.uid

    @property
    def key(self) -> AllocationKey:
        return AllocationKey(self.uid, self.container_index, self.device_index, self.kind)

    def describe(self) -> str:
        """The holder as an operator reads it: ``ns/name (uid)`` and the container or the request."""
        ref = self.claim if self.claim is not None else self.pod
        named = f"{ref.namespace}/{ref.name}" if ref.name else ref.uid
        if self.kind is OwnerKind.CLAIM:
            return f"claim {named} ({ref.uid}) request {self.request}"
        return f"{named} ({ref.uid}) container {self.container_name}"

    def inconsistency(self) -> str:
        """Why this owner is neither a pod's nor a claim's ("" when it is one): a pod owner names no
        claim or request; a claim owner names its claim, a request, and no pod or container."""
        if self.kind is OwnerKind.POD:
            if self.claim is not None or self.request:
                return "a pod owner names a claim or a request"
            return ""
        if self.claim is None or not self.request:
            return "a claim owner names no claim or no request"
        if self.pod.uid or self.pod.namespace or self.pod.name or self.container_name or self.container_index:
            return "a claim owner names a pod or a container"
        return ""


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
    request: str = ""  # with a claim: the claim's request this device answers


class AllocateRequest(msgspec.Struct, frozen=True):
    """A pod's container's devices, or (``claim`` set; ``pod`` then ``PodRef("")``, no container) a
    claim's."""

    pod: PodRef
    container_name: str
    container_index: int
    devices: tuple[DeviceRequest, ...]
    claim: ClaimRef | None = None

    def owner(self, device: DeviceRequest) -> Owner:
        """Who holds ``device`` once allocated."""
        if self.claim is not None:
            return Owner.of_claim(self.claim, device.device_index, device.request)
        return Owner(self.pod, self.container_name, self.container_index, device.device_index)


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
