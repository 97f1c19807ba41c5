"""Hopper GH100: H100 80 GB, H100 94 GB (NVL), H200, H20, GH200 96 GB and 144 GB (8 memory slices).

Every board shares the GH100 shape: indices, IDs (19/20/15/14/9/5/0), instance counts and placements
(lgip + lgipp on H100 80GB, facts TX 8225626544; ``1g.20gb@6`` seen as the DRA device name
``gpu-0-mig-1g20gb-15-6``). Names, memory and SMs differ per board and are sourced per model below.
The double-memory 1g GI has more SMs than a plain slice, so its full CI is CI 7 (``ci_table``).
"""

from __future__ import annotations

from sidecar.nvml.profile_types import (
    GI_PROFILE_1_SLICE,
    GI_PROFILE_1_SLICE_REV1,
    GI_PROFILE_1_SLICE_REV2,
    GI_PROFILE_2_SLICE,
    GI_PROFILE_3_SLICE,
    GI_PROFILE_4_SLICE,
    GI_PROFILE_7_SLICE,
    GpuProduct,
    gi,
)

_ALL_1G = (0, 1, 2, 3, 4, 5, 6)


def gh100(
    key: str,
    name: str,
    memory_mb: int,
    names: tuple[str, ...],
    mems: tuple[int, ...],
    *,
    sms: tuple[int, ...] = (16, 26, 32, 60, 64, 132),
    ce7: int = 8,
) -> GpuProduct:
    """One GH100 board: ``names`` of the 7 profiles, ``mems`` of 1g / 1g double / 3g / 7g, ``sms`` of
    1g / 1g double / 2g / 3g / 4g / 7g. Engines (CE/DEC/JPG/OFA per g: 1/1/1/0 … 7g 8/7/7/1) are the
    H100 80GB listing's; the other boards' listings agree where they were found."""
    g1, g1me, g1x2, g2, g3, g4, g7 = names
    m1, m2, m4, m8 = mems
    s1, s1x2, s2, s3, s4, s7 = sms
    # fmt: off
    profiles = (
        gi(index=GI_PROFILE_1_SLICE, id=19, name=g1, slices=1, size=1, count=7, starts=_ALL_1G,
           memory_mb=m1, sms=s1, ce=1, dec=1, enc=0, jpg=1, ofa=0, slice_sms=s1),
        gi(index=GI_PROFILE_1_SLICE_REV1, id=20, name=g1me, slices=1, size=1, count=1, starts=_ALL_1G,
           memory_mb=m1, sms=s1, ce=1, dec=1, enc=0, jpg=1, ofa=1, slice_sms=s1),
        gi(index=GI_PROFILE_1_SLICE_REV2, id=15, name=g1x2, slices=1, size=2, count=4, starts=(0, 2, 4, 6),
           memory_mb=m2, sms=s1x2, ce=1, dec=1, enc=0, jpg=1, ofa=0, slice_sms=s1),
        gi(index=GI_PROFILE_2_SLICE, id=14, name=g2, slices=2, size=2, count=3, starts=(0, 2, 4),
           memory_mb=m2, sms=s2, ce=2, dec=2, enc=0, jpg=2, ofa=0, slice_sms=s1),
        gi(index=GI_PROFILE_3_SLICE, id=9, name=g3, slices=3, size=4, count=2, starts=(0, 4),
           memory_mb=m4, sms=s3, ce=3, dec=3, enc=0, jpg=3, ofa=0, slice_sms=s1),
        gi(index=GI_PROFILE_4_SLICE, id=5, name=g4, slices=4, size=4, count=1, starts=(0,),
           memory_mb=m4, sms=s4, ce=4, dec=4, enc=0, jpg=4, ofa=0, slice_sms=s1),
        gi(index=GI_PROFILE_7_SLICE, id=0, name=g7, slices=7, size=8, count=1, starts=(0,),
           memory_mb=m8, sms=s7, ce=ce7, dec=7, enc=0, jpg=7, ofa=1, slice_sms=s1),
    )
    # fmt: on
    return GpuProduct(
        key=key,
        name=name,
        memory_mb=memory_mb,
        multiprocessor_count=s7,
        memory_slices=8,
        max_mig_devices=7,
        resetless_mig_toggle=True,
        profiles=profiles,
    )


# lgip on H100 80GB HBM3 (facts TX 8225626544, jbarrow.ai): 9.75 / 19.62 / 39.50 / 79.25 GiB; the 3g
# device shows 40448 MiB (UG MPS example).
H100_80GB = gh100(
    "h100-80gb",
    "NVIDIA H100 80GB HBM3",
    81559,
    ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    (9984, 20096, 40448, 81152),
)
# lgip on H100 NVL (NVIDIA/gpu-operator PR #900, mig-parted PR #101): 10.75 / 21.62 / 46.38 GiB,
# SMs 16 / 26 / 32; MIG devices of 11008 / 22144 / 47488 MiB (facts TX 6230417598). 7g.94gb: 93.12 GiB
# in the listing of facts TX 62450835955 = 95360 MiB.
H100_94GB = gh100(
    "h100-94gb",
    "NVIDIA H100 NVL",
    95830,
    ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"),
    (11008, 22144, 47488, 95360),
)
# lgip on H200 (NVIDIA/mig-parted issue #120): 16.00 / 32.25 / 69.50 / 139.75 GiB, SMs 16 / 26 / 32 /
# 60 / 64, engines as H100. Placements: no public H200 lgipp (unverified, GH100's assumed).
H200_141GB = gh100(
    "h200-141gb",
    "NVIDIA H200",
    143771,
    ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    (16384, 33024, 71168, 143104),
)
# lgip on GH200 144G HBM3e (NVIDIA/mig-parted PR #139, gpu-operator PR #1057): 1g.18gb 17.50 GiB 16 SM,
# 1g.36gb / 2g.36gb 35.25 GiB 26 / 32 SM. 3g / 4g / 7g memory, the total and SMs: unverified.
GH200_144GB = gh100(
    "gh200-144gb",
    "NVIDIA GH200 144G HBM3e",
    147456,
    ("1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"),
    (17920, 36096, 72192, 145408),
)
# GH200 96GB (HBM3, device 0x2342): profile names from mig-parted's default config (1g.12gb …
# 7g.96gb). Memory, total and SMs: unverified (H100 NVL's shape assumed).
GH200_96GB = gh100(
    "gh200-96gb",
    "NVIDIA GH200 480GB",
    97871,
    ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    (11264, 22528, 47104, 95744),
)
# H20 (96 GB, 78 SMs): profile names as GH200 96GB (mig-parted default config). Memory and every SM
# count: unverified (no public listing found); the SMs scale GH100's to 78.
H20 = gh100(
    "h20",
    "NVIDIA H20",
    97871,
    ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    (11264, 22528, 47104, 95744),
    sms=(10, 16, 20, 36, 40, 78),
)
