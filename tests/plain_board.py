"""A small H100-like profile table for the plain-value tests of the pure planners."""

from __future__ import annotations

from sidecar.nvml.port import GpuInstanceProfile, Placement

# name -> (GI profile ID, full-size CI profile ID, placement size, placement starts)
TABLE = {
    "1g.10gb": (19, 0, 1, range(7)),
    "3g.40gb": (9, 2, 4, (0, 4)),
    "7g.80gb": (0, 4, 8, (0,)),
}


def profiles(*names: str) -> tuple[GpuInstanceProfile, ...]:
    """The profiles ``names`` of ``TABLE`` (all of them without names), indexed in that order."""
    chosen = names or tuple(TABLE)
    return tuple(
        GpuInstanceProfile(
            index=i,
            id=TABLE[name][0],
            name=name,
            slice_count=TABLE[name][2],
            instance_count=len(TABLE[name][3]),
            memory_mb=10240 * TABLE[name][2],
            multiprocessor_count=16 * TABLE[name][2],
            placements=tuple(Placement(s, TABLE[name][2]) for s in TABLE[name][3]),
            ci_profile_id=TABLE[name][1],
        )
        for i, name in enumerate(chosen)
    )
