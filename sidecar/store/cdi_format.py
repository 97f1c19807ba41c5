"""The CDI spec file's JSON shape and the CDI name rules (pure; ``sidecar.store.cdi`` does the I/O)."""

from __future__ import annotations

import re

import msgspec

# pkg/parser ValidateVendorName / ValidateClassName: a letter first, a letter or digit last,
# [A-Za-z0-9_.-] between. The spec limits the class to 63 characters and the vendor (a DNS
# subdomain) to 253.
_KIND_PART_RE = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")


class DeviceNode(msgspec.Struct, frozen=True, rename="camel", omit_defaults=True):
    path: str
    type: str
    major: int
    minor: int
    file_mode: int | None = None


class ContainerEdits(msgspec.Struct, frozen=True, rename="camel"):
    device_nodes: tuple[DeviceNode, ...]


class Device(msgspec.Struct, frozen=True, rename="camel"):
    name: str
    container_edits: ContainerEdits


class Spec(msgspec.Struct, frozen=True, rename="camel"):
    cdi_version: str
    kind: str
    devices: tuple[Device, ...]


class SpecHeader(msgspec.Struct):
    """What ``list_mig_uuids`` needs from any spec file; other fields are ignored, not rejected."""

    kind: str = ""
    devices: list[DeviceName] = msgspec.field(default_factory=list)


class DeviceName(msgspec.Struct):
    name: str = ""


ENCODER = msgspec.json.Encoder()
HEADER_DECODER = msgspec.json.Decoder(SpecHeader)


def parse_kind(kind: str) -> tuple[str, str]:
    """``vendor/class`` -> (vendor, class), checked by the CDI name rules; ValueError otherwise."""
    vendor, sep, cls = kind.partition("/")
    if (
        not sep
        or not _KIND_PART_RE.fullmatch(vendor)
        or not _KIND_PART_RE.fullmatch(cls)
        or len(vendor) > 253
        or len(cls) > 63
    ):
        raise ValueError(f"not a CDI kind (vendor/class): {kind!r}")
    return vendor, cls


def minimum_cdi_version(kind: str) -> str:
    """The lowest ``cdiVersion`` that covers what this module writes for ``kind``."""
    _, cls = parse_kind(kind)
    return "0.6.0" if "." in cls else "0.3.0"
