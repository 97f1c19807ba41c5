"""Per-model MIG profile and placement tables, and the numbering rules real drivers follow.

Pure data and lookups: the simulated library builds its GPUs from these tables, and tests pin them to
the published hardware facts (``nvidia-smi mig -lgip`` / ``-lgipp`` listings and the MIG user guide).

Three numbers name a GPU instance profile and they are easy to confuse:

* the profile *index*, the ``NVML_GPU_INSTANCE_PROFILE_*`` constant passed to
  ``nvmlDeviceGetGpuInstanceProfileInfo`` (0x0 = 1 slice, 0x7 = 1 slice REV1 "+me", 0x9 = 1 slice REV2
  "double memory" …);
* the profile *ID* (``info.id``, what ``nvidia-smi`` prints), which every other call takes and which
  differs per GPU family (1g is 19 on A100/H100 but 14 on A30);
* the placement *size*, counted in memory slices, not compute slices (a 3g instance spans 4 of 8).

Compute-instance profiles use the same number for index and ID. Memory sizes and SM counts vary a
little between drivers; the values here are taken from real listings where one was found, and
otherwise chosen so that the profile names follow from them by the naming rule NVIDIA's own
tooling uses (see ``profile_gb``).
"""

from __future__ import annotations

import math

import msgspec

# NVML_GPU_INSTANCE_PROFILE_* index constants (nvml.h).
GI_PROFILE_1_SLICE = 0x0
GI_PROFILE_2_SLICE = 0x1
GI_PROFILE_3_SLICE = 0x2
GI_PROFILE_4_SLICE = 0x3
GI_PROFILE_7_SLICE = 0x4
GI_PROFILE_1_SLICE_REV1 = 0x7  # "+me": one slice with all media engines
GI_PROFILE_2_SLICE_REV1 = 0x8
GI_PROFILE_1_SLICE_REV2 = 0x9  # one compute slice with two memory slices ("1g.10gb" on A100-40GB)
GI_PROFILE_COUNT = 0x12

# NVML_COMPUTE_INSTANCE_PROFILE_* constants; for compute instances index and ID are the same number.
# Not in slice order: 6 and 8 slices came later and took the next free numbers.
CI_PROFILE_1_SLICE = 0x0
CI_PROFILE_2_SLICE = 0x1
CI_PROFILE_3_SLICE = 0x2
CI_PROFILE_4_SLICE = 0x3
CI_PROFILE_7_SLICE = 0x4
CI_PROFILE_8_SLICE = 0x5
CI_PROFILE_6_SLICE = 0x6
CI_PROFILE_COUNT = 0x9

# The full-size CI inside a GI of g compute slices. Not index 0: index 0 is the 1-slice CI, and a
# controller that used it as "the default CI" would carve a 1c CI out of a bigger GI.
FULL_CI_PROFILE_BY_SLICES: dict[int, int] = {
    1: CI_PROFILE_1_SLICE,
    2: CI_PROFILE_2_SLICE,
    3: CI_PROFILE_3_SLICE,
    4: CI_PROFILE_4_SLICE,
    6: CI_PROFILE_6_SLICE,
    7: CI_PROFILE_7_SLICE,
    8: CI_PROFILE_8_SLICE,
}


def full_ci_profile_id(slice_count: int) -> int | None:
    """The full-size CI profile of a GI with ``slice_count`` compute slices; None when unknown.

    There is deliberately no default: a guess would be profile 0, a 1-slice CI inside a bigger GI."""
    return FULL_CI_PROFILE_BY_SLICES.get(slice_count)


class CiProfile(msgspec.Struct, frozen=True):
    """A compute instance profile inside a GI of a given size (index = ID)."""

    id: int
    slice_count: int
    instance_count: int
    starts: tuple[int, ...]  # placement starts in compute slices; size = slice_count


