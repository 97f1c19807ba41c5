"""Per-instance CDI spec files on disk: content read from a fake ``/proc``, rewrite, removal queue.

The fake ``/proc`` tree is written by each test the way the NVIDIA driver lays it out, so the
expected device numbers are visible in the test itself.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from sidecar.model.domain import Identity
from sidecar.model.errors import StateWriteFailed
from sidecar.store.cdi import CdiSpecs, ForeignSpecFile

MIG_A = "MIG-5c2f3a9e-1111-2222-3333-444455556666"
MIG_B = "MIG-00000000-aaaa-bbbb-cccc-dddddddddddd"
NVIDIA_MAJOR = 195
CAPS_MAJOR = 508

PROC_DEVICES = f"""Character devices:
  1 mem
  4 /dev/vc/0
{NVIDIA_MAJOR} nvidia-frontend
236 nvidia-uvm
{CAPS_MAJOR} nvidia-caps

Block devices:
  7 loop
{CAPS_MAJOR + 1} nvidia-caps
"""


def cap_minors(gpu_minor: int, gi: int, ci: int) -> tuple[int, int]:
    """The driver's fixed numbering of /dev/nvidia-caps minors (MIG user guide)."""
    base = 3 + 135 * gpu_minor + 9 * gi
    return base, base + 1 + ci


def write_access(proc: Path, gpu_minor: int, gi: int, ci: int, mode: int = 256) -> tuple[int, int]:
    gi_minor, ci_minor = cap_minors(gpu_minor, gi, ci)
    gi_dir = proc / "driver/nvidia/capabilities" / f"gpu{gpu_minor}" / "mig" / f"gi{gi}"
    (gi_dir / f"ci{ci}").mkdir(parents=True, exist_ok=True)
    (gi_dir / "access").write_text(
        f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"
    )
    (gi_dir / f"ci{ci}" / "access").write_text(
        f"DeviceFileMinor: {ci_minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"
    )
    return gi_minor, ci_minor


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    (root / "devices").write_text(PROC_DEVICES)
    write_access(root, gpu_minor=1, gi=3, ci=0)
    write_access(root, gpu_minor=1, gi=5, ci=0, mode=292)
    return root


@pytest.fixture
def cdi_dir(tmp_path: Path) -> Path:
    return tmp_path / "cdi"


@pytest.fixture
def specs(cdi_dir: Path, proc: Path) -> CdiSpecs:
    return CdiSpecs(cdi_dir, proc_root=proc)


ID_A = Identity(3, 0, MIG_A)
ID_B = Identity(5, 0, MIG_B)


def is_current(specs: CdiSpecs, gpu_minor: int, identity: Identity) -> bool:
    """The spec file exists and holds exactly what ``ensure`` would write now."""
    path = specs.spec_path(identity.mig_uuid)
    return path.is_file() and path.read_bytes() == specs.render(gpu_minor, identity)


