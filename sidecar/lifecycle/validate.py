"""Everything about an Allocate request that can be checked without changing anything."""

from __future__ import annotations

import msgspec

from sidecar.lifecycle.inventory import Inventory
from sidecar.model import placement
from sidecar.model.domain import (
    POD_UID_RE,
    REQUEST_NAME_RE,
    AllocateRequest,
    AllocationKey,
    DeviceRequest,
    Owner,
    PodRef,
    Reservation,
)
from sidecar.model.errors import IllegalPlacement, InvalidRequest, UnknownProfile
from sidecar.nvml.port import GpuInfo, GpuInstanceProfile


class Validated(msgspec.Struct, frozen=True):
    """One device of a request after validation: everything later steps need, read once."""

    device: DeviceRequest
    key: AllocationKey
    owner: Owner
    gpu: GpuInfo
    profile: GpuInstanceProfile


def require_legal(profile: GpuInstanceProfile, res: Reservation) -> None:
    """IllegalPlacement, naming the legal ones, unless ``res.placement`` is one of ``profile``'s."""
    if not placement.is_legal(profile, res.placement):
        legal = ",".join(str(p) for p in profile.placements)
        raise IllegalPlacement(
            f"placement {res.placement} is not legal for {res.profile} on {res.gpu_uuid} (legal: {legal})",
            {
                "gpu_uuid": res.gpu_uuid,
                "profile": res.profile,
                "placement": str(res.placement),
                "legal": legal,
            },
        )


def validate(inventory: Inventory, request: AllocateRequest) -> list[Validated]:
    """Every device of the request, checked before anything changes (InvalidRequest and friends)."""
    claim = request.claim
    if claim is None:
        uid = request.pod.uid
        if not POD_UID_RE.fullmatch(uid):
            raise InvalidRequest(f"pod uid {uid!r} is not a valid UID", {"pod_uid": uid})
        if request.container_index < 0:
            raise InvalidRequest(f"container index {request.container_index} is negative")
        if any(d.request for d in request.devices):
            raise InvalidRequest("a pod's devices name no claim request")
    else:
        if not POD_UID_RE.fullmatch(claim.uid):
            raise InvalidRequest(f"claim uid {claim.uid!r} is not a valid UID", {"claim_uid": claim.uid})
        if request.pod != PodRef("") or request.container_name or request.container_index:
            raise InvalidRequest("a claim's Allocate names no pod and no container")
        bad = next((d.request for d in request.devices if not REQUEST_NAME_RE.fullmatch(d.request)), None)
        if bad is not None:
            raise InvalidRequest(f"{bad!r} is not a DRA request name", {"request": bad})
    if not request.devices:
        raise InvalidRequest("the request names no devices")
    indices = [d.device_index for d in request.devices]
    if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
        raise InvalidRequest(f"device indices {indices} must be distinct and non-negative")
    out: list[Validated] = []
    for d in request.devices:
        res = d.reservation
        gpu = inventory.gpu_info(res.gpu_uuid)
        try:
            profile = inventory.resolve_profile(res.gpu_uuid, res.profile)
        except UnknownProfile:
            # With MIG disabled a GPU may list no profile at all: say MIG_DISABLED then. Otherwise
            # the mode is read once, under the GPU lock, and only by a device that needs hardware.
            inventory.require_mig_enabled(res.gpu_uuid)
            raise
        require_legal(profile, res)
        owner = request.owner(d)
        out.append(Validated(device=d, key=owner.key, owner=owner, gpu=gpu, profile=profile))
    clash = placement.first_overlap([(v.gpu.uuid, v.device.reservation.placement) for v in out])
    if clash is not None:
        a, b = (out[i].device for i in clash)
        raise InvalidRequest(
            f"devices {a.device_index} and {b.device_index} overlap on {a.reservation.gpu_uuid}"
            f" ({a.reservation.placement} and {b.reservation.placement})"
        )
    return out