# CI profiles by the compute slice count of their GI (MIG user guide, real ``-lcip`` listings). A 4g
# GI offers 1c, 2c and 4c (no 3c); a 7g GI offers 1c, 2c, 3c, 4c and 7c.
CI_PROFILES_BY_GI_SLICES: dict[int, tuple[CiProfile, ...]] = {
    1: (CiProfile(CI_PROFILE_1_SLICE, 1, 1, (0,)),),
    2: (CiProfile(CI_PROFILE_1_SLICE, 1, 2, (0, 1)), CiProfile(CI_PROFILE_2_SLICE, 2, 1, (0,))),
    3: (
        CiProfile(CI_PROFILE_1_SLICE, 1, 3, (0, 1, 2)),
        CiProfile(CI_PROFILE_2_SLICE, 2, 1, (0,)),
        CiProfile(CI_PROFILE_3_SLICE, 3, 1, (0,)),
    ),
    4: (
        CiProfile(CI_PROFILE_1_SLICE, 1, 4, (0, 1, 2, 3)),
        CiProfile(CI_PROFILE_2_SLICE, 2, 2, (0, 2)),
        CiProfile(CI_PROFILE_4_SLICE, 4, 1, (0,)),
    ),
    7: (
        CiProfile(CI_PROFILE_1_SLICE, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
        CiProfile(CI_PROFILE_2_SLICE, 2, 3, (0, 2, 4)),
        CiProfile(CI_PROFILE_3_SLICE, 3, 2, (0, 4)),
        CiProfile(CI_PROFILE_4_SLICE, 4, 1, (0,)),
        CiProfile(CI_PROFILE_7_SLICE, 7, 1, (0,)),
    ),
}


class GiProfile(msgspec.Struct, frozen=True):
    """One GPU instance profile of a model, as ``-lgip``/``-lgipp`` describe it."""

    index: int
    id: int
    name: str  # without the "MIG " prefix NVML puts in the v2 struct
    slice_count: int  # compute slices
    size: int  # memory slices per placement
    instance_count: int
    starts: tuple[int, ...]  # legal placement starts; placements never depend on occupancy
    memory_mb: int
    multiprocessor_count: int
    copy_engines: int = 1
    decoders: int = 0
    encoders: int = 0
    jpegs: int = 0
    ofas: int = 0

    @property
    def ci_profiles(self) -> tuple[CiProfile, ...]:
        return CI_PROFILES_BY_GI_SLICES[self.slice_count]

    @property
    def full_ci_profile_id(self) -> int:
        return FULL_CI_PROFILE_BY_SLICES[self.slice_count]


class GpuModel(msgspec.Struct, frozen=True):
    key: str  # what --sim-gpus and ``sim init`` take, e.g. "h100-80gb"
    name: str  # nvmlDeviceGetName
    memory_mb: int  # total memory, MiB
    multiprocessor_count: int
    memory_slices: int  # the placement axis: 8, or 4 on A30
    max_mig_devices: int  # nvmlDeviceGetMaxMigDeviceCount with MIG enabled
    resetless_mig_toggle: bool  # Hopper switches MIG mode at once; Ampere needs a GPU reset
    profiles: tuple[GiProfile, ...]

    def profile_by_index(self, index: int) -> GiProfile | None:
        return next((p for p in self.profiles if p.index == index), None)

    def profile_by_id(self, profile_id: int) -> GiProfile | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    def profile_by_name(self, name: str) -> GiProfile | None:
        bare = name.removeprefix("MIG ")
        return next((p for p in self.profiles if p.name == bare), None)


_ALL_1G = (0, 1, 2, 3, 4, 5, 6)


def _gh100(key: str, name: str, memory_mb: int, names: tuple[str, ...], mems: tuple[int, ...]) -> GpuModel:
    """Hopper GH100 boards share indices, IDs, placements and SMs; only names and memory differ."""
    g1, g1me, g1x2, g2, g3, g4, g7 = names
    m1, m2, m4, m8 = mems
    return GpuModel(
        key=key,
        name=name,
        memory_mb=memory_mb,
        multiprocessor_count=132,
        memory_slices=8,
        max_mig_devices=7,
        resetless_mig_toggle=True,
        profiles=(
            GiProfile(GI_PROFILE_1_SLICE, 19, g1, 1, 1, 7, _ALL_1G, m1, 16, 1, 1, 0, 1, 0),
            GiProfile(GI_PROFILE_1_SLICE_REV1, 20, g1me, 1, 1, 1, _ALL_1G, m1, 16, 1, 1, 0, 1, 1),
            GiProfile(GI_PROFILE_1_SLICE_REV2, 15, g1x2, 1, 2, 4, (0, 2, 4, 6), m2, 26, 1, 1, 0, 1, 0),
            GiProfile(GI_PROFILE_2_SLICE, 14, g2, 2, 2, 3, (0, 2, 4), m2, 32, 2, 2, 0, 2, 0),
            GiProfile(GI_PROFILE_3_SLICE, 9, g3, 3, 4, 2, (0, 4), m4, 60, 3, 3, 0, 3, 0),
            GiProfile(GI_PROFILE_4_SLICE, 5, g4, 4, 4, 1, (0,), m4, 64, 4, 4, 0, 4, 0),
            GiProfile(GI_PROFILE_7_SLICE, 0, g7, 7, 8, 1, (0,), m8, 132, 8, 7, 0, 7, 1),
        ),
    )


def _ga100(key: str, name: str, memory_mb: int, names: tuple[str, ...], mems: tuple[int, ...]) -> GpuModel:
    """Ampere GA100 boards (40 GB and 80 GB) share everything but names and memory."""
    g1, g1me, g1x2, g2, g3, g4, g7 = names
    m1, m2, m4, m8 = mems
    return GpuModel(
        key=key,
        name=name,
        memory_mb=memory_mb,
        multiprocessor_count=108,
        memory_slices=8,
        max_mig_devices=7,
        resetless_mig_toggle=False,
        profiles=(
            GiProfile(GI_PROFILE_1_SLICE, 19, g1, 1, 1, 7, _ALL_1G, m1, 14, 1, 0, 0, 0, 0),
            GiProfile(GI_PROFILE_1_SLICE_REV1, 20, g1me, 1, 1, 1, _ALL_1G, m1, 14, 1, 1, 0, 1, 1),
            GiProfile(GI_PROFILE_1_SLICE_REV2, 15, g1x2, 1, 2, 4, (0, 2, 4, 6), m2, 14, 1, 1, 0, 0, 0),
            GiProfile(GI_PROFILE_2_SLICE, 14, g2, 2, 2, 3, (0, 2, 4), m2, 28, 2, 1, 0, 0, 0),
            GiProfile(GI_PROFILE_3_SLICE, 9, g3, 3, 4, 2, (0, 4), m4, 42, 3, 2, 0, 0, 0),
            GiProfile(GI_PROFILE_4_SLICE, 5, g4, 4, 4, 1, (0,), m4, 56, 4, 2, 0, 0, 0),
            GiProfile(GI_PROFILE_7_SLICE, 0, g7, 7, 8, 1, (0,), m8, 98, 7, 5, 0, 1, 1),
        ),
    )


A100_40GB = _ga100(
    "a100-40gb",
    "NVIDIA A100-SXM4-40GB",
    40960,
    ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    (4864, 9856, 19968, 40192),
)
A100_80GB = _ga100(
    "a100-80gb",
    "NVIDIA A100-SXM4-80GB",
    81920,
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9856, 19968, 40192, 80384),
)
# A30 has 4 memory slices and 4 compute slices, its own IDs (1g = 14, 2g = 5, 4g = 0), a 2g "+me"
# profile and no double-memory 1g (real -lgip/-lgipp, driver 535).
A30 = GpuModel(
    key="a30",
    name="NVIDIA A30",
    memory_mb=24576,
    multiprocessor_count=56,
    memory_slices=4,
    max_mig_devices=4,
    resetless_mig_toggle=False,
    profiles=(
        GiProfile(GI_PROFILE_1_SLICE, 14, "1g.6gb", 1, 1, 4, (0, 1, 2, 3), 5836, 14, 1, 0, 0, 0, 0),
        GiProfile(GI_PROFILE_1_SLICE_REV1, 21, "1g.6gb+me", 1, 1, 1, (0, 1, 2, 3), 5836, 14, 1, 1, 0, 1, 1),
        GiProfile(GI_PROFILE_2_SLICE, 5, "2g.12gb", 2, 2, 2, (0, 2), 11672, 28, 2, 2, 0, 0, 0),
        GiProfile(GI_PROFILE_2_SLICE_REV1, 6, "2g.12gb+me", 2, 2, 1, (0, 2), 11672, 28, 2, 2, 0, 1, 1),
        GiProfile(GI_PROFILE_4_SLICE, 0, "4g.24gb", 4, 4, 1, (0,), 23344, 56, 4, 4, 0, 1, 1),
    ),
)
H100_80GB = _gh100(
    "h100-80gb",
    "NVIDIA H100 80GB HBM3",
    81559,
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9984, 20096, 40448, 81152),
)
H100_94GB = _gh100(
    "h100-94gb",
    "NVIDIA H100 NVL",
    95830,
    ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    (11008, 22144, 47488, 95232),
)
# Profile memory from a real nvidia-smi mig -lgip on H200, from the NVIDIA/mig-parted issue "Add
# support for the NVIDIA H200 GPU": 16.00 / 32.25 / 69.50 / 139.75 GiB (memorySizeMB / 1024), with
# Hopper's IDs, instance counts and SMs. (GH200 lists 17.50 GiB for its own 1g.18gb; H200 does not.)
H200_141GB = _gh100(
    "h200-141gb",
    "NVIDIA H200",
    143771,
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    (16384, 33024, 71168, 143104),
)

MODELS: dict[str, GpuModel] = {
    m.key: m for m in (A100_40GB, A100_80GB, A30, H100_80GB, H100_94GB, H200_141GB)
}


def model(key: str) -> GpuModel:
    """The model for a ``--sim-gpus`` key; KeyError lists the known ones."""
    try:
        return MODELS[key.lower()]
    except KeyError:
        raise KeyError(f"unknown GPU model {key!r}; known: {', '.join(MODELS)}") from None


def model_by_name(name: str) -> GpuModel | None:
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