class TestSpecContent:
    def test_the_spec_names_the_instance_and_its_four_device_nodes_from_proc(
        self, specs: CdiSpecs, cdi_dir: Path
    ) -> None:
        name = specs.ensure(1, ID_A)

        assert name == f"k8s.hami.io/mig={MIG_A}"
        path = cdi_dir / f"k8s.hami.io-mig_{MIG_A}.json"
        gi_minor, ci_minor = cap_minors(1, 3, 0)
        assert json.loads(path.read_bytes()) == {
            "cdiVersion": "0.3.0",
            "kind": "k8s.hami.io/mig",
            "devices": [
                {
                    "name": MIG_A,
                    "containerEdits": {
                        "deviceNodes": [
                            {"path": "/dev/nvidia1", "type": "c", "major": NVIDIA_MAJOR, "minor": 1},
                            {"path": "/dev/nvidiactl", "type": "c", "major": NVIDIA_MAJOR, "minor": 255},
                            {
                                "path": f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
                                "type": "c",
                                "major": CAPS_MAJOR,
                                "minor": gi_minor,
                                "fileMode": 256,
                            },
                            {
                                "path": f"/dev/nvidia-caps/nvidia-cap{ci_minor}",
                                "type": "c",
                                "major": CAPS_MAJOR,
                                "minor": ci_minor,
                                "fileMode": 256,
                            },
                        ]
                    },
                }
            ],
        }

    def test_the_file_is_0644_and_no_temp_file_is_left(self, specs: CdiSpecs, cdi_dir: Path) -> None:
        specs.ensure(1, ID_A)
        path = specs.spec_path(MIG_A)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        assert [p.name for p in cdi_dir.iterdir()] == [path.name]

    def test_the_file_mode_is_copied_from_the_access_file_as_a_decimal_number(self, specs: CdiSpecs) -> None:
        specs.ensure(1, ID_B)
        nodes = json.loads(specs.spec_path(MIG_B).read_bytes())["devices"][0]["containerEdits"]["deviceNodes"]
        assert [n.get("fileMode") for n in nodes] == [None, None, 292, 292]

    def test_the_legacy_nvidia_line_gives_the_major_when_there_is_no_nvidia_frontend(
        self, specs: CdiSpecs, proc: Path
    ) -> None:
        (proc / "devices").write_text(PROC_DEVICES.replace("nvidia-frontend", "nvidia"))
        specs.ensure(1, ID_A)
        nodes = json.loads(specs.spec_path(MIG_A).read_bytes())["devices"][0]["containerEdits"]["deviceNodes"]
        assert nodes[0]["major"] == NVIDIA_MAJOR

    def test_a_kind_with_a_dot_in_its_class_raises_the_cdi_version_to_0_6_0(
        self, cdi_dir: Path, proc: Path
    ) -> None:
        specs = CdiSpecs(cdi_dir, kind="example.com/mig.v1", proc_root=proc)
        assert specs.ensure(1, ID_A) == f"example.com/mig.v1={MIG_A}"
        path = cdi_dir / f"example.com-mig.v1_{MIG_A}.json"
        assert json.loads(path.read_bytes())["cdiVersion"] == "0.6.0"

    def test_equal_inputs_give_equal_bytes(self, specs: CdiSpecs, tmp_path: Path, proc: Path) -> None:
        other = CdiSpecs(tmp_path / "other", proc_root=proc)
        specs.ensure(1, ID_A)
        other.ensure(1, ID_A)
        assert specs.spec_path(MIG_A).read_bytes() == other.spec_path(MIG_A).read_bytes()

    def test_an_instance_without_capability_files_gets_no_spec(self, specs: CdiSpecs, cdi_dir: Path) -> None:
        with pytest.raises(StateWriteFailed, match=MIG_A):
            specs.ensure(1, Identity(7, 0, MIG_A))
        assert not cdi_dir.exists() or list(cdi_dir.iterdir()) == []

    def test_proc_devices_without_nvidia_caps_fails_closed(self, specs: CdiSpecs, proc: Path) -> None:
        (proc / "devices").write_text(f"Character devices:\n{NVIDIA_MAJOR} nvidia-frontend\n")
        with pytest.raises(StateWriteFailed, match="nvidia-caps"):
            specs.ensure(1, ID_A)


# CDI rules (pkg/parser and specs-go): the JSON schema plus the Go library's semantic checks.
_KIND_PART = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_SPEC_FIELDS = {"cdiVersion", "kind", "devices", "annotations", "containerEdits"}
_DEVICE_FIELDS = {"name", "containerEdits", "annotations"}
_NODE_FIELDS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}


