"""HAMi's record and spec files, read as HAMi writes them, and every way one stops being trusted."""

from __future__ import annotations

import hashlib

import pytest
from hami_format import record_bytes, record_filename, spec_bytes, spec_filename

from sidecar.model import hami_files
from sidecar.model.hami_files import HamiRecordError, decode_record, hami_record_hint, recognize_spec
from sidecar.nvml.port import Placement

MIG = "MIG-0f0e0d0c-bbbb-5bbb-8bbb-000000000001"
GPU = "GPU-00000000-aaaa-4aaa-8aaa-000000000000"


def good() -> bytes:
    return record_bytes(MIG, GPU, "1g.10gb", 1, 1, 2, 3)


class TestNames:
    def test_the_record_file_is_named_by_the_sha256_of_the_mig_uuid_string(self) -> None:
        digest = hashlib.sha256(MIG.encode()).hexdigest()
        assert hami_files.record_filename(MIG) == f"hami-owned-mig-{digest}.json"
        assert hami_files.spec_filename(MIG) == f"hami-dynamic-mig-mig-{digest}.json"
        assert hami_files.spec_device(MIG) == f"k8s.device-plugin.nvidia.com/dynamic-mig=mig-{digest}"

    def test_a_name_is_only_derived_from_a_mig_uuid(self) -> None:
        with pytest.raises(ValueError, match="not a MIG UUID"):
            hami_files.device_name("GPU-x")

    def test_hami_temp_files_are_not_records(self) -> None:
        assert hami_files.is_record_filename(record_filename(MIG))
        assert not hami_files.is_record_filename(".hami-owned-123")
        assert not hami_files.is_record_filename("mig-GPU-00000000-aaaa-4aaa-8aaa-000000000000-0-1.json")


class TestDecodeRecord:
    def test_a_record_as_hami_writes_it_decodes_field_for_field(self) -> None:
        record = decode_record(record_filename(MIG), good())
        assert (record.mig_uuid, record.parent_gpu_uuid, record.profile) == (MIG, GPU, "1g.10gb")
        assert record.where == Placement(1, 1)
        assert (record.gpu_instance_id, record.compute_instance_id) == (2, 3)

    @pytest.mark.parametrize("version", [0, 2])
    def test_another_version_is_refused_by_its_number(self, version: int) -> None:
        data = record_bytes(MIG, GPU, "1g.10gb", 1, 1, 2, 3, version=version)
        with pytest.raises(HamiRecordError, match=f"unsupported version {version}"):
            decode_record(record_filename(MIG), data)

    def test_a_file_named_for_another_uuid_is_refused(self) -> None:
        other = "MIG-0f0e0d0c-bbbb-5bbb-8bbb-000000000002"
        with pytest.raises(HamiRecordError, match="file name does not match"):
            decode_record(record_filename(other), good())

    @pytest.mark.parametrize(
        ("data", "why"),
        [
            (good().replace(b'"computeInstanceID":3}', b'"computeInstanceID":3,"extra":1}'), "unknown field"),
            (good().replace(b',"computeInstanceID":3', b""), "missing required field"),
            (good().replace(b'"gpuInstanceID":2', b'"gpuInstanceID":"2"'), "Expected `int`"),
            (good().replace(b'"gpuInstanceID":2', b'"gpuInstanceID":-1'), "out of range"),
            (good().replace(b'"size":1', b'"size":0'), "empty"),
            (good().replace(GPU.encode(), b"GPU-parent"), "not a GPU UUID"),
            (good()[:40], "no version|does not decode"),
            (b"not-json", "no version"),
        ],
    )
    def test_anything_but_the_exact_format_is_refused(self, data: bytes, why: str) -> None:
        with pytest.raises(HamiRecordError, match=why):
            decode_record(record_filename(MIG), data)

    def test_a_record_whose_uuid_is_not_a_mig_uuid_is_refused(self) -> None:
        data = good().replace(MIG.encode(), b"GPU-0f0e0d0c")
        with pytest.raises(HamiRecordError, match="not a MIG UUID"):
            decode_record(record_filename(MIG), data)

    def test_an_undecodable_file_still_says_where_it_points(self) -> None:
        hint = hami_record_hint(record_bytes(MIG, GPU, "1g.10gb", 4, 1, 2, 3, version=7))
        assert (hint.mig_uuid, hint.gpu_uuid, hint.placement) == (MIG, GPU, Placement(4, 1))
        assert hami_record_hint(b"garbage") == hami_files.RecordHint()


class TestRecognizeSpec:
    def test_a_spec_as_hami_writes_it_is_hamis(self) -> None:
        spec = recognize_spec(spec_filename(MIG), spec_bytes(MIG, GPU, 0, 2, 3))
        assert spec is not None
        assert (spec.mig_uuid, spec.parent_gpu_uuid, spec.geometry) == (MIG, GPU, "0:2:3")

    def test_another_kind_is_not_hamis(self) -> None:
        data = spec_bytes(MIG, GPU, 0, 2, 3, kind="example.com/administrator-owned")
        assert recognize_spec(spec_filename(MIG), data) is None

    def test_a_spec_whose_annotation_names_another_instance_is_not_hamis(self) -> None:
        other = "MIG-0f0e0d0c-bbbb-5bbb-8bbb-000000000002"
        data = spec_bytes(MIG, GPU, 0, 2, 3).replace(
            f'"hami.io/mig-uuid":"{MIG}"'.encode(), f'"hami.io/mig-uuid":"{other}"'.encode()
        )
        assert recognize_spec(spec_filename(MIG), data) is None
        assert recognize_spec(spec_filename(other), data) is None

    def test_a_spec_under_another_file_name_is_not_hamis(self) -> None:
        other = "MIG-0f0e0d0c-bbbb-5bbb-8bbb-000000000002"
        assert recognize_spec(spec_filename(other), spec_bytes(MIG, GPU, 0, 2, 3)) is None

    def test_a_spec_with_two_devices_or_none_is_not_hamis(self) -> None:
        one = spec_bytes(MIG, GPU, 0, 2, 3)
        start = one.index(b'"devices":[') + len(b'"devices":[')
        end = one.index(b'],"containerEdits":{"env"')
        device = one[start:end]
        two = one[:start] + device + b"," + device + one[end:]
        assert recognize_spec(spec_filename(MIG), two) is None
        assert recognize_spec(spec_filename(MIG), one[:start] + one[end:]) is None
        assert recognize_spec(spec_filename(MIG), b"{") is None
