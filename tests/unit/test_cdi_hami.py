"""HAMi's CDI specs in the shared CDI directory: listed by content, removed only when still HAMi's."""

from __future__ import annotations

from pathlib import Path

from hami_format import spec_bytes, spec_filename, write_spec

from sidecar.store.cdi import CdiSpecs

MIG = "MIG-0f0e0d0c-bbbb-5bbb-8bbb-000000000001"
OTHER = "MIG-0f0e0d0c-bbbb-5bbb-8bbb-000000000002"
GPU = "GPU-00000000-aaaa-4aaa-8aaa-000000000000"


def test_only_specs_that_are_hamis_by_content_are_listed(tmp_path: Path) -> None:
    write_spec(tmp_path, MIG, GPU, 0, 1, 0)
    (tmp_path / spec_filename(OTHER)).write_bytes(spec_bytes(OTHER, GPU, 0, 2, 0, kind="example.com/x"))
    (tmp_path / "k8s.device-plugin.nvidia.com-gpu.json").write_text("{}")
    assert [s.mig_uuid for s in CdiSpecs(tmp_path).hami_specs()] == [MIG]
    assert CdiSpecs(None).hami_specs() == []


def test_a_hami_spec_is_removed_and_someone_elses_file_under_its_name_stays(tmp_path: Path) -> None:
    cdi = CdiSpecs(tmp_path)
    path = write_spec(tmp_path, MIG, GPU, 0, 1, 0)
    assert cdi.remove_hami_spec(MIG)
    assert not path.exists()
    assert cdi.remove_hami_spec(MIG)  # missing: done
    foreign = tmp_path / spec_filename(OTHER)
    foreign.write_bytes(spec_bytes(OTHER, GPU, 0, 2, 0, kind="example.com/administrator-owned"))
    assert cdi.remove_hami_spec(OTHER)
    assert foreign.exists()
    assert cdi.pending_removals() == []
