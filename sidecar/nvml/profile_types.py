"""The shape of a GPU model's MIG tables: GI profiles, the CI profiles inside each, and NVML's constants.

Pure data. The tables themselves live in ``sidecar.nvml.tables`` (one module per GPU family, each
row with its source); ``profiles`` collects them.

Three numbers name a GPU instance profile and they are easy to confuse:

* the profile *index*, the ``NVML_GPU_INSTANCE_PROFILE_*`` constant passed to
  ``nvmlDeviceGetGpuInstanceProfileInfo`` (0x0 = 1 slice, 0x7 = 1 slice REV1 "+me", 0x9 = 1 slice REV2
  "double memory" …);
* the profile *ID* (``info.id``, what ``nvidia-smi`` prints), which every other call takes and which
  differs per GPU family (1g is 19 on A100/H100 but 14 on A30);
* the placement *size*, counted in memory slices, not compute slices (a 3g instance spans 4 of 8).

Compute-instance profiles use the same number for index and ID.
"""

from __future__ import annotations

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
GI_PROFILE_1_SLICE_GFX = 0xA  # "+gfx": graphics capable (RTX PRO Blackwell)
GI_PROFILE_2_SLICE_GFX = 0xB
GI_PROFILE_4_SLICE_GFX = 0xC
GI_PROFILE_1_SLICE_NO_ME = 0xD  # "-me": no media engines
GI_PROFILE_2_SLICE_NO_ME = 0xE
GI_PROFILE_1_SLICE_ALL_ME = 0xF  # "+me.all": every media engine of the GPU
GI_PROFILE_2_SLICE_ALL_ME = 0x10
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
CI_PROFILE_1_SLICE_REV1 = 0x7  # a 1-slice CI with every SM of a double-memory 1g GI (Hopper, Blackwell)
CI_PROFILE_COUNT = 0x9

# The CI profile of g compute slices. Not index 0 for g > 1: index 0 is the 1-slice CI, and a
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
    """The CI profile constant of ``slice_count`` compute slices; None when unknown.

    There is deliberately no default: a guess would be profile 0, a 1-slice CI inside a bigger GI."""
    return FULL_CI_PROFILE_BY_SLICES.get(slice_count)


class CiProfile(msgspec.Struct, frozen=True, kw_only=True):
    """A compute instance profile inside one GI profile (index = ID), as ``-lcip`` lists it."""

    id: int
    slice_count: int
    instance_count: int
    starts: tuple[int, ...]  # placement starts in compute slices; size = slice_count
    multiprocessor_count: int


def pick_full_ci(gi_slices: int, cis: list[tuple[int, int, int]]) -> int | None:
    """The full-size CI of a GI: among (id, slice count, SMs), the one with the GI's compute slices and
    the most SMs; None when no CI profile spans the GI.

    Why "most SMs": a double-memory 1g GI on Hopper and Blackwell offers CI 0 with the SMs of a plain
    1g slice and CI 7 (1_SLICE_REV1) with every SM of the GI, and the driver's default is CI 7
    (kubernetes-sigs/dra-driver-nvidia-gpu#1454). A100's 1g.20gb has only CI 0, so "always REV1" is
    wrong too (go-nvlib reverted that in its PR #102)."""
    spanning = [(sms, -cid, cid) for cid, slices, sms in cis if slices == gi_slices]
    return max(spanning)[2] if spanning else None


class GiProfile(msgspec.Struct, frozen=True, kw_only=True):
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
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    ci_profiles: tuple[CiProfile, ...]

    @property
    def full_ci_profile_id(self) -> int:
        picked = pick_full_ci(
            self.slice_count, [(c.id, c.slice_count, c.multiprocessor_count) for c in self.ci_profiles]
        )
        assert picked is not None, f"{self.name}: no CI profile spans the GI"
        return picked


class GpuProduct(msgspec.Struct, frozen=True, kw_only=True):
    key: str  # what --sim-gpus and ``sim init`` take, e.g. "h100-80gb"
    name: str  # nvmlDeviceGetName
    memory_mb: int  # total memory, MiB
    multiprocessor_count: int
    memory_slices: int  # the placement axis: 8, or 4 on A30 and RTX PRO 6000
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


# Partial CIs inside a GI of g compute slices: (slices, instances, starts). A 4g GI offers 1c, 2c and
# 4c (no 3c); a 7g GI 1c, 2c, 3c, 4c and 7c (MIG user guide, real ``-lcip`` listings; the 7g and 4g
# placements are not confirmed by a public listing: unverified).
_CI_SHAPES: dict[int, tuple[tuple[int, int, tuple[int, ...]], ...]] = {
    1: ((1, 1, (0,)),),
    2: ((1, 2, (0, 1)), (2, 1, (0,))),
    3: ((1, 3, (0, 1, 2)), (2, 1, (0,)), (3, 1, (0,))),
    4: ((1, 4, (0, 1, 2, 3)), (2, 2, (0, 2)), (4, 1, (0,))),
    7: ((1, 7, (0, 1, 2, 3, 4, 5, 6)), (2, 3, (0, 2, 4)), (3, 2, (0, 4)), (4, 1, (0,)), (7, 1, (0,))),
}


def ci_table(gi_slices: int, gi_sms: int, slice_sms: int) -> tuple[CiProfile, ...]:
    """The CI profiles of a GI with ``gi_slices`` compute slices and ``gi_sms`` SMs.

    A partial CI has ``slice_sms`` per compute slice (the SMs of the model's plain 1g profile); the
    CI spanning the GI has all of them. When a 1-slice GI has more SMs than a plain slice (the
    double-memory 1g on Hopper and Blackwell), CI 0 keeps a plain slice's SMs and CI 7 (1_SLICE_REV1)
    spans the GI: the shape of dra-driver-nvidia-gpu#1454 (B300 1g.67gb: CI 0 18 SMs, CI 7 30 SMs)
    and of real H100 ``-lcip`` listings of 1g.20gb (go-nvml #146)."""
    table = []
    for slices, count, starts in _CI_SHAPES[gi_slices]:
        ci_id = FULL_CI_PROFILE_BY_SLICES[slices]
        sms = gi_sms if slices == gi_slices else slices * slice_sms
        if slices == gi_slices == 1 and gi_sms > slice_sms:
            table.append(
                CiProfile(
                    id=ci_id, slice_count=1, instance_count=1, starts=(0,), multiprocessor_count=slice_sms
                )
            )
            ci_id = CI_PROFILE_1_SLICE_REV1
        table.append(
            CiProfile(
                id=ci_id, slice_count=slices, instance_count=count, starts=starts, multiprocessor_count=sms
            )
        )
    return tuple(table)


def gi(
    *,
    index: int,
    id: int,
    name: str,
    slices: int,
    size: int,
    count: int,
    starts: tuple[int, ...],
    memory_mb: int,
    sms: int,
    ce: int,
    dec: int,
    enc: int,
    jpg: int,
    ofa: int,
    slice_sms: int,
) -> GiProfile:
    """A GI profile row with its CI profiles (``ci_table``); every value named as ``-lgip`` shows it."""
    return GiProfile(
        index=index,
        id=id,
        name=name,
        slice_count=slices,
        size=size,
        instance_count=count,
        starts=starts,
        memory_mb=memory_mb,
        multiprocessor_count=sms,
        copy_engines=ce,
        decoders=dec,
        encoders=enc,
        jpegs=jpg,
        ofas=ofa,
        ci_profiles=ci_table(slices, sms, slice_sms),
    )
