"""Per-model MIG profile and placement tables, and the numbering rules real drivers follow.

Pure data and lookups: the simulated library builds its GPUs from these tables, the probe diffs a
real GPU against them, and tests pin them to the published hardware facts. The types and NVML's
constants live in ``profile_types``; the tables, each row with its source, in ``tables``.
"""

from __future__ import annotations

import math

from sidecar.nvml.profile_types import *  # noqa: F403 - this module is the one place callers import from
from sidecar.nvml.profile_types import CiProfile, GiProfile, GpuProduct
from sidecar.nvml.tables.ampere import A30, A100_40GB, A100_80GB
from sidecar.nvml.tables.blackwell import B200, RTX_PRO_6000
from sidecar.nvml.tables.hopper import GH200_96GB, GH200_144GB, H20, H100_80GB, H100_94GB, H200_141GB

MODELS: dict[str, GpuProduct] = {
    m.key: m
    for m in (
        A100_40GB,
        A100_80GB,
        A30,
        H100_80GB,
        H100_94GB,
        H200_141GB,
        H20,
        GH200_96GB,
        GH200_144GB,
        B200,
        RTX_PRO_6000,
    )
}


def model(key: str) -> GpuProduct:
    """The model for a ``--sim-gpus`` key; KeyError lists the known ones."""
    try:
        return MODELS[key.lower()]
    except KeyError:
        raise KeyError(f"unknown GPU model {key!r}; known: {', '.join(MODELS)}") from None


def model_by_name(name: str) -> GpuProduct | None:
    return next((m for m in MODELS.values() if m.name == name), None)


def parse_gpus(spec: str) -> list[tuple[str, int]]:
    """``h100-80gb:2,a100-40gb`` -> [("h100-80gb", 2), ("a100-40gb", 1)]; ValueError on bad syntax/model."""
    result: list[tuple[str, int]] = []
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            continue
        key, _, count = part.partition(":")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"bad GPU count in {part!r}: want MODEL[:COUNT]") from None
        if n < 1:
            raise ValueError(f"GPU count must be positive in {part!r}")
        try:
            result.append((model(key).key, n))
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
    if not result:
        raise ValueError("no GPUs given: want MODEL[:COUNT],... e.g. h100-80gb:2")
    return result


def gpu_instance_id(memory_slices: int, start: int, size: int) -> int:
    """The GI ID a driver gives a GI at ``start:size``: a binary-heap numbering of the slice axis.

    Never documented, but every real listing fits it: on 8-slice GPUs 0:8 -> 0; 0:4 -> 1, 4:4 -> 2;
    0:2 -> 3 … 6:2 -> 6; n:1 -> 7 + n (A30's 4-slice axis: 0:4 -> 0, n:2 -> 1 + n/2, n:1 -> 3 + n).
    The service itself always reads the ID from NVML; only the simulator derives it.
    """
    return memory_slices // size - 1 + start // size


def gi_access_minor(gpu_minor: int, gi_id: int) -> int:
    """``/dev/nvidia-caps/nvidia-cap<N>`` minor of a GI's access capability (fixed by the driver)."""
    return 3 + 135 * gpu_minor + 9 * gi_id


def ci_access_minor(gpu_minor: int, gi_id: int, ci_id: int) -> int:
    """Minor of a CI's access capability: the GI's minor + 1 + CI ID."""
    return 4 + 135 * gpu_minor + 9 * gi_id + ci_id


def profile_gb(memory_mb: int, total_memory_mb: int) -> int:
    """The ``<N>gb`` of a profile name: the memory fraction rounded up to eighths, times total GiB.

    This is how NVIDIA's tooling names MIG devices; a table whose names disagree with its own memory
    sizes has a typo. Rounds half away from zero, as Go's ``math.Round`` does.
    """
    eighths = math.ceil(memory_mb * 8 / total_memory_mb) / 8
    return math.floor(eighths * math.ceil(total_memory_mb / 1024) + 0.5)


def ci_profile_name(gi: GiProfile, ci: CiProfile) -> str:
    """``1c.3g.40gb`` for a partial CI, ``3g.40gb`` for the full-size one."""
    return gi.name if ci.slice_count == gi.slice_count else f"{ci.slice_count}c.{gi.name}"
