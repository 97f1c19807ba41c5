"""Removal of a spec file by the path it was found at.

``list_mig_uuids`` finds this sidecar's spec files by their content, whatever their file name;
removing a stray went by the name derived from the MIG UUID instead, so a spec of our kind under
another name was never removed (and the derived name, if it existed, was). ``remove`` now takes the
path that was found. The queue of failed removals keeps working for such a path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.store.cdi import CdiSpecs

MIG_A = "MIG-5c2f3a9e-1111-2222-3333-444455556666"
MIG_B = "MIG-00000000-aaaa-bbbb-cccc-dddddddddddd"


@pytest.fixture
def cdi_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "cdi"
    directory.mkdir()
    return directory


@pytest.fixture
def specs(cdi_dir: Path, tmp_path: Path) -> CdiSpecs:
    return CdiSpecs(cdi_dir, proc_root=tmp_path / "proc")


def write_spec(path: Path, kind: str, *names: str) -> str:
    text = json.dumps({"cdiVersion": "0.3.0", "kind": kind, "devices": [{"name": n} for n in names]})
    path.write_text(text)
    return text


class TestRemovingASpecByTheFileItWasFoundIn:
    def test_a_spec_of_our_kind_under_another_name_is_removed_by_the_path_found(
        self, specs: CdiSpecs, cdi_dir: Path
    ) -> None:
        odd = cdi_dir / "left-by-an-older-version.json"
        write_spec(odd, specs.kind, MIG_A)
        found = specs.list_mig_uuids()
        assert found == {MIG_A: odd}

        assert specs.remove(MIG_A, path=found[MIG_A]) is True

        assert not odd.exists()
        assert specs.list_mig_uuids() == {}
        assert specs.pending_removals() == []

    def test_the_file_the_name_would_derive_is_not_what_goes(self, specs: CdiSpecs, cdi_dir: Path) -> None:
        odd = cdi_dir / "odd.json"
        write_spec(odd, specs.kind, MIG_A)
        derived = specs.spec_path(MIG_A)
        derived_text = write_spec(derived, specs.kind, MIG_A)

        specs.remove(MIG_A, path=odd)

        assert sorted(p.name for p in cdi_dir.iterdir()) == [derived.name]
        assert derived.read_text() == derived_text

    def test_a_failed_removal_of_a_found_path_is_queued_under_that_path_and_retried(
        self, specs: CdiSpecs, cdi_dir: Path
    ) -> None:
        # The CDI directory replaced by a file: every call on the path fails with ENOTDIR, also
        # for root. (A directory at the path would not do: it is not ours, so it is never removed.)
        odd = cdi_dir / "odd.json"
        write_spec(odd, specs.kind, MIG_A)
        moved = cdi_dir.with_name("cdi-away")
        cdi_dir.rename(moved)
        cdi_dir.write_text("not a directory")

        assert specs.remove(MIG_A, path=odd) is False
        assert specs.pending_removals() == [str(odd)]
        assert specs.retry_removals() == []

        cdi_dir.unlink()
        moved.rename(cdi_dir)
        assert specs.retry_removals() == [str(odd)]
        assert not odd.exists()
        assert specs.pending_removals() == []

    def test_a_path_outside_the_cdi_directory_is_refused_and_left_alone(
        self, specs: CdiSpecs, tmp_path: Path
    ) -> None:
        outside = tmp_path / "elsewhere.json"
        text = write_spec(outside, specs.kind, MIG_A)

        with pytest.raises(ValueError, match="not in the CDI directory"):
            specs.remove(MIG_A, path=outside)

        assert outside.read_text() == text
        assert specs.pending_removals() == []

    def test_without_a_path_the_derived_file_is_removed_as_before(
        self, specs: CdiSpecs, cdi_dir: Path
    ) -> None:
        write_spec(specs.spec_path(MIG_B), specs.kind, MIG_B)

        assert specs.remove(MIG_B) is True

        assert list(cdi_dir.iterdir()) == []

    def test_with_cdi_disabled_a_removal_by_path_is_a_no_op(self, tmp_path: Path) -> None:
        specs = CdiSpecs(None, proc_root=tmp_path / "proc")
        odd = tmp_path / "odd.json"
        text = write_spec(odd, specs.kind, MIG_A)

        assert specs.remove(MIG_A, path=odd) is True

        assert odd.read_text() == text
