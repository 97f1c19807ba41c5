"""Request protos -> validated domain values: what the gRPC edge lets through, and nothing more.

A malformed request never reaches the lifecycle: every check here raises ``InvalidRequest``
(INVALID_ARGUMENT ``INVALID_REQUEST``) before anything is read or written. Names are held to
Kubernetes' own limits, because a name is stored in a record and repeated in every GetState: a pod
UID of at most 128 bytes, a namespace that is a DNS label (at most 63), a pod name of at most 253
bytes and a container name of at most 63. A claim (an Allocate or Release of a DRA kubelet plugin,
``OwnerKind.CLAIM``) is held to the same: its uid as strict as a pod's, its namespace a DNS label, its
name a DNS subdomain (at most 253), and each device's request a DRA request name. An Allocate names
exactly one of pod and claim, a Release exactly one of pod_uid and claim_uid. Error messages quote
an input through ``quote_clipped``, so an answer never grows with the request (a client's header
limit would turn it into a reasonless RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar.model.domain import (
    GPU_UUID_RE,
    MIG_UUID_RE,
    POD_UID_RE,
    REQUEST_NAME_RE,
    ActiveAllocation,
    AllocateRequest,
    ClaimRef,
    DeviceRequest,
    Identity,
    Owner,
    OwnerKind,
    PodRef,
    Reservation,
)
from sidecar.model.errors import InvalidRequest
from sidecar.nvml.port import Placement

MAX_POD_UID_BYTES = 128
MAX_NAMESPACE_BYTES = 63
MAX_POD_NAME_BYTES = 253
MAX_CONTAINER_NAME_BYTES = 63
MAX_CLAIM_NAME_BYTES = 253
MAX_REQUEST_NAME_BYTES = 127  # two DNS labels and the "/" between them
MAX_PROFILE_BYTES = 64  # the longest NVML profile name is a fifth of this
# Counts of the repeated fields. A node holds at most 8 GPUs of 7 MIG devices each (56 instances):
# one container asks for at most that many devices, and a pod list names each live instance once plus
# at most one pending reservation per placement. The bounds leave room far past that, and with the
# name limits above they bound the largest valid request (``limits.MAX_REQUEST_BYTES``).
MAX_DEVICES = 64
MAX_ACTIVE = 1024
MAX_ALLOWED_PROFILES = 256
QUOTE_CHARS = 64
DNS_LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def quote_clipped(value: str, limit: int = QUOTE_CHARS) -> str:
    """``value`` quoted as ``ascii()`` does (no control or non-ASCII bytes reach a message), cut to
    about ``limit`` characters with its full length said, so a quote never grows with the input."""
    quoted = ascii(value)
    if len(quoted) <= limit:
        return quoted
    return f"{quoted[:limit]}... ({len(value)} characters)"


def require(condition: bool, message: str, **metadata: str) -> None:
    """For checks whose message costs nothing to build; the hot checks below build theirs (quoting
    the input, naming the field) only once they fail, as every Allocate passes them all."""
    if not condition:
        raise InvalidRequest(message, metadata)


def _invalid(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, {"field": field})


def _fits(value: str, limit: int) -> bool:
    """Whether ``value`` is at most ``limit`` bytes in UTF-8 (no character passes 4 bytes)."""
    return len(value) <= limit // 4 or len(value.encode()) <= limit


def _too_long(value: str, limit: int, what: str, field: str) -> InvalidRequest:
    return _invalid(
        f"{what} is {len(value.encode())} bytes, more than {limit}: {quote_clipped(value)}", field
    )


def placement(message: pb.DeviceRequest | pb.ActiveAllocation | pb.NextPlacement, where: str) -> Placement:
    if not message.HasField("placement"):
        raise _invalid(f"{where}: placement is missing", f"{where}.placement")
    given = message.placement
    value = Placement(int(given.start), int(given.size))
    if value.size <= 0:
        raise _invalid(f"{where}: placement size must be at least 1", f"{where}.placement")
    return value


def gpu_uuid(value: str, where: str) -> str:
    if not value:
        raise _invalid(f"{where}: gpu_uuid is missing", f"{where}.gpu_uuid")
    if not GPU_UUID_RE.fullmatch(value):
        raise _invalid(f"{where}: {quote_clipped(value)} is not a GPU UUID", f"{where}.gpu_uuid")
    return value


def profile_name(value: str, where: str, field: str) -> str:
    if not value:
        raise _invalid(f"{where}: profile is missing", field)
    if not _fits(value, MAX_PROFILE_BYTES):
        raise _too_long(value, MAX_PROFILE_BYTES, f"{where}: profile", field)
    return value


def reservation(message: pb.DeviceRequest | pb.ActiveAllocation, where: str) -> Reservation:
    gpu = gpu_uuid(message.gpu_uuid, where)
    profile = profile_name(message.profile, where, f"{where}.profile")
    return Reservation(gpu, profile, placement(message, where))


def pod_uid(value: str, where: str, field: str, what: str = "pod") -> str:
    """A pod's uid, or (``what`` "claim") a claim's, held to the same rule."""
    if not value:
        raise _invalid(f"{where}: {what} uid is missing", field)
    if not _fits(value, MAX_POD_UID_BYTES):
        raise _too_long(value, MAX_POD_UID_BYTES, f"{where}: {what} uid", field)
    if not POD_UID_RE.fullmatch(value):
        raise _invalid(f"{where}: {quote_clipped(value)} is not a {what} UID", field)
    return value


def namespace(value: str, where: str, what: str) -> str:
    """An empty namespace is "not told" (grpcurl, older clients); a given one must be a real one."""
    field = f"{where}.{what}.namespace"
    if not _fits(value, MAX_NAMESPACE_BYTES):
        raise _too_long(value, MAX_NAMESPACE_BYTES, f"{where}: {what} namespace", field)
    if value and not DNS_LABEL_RE.fullmatch(value):
        raise _invalid(f"{where}: {what} namespace {quote_clipped(value)} is not a DNS label", field)
    return value


def pod(message: pb.PodRef, has_pod: bool, where: str) -> PodRef:
    uid = pod_uid(message.uid if has_pod else "", where, f"{where}.pod.uid")
    space, name = namespace(message.namespace, where, "pod"), message.name
    if not _fits(name, MAX_POD_NAME_BYTES):
        raise _too_long(name, MAX_POD_NAME_BYTES, f"{where}: pod name", f"{where}.pod.name")
    return PodRef(uid, space, name)


def claim(message: pb.ClaimRef, where: str) -> ClaimRef:
    """A ResourceClaim: its uid as strict as a pod's; namespace and name, when told, Kubernetes'
    own (a DNS label, a DNS subdomain)."""
    uid = pod_uid(message.uid, where, f"{where}.claim.uid", "claim")
    space, name, field = namespace(message.namespace, where, "claim"), message.name, f"{where}.claim.name"
    if not _fits(name, MAX_CLAIM_NAME_BYTES):
        raise _too_long(name, MAX_CLAIM_NAME_BYTES, f"{where}: claim name", field)
    if name and not DNS_SUBDOMAIN_RE.fullmatch(name):
        raise _invalid(f"{where}: claim name {quote_clipped(name)} is not a DNS subdomain", field)
    return ClaimRef(uid, space, name)


def request_name(value: str, for_claim: bool, where: str) -> str:
    """The claim's request a device answers: required with a claim, a DRA request name (a DNS
    label, or two joined by "/" for a subrequest); empty with a pod."""
    field = f"{where}.request"
    if not for_claim:
        if value:
            raise _invalid(
                f"{where}: request {quote_clipped(value)} is set, but a pod's device names none", field
            )
        return ""
    if not value:
        raise _invalid(f"{where}: request is missing (a claim's device names the request it answers)", field)
    if not _fits(value, MAX_REQUEST_NAME_BYTES) or not REQUEST_NAME_RE.fullmatch(value):
        raise _invalid(
            f"{where}: {quote_clipped(value)} is not a DRA request name (a DNS label, or two joined by /)",
            field,
        )
    return value


def container_name(value: str, where: str) -> str:
    if not _fits(value, MAX_CONTAINER_NAME_BYTES):
        raise _too_long(
            value, MAX_CONTAINER_NAME_BYTES, f"{where}: container name", f"{where}.container_name"
        )
    return value


def allocate(request: pb.AllocateRequest) -> AllocateRequest:
    has_pod, has_claim = request.HasField("pod"), request.HasField("claim")
    for_claim: ClaimRef | None = None
    if has_claim:
        require(
            not has_pod, "request: pod and claim are both set; exactly one names the owner", field="pod,claim"
        )
        require(
            not request.container_name and not request.container_index,
            "request: a claim's Allocate names no container (container_name empty, container_index 0)",
            field="container_name,container_index",
        )
        for_claim = claim(request.claim, "request")
        owner, container = PodRef(""), ""
    else:
        require(
            has_pod, "request: neither pod nor claim is set; exactly one names the owner", field="pod,claim"
        )
        owner = pod(request.pod, has_pod, "request")
        container = container_name(request.container_name, "request")
    count = len(request.devices)
    require(count > 0, "request: devices is empty", field="devices")
    if count > MAX_DEVICES:
        raise InvalidRequest(f"request: {count} devices, more than {MAX_DEVICES}", {"field": "devices"})
    devices: list[DeviceRequest] = []
    seen: set[int] = set()
    for position, device in enumerate(request.devices):
        where, index = f"devices[{position}]", int(device.device_index)
        if index in seen:
            raise _invalid(f"{where}: device_index {index} repeats", f"{where}.device_index")
        seen.add(index)
        answers = request_name(device.request, for_claim is not None, where)
        devices.append(DeviceRequest(index, reservation(device, where), answers))
    return AllocateRequest(owner, container, int(request.container_index), tuple(devices), for_claim)


def release(request: pb.ReleaseRequest) -> tuple[str, OwnerKind]:
    """Whose instances a Release gives back: (uid, kind), from exactly one of pod_uid and claim_uid."""
    if request.claim_uid:
        require(
            not request.pod_uid,
            "request: pod_uid and claim_uid are both set; exactly one names the owner",
            field="pod_uid,claim_uid",
        )
        return pod_uid(request.claim_uid, "request", "claim_uid", "claim"), OwnerKind.CLAIM
    require(
        bool(request.pod_uid),
        "request: neither pod_uid nor claim_uid is set; exactly one names the owner",
        field="pod_uid,claim_uid",
    )
    return pod_uid(request.pod_uid, "request", "pod_uid"), OwnerKind.POD


def active(messages: Sequence[pb.ActiveAllocation]) -> list[ActiveAllocation]:
    """ActiveAllocation protos -> domain. An empty ``mig_uuid`` means "no runtime identity known"."""
    require(
        len(messages) <= MAX_ACTIVE,
        f"active: {len(messages)} allocations, more than {MAX_ACTIVE}",
        field="active",
    )
    decoded: list[ActiveAllocation] = []
    for position, message in enumerate(messages):
        where = f"active[{position}]"
        ref = pod(message.pod, message.HasField("pod"), where)
        container = container_name(message.container_name, where)
        owner = Owner(ref, container, int(message.container_index), int(message.device_index))
        identity = None
        if message.mig_uuid:
            if not MIG_UUID_RE.fullmatch(message.mig_uuid):
                raise _invalid(
                    f"{where}: {quote_clipped(message.mig_uuid)} is not a MIG UUID", f"{where}.mig_uuid"
                )
            identity = Identity(
                int(message.gpu_instance_id), int(message.compute_instance_id), message.mig_uuid
            )
        decoded.append(ActiveAllocation(owner, reservation(message, where), identity))
    return decoded


MAX_NEXT_PLACEMENTS = 256  # one per (GPU, profile): 8 GPUs of 19 profiles (an H100's) is 152


def next_placements(values: Sequence[pb.NextPlacement]) -> list[Reservation]:
    """A KeepFree's placements, each shaped as an Allocate's device and at most one per (GPU, profile)."""
    require(
        len(values) <= MAX_NEXT_PLACEMENTS,
        f"next: {len(values)} placements, more than {MAX_NEXT_PLACEMENTS}",
        field="next",
    )
    out: list[Reservation] = []
    for position, message in enumerate(values):
        where = f"next[{position}]"
        gpu = gpu_uuid(message.gpu_uuid, where)
        profile = profile_name(message.profile, where, f"{where}.profile")
        at = placement(message, where)
        if any(r.gpu_uuid == gpu and r.profile == profile for r in out):
            raise _invalid(f"{where}: a second placement for {quote_clipped(profile)} on {gpu}", where)
        out.append(Reservation(gpu, profile, at))
    return out


MAX_MIG_UUIDS = 64  # a GPU holds at most 7 MIG devices; more names than this is not a real request


def mig_uuids(values: Sequence[str], where: str) -> list[str]:
    """MIG UUIDs named by a request, each checked for shape (whether it exists is the lifecycle's)."""
    require(len(values) <= MAX_MIG_UUIDS, f"{where}: {len(values)} MIG UUIDs, more than {MAX_MIG_UUIDS}")
    for position, value in enumerate(values):
        if not MIG_UUID_RE.fullmatch(value):
            field = f"{where}[{position}]"
            raise _invalid(f"{field}: {quote_clipped(value)} is not a MIG UUID", field)
    return list(values)


def mig_uuid(value: str, where: str) -> str:
    """One MIG UUID a request names, checked for shape (whether it exists is the lifecycle's)."""
    if not MIG_UUID_RE.fullmatch(value):
        raise _invalid(f"{where}: {quote_clipped(value) or 'empty'} is not a MIG UUID", where)
    return value


def allowed_profiles(names: Sequence[str]) -> list[str]:
    require(
        len(names) <= MAX_ALLOWED_PROFILES,
        f"allowed_profiles: {len(names)} names, more than {MAX_ALLOWED_PROFILES}",
        field="allowed_profiles",
    )
    for position, name in enumerate(names):
        profile_name(name, f"allowed_profiles[{position}]", f"allowed_profiles[{position}]")
    return list(names)