class TestCdiRules:
    def test_the_spec_satisfies_the_cdi_schema_and_name_rules(self, specs: CdiSpecs) -> None:
        specs.ensure(1, ID_A)
        spec = json.loads(specs.spec_path(MIG_A).read_bytes())

        assert set(spec) <= _SPEC_FIELDS
        assert {"cdiVersion", "kind", "devices"} <= set(spec)
        assert "annotations" not in spec  # would need cdiVersion 0.6.0
        vendor, _, cls = spec["kind"].partition("/")
        assert _KIND_PART.match(vendor)
        assert _KIND_PART.match(cls)
        assert len(cls) <= 63
        assert spec["devices"], "a spec needs at least one device"
        names = [d["name"] for d in spec["devices"]]
        assert len(names) == len(set(names))
        for device in spec["devices"]:
            assert set(device) <= _DEVICE_FIELDS
            assert _DEVICE_NAME.match(device["name"])
            assert not device["name"][0].isdigit()  # a leading digit needs cdiVersion 0.5.0
            edits = device["containerEdits"]
            assert edits, "device edits must not be empty"
            for node in edits["deviceNodes"]:
                assert set(node) <= _NODE_FIELDS
                assert node["path"].startswith("/dev/")
                assert "hostPath" not in node  # would need cdiVersion 0.5.0
                assert node["type"] == "c"
                assert isinstance(node["major"], int)
                assert isinstance(node["minor"], int)

    @pytest.mark.parametrize(
        "kind", ["foo", "vendor.com/foo/", "vendor.com/foo/bar", "1vendor/mig", "k8s/-mig", "/mig"]
    )
    def test_a_kind_that_breaks_the_cdi_rules_is_refused_at_construction(
        self, kind: str, cdi_dir: Path
    ) -> None:
        with pytest.raises(ValueError, match="not a CDI kind"):
            CdiSpecs(cdi_dir, kind=kind)

    def test_a_legacy_slash_mig_uuid_is_refused(self, specs: CdiSpecs) -> None:
        with pytest.raises(ValueError, match="not a MIG UUID"):
            specs.ensure(1, Identity(3, 0, "MIG-GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0/3/0"))


class TestReuse:
    def test_an_identical_file_is_left_alone(self, specs: CdiSpecs) -> None:
        specs.ensure(1, ID_A)
        path = specs.spec_path(MIG_A)
        inode = path.stat().st_ino
        assert is_current(specs, 1, ID_A)
        specs.ensure(1, ID_A)
        assert path.stat().st_ino == inode

    @pytest.mark.parametrize(
        "damage",
        [
            b'{"cdiVersion":"0.3.0","kind":"k8s.hami.io/mig","devices":[{"name":"%s"}]}' % MIG_A.encode(),
            b'{"cdiVersion":"9.9.9","kind":"k8s.hami.io/mig","devices":[{"name":"%s","containerEdits":'
            b'{"deviceNodes":[{"path":"/dev/null","type":"c","major":1,"minor":3}]}}]}' % MIG_A.encode(),
            b'{"kind":"k8s.hami.io/mig","devices":[{"name":"%s"},{"name":"%s"}],"extra":1}'
            % (MIG_A.encode(), MIG_A.encode()),
        ],
        ids=["no edits", "wrong edits and version", "the device twice and an unknown field"],
    )
    def test_a_missing_or_corrupt_spec_of_this_kind_naming_the_instance_is_rewritten(
        self, specs: CdiSpecs, damage: bytes
    ) -> None:
        specs.ensure(1, ID_A)
        path = specs.spec_path(MIG_A)
        good = path.read_bytes()
        path.write_bytes(damage)
        assert not is_current(specs, 1, ID_A)
        specs.ensure(1, ID_A)
        assert path.read_bytes() == good
        path.unlink()
        assert not is_current(specs, 1, ID_A)
        specs.ensure(1, ID_A)
        assert path.read_bytes() == good

    def test_a_changed_major_in_proc_makes_the_file_stale_and_ensure_rewrites_it(
        self, specs: CdiSpecs, proc: Path, cdi_dir: Path
    ) -> None:
        """Majors change only with a driver reload, which ends every instance and the sidecar's NVML
        session: the spec is rewritten by the next sidecar (a new ``CdiSpecs``), which renders afresh."""
        specs.ensure(1, ID_A)
        (proc / "devices").write_text(PROC_DEVICES.replace(f"{CAPS_MAJOR} nvidia-caps", "238 nvidia-caps", 1))
        restarted = CdiSpecs(cdi_dir, proc_root=proc)
        assert not is_current(restarted, 1, ID_A)
        restarted.ensure(1, ID_A)
        nodes = json.loads(specs.spec_path(MIG_A).read_bytes())["devices"][0]["containerEdits"]["deviceNodes"]
        assert [n["major"] for n in nodes] == [NVIDIA_MAJOR, NVIDIA_MAJOR, 238, 238]

    def test_a_spec_this_process_wrote_and_nobody_touched_is_not_rendered_again(
        self, specs: CdiSpecs, proc: Path
    ) -> None:
        """Known current: ensure answers from memory, so /proc is not read (here it is gone)."""
        name = specs.ensure(1, ID_A)
        path = specs.spec_path(MIG_A)
        good = path.read_bytes()
        (proc / "devices").unlink()
        assert specs.ensure(1, ID_A) == name
        assert path.read_bytes() == good
        path.unlink()  # touched: rendered again, which now fails for want of /proc
        with pytest.raises(StateWriteFailed):
            specs.ensure(1, ID_A)


