"""The takeover decision on plain values: what becomes of each of HAMi's records and specs.

The live layout is built from small frozen values that have the shape recovery's own ``LiveGpu``
has (``plan_takeover`` asks for no more); HAMi's files are decoded from the bytes HAMi writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from hami_format import record_bytes, record_filename, spec_bytes, spec_filename
from plain_board import TABLE, profiles

from sidecar.model.domain import ActiveAllocation, Identity, Owner, PodRef, Reservation, State
from sidecar.model.hami_files import HamiSpec, recognize_spec
from sidecar.model.hami_takeover import (
    HamiRecordFile,
    TakeoverInputs,
    TakeoverPlan,
    plan_takeover,
    read_record_file,
)
from sidecar.model.ownership import record_name
from sidecar.nvml.port import ComputeInstanceInfo, GpuInfo, GpuInstanceInfo, GpuInstanceProfile, Placement

GPU0 = "GPU-00000000-aaaa-4aaa-8aaa-000000000000"
GPU1 = "GPU-11111111-aaaa-4aaa-8aaa-111111111111"
BOOT = "boot-now"
NOW = "2030-01-01T00:00:00Z"
PROFILES = profiles("1g.10gb", "3g.40gb")


@dataclass(frozen=True)
class Gi:
    info: GpuInstanceInfo
    compute_instances: tuple[ComputeInstanceInfo, ...]


@dataclass(frozen=True)
class Gpu:
    info: GpuInfo
    profiles: tuple[GpuInstanceProfile, ...]
    gpu_instances: tuple[Gi, ...]


def mig(n: int) -> str:
    return f"MIG-{n:08x}-bbbb-5bbb-8bbb-{n:012x}"


def gi(  # noqa: PLR0917 - a GI as a row: GPU, ID, profile, start, CI ID, MIG UUID
    gpu: str, gi_id: int, profile: str, start: int, ci_id: int, uuid: str, *, ci_profile: int = -1
) -> Gi:
    gip, cip, size, _ = TABLE[profile]
    return Gi(
        GpuInstanceInfo(gpu, gi_id, gip, Placement(start, size)),
        (ComputeInstanceInfo(gpu, gi_id, ci_id, cip if ci_profile < 0 else ci_profile, uuid),),
    )


def gpu(uuid: str, *gis: Gi, mig_enabled: bool = True) -> Gpu:
    info = GpuInfo(0, uuid, 0, "NVIDIA H100 80GB HBM3", 81559, mig_enabled, mig_enabled)
    return Gpu(info, PROFILES, gis)


def hami(
    uuid: str, profile: str, start: int, gi_id: int, ci_id: int, *, parent: str = GPU0
) -> HamiRecordFile:
    size = TABLE[profile][2]
    return read_record_file(
        record_filename(uuid), record_bytes(uuid, parent, profile, start, size, gi_id, ci_id)
    )


def spec(uuid: str) -> HamiSpec:
    found = recognize_spec(spec_filename(uuid), spec_bytes(uuid, GPU0, 0, 1, 0))
    assert found is not None
    return found


def pod(  # noqa: PLR0917 - an allocation as a row
    uid: str, uuid: str, profile: str, start: int, gi_id: int, ci_id: int
) -> ActiveAllocation:
    size = TABLE[profile][2]
    return ActiveAllocation(
        owner=Owner(PodRef(uid, "default", f"name-{uid}"), "main", 0, 0),
        reservation=Reservation(GPU0, profile, Placement(start, size)),
        identity=Identity(gi_id, ci_id, uuid),
    )


def decide(**kwargs: object) -> TakeoverPlan:
    return plan_takeover(TakeoverInputs(boot_id=BOOT, now=NOW, generation=7, **kwargs))  # type: ignore[arg-type]


LAYOUT = (
    gpu(
        GPU0,
        gi(GPU0, 1, "1g.10gb", 0, 0, mig(1)),
        gi(GPU0, 2, "1g.10gb", 1, 0, mig(2)),
        gi(GPU0, 3, "3g.40gb", 4, 0, mig(3)),
    ),
)


class TestConversion:
    def test_a_record_the_pod_list_names_becomes_active_with_the_pod_as_owner(self) -> None:
        alloc = pod("p1", mig(1), "1g.10gb", 0, 1, 0)
        out = decide(hami_records=(hami(mig(1), "1g.10gb", 0, 1, 0),), gpus=LAYOUT, active=(alloc,))
        (conv,) = out.converted
        assert conv.filename == record_filename(mig(1))
        assert conv.record.state is State.ACTIVE
        assert conv.record.owner == alloc.owner
        assert conv.record.identity == Identity(1, 0, mig(1))
        assert (conv.record.gi_profile_id, conv.record.ci_profile_id) == (19, 0)
        assert (conv.record.activated_generation, conv.record.boot_id, conv.record.since) == (7, BOOT, NOW)
        assert out.complete
        assert not out.errors
        assert not out.kept

    def test_a_record_no_pod_names_becomes_idle(self) -> None:
        out = decide(hami_records=(hami(mig(3), "3g.40gb", 4, 3, 0),), gpus=LAYOUT)
        (conv,) = out.converted
        assert conv.record.state is State.IDLE
        assert conv.record.owner is None
        assert conv.record.name == record_name(GPU0, Placement(4, 4))
        assert conv.record.idled_generation == 7
        assert conv.record.profile == "3g.40gb"

    def test_a_pod_naming_the_mig_uuid_with_other_ids_does_not_make_it_active(self) -> None:
        alloc = pod("p1", mig(2), "1g.10gb", 1, 2, 5)
        out = decide(hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0),), gpus=LAYOUT, active=(alloc,))
        assert out.converted[0].record.state is State.IDLE

    def test_the_sidecars_cdi_name_is_recorded(self) -> None:
        out = decide(
            hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0),), gpus=LAYOUT, cdi_devices={mig(2): "k/c=x"}
        )
        assert out.converted[0].record.cdi_device == "k/c=x"


class TestFinish:
    def test_a_record_the_sidecar_already_holds_only_has_hamis_file_removed(self) -> None:
        """A crash between writing the sidecar's record and removing HAMi's file."""
        first = decide(hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0),), gpus=LAYOUT)
        ours = first.converted[0].record
        again = decide(hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0),), gpus=LAYOUT, owned=(ours,))
        assert not again.converted
        assert not again.kept
        (fin,) = again.finished
        assert (fin.filename, fin.record_name, fin.mig_uuid) == (record_filename(mig(2)), ours.name, mig(2))


class TestKept:
    def _one_kept(self, record: HamiRecordFile, layout: tuple[Gpu, ...] = LAYOUT) -> TakeoverPlan:
        out = decide(hami_records=(record,), gpus=layout)
        assert not out.converted
        assert not out.finished
        assert len(out.kept) == 1
        assert out.kept[0].filename == record.filename
        assert record.filename in out.errors[0]
        assert not out.complete
        return out

    def test_a_wrong_gi_id_keeps_the_file_and_the_instance_foreign(self) -> None:
        out = self._one_kept(hami(mig(2), "1g.10gb", 1, 5, 0))
        assert "GPU instance ID is 2, the record says 5" in out.kept[0].why
        assert out.foreign == {(GPU0, 2)}

    def test_a_wrong_ci_id_mig_uuid_profile_or_placement_keeps_it(self) -> None:
        assert "compute instance ID is 0" in self._one_kept(hami(mig(2), "1g.10gb", 1, 2, 4)).kept[0].why
        wrong_uuid = read_record_file(
            record_filename(mig(9)), record_bytes(mig(9), GPU0, "1g.10gb", 1, 1, 2, 0)
        )
        assert "MIG UUID is" in self._one_kept(wrong_uuid).kept[0].why
        wrong_profile = read_record_file(
            record_filename(mig(2)), record_bytes(mig(2), GPU0, "1g.20gb", 1, 1, 2, 0)
        )
        assert "profile 1g.10gb" in self._one_kept(wrong_profile).kept[0].why
        moved = self._one_kept(hami(mig(2), "1g.10gb", 5, 2, 0))
        assert "no GPU instance is at its placement" in moved.kept[0].why
        assert moved.foreign == {(GPU0, 2)}  # its MIG UUID still lives elsewhere: that one stays foreign

    def test_a_wrong_parent_gpu_keeps_it(self) -> None:
        out = self._one_kept(hami(mig(2), "1g.10gb", 1, 2, 0, parent=GPU1))
        assert "not visible" in out.kept[0].why
        assert out.foreign == {(GPU0, 2)}

    def test_mig_disabled_or_a_ci_of_another_profile_keeps_it(self) -> None:
        off = (gpu(GPU0, mig_enabled=False),)
        assert "MIG is disabled" in self._one_kept(hami(mig(2), "1g.10gb", 1, 2, 0), off).kept[0].why
        partial = (gpu(GPU0, gi(GPU0, 2, "1g.10gb", 1, 0, mig(2), ci_profile=9)),)
        assert "not the full-size" in self._one_kept(hami(mig(2), "1g.10gb", 1, 2, 0), partial).kept[0].why

    def test_a_bad_version_keeps_it_and_its_instance_foreign(self) -> None:
        data = record_bytes(mig(2), GPU0, "1g.10gb", 1, 1, 2, 0, version=2)
        out = self._one_kept(read_record_file(record_filename(mig(2)), data))
        assert "unsupported version 2" in out.kept[0].why
        assert out.foreign == {(GPU0, 2)}

    def test_garbage_is_kept_and_points_at_nothing(self) -> None:
        out = self._one_kept(read_record_file(record_filename(mig(2)), b"\x00garbage"))
        assert out.foreign == frozenset()

    def test_a_kept_record_never_makes_an_owned_instance_foreign(self) -> None:
        ours = decide(hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0),), gpus=LAYOUT).converted[0].record
        out = decide(hami_records=(hami(mig(2), "1g.10gb", 1, 9, 0),), gpus=LAYOUT, owned=(ours,))
        assert len(out.kept) == 1
        assert out.foreign == frozenset()

    def test_two_files_pointing_at_one_instance_are_both_kept(self) -> None:
        bad = read_record_file(record_filename(mig(9)), record_bytes(mig(9), GPU0, "1g.10gb", 1, 1, 2, 0))
        out = decide(hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0), bad), gpus=LAYOUT)
        assert not out.converted
        assert {k.filename for k in out.kept} == {record_filename(mig(2)), record_filename(mig(9))}
        assert out.foreign == {(GPU0, 2)}

    def test_an_instance_held_aside_by_the_sidecar_is_not_taken(self) -> None:
        out = decide(
            hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0),), gpus=LAYOUT, claimed=frozenset({(GPU0, 2)})
        )
        assert not out.converted
        assert len(out.kept) == 1

    def test_no_file_is_both_kept_and_converted(self) -> None:
        files = (
            hami(mig(1), "1g.10gb", 0, 1, 0),
            hami(mig(2), "1g.10gb", 1, 7, 0),
            hami(mig(3), "3g.40gb", 4, 3, 0),
        )
        out = decide(hami_records=files, gpus=LAYOUT)
        decided = [c.filename for c in out.converted] + [k.filename for k in out.kept]
        assert sorted(decided) == sorted(f.filename for f in files)
        assert len(set(decided)) == len(decided)


class TestSpecs:
    def test_the_spec_of_an_active_instance_is_kept_and_idle_and_strays_removed(self) -> None:
        out = decide(
            hami_records=(hami(mig(1), "1g.10gb", 0, 1, 0), hami(mig(2), "1g.10gb", 1, 2, 0)),
            hami_specs=(spec(mig(1)), spec(mig(2)), spec(mig(8))),
            gpus=LAYOUT,
            active=(pod("p1", mig(1), "1g.10gb", 0, 1, 0),),
        )
        assert [s.mig_uuid for s in out.keep_specs] == [mig(1)]
        assert {s.mig_uuid for s in out.remove_specs} == {mig(2), mig(8)}

    def test_nothing_is_removed_while_a_hami_record_is_kept(self) -> None:
        out = decide(
            hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0), hami(mig(3), "3g.40gb", 4, 9, 0)),
            hami_specs=(spec(mig(2)), spec(mig(8))),
            gpus=LAYOUT,
        )
        assert not out.complete
        assert not out.remove_specs
        assert {s.mig_uuid for s in out.keep_specs} == {mig(2), mig(8)}

    def test_the_spec_of_a_live_instance_nobody_owns_is_kept(self) -> None:
        out = decide(hami_specs=(spec(mig(3)),), gpus=LAYOUT)
        assert out.complete
        assert [s.mig_uuid for s in out.keep_specs] == [mig(3)]

    def test_the_spec_of_an_owned_active_or_error_instance_is_kept_until_destroyed(self) -> None:
        conv = decide(hami_records=(hami(mig(2), "1g.10gb", 1, 2, 0),), gpus=LAYOUT).converted[0].record
        for state in (State.ACTIVE, State.ERROR, State.DELETING):
            owned = msgspec.structs.replace(conv, state=state)
            out = decide(hami_specs=(spec(mig(2)),), gpus=LAYOUT, owned=(owned,))
            assert [s.mig_uuid for s in out.keep_specs] == [mig(2)], state
        out = decide(hami_specs=(spec(mig(2)),), gpus=LAYOUT, owned=(conv,))
        assert [s.mig_uuid for s in out.remove_specs] == [mig(2)]
