"""Ampere GA100: A100 40 GB / 80 GB (8 memory slices, 7 compute slices) and A30 (4 and 4)."""

from __future__ import annotations

from sidecar.nvml.profile_types import (
    GI_PROFILE_1_SLICE,
    GI_PROFILE_1_SLICE_REV1,
    GI_PROFILE_1_SLICE_REV2,
    GI_PROFILE_2_SLICE,
    GI_PROFILE_2_SLICE_REV1,
    GI_PROFILE_3_SLICE,
    GI_PROFILE_4_SLICE,
    GI_PROFILE_7_SLICE,
    GpuProduct,
    gi,
)

_ALL_1G = (0, 1, 2, 3, 4, 5, 6)


def _ga100(key: str, name: str, memory_mb: int, names: tuple[str, ...], mems: tuple[int, ...]) -> GpuProduct:
    """A100 boards share indices, IDs, placements, SMs and engines; only names and memory differ.

    IDs, SMs, engines: lgip on A100-SXM4-40GB (facts TX 42708883739, 4867217048); placements: UG
    ``-lgipp``; memory: 4.75 / 9.62 / 19.50 / 39.25 GiB in the same listings (80 GB: 9.75 / 19.50 /
    39.25 / 78.50 GiB, a public tutorial listing). A100's 1g double-memory GI has 14 SMs like a plain
    slice, so it has CI 0 only (go-nvlib PR #102 reverted "always REV1" for this profile)."""
    g1, g1me, g1x2, g2, g3, g4, g7 = names
    m1, m2, m4, m8 = mems
    s = 14  # SMs of one compute slice
    # fmt: off
    profiles = (
        gi(index=GI_PROFILE_1_SLICE, id=19, name=g1, slices=1, size=1, count=7, starts=_ALL_1G,
           memory_mb=m1, sms=14, ce=1, dec=0, enc=0, jpg=0, ofa=0, slice_sms=s),
        gi(index=GI_PROFILE_1_SLICE_REV1, id=20, name=g1me, slices=1, size=1, count=1, starts=_ALL_1G,
           memory_mb=m1, sms=14, ce=1, dec=1, enc=0, jpg=1, ofa=1, slice_sms=s),
        gi(index=GI_PROFILE_1_SLICE_REV2, id=15, name=g1x2, slices=1, size=2, count=4, starts=(0, 2, 4, 6),
           memory_mb=m2, sms=14, ce=1, dec=1, enc=0, jpg=0, ofa=0, slice_sms=s),
        gi(index=GI_PROFILE_2_SLICE, id=14, name=g2, slices=2, size=2, count=3, starts=(0, 2, 4),
           memory_mb=m2, sms=28, ce=2, dec=1, enc=0, jpg=0, ofa=0, slice_sms=s),
        gi(index=GI_PROFILE_3_SLICE, id=9, name=g3, slices=3, size=4, count=2, starts=(0, 4),
           memory_mb=m4, sms=42, ce=3, dec=2, enc=0, jpg=0, ofa=0, slice_sms=s),
        gi(index=GI_PROFILE_4_SLICE, id=5, name=g4, slices=4, size=4, count=1, starts=(0,),
           memory_mb=m4, sms=56, ce=4, dec=2, enc=0, jpg=0, ofa=0, slice_sms=s),
        gi(index=GI_PROFILE_7_SLICE, id=0, name=g7, slices=7, size=8, count=1, starts=(0,),
           memory_mb=m8, sms=98, ce=7, dec=5, enc=0, jpg=1, ofa=1, slice_sms=s),
    )
    # fmt: on
    return GpuProduct(
        key=key,
        name=name,
        memory_mb=memory_mb,
        multiprocessor_count=108,
        memory_slices=8,
        max_mig_devices=7,
        resetless_mig_toggle=False,
        profiles=profiles,
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

# A30: 4 memory slices and 4 compute slices, its own IDs (1g = 14, 2g = 5, 4g = 0), a 2g "+me" profile
# and no double-memory 1g. IDs, counts, placements, SMs, engines: lgip/lgipp on driver 535.183.01
# (facts TX 25510043945). Memory: MIG devices of that node show 5952 / 11968 MiB total, i.e. the
# listing's 5.81 / 11.69 GiB; 4g's 23.44 GiB is 24000 MiB to the listing's precision (exact MiB
# unverified). The 1g profile has one decoder (the listing's DEC column), no JPEG/OFA. Whether a
# "+me" GI may coexist with a plain one on the 4-slice axis is unverified.
_A30_ALL = (0, 1, 2, 3)
# fmt: off
_A30_PROFILES = (
    gi(index=GI_PROFILE_1_SLICE, id=14, name="1g.6gb", slices=1, size=1, count=4, starts=_A30_ALL,
       memory_mb=5952, sms=14, ce=1, dec=1, enc=0, jpg=0, ofa=0, slice_sms=14),
    gi(index=GI_PROFILE_1_SLICE_REV1, id=21, name="1g.6gb+me", slices=1, size=1, count=1, starts=_A30_ALL,
       memory_mb=5952, sms=14, ce=1, dec=1, enc=0, jpg=1, ofa=1, slice_sms=14),
    gi(index=GI_PROFILE_2_SLICE, id=5, name="2g.12gb", slices=2, size=2, count=2, starts=(0, 2),
       memory_mb=11968, sms=28, ce=2, dec=2, enc=0, jpg=0, ofa=0, slice_sms=14),
    gi(index=GI_PROFILE_2_SLICE_REV1, id=6, name="2g.12gb+me", slices=2, size=2, count=1, starts=(0, 2),
       memory_mb=11968, sms=28, ce=2, dec=2, enc=0, jpg=1, ofa=1, slice_sms=14),
    gi(index=GI_PROFILE_4_SLICE, id=0, name="4g.24gb", slices=4, size=4, count=1, starts=(0,),
       memory_mb=24000, sms=56, ce=4, dec=4, enc=0, jpg=1, ofa=1, slice_sms=14),
)
# fmt: on
A30 = GpuProduct(
    key="a30",
    name="NVIDIA A30",
    memory_mb=24576,
    multiprocessor_count=56,
    memory_slices=4,
    max_mig_devices=4,
    resetless_mig_toggle=False,
    profiles=_A30_PROFILES,
)
