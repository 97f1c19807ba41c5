"""The files HAMi's in-process dynamic MIG lifecycle leaves on a node, decoded strictly (pure).

A node that ran HAMi's own lifecycle (its device plugin creating GI/CI itself) holds two kinds of
files this sidecar takes over at Recover (``hami_takeover``). Their formats are HAMi's, not ours;
this module only reads them and derives their names, and never writes one.

Ownership records, in the state directory (HAMi's default is this sidecar's default state
directory), one per instance HAMi created or adopted::

    hami-owned-mig-<hex>.json     <hex> = lowercase sha256 of the MIG UUID string ("MIG-...")
    {"version":1,"migUUID":"MIG-...","parentGPUUUID":"GPU-...","profile":"1g.10gb",
     "placement":{"start":1,"size":1},"gpuInstanceID":2,"computeInstanceID":3}

HAMi writes every field (no omission), ``version`` 1, followed by a newline; its own loader refuses
a file whose name is not the one derived from the MIG UUID inside. Here decoding is stricter than
HAMi's: an unknown or missing field, a value of the wrong type, a version other than 1, a MIG UUID
or GPU UUID of the wrong shape, a zero-size placement, or a name that is not the content's all make
the file undecodable (``HamiRecordError``), and an undecodable file is never converted or removed.
A lenient second reading (``hami_record_hint``) still says which instance such a file points at, so
that instance can stay foreign.

CDI specs, in the CDI directory, one per instance::

    hami-dynamic-mig-mig-<hex>.json   kind "k8s.device-plugin.nvidia.com/dynamic-mig",
                                      one device named "mig-<hex>", annotated
                                      hami.io/mig-uuid, hami.io/parent-gpu-uuid,
                                      hami.io/mig-geometry ("<parent minor>:<GI ID>:<CI ID>")

A file is HAMi's spec only when all of it agrees: the kind, exactly one device, the device name
derived from its ``hami.io/mig-uuid`` annotation, and the file name derived from that device name
(HAMi applies the same test before it deletes one). Anything else in the directory is someone
else's and is never touched.
"""

from __future__ import annotations

import hashlib
import re

import msgspec

from sidecar.model.domain import GPU_UUID_RE
from sidecar.nvml.port import Placement

RECORD_VERSION = 1
RECORD_PREFIX = "hami-owned-"
SPEC_PREFIX = "hami-dynamic-mig-"
SUFFIX = ".json"
SPEC_KIND = "k8s.device-plugin.nvidia.com/dynamic-mig"
MIG_UUID_ANNOTATION = "hami.io/mig-uuid"
PARENT_ANNOTATION = "hami.io/parent-gpu-uuid"
GEOMETRY_ANNOTATION = "hami.io/mig-geometry"

_UINT32_MAX = 2**32 - 1
_DEVICE_NAME_RE = re.compile(r"mig-[0-9a-f]{64}")


def device_name(mig_uuid: str) -> str:
    """HAMi's CDI device name of an instance, ``mig-<sha256 hex of the MIG UUID>``.

    HAMi hashes the UUID so that the name is CDI-safe whatever the UUID holds; the ownership record
    file and the spec file are both named after it. ValueError unless ``mig_uuid`` starts with MIG-."""
    if not isinstance(mig_uuid, str) or not mig_uuid.startswith("MIG-"):
        raise ValueError(f"not a MIG UUID: {mig_uuid!r}")
    return "mig-" + hashlib.sha256(mig_uuid.encode()).hexdigest()


def record_filename(mig_uuid: str) -> str:
    """The file name HAMi gives the ownership record of ``mig_uuid``."""
    return f"{RECORD_PREFIX}{device_name(mig_uuid)}{SUFFIX}"


def spec_filename(mig_uuid: str) -> str:
    """The file name HAMi gives the CDI spec of ``mig_uuid``."""
    return f"{SPEC_PREFIX}{device_name(mig_uuid)}{SUFFIX}"


def spec_device(mig_uuid: str) -> str:
    """The qualified CDI name HAMi handed out for ``mig_uuid`` (what a running container resolves)."""
    return f"{SPEC_KIND}={device_name(mig_uuid)}"


def is_record_filename(filename: str) -> bool:
    """Whether a state-directory entry is HAMi's to judge (HAMi's loader reads exactly these).

    Dot files (a write in progress, HAMi's ``.hami-owned-*`` temp files) are never records."""
    return filename.startswith(RECORD_PREFIX) and filename.endswith(SUFFIX)


def is_spec_filename(filename: str) -> bool:
    """Whether a CDI-directory entry is named like one of HAMi's dynamic MIG specs."""
    return filename.startswith(SPEC_PREFIX) and filename.endswith(SUFFIX)


