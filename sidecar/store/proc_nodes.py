"""The device numbers of a MIG instance's nodes, as the driver publishes them under ``<proc>``.

Majors come from the "Character devices:" section of ``<proc>/devices``; a GPU or compute instance's
capability minor and mode from its ``access`` file under
``<proc>/driver/nvidia/capabilities/gpu<minor>/mig/``. Both are read at every spec render, never
cached: the caps files come and go with the instances, and a driver reload may renumber majors.
"""

from __future__ import annotations

from pathlib import Path


def read_char_majors(proc_root: Path) -> dict[str, int]:
    """Driver name -> major from the "Character devices:" section of ``<proc>/devices``.

    The block section reuses numbers for other drivers, so it is cut off."""
    majors: dict[str, int] = {}
    in_char = False
    for line in (proc_root / "devices").read_text().splitlines():
        stripped = line.strip()
        if stripped.endswith(":"):
            in_char = stripped == "Character devices:"
            continue
        fields = stripped.split()
        if in_char and len(fields) == 2 and fields[0].isdigit():
            majors.setdefault(fields[1], int(fields[0]))
    return majors


def read_access_file(path: Path) -> tuple[int, int]:
    """(DeviceFileMinor, DeviceFileMode) of a MIG capability ``access`` file; both decimal."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip()
    try:
        return int(values["DeviceFileMinor"]), int(values["DeviceFileMode"])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path} has no DeviceFileMinor/DeviceFileMode: {exc}") from exc
