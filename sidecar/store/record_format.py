"""The on-disk format of ownership records and of the ``generation`` file (pure: bytes in, bytes out).

The envelope ``{"version":1,"checksum":"sha256:<hex>","record":{...}}`` and the rules for reading it
are described in ``sidecar.store.records``, which does the I/O and re-exports these names.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from sidecar.model.names import owner_fault
from sidecar.model.ownership import OwnershipRecord, record_name

RECORD_VERSION = 1
GENERATION_FILE = "generation"
CHECKSUM_PREFIX = "sha256:"

MAX_GENERATION = 2**63 - 1
"""The largest generation a file may hold: a stored value above it is corrupt. Half of uint64 (and
int64's maximum, for a Go reader), so the lifecycle's increments and ceiling blocks past any stored
value still fit the contract's uint64 and never overflow it."""
MAX_XID = 2**64 - 1
"""The largest Xid a record may hold: NVML's event data (``eventData``) is an unsigned 64-bit value."""


class RecordError(Exception):
    """Base of record read errors."""


class RecordNotFound(RecordError):  # noqa: N818 - the contract's name; "not found" reads better than "Error"
    """No file for that record name: start empty, this is not a failure."""


class CorruptRecord(RecordError):  # noqa: N818 - the contract's name
    """A record file exists but cannot be trusted: truncated, bad checksum, unknown field, wrong version."""

    def __init__(self, name: str, path: Path, why: str) -> None:
        super().__init__(f"ownership record {path} is corrupt: {why}")
        self.name = name
        self.path = path
        self.why = why


class _Header(msgspec.Struct):
    """Only the version, decoded leniently first, so a newer format reports "unsupported version"
    rather than whatever its other fields happen to trip over."""

    version: int


class _EnvelopeV1(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    checksum: str
    record: msgspec.Raw  # the exact stored bytes of the record: what the checksum covers


class GenerationCeiling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The payload of the ``generation`` file: the highest generation that may have been handed out."""

    ceiling: int


_HEADER_DECODER = msgspec.json.Decoder(_Header)
_ENVELOPE_DECODER = msgspec.json.Decoder(_EnvelopeV1)
_RECORD_DECODER = msgspec.json.Decoder(OwnershipRecord)  # strict: no int<->str coercion
_CEILING_DECODER = msgspec.json.Decoder(GenerationCeiling)
_ENCODER = msgspec.json.Encoder()


def _checksum(data: bytes) -> str:
    return CHECKSUM_PREFIX + hashlib.sha256(data).hexdigest()


def encode_record(record: OwnershipRecord) -> bytes:
    """The exact file content for ``record``: the envelope around the record bytes, newline-terminated.

    Constructing a Struct does not check field types, so the encoded record is decoded again here;
    a record that would not read back (a str where an int belongs, a bad GPU UUID) raises ValueError
    instead of reaching the disk."""
    raw = _ENCODER.encode(record)
    try:
        _RECORD_DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        raise ValueError(f"ownership record would not read back: {exc}") from exc
    record_name(record.gpu_uuid, record.placement)
    why = _out_of_range(record)
    if why:
        raise ValueError(f"ownership record would not read back: {why}")
    return _envelope(raw)


def encode_generation(ceiling: int) -> bytes:
    """The exact content of the ``generation`` file for ``ceiling`` (a non-negative int)."""
    if type(ceiling) is not int or not 0 <= ceiling <= MAX_GENERATION:
        raise ValueError(f"not a generation ceiling: {ceiling!r}")
    return _envelope(_ENCODER.encode(GenerationCeiling(ceiling=ceiling)))


def decode_generation(path: Path, data: bytes) -> int:
    """The ceiling stored in the bytes of the ``generation`` file; CorruptRecord on any doubt."""
    raw = _verified_payload(GENERATION_FILE, path, data)
    try:
        ceiling = _CEILING_DECODER.decode(raw).ceiling
    except msgspec.DecodeError as exc:
        raise CorruptRecord(GENERATION_FILE, path, f"generation ceiling does not decode: {exc}") from exc
    if not 0 <= ceiling <= MAX_GENERATION:
        raise CorruptRecord(
            GENERATION_FILE, path, f"generation ceiling {ceiling} is out of range 0..{MAX_GENERATION}"
        )
    return ceiling


_ENVELOPE_HEAD = b'{"version":%d,"checksum":"' % RECORD_VERSION


def _envelope(payload: bytes) -> bytes:
    """The file content around the exact ``payload`` bytes: version, checksum over them, newline."""
    return b'%s%s","record":%s}\n' % (_ENVELOPE_HEAD, _checksum(payload).encode(), payload)


def _verified_payload(name: str, path: Path, data: bytes) -> bytes:
    """Decode the envelope of a file and verify its checksum; the exact payload bytes or CorruptRecord."""
    try:
        header = _HEADER_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(name, path, f"not a record envelope: {exc}") from exc
    if header.version != RECORD_VERSION:
        raise CorruptRecord(
            name, path, f"unsupported version {header.version} (this build reads {RECORD_VERSION})"
        )
    try:
        envelope = _ENVELOPE_DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(name, path, f"not a version {RECORD_VERSION} envelope: {exc}") from exc
    raw = bytes(envelope.record)
    actual = _checksum(raw)
    if envelope.checksum != actual:
        raise CorruptRecord(name, path, f"checksum mismatch: stored {envelope.checksum}, computed {actual}")
    return raw


def decode_record(name: str, path: Path, data: bytes) -> OwnershipRecord:
    """Decode and verify the bytes of the file ``path`` named ``name``; CorruptRecord on any doubt."""
    raw = _verified_payload(name, path, data)
    try:
        record = _RECORD_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise CorruptRecord(name, path, f"record does not decode: {exc}") from exc
    try:
        own_name = record.name
    except ValueError as exc:
        raise CorruptRecord(name, path, f"record names no valid instance: {exc}") from exc
    if own_name != name:
        raise CorruptRecord(name, path, f"file name does not match the record (it names {own_name})")
    why = _out_of_range(record)
    if why:
        raise CorruptRecord(name, path, why)
    return record


def _out_of_range(record: OwnershipRecord) -> str:
    """Why a value of ``record`` is out of its range ("" when none is): a generation outside
    ``0..MAX_GENERATION`` would overflow the contract's uint64 once the lifecycle counts past it;
    an Xid outside ``0..MAX_XID`` is none NVML's 64-bit event data can carry; an owner that no request
    could have named (``names.owner_fault``: neither a pod's nor a claim's, or a name the edge refuses)
    could be released by no call."""
    for field in ("activated_generation", "idled_generation"):
        value = getattr(record, field)
        if not 0 <= value <= MAX_GENERATION:
            return f"{field} {value} is out of range 0..{MAX_GENERATION}"
    if not 0 <= record.xid <= MAX_XID:
        return f"xid {record.xid} is out of range 0..{MAX_XID}"
    if record.owner is not None and (why := owner_fault(record.owner)):
        return f"owner: {why}"
    return ""