class TestListing:
    def test_only_files_of_this_kind_are_listed(self, specs: CdiSpecs, cdi_dir: Path) -> None:
        specs.ensure(1, ID_A)
        specs.ensure(1, ID_B)
        (cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json").write_text(
            json.dumps(
                {
                    "cdiVersion": "0.5.0",
                    "kind": "k8s.device-plugin.nvidia.com/gpu",
                    "devices": [{"name": MIG_A}],
                }
            )
        )
        (cdi_dir / "broken.json").write_text("{")
        (cdi_dir / f".k8s.hami.io-mig_{MIG_A}.tmp-0123").write_text("{")
        (cdi_dir / "notes.yaml").write_text("kind: k8s.hami.io/mig")
        assert specs.list_mig_uuids() == {MIG_A: specs.spec_path(MIG_A), MIG_B: specs.spec_path(MIG_B)}

    def test_a_missing_directory_lists_nothing(self, specs: CdiSpecs) -> None:
        assert specs.list_mig_uuids() == {}


class TestTempSweep:
    """Temp files a crash inside a write left behind (``.<spec name>.tmp-<hex>``) are swept at startup;
    nothing else in the shared CDI directory is ever touched."""

    def test_only_this_kinds_leftover_temp_files_are_removed(self, specs: CdiSpecs, cdi_dir: Path) -> None:
        specs.ensure(1, ID_A)
        ours = cdi_dir / f".k8s.hami.io-mig_{MIG_B}.tmp-0123456789abcdef"
        ours.write_text('{"cdiVersion"')
        others = {
            f".k8s.device-plugin.nvidia.com-gpu_{MIG_B}.tmp-0123456789abcdef": "another kind's write",
            ".k8s.hami.io-mig_notes.tmp-0123456789abcdef": "not a MIG UUID",
            f"k8s.hami.io-mig_{MIG_B}.tmp-0123456789abcdef": "not a dotfile",
            f".k8s.hami.io-mig_{MIG_B}.json": "no temp marker",
            f".k8s.hami.io-mig_{MIG_B}.tmp-0123456789abcdef.json": "ends like a spec",
            ".hidden": "someone's dotfile",
            "k8s.device-plugin.nvidia.com-gpu.json": "{}",
        }
        for name, text in others.items():
            (cdi_dir / name).write_text(text)
        a_dir = cdi_dir / f".k8s.hami.io-mig_{MIG_A}.tmp-00000000000000aa"
        a_dir.mkdir()
        a_link = cdi_dir / f".k8s.hami.io-mig_{MIG_A}.tmp-00000000000000bb"
        a_link.symlink_to(cdi_dir / "k8s.device-plugin.nvidia.com-gpu.json")

        assert specs.sweep_temp_files() == [str(ours)]

        assert not ours.exists()
        for name, text in others.items():
            assert (cdi_dir / name).read_text() == text
        assert a_dir.is_dir()
        assert a_link.is_symlink()
        assert is_current(specs, 1, ID_A)

    def test_the_temp_files_of_a_configured_kind_are_its_own(self, cdi_dir: Path, proc: Path) -> None:
        specs = CdiSpecs(cdi_dir, kind="example.com/gpu.mig", proc_root=proc)
        cdi_dir.mkdir()
        ours = cdi_dir / f".example.com-gpu.mig_{MIG_A}.tmp-0123456789abcdef"
        default_kind = cdi_dir / f".k8s.hami.io-mig_{MIG_A}.tmp-0123456789abcdef"
        ours.write_text("")
        default_kind.write_text("")
        assert specs.sweep_temp_files() == [str(ours)]
        assert default_kind.exists()

    def test_a_missing_directory_or_disabled_cdi_sweeps_nothing(self, specs: CdiSpecs, proc: Path) -> None:
        assert specs.sweep_temp_files() == []
        assert CdiSpecs(None, proc_root=proc).sweep_temp_files() == []


