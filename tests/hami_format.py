"""HAMi's files, byte for byte as HAMi writes them, for the takeover tests.

HAMi's ownership record is Go's ``json.Marshal`` of its struct (field order as declared, no spaces,
every field present) plus a newline; its CDI spec is the NVIDIA toolkit's spec for the parent GPU
with the device renamed and annotated. These writers produce exactly that shape from the values,
so a test names an instance and gets the bytes HAMi would have left on the node.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def hami_name(mig_uuid: str) -> str:
    return "mig-" + hashlib.sha256(mig_uuid.encode()).hexdigest()


def record_bytes(  # noqa: PLR0917 - the record's own seven fields, in its order
    mig_uuid: str,
    parent: str,
    profile: str,
    start: int,
    size: int,
    gi_id: int,
    ci_id: int,
    *,
    version: int = 1,
) -> bytes:
    return (
        f'{{"version":{version},"migUUID":"{mig_uuid}","parentGPUUUID":"{parent}","profile":"{profile}",'
        f'"placement":{{"start":{start},"size":{size}}},"gpuInstanceID":{gi_id},"computeInstanceID":{ci_id}}}\n'
    ).encode()


def record_filename(mig_uuid: str) -> str:
    return f"hami-owned-{hami_name(mig_uuid)}.json"


def spec_filename(mig_uuid: str) -> str:
    return f"hami-dynamic-mig-{hami_name(mig_uuid)}.json"


def spec_bytes(mig_uuid: str, parent: str, minor: int, gi_id: int, ci_id: int, *, kind: str = "") -> bytes:
    spec = {
        "cdiVersion": "0.5.0",
        "kind": kind or "k8s.device-plugin.nvidia.com/dynamic-mig",
        "devices": [
            {
                "name": hami_name(mig_uuid),
                "annotations": {
                    "hami.io/mig-geometry": f"{minor}:{gi_id}:{ci_id}",
                    "hami.io/mig-uuid": mig_uuid,
                    "hami.io/parent-gpu-uuid": parent,
                },
                "containerEdits": {
                    "deviceNodes": [
                        {"path": f"/dev/nvidia{minor}", "type": "c", "major": 195, "minor": minor},
                        {
                            "path": "/dev/nvidia-caps/nvidia-cap42",
                            "type": "c",
                            "major": 238,
                            "minor": 42,
                            "fileMode": 438,
                        },
                        {
                            "path": "/dev/nvidia-caps/nvidia-cap43",
                            "type": "c",
                            "major": 238,
                            "minor": 43,
                            "fileMode": 438,
                        },
                    ]
                },
            }
        ],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}],
        },
    }
    return json.dumps(spec, separators=(",", ":")).encode()


def write_record(directory: Path, mig_uuid: str, *args: int | str, version: int = 1) -> Path:
    """Write HAMi's record for ``mig_uuid`` (parent, profile, start, size, GI ID, CI ID) as HAMi does."""
    path = directory / record_filename(mig_uuid)
    parent, profile, start, size, gi_id, ci_id = args
    path.write_bytes(
        record_bytes(
            mig_uuid,
            str(parent),
            str(profile),
            int(start),
            int(size),
            int(gi_id),
            int(ci_id),
            version=version,
        )
    )
    path.chmod(0o600)
    return path


def write_spec(directory: Path, mig_uuid: str, parent: str, minor: int, gi_id: int, ci_id: int) -> Path:  # noqa: PLR0917
    path = directory / spec_filename(mig_uuid)
    path.write_bytes(spec_bytes(mig_uuid, parent, minor, gi_id, ci_id))
    path.chmod(0o644)
    return path