class HamiPlacement(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    start: int
    size: int


class HamiRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """HAMi's ownership record, version 1, field for field; every field is required."""

    version: int
    mig_uuid: str = msgspec.field(name="migUUID")
    parent_gpu_uuid: str = msgspec.field(name="parentGPUUUID")
    profile: str
    placement: HamiPlacement
    gpu_instance_id: int = msgspec.field(name="gpuInstanceID")
    compute_instance_id: int = msgspec.field(name="computeInstanceID")

    @property
    def filename(self) -> str:
        return record_filename(self.mig_uuid)

    @property
    def where(self) -> Placement:
        return Placement(self.placement.start, self.placement.size)


class HamiRecordError(Exception):
    """A file named like a HAMi ownership record that cannot be trusted as one."""

    def __init__(self, filename: str, why: str) -> None:
        super().__init__(f"HAMi ownership record {filename} is not usable: {why}")
        self.filename = filename
        self.why = why


class _Version(msgspec.Struct):
    version: int


class _Hint(msgspec.Struct, frozen=True, rename="camel"):
    """Whatever a file that does not decode still says about its instance; nothing is required."""

    mig_uuid: str = msgspec.field(default="", name="migUUID")
    parent_gpu_uuid: str = msgspec.field(default="", name="parentGPUUUID")
    placement: HamiPlacement | None = None


class RecordHint(msgspec.Struct, frozen=True):
    """Where an undecodable record points: a MIG UUID, or a GPU and placement, or neither."""

    mig_uuid: str = ""
    gpu_uuid: str = ""
    placement: Placement | None = None


_VERSION_DECODER = msgspec.json.Decoder(_Version)
_RECORD_DECODER = msgspec.json.Decoder(HamiRecord)
_HINT_DECODER = msgspec.json.Decoder(_Hint)


def decode_record(filename: str, data: bytes) -> HamiRecord:
    """The record in the bytes of the state-directory file ``filename``; HamiRecordError on any doubt.

    The version is read first, on its own, so a file of another version says so rather than whatever
    its other fields trip over."""
    try:
        version = _VERSION_DECODER.decode(data).version
    except msgspec.DecodeError as exc:
        raise HamiRecordError(filename, f"no version: {exc}") from exc
    if version != RECORD_VERSION:
        raise HamiRecordError(filename, f"unsupported version {version} (only {RECORD_VERSION} is known)")
    try:
        record = _RECORD_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise HamiRecordError(filename, f"does not decode as version {RECORD_VERSION}: {exc}") from exc
    why = _invalid(record)
    if why is not None:
        raise HamiRecordError(filename, why)
    if filename != record.filename:
        raise HamiRecordError(
            filename, f"the file name does not match its MIG UUID {record.mig_uuid} (want {record.filename})"
        )
    return record


def _invalid(record: HamiRecord) -> str | None:
    if not record.mig_uuid.startswith("MIG-"):
        return f"migUUID {record.mig_uuid!r} is not a MIG UUID"
    if not GPU_UUID_RE.fullmatch(record.parent_gpu_uuid):
        return f"parentGPUUUID {record.parent_gpu_uuid!r} is not a GPU UUID"
    if not record.profile.strip():
        return "the profile is empty"
    numbers = {
        "placement.start": record.placement.start,
        "placement.size": record.placement.size,
        "gpuInstanceID": record.gpu_instance_id,
        "computeInstanceID": record.compute_instance_id,
    }
    for field, value in numbers.items():
        if not 0 <= value <= _UINT32_MAX:
            return f"{field} {value} is out of range"
    if record.placement.size == 0:
        return "the placement is empty (size 0)"
    return None


def hami_record_hint(data: bytes) -> RecordHint:
    """What an undecodable record file still names, read leniently; an empty hint when nothing."""
    try:
        hint = _HINT_DECODER.decode(data)
    except msgspec.DecodeError:
        return RecordHint()
    placement = None
    if hint.placement is not None and hint.placement.start >= 0 and hint.placement.size > 0:
        placement = Placement(hint.placement.start, hint.placement.size)
    return RecordHint(mig_uuid=hint.mig_uuid, gpu_uuid=hint.parent_gpu_uuid, placement=placement)


class HamiSpec(msgspec.Struct, frozen=True):
    """One of HAMi's per-instance CDI specs, recognized as such."""

    filename: str
    mig_uuid: str
    parent_gpu_uuid: str = ""
    geometry: str = ""


class _SpecDevice(msgspec.Struct, frozen=True):
    name: str = ""
    annotations: dict[str, str] = msgspec.field(default_factory=dict)


class _SpecView(msgspec.Struct, frozen=True):
    """The parts of a CDI spec that tell whose it is; every other field is allowed and ignored."""

    kind: str = ""
    devices: list[_SpecDevice] = msgspec.field(default_factory=list)


_SPEC_DECODER = msgspec.json.Decoder(_SpecView)


def recognize_spec(filename: str, data: bytes) -> HamiSpec | None:
    """The HAMi spec in the bytes of the CDI-directory file ``filename``, or None if it is not one."""
    if not is_spec_filename(filename):
        return None
    try:
        spec = _SPEC_DECODER.decode(data)
    except msgspec.DecodeError:
        return None
    if spec.kind != SPEC_KIND or len(spec.devices) != 1:
        return None
    device = spec.devices[0]
    mig_uuid = device.annotations.get(MIG_UUID_ANNOTATION, "")
    if not mig_uuid.startswith("MIG-") or not _DEVICE_NAME_RE.fullmatch(device.name):
        return None
    if device.name != device_name(mig_uuid) or filename != spec_filename(mig_uuid):
        return None
    return HamiSpec(
        filename=filename,
        mig_uuid=mig_uuid,
        parent_gpu_uuid=device.annotations.get(PARENT_ANNOTATION, ""),
        geometry=device.annotations.get(GEOMETRY_ANNOTATION, ""),
    )
