"""The sizes the edge bounds: the largest request it accepts, and how large an error may grow.

The largest request is computed from what ``decode`` lets through (and the name limits of
``sidecar.model.names``).

Every field of every request is bounded by ``decode`` (name lengths in bytes, counts of repeated
fields, integer widths), so the largest valid request of each RPC is a fixed message: this module
builds it and measures it. The server's receive limit is set to the largest of them
(``MAX_REQUEST_BYTES``), so any valid request fits and a body above it is refused by the transport
before it is read into memory: RESOURCE_EXHAUSTED, with gRPC's own message and no ErrorInfo (the
sidecar's handlers never see it). Below the limit, a request that breaks a bound is the sidecar's
INVALID_REQUEST as usual.
"""

from __future__ import annotations

from google.protobuf.message import Message
from hami.migsidecar.v1 import migsidecar_pb2 as pb

from sidecar.edge import decode
from sidecar.model import names

_U32 = 2**32 - 1
_U64 = 2**64 - 1
_GPU = "GPU-" + "f" * 8 + "-ffff-ffff-ffff-" + "f" * 12
_MIG = "MIG-" + "f" * 8 + "-ffff-ffff-ffff-" + "f" * 12


def _placement() -> pb.Placement:
    return pb.Placement(start=_U32, size=_U32)


def _pod() -> pb.PodRef:
    return pb.PodRef(
        uid="u" * names.MAX_POD_UID_BYTES,
        namespace="n" * names.MAX_NAMESPACE_BYTES,
        name="p" * names.MAX_POD_NAME_BYTES,
    )


def _active() -> pb.ActiveAllocation:
    return pb.ActiveAllocation(
        pod=_pod(),
        container_name="c" * names.MAX_CONTAINER_NAME_BYTES,
        container_index=_U32,
        device_index=_U32,
        gpu_uuid=_GPU,
        profile="g" * decode.MAX_PROFILE_BYTES,
        placement=_placement(),
        mig_uuid=_MIG,
        gpu_instance_id=_U32,
        compute_instance_id=_U32,
    )


def largest_requests() -> dict[str, Message]:
    """The largest valid request of each RPC whose request has a repeated or unbounded field."""
    device = pb.DeviceRequest(
        device_index=_U32, gpu_uuid=_GPU, profile="g" * decode.MAX_PROFILE_BYTES, placement=_placement()
    )
    active = [_active() for _ in range(decode.MAX_ACTIVE)]
    for_pod = pb.AllocateRequest(
        pod=_pod(),
        container_name="c" * names.MAX_CONTAINER_NAME_BYTES,
        container_index=_U32,
        devices=[device] * decode.MAX_DEVICES,
    )
    # A claim's names no container, and each of its devices the longest request name.
    label = "r" * 63
    for_claim = pb.AllocateRequest(
        claim=pb.ClaimRef(
            uid="u" * names.MAX_POD_UID_BYTES,
            namespace="n" * names.MAX_NAMESPACE_BYTES,
            name="c" * names.MAX_CLAIM_NAME_BYTES,
        ),
        devices=[pb.DeviceRequest(request=f"{label}/{label}")] * decode.MAX_DEVICES,
    )
    for message in for_claim.devices:
        message.MergeFrom(device)
    return {
        "Allocate": max(for_pod, for_claim, key=lambda m: int(m.ByteSize())),
        "Recover": pb.RecoverRequest(active=active),
        "SyncActive": pb.SyncActiveRequest(generation=_U64, active=active),
        "DiscoverProfiles": pb.DiscoverProfilesRequest(
            gpu_uuid=_GPU, allowed_profiles=["g" * decode.MAX_PROFILE_BYTES] * decode.MAX_ALLOWED_PROFILES
        ),
        "KeepFree": pb.KeepFreeRequest(
            next=[
                pb.NextPlacement(
                    gpu_uuid=_GPU,
                    profile="g" * decode.MAX_PROFILE_BYTES,
                    placement=pb.Placement(start=_U32, size=_U32),
                )
            ]
            * decode.MAX_NEXT_PLACEMENTS,
            gpu_uuids=[_GPU] * decode.MAX_GPUS,
        ),
        "ReclaimIdle": pb.ReclaimIdleRequest(
            gpu_uuid=_GPU, mig_uuids=[_MIG] * decode.MAX_MIG_UUIDS, force=True
        ),
    }


def _largest() -> int:
    biggest = max(int(m.ByteSize()) for m in largest_requests().values())
    return -(-biggest // 1024) * 1024  # rounded up to whole KiB


MAX_REQUEST_BYTES = _largest()

# An error's message and ErrorInfo metadata together stay under about 1 KB (see ``error_status``).
MAX_MESSAGE_BYTES = 448
MAX_METADATA_KEY_BYTES = 32
MAX_METADATA_VALUE_BYTES = 128
MAX_METADATA_BYTES = 448


def truncate_utf8(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes (cut at a character boundary, marked with "...")."""
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "..."


def bounded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """The ErrorInfo metadata of an error, each value cut and the whole within ``MAX_METADATA_BYTES``:
    the entries that no longer fit are left out (the message and the log still say everything)."""
    kept: dict[str, str] = {}
    used = 0
    for key, value in metadata.items():
        entry = {truncate_utf8(key, MAX_METADATA_KEY_BYTES): truncate_utf8(value, MAX_METADATA_VALUE_BYTES)}
        size = sum(len(k.encode()) + len(v.encode()) for k, v in entry.items())
        if used + size > MAX_METADATA_BYTES:
            break
        kept.update(entry)
        used += size
    return kept


__all__ = ["MAX_MESSAGE_BYTES", "MAX_REQUEST_BYTES", "bounded_metadata", "largest_requests", "truncate_utf8"]