class TestRemoval:
    def test_remove_deletes_the_file_and_a_missing_file_counts_as_removed(self, specs: CdiSpecs) -> None:
        specs.ensure(1, ID_A)
        assert specs.remove(MIG_A)
        assert not specs.spec_path(MIG_A).exists()
        assert specs.remove(MIG_A)
        assert specs.pending_removals() == []

    def test_a_failed_removal_is_queued_and_done_by_a_later_retry(
        self, specs: CdiSpecs, cdi_dir: Path
    ) -> None:
        specs.ensure(1, ID_A)
        specs.ensure(1, ID_B)
        # Tests run as root, where a 0555 directory stops no unlink. Replacing the directory with a
        # plain file makes unlink(2) fail with ENOTDIR for any user: the directory is unavailable,
        # as when a read-only or unmounted hostPath is in the way.
        moved = cdi_dir.with_name("cdi-away")
        cdi_dir.rename(moved)
        cdi_dir.write_text("not a directory")

        assert specs.remove(MIG_A) is False
        assert specs.pending_removals() == [str(specs.spec_path(MIG_A))]
        assert specs.retry_removals() == []
        assert specs.pending_removals() == [str(specs.spec_path(MIG_A))]

        cdi_dir.unlink()
        moved.rename(cdi_dir)
        assert specs.retry_removals() == [str(specs.spec_path(MIG_A))]
        assert specs.pending_removals() == []
        assert sorted(p.name for p in cdi_dir.iterdir()) == [specs.spec_path(MIG_B).name]

    def test_a_path_that_cannot_be_reached_stays_queued_until_it_can(
        self, specs: CdiSpecs, cdi_dir: Path
    ) -> None:
        # The CDI directory replaced by a file: every call on the path fails with ENOTDIR, also for root.
        specs.ensure(1, ID_A)
        path = specs.spec_path(MIG_A)
        moved = cdi_dir.with_name("cdi-away")
        cdi_dir.rename(moved)
        cdi_dir.write_text("not a directory")
        assert specs.remove(MIG_A) is False
        assert specs.retry_removals() == []
        assert specs.pending_removals() == [str(path)]
        cdi_dir.unlink()
        moved.rename(cdi_dir)
        assert specs.retry_removals() == [str(path)]
        assert not path.exists()

    def test_ensuring_an_instance_again_cancels_its_queued_removal(
        self, specs: CdiSpecs, cdi_dir: Path
    ) -> None:
        specs.ensure(1, ID_A)
        moved = cdi_dir.with_name("cdi-away")
        cdi_dir.rename(moved)
        cdi_dir.write_text("not a directory")
        assert specs.remove(MIG_A) is False
        cdi_dir.unlink()
        moved.rename(cdi_dir)
        specs.ensure(1, ID_A)
        assert specs.pending_removals() == []
        assert specs.retry_removals() == []
        assert specs.spec_path(MIG_A).exists()


