"""Everything about an Allocate request that can be checked without changing anything."""

from __future__ import annotations

import msgspec

from sidecar.lifecycle.inventory import Inventory
from sidecar.model import placement
from sidecar.model.domain import POD_UID_RE, AllocateRequest, AllocationKey, DeviceRequest, Owner
from sidecar.model.errors import IllegalPlacement, InvalidRequest, UnknownProfile
from sidecar.nvml.port import GpuInfo, GpuInstanceProfile


class Validated(msgspec.Struct, frozen=True):
    """One device of a request after validation: everything later steps need, read once."""

    device: DeviceRequest
    key: AllocationKey
    owner: Owner
    gpu: GpuInfo
    profile: GpuInstanceProfile


def validate(inventory: Inventory, request: AllocateRequest) -> list[Validated]:
    """Every device of the request, checked before anything changes (InvalidRequest and friends)."""
    pod = request.pod
    if not POD_UID_RE.fullmatch(pod.uid):
        raise InvalidRequest(f"pod uid {pod.uid!r} is not a valid UID", {"pod_uid": pod.uid})
    if request.container_index < 0:
        raise InvalidRequest(f"container index {request.container_index} is negative")
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
        if not placement.is_legal(profile, res.placement):
            legal = ",".join(str(p) for p in profile.placements)
            raise IllegalPlacement(
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
        out.append(Validated(device=d, key=owner.key, owner=owner, gpu=gpu, profile=profile))
    clash = placement.first_overlap([(v.gpu.uuid, v.device.reservation.placement) for v in out])
    if clash is not None:
        a, b = (out[i].device for i in clash)
        raise InvalidRequest(
            f"devices {a.device_index} and {b.device_index} overlap on {a.reservation.gpu_uuid}"
            f" ({a.reservation.placement} and {b.reservation.placement})"
        )
    return out
