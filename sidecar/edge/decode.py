"""Request protos -> validated domain values: what the gRPC edge lets through, and nothing more.

A malformed request never reaches the lifecycle: every check here raises ``InvalidRequest``
(INVALID_ARGUMENT ``INVALID_REQUEST``) before anything is read or written. The names of an owner
(uids, namespaces, pod, container and claim names, a claim's request names) are held to the one rule
of ``sidecar.model.names``, which the record decoder applies to every stored owner too, so whatever
this lets through can be read back and released. An Allocate names exactly one of pod and claim, a
Release exactly one of pod_uid and claim_uid. Error messages quote an input through
``quote_clipped``, so an answer never grows with the request (a client's header limit would turn it
into a reasonless RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from collections.abc import Sequence

from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar.model.domain import (
    GPU_UUID_RE,
    MIG_UUID_RE,
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
from sidecar.model.names import (
    claim_name_fault,
    container_name_fault,
    fits,
    namespace_fault,
    pod_name_fault,
    quote_clipped,
    request_name_fault,
    too_long,
    uid_fault,
)
from sidecar.nvml.port import Placement

MAX_PROFILE_BYTES = 64  # the longest NVML profile name is a fifth of this
# Counts of the repeated fields. A node holds at most 8 GPUs of 7 MIG devices each (56 instances):
# one container asks for at most that many devices, and a pod list names each live instance once plus
# at most one pending reservation per placement. The bounds leave room far past that, and with the
# name limits (``sidecar.model.names``) they bound the largest valid request (``limits.MAX_REQUEST_BYTES``).
MAX_DEVICES = 64
MAX_ACTIVE = 1024
MAX_ALLOWED_PROFILES = 256


def require(condition: bool, message: str, **metadata: str) -> None:
    """For checks whose message costs nothing to build; the hot checks below build theirs (quoting
    the input, naming the field) only once they fail, as every Allocate passes them all."""
    if not condition:
        raise InvalidRequest(message, metadata)


def _invalid(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, {"field": field})


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
    if not fits(value, MAX_PROFILE_BYTES):
        raise _invalid(f"{where}: {too_long(value, MAX_PROFILE_BYTES, 'profile')}", field)
    return value


def reservation(message: pb.DeviceRequest | pb.ActiveAllocation, where: str) -> Reservation:
    gpu = gpu_uuid(message.gpu_uuid, where)
    profile = profile_name(message.profile, where, f"{where}.profile")
    return Reservation(gpu, profile, placement(message, where))


def _check(fault: str, where: str, field: str) -> None:
    if fault:
        raise _invalid(f"{where}: {fault}", field)


def pod_uid(value: str, where: str, field: str, what: str = "pod") -> str:
    """A pod's uid, or (``what`` "claim") a claim's, held to the same rule."""
    _check(uid_fault(value, what), where, field)
    return value


def pod(message: pb.PodRef, has_pod: bool, where: str) -> PodRef:
    uid = pod_uid(message.uid if has_pod else "", where, f"{where}.pod.uid")
    _check(namespace_fault(message.namespace, "pod"), where, f"{where}.pod.namespace")
    _check(pod_name_fault(message.name), where, f"{where}.pod.name")
    return PodRef(uid, message.namespace, message.name)


def claim(message: pb.ClaimRef, where: str) -> ClaimRef:
    """A ResourceClaim: its uid as strict as a pod's; namespace and name, when told, Kubernetes'
    own (a DNS label, a DNS subdomain)."""
    uid = pod_uid(message.uid, where, f"{where}.claim.uid", "claim")
    _check(namespace_fault(message.namespace, "claim"), where, f"{where}.claim.namespace")
    _check(claim_name_fault(message.name), where, f"{where}.claim.name")
    return ClaimRef(uid, message.namespace, message.name)


def request_name(value: str, for_claim: bool, where: str) -> str:
    """The claim's request a device answers: required with a claim; empty with a pod."""
    field = f"{where}.request"
    if not for_claim:
        if value:
            raise _invalid(
                f"{where}: request {quote_clipped(value)} is set, but a pod's device names none", field
            )
        return ""
    _check(request_name_fault(value), where, field)
    return value


def container_name(value: str, where: str) -> str:
    _check(container_name_fault(value), where, f"{where}.container_name")
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


MAX_GPUS = 64  # more GPUs than a node has; more names than this is not a real request


def gpu_uuids(values: Sequence[str]) -> list[str]:
    """GPUs a request names (KeepFree's), each checked for shape and named once (whether it exists
    is the lifecycle's)."""
    count = len(values)
    require(count <= MAX_GPUS, f"gpu_uuids: {count} GPUs, more than {MAX_GPUS}", field="gpu_uuids")
    for position, value in enumerate(values):
        where = f"gpu_uuids[{position}]"
        gpu_uuid(value, where)
        if value in values[:position]:
            raise _invalid(f"{where}: {quote_clipped(value)} named twice", where)
    return list(values)


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
