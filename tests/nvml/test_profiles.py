"""The profile tables are pinned to the published hardware facts (lgip/lgipp listings, MIG user guide)."""

from __future__ import annotations

import pynvml
import pytest

from sidecar.nvml import profiles

# (name, index, ID, compute slices, memory slices, instance count, starts) per model.
A100_40GB = [
    ("1g.5gb", 0x0, 19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
    ("1g.5gb+me", 0x7, 20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    ("1g.10gb", 0x9, 15, 1, 2, 4, (0, 2, 4, 6)),
    ("2g.10gb", 0x1, 14, 2, 2, 3, (0, 2, 4)),
    ("3g.20gb", 0x2, 9, 3, 4, 2, (0, 4)),
    ("4g.20gb", 0x3, 5, 4, 4, 1, (0,)),
    ("7g.40gb", 0x4, 0, 7, 8, 1, (0,)),
]
A30 = [
    ("1g.6gb", 0x0, 14, 1, 1, 4, (0, 1, 2, 3)),
    ("1g.6gb+me", 0x7, 21, 1, 1, 1, (0, 1, 2, 3)),
    ("2g.12gb", 0x1, 5, 2, 2, 2, (0, 2)),
    ("2g.12gb+me", 0x8, 6, 2, 2, 1, (0, 2)),
    ("4g.24gb", 0x3, 0, 4, 4, 1, (0,)),
]
HOPPER_SHAPE = [  # index, ID, C, size, N, starts: identical on every GH100 board
    (0x0, 19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
    (0x7, 20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    (0x9, 15, 1, 2, 4, (0, 2, 4, 6)),
    (0x1, 14, 2, 2, 3, (0, 2, 4)),
    (0x2, 9, 3, 4, 2, (0, 4)),
    (0x3, 5, 4, 4, 1, (0,)),
    (0x4, 0, 7, 8, 1, (0,)),
]
NAMES = {
    "a100-80gb": ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "h100-80gb": ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "h100-94gb": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
    "h200-141gb": ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
}


def _shape(model: profiles.GpuProduct) -> list[tuple[object, ...]]:
    return [
        (p.name, p.index, p.id, p.slice_count, p.size, p.instance_count, p.starts) for p in model.profiles
    ]


class TestPublishedTables:
    def test_a100_40gb_has_the_published_indices_ids_and_placements(self) -> None:
        assert _shape(profiles.model("a100-40gb")) == A100_40GB

    def test_a100_80gb_differs_from_40gb_only_in_names_and_memory(self) -> None:
        shape = [row[1:] for row in _shape(profiles.model("a100-80gb"))]
        assert shape == [row[1:] for row in A100_40GB]
        assert [p.name for p in profiles.model("a100-80gb").profiles] == NAMES["a100-80gb"]

    def test_a30_has_its_own_ids_and_a_four_slice_axis(self) -> None:
        assert _shape(profiles.model("a30")) == A30
        assert profiles.model("a30").memory_slices == 4

    @pytest.mark.parametrize("key", ["h100-80gb", "h100-94gb", "h200-141gb"])
    def test_hopper_boards_share_the_gh100_shape(self, key: str) -> None:
        m = profiles.model(key)
        assert [row[1:] for row in _shape(m)] == HOPPER_SHAPE
        assert [p.name for p in m.profiles] == NAMES[key]

    def test_h200_profile_memory_is_what_a_real_h200_lists(self) -> None:
        """``nvidia-smi mig -lgip`` on an H200 prints memorySizeMB / 1024 in its GiB column: 16.00 for
        1g.18gb (not the 17.50 of the GH200 board with the same profile name)."""
        gib = [p.memory_mb / 1024 for p in profiles.model("h200-141gb").profiles]
        assert gib == [16.00, 16.00, 32.25, 32.25, 69.50, 69.50, 139.75]

    @pytest.mark.parametrize(
        ("key", "name"),
        [
            ("a100-40gb", "NVIDIA A100-SXM4-40GB"),
            ("a100-80gb", "NVIDIA A100-SXM4-80GB"),
            ("a30", "NVIDIA A30"),
            ("h100-80gb", "NVIDIA H100 80GB HBM3"),
            ("h100-94gb", "NVIDIA H100 NVL"),
            ("h200-141gb", "NVIDIA H200"),
        ],
    )
    def test_models_report_the_driver_s_device_name(self, key: str, name: str) -> None:
        assert profiles.model(key).name == name
        assert profiles.model_by_name(name) == profiles.model(key)

    @pytest.mark.parametrize("key", list(profiles.MODELS))
    def test_every_profile_name_follows_from_its_memory_size(self, key: str) -> None:
        m = profiles.model(key)
        for p in m.profiles:
            gb = int(p.name.split(".")[1].split("gb")[0])
            assert profiles.profile_gb(p.memory_mb, m.memory_mb) == gb, p.name

    @pytest.mark.parametrize("key", list(profiles.MODELS))
    def test_placements_of_a_profile_never_overlap_each_other_and_fit_the_axis(self, key: str) -> None:
        m = profiles.model(key)
        for p in m.profiles:
            ends = [s + p.size for s in p.starts]
            assert all(e <= m.memory_slices for e in ends)
            assert all(b >= a + p.size for a, b in zip(p.starts, p.starts[1:], strict=False))


class TestNumbering:
    @pytest.mark.parametrize(
        ("start", "size", "gi_id"),
        [(0, 8, 0), (0, 4, 1), (4, 4, 2), (0, 2, 3), (2, 2, 4), (4, 2, 5), (6, 2, 6), (0, 1, 7), (6, 1, 13)],
    )
    def test_eight_slice_gpus_number_gpu_instances_as_a_heap(self, start: int, size: int, gi_id: int) -> None:
        assert profiles.gpu_instance_id(8, start, size) == gi_id

    @pytest.mark.parametrize(
        ("start", "size", "gi_id"), [(0, 4, 0), (0, 2, 1), (2, 2, 2), (0, 1, 3), (3, 1, 6)]
    )
    def test_a30_numbers_its_four_slice_heap_the_same_way(self, start: int, size: int, gi_id: int) -> None:
        assert profiles.gpu_instance_id(4, start, size) == gi_id

    @pytest.mark.parametrize(
        ("gpu", "gi", "ci", "gi_minor", "ci_minor"),
        [
            (0, 0, 0, 3, 4),
            (0, 1, 2, 12, 15),
            (3, 3, 3, 435, 439),
            (6, 11, 7, 912, 920),
            (31, 14, 7, 4314, 4322),
        ],
    )
    def test_capability_minors_follow_the_driver_s_fixed_arithmetic(
        self, gpu: int, gi: int, ci: int, gi_minor: int, ci_minor: int
    ) -> None:
        assert profiles.gi_access_minor(gpu, gi) == gi_minor
        assert profiles.ci_access_minor(gpu, gi, ci) == ci_minor

    @pytest.mark.parametrize(
        ("slices", "ci_profile"), [(1, 0), (2, 1), (3, 2), (4, 3), (6, 6), (7, 4), (8, 5)]
    )
    def test_the_full_size_compute_instance_is_not_profile_zero(self, slices: int, ci_profile: int) -> None:
        assert profiles.FULL_CI_PROFILE_BY_SLICES[slices] == ci_profile
        assert profiles.full_ci_profile_id(slices) == ci_profile

    @pytest.mark.parametrize("slices", [1, 2, 3, 4, 6, 7, 8])
    def test_the_full_size_compute_instance_is_nvml_s_own_constant(self, slices: int) -> None:
        constant = getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{slices}_SLICE")
        assert profiles.full_ci_profile_id(slices) == constant

    @pytest.mark.parametrize("slices", [0, 5, 9, 16])
    def test_a_slice_count_without_a_known_compute_instance_profile_has_none(self, slices: int) -> None:
        """Never a default: profile 0 is the 1-slice CI and would carve a sliver out of a bigger GI."""
        assert profiles.full_ci_profile_id(slices) is None


class TestGpuListSyntax:
    def test_models_with_counts_parse_in_order(self) -> None:
        assert profiles.parse_gpus("h100-80gb:2,a100-40gb") == [("h100-80gb", 2), ("a100-40gb", 1)]

    @pytest.mark.parametrize("bad", ["", "h100-80gb:x", "h100-80gb:0", "v100:1"])
    def test_bad_gpu_lists_are_refused_with_a_reason(self, bad: str) -> None:
        with pytest.raises(ValueError, match=r"."):
            profiles.parse_gpus(bad)