class TestDisabled:
    def test_with_cdi_disabled_nothing_is_written_and_every_method_is_a_no_op(
        self, tmp_path: Path, proc: Path
    ) -> None:
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        specs = CdiSpecs(None, proc_root=proc)
        assert not specs.enabled
        assert specs.ensure(1, ID_A) == ""
        assert specs.device_name(MIG_A) == ""
        assert specs.remove(MIG_A)
        assert specs.pending_removals() == []
        assert specs.retry_removals() == []
        assert specs.list_mig_uuids() == {}
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


class TestOnlyThisSidecarsSpecIsTouched:
    """A file at a spec's path is ours only as a spec of our kind naming that MIG UUID alone."""

    FOREIGN = {
        "another kind": b'{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[{"name":"%s"}]}'
        % MIG_A.encode(),
        "another MIG UUID": b'{"cdiVersion":"0.3.0","kind":"k8s.hami.io/mig","devices":[{"name":"%s"}]}'
        % MIG_B.encode(),
        "a second MIG UUID": b'{"kind":"k8s.hami.io/mig","devices":[{"name":"%s"},{"name":"%s"}]}'
        % (MIG_A.encode(), MIG_B.encode()),
        "no devices": b'{"cdiVersion":"0.3.0","kind":"k8s.hami.io/mig","devices":[]}',
        "not JSON": b"{not json",
        "empty": b"",
        "truncated": b'{"cdiVersion":"0.3.0","kind":"k8s.hami.io/m',
        "a JSON list": b"[1, 2]",
        "a device that is not an object": b'{"kind":"k8s.hami.io/mig","devices":["%s"]}' % MIG_A.encode(),
    }

    @pytest.mark.parametrize("content", FOREIGN.values(), ids=FOREIGN.keys())
    def test_ensure_and_remove_leave_a_foreign_file_as_it_is_and_fail_naming_it(
        self, specs: CdiSpecs, content: bytes
    ) -> None:
        path = specs.spec_path(MIG_A)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)

        with pytest.raises(ForeignSpecFile) as ensured:
            specs.ensure(1, ID_A)
        with pytest.raises(ForeignSpecFile) as removed:
            specs.remove(MIG_A)

        assert path.read_bytes() == content
        for caught in (ensured, removed):
            assert (caught.value.reason, caught.value.code.name) == ("STATE_WRITE_FAILED", "UNAVAILABLE")
            assert caught.value.metadata == {"file": str(path), "mig_uuid": MIG_A}
            assert str(path) in caught.value.message
        assert specs.pending_removals() == []  # no retry makes it ours

    @pytest.mark.parametrize("target", ["symlink", "directory"])
    def test_a_symlink_or_a_directory_at_the_path_is_never_ours(
        self, specs: CdiSpecs, cdi_dir: Path, tmp_path: Path, target: str
    ) -> None:
        specs.ensure(1, ID_B)
        path = specs.spec_path(MIG_A)
        if target == "symlink":
            path.symlink_to(specs.spec_path(MIG_B))
        else:
            path.mkdir()
        before = specs.spec_path(MIG_B).read_bytes()

        with pytest.raises(ForeignSpecFile, match=target if target == "symlink" else "not a regular file"):
            specs.ensure(1, ID_A)
        with pytest.raises(ForeignSpecFile):
            specs.remove(MIG_A)

        assert path.is_symlink() if target == "symlink" else path.is_dir()
        assert specs.spec_path(MIG_B).read_bytes() == before

    def test_a_queued_removal_leaves_a_file_another_writer_put_there_meanwhile(
        self, specs: CdiSpecs, cdi_dir: Path
    ) -> None:
        specs.ensure(1, ID_A)
        moved = cdi_dir.with_name("cdi-away")  # the directory unreachable for a moment: queued
        cdi_dir.rename(moved)
        cdi_dir.write_text("not a directory")
        assert specs.remove(MIG_A) is False
        cdi_dir.unlink()
        moved.rename(cdi_dir)
        path = specs.spec_path(MIG_A)
        theirs = self.FOREIGN["another kind"]
        path.write_bytes(theirs)

        assert specs.retry_removals() == []

        assert path.read_bytes() == theirs
        assert specs.pending_removals() == []
