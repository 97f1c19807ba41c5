"""Rule 2b in the whole recovery plan: HAMi's records and specs among the sidecar's own rules.

``plan`` is pure, so every test builds the inputs by hand: a live layout, the sidecar's records, the
pod list, and HAMi's files decoded from the bytes HAMi writes (``hami_format``). The tests assert
the plan: which actions touch which file and in what order, the table, and the report. The decision
per file is ``test_hami_takeover``'s subject; these tests are about what the other rules make of it
(the pod list, the sidecar's own records, adoption of unowned instances, the CDI specs).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from hami_format import record_bytes, record_filename, spec_bytes, spec_filename
from plain_board import profiles

from sidecar.model.domain import ActiveAllocation, Identity, Owner, PodRef, Reservation, State
from sidecar.model.hami_files import HamiSpec, recognize_spec
from sidecar.model.hami_takeover import TAKEN_OVER_FROM, HamiRecordFile, read_record_file
from sidecar.model.ownership import OwnershipRecord, record_name
from sidecar.model.recovery_plan.actions import (
    DestroyOwned,
    EnsureCdi,
    Plan,
    PutRecord,
    RemoveCdi,
    RemoveHamiRecord,
    RemoveHamiSpec,
)
from sidecar.model.recovery_plan.inputs import Inputs, LiveGpu, LiveGpuInstance
from sidecar.model.recovery_plan.plan import plan
from sidecar.nvml.port import ComputeInstanceInfo, GpuInfo, GpuInstanceInfo, Placement

GPU0 = "GPU-00000000-aaaa-4aaa-8aaa-000000000000"
BOOT = "boot-now"
NOW = "2030-01-01T00:00:00Z"
KIND = "k8s.hami.io/mig"
PROFILES = profiles("1g.10gb", "3g.40gb")


def mig(n: int) -> str:
    return f"MIG-{n:08x}-bbbb-5bbb-8bbb-{n:012x}"


# One GPU, three 1g instances as HAMi made them: (GI ID, start, MIG UUID); CI ID 0 in each.
SLOTS = {mig(1): (1, 0), mig(2): (2, 1), mig(3): (3, 2)}


def layout(*uuids: str, processes: int = 0) -> LiveGpu:
    gis = tuple(
        LiveGpuInstance(
            info=GpuInstanceInfo(GPU0, SLOTS[u][0], 19, Placement(SLOTS[u][1], 1)),
            compute_instances=(ComputeInstanceInfo(GPU0, SLOTS[u][0], 0, 0, u),),
        )
        for u in uuids
    )
    info = GpuInfo(0, GPU0, 0, "NVIDIA H100 80GB HBM3", 81559, True, True)
    return LiveGpu(info=info, profiles=PROFILES, gpu_instances=gis, processes=processes)


def hami_record(uuid: str, *, gi_id: int | None = None, version: int = 1) -> HamiRecordFile:
    """HAMi's record of ``uuid`` as HAMi wrote it; ``gi_id`` / ``version`` to make it wrong."""
    real_gi, start = SLOTS[uuid]
    data = record_bytes(
        uuid, GPU0, "1g.10gb", start, 1, real_gi if gi_id is None else gi_id, 0, version=version
    )
    return read_record_file(record_filename(uuid), data)


def hami_spec(uuid: str) -> HamiSpec:
    found = recognize_spec(spec_filename(uuid), spec_bytes(uuid, GPU0, 0, SLOTS[uuid][0], 0))
    assert found is not None
    return found


def pod(uid: str, uuid: str) -> ActiveAllocation:
    gi_id, start = SLOTS[uuid]
    return ActiveAllocation(
        owner=Owner(PodRef(uid, "default", f"name-{uid}"), "main", 0, 0),
        reservation=Reservation(GPU0, "1g.10gb", Placement(start, 1)),
        identity=Identity(gi_id, 0, uuid),
    )


def name_of(uuid: str) -> str:
    return record_name(GPU0, Placement(SLOTS[uuid][1], 1))


def inputs(
    gpu: LiveGpu,
    *,
    hami: Iterable[HamiRecordFile] = (),
    specs: Iterable[HamiSpec] = (),
    records: Iterable[OwnershipRecord] = (),
    active: Iterable[ActiveAllocation] = (),
    cdi_files: Iterable[str] = (),
    adopt: bool = False,
    takeover: bool = True,
) -> Inputs:
    uuids = [ci.mig_uuid for gi in gpu.gpu_instances for ci in gi.compute_instances]
    return Inputs(
        active=tuple(active),
        records=tuple(records),
        gpus=(gpu,),
        cdi_files=tuple(cdi_files),
        cdi_devices={u: f"{KIND}={u}" for u in uuids},
        boot_id=BOOT,
        hami_records=tuple(hami),
        hami_specs=tuple(specs),
        hami_takeover=takeover,
        adopt_existing=adopt,
        generation=4,
        now=NOW,
    )


def table(p: Plan) -> dict[str, OwnershipRecord]:
    return {r.mig_uuid or r.name: r for r in p.table}


def hami_removed(p: Plan) -> list[str]:
    return [a.filename for a in p.actions if isinstance(a, RemoveHamiRecord)]


def hami_specs_removed(p: Plan) -> set[str]:
    return {a.mig_uuid for a in p.actions if isinstance(a, RemoveHamiSpec)}


def touched_gis(p: Plan) -> set[int]:
    """GI IDs that some action writes a record of or destroys."""
    return {
        a.record.gpu_instance_id
        for a in p.actions
        if isinstance(a, PutRecord | DestroyOwned) and a.record.gpu_instance_id is not None
    }


def foreign(p: Plan) -> set[str]:
    return {r.identity.mig_uuid for r in p.report.preserved_foreign if r.identity is not None}


def after(p: Plan, before: Inputs) -> Inputs:
    """What the next recovery gathers once every step of ``p`` succeeded (nothing is destroyed here)."""
    gone = set(hami_removed(p))
    specs_gone = hami_specs_removed(p)
    files = (set(before.cdi_files) - {a.mig_uuid for a in p.actions if isinstance(a, RemoveCdi)}) | {
        a.identity.mig_uuid for a in p.actions if isinstance(a, EnsureCdi)
    }
    return msgspec.structs.replace(
        before,
        records=p.table,
        hami_records=tuple(f for f in before.hami_records if f.filename not in gone),
        hami_specs=tuple(s for s in before.hami_specs if s.mig_uuid not in specs_gone),
        cdi_files=tuple(sorted(files)),
        generation=p.generation,
    )


class TestAnIdleHamiInstanceIsConvertedInOneStep:
    def test_its_record_is_written_before_hamis_file_goes_and_its_own_spec_last(self) -> None:
        p = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))]))
        (step,) = p.steps
        ours = table(p)[mig(1)]
        assert step.actions == (
            PutRecord(ours),
            RemoveHamiRecord(record_filename(mig(1)), name_of(mig(1)), mig(1)),
            EnsureCdi(0, Identity(1, 0, mig(1))),
        )
        assert step.record_name == ours.name

    def test_the_record_is_idle_marked_taken_over_and_stamped_with_the_fresh_generation(self) -> None:
        p = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))]))
        ours = table(p)[mig(1)]
        assert (ours.state, ours.owner, ours.taken_over_from) == (State.IDLE, None, TAKEN_OVER_FROM)
        assert ours.identity == Identity(1, 0, mig(1))
        assert ours.idled_generation == p.generation == 5
        assert (ours.boot_id, ours.since, ours.cdi_device) == (BOOT, NOW, f"{KIND}={mig(1)}")

    def test_it_is_reported_restored_idle_and_not_foreign(self) -> None:
        p = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))]))
        assert [r.identity for r in p.report.restored_idle] == [Identity(1, 0, mig(1))]
        assert p.report.preserved_foreign == p.report.adopted_foreign == ()
        assert p.report.errors == ()

    def test_adoption_of_unowned_instances_does_not_take_it_a_second_time(self) -> None:
        p = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))], adopt=True))
        assert p.report.adopted_foreign == ()
        assert [a.record.taken_over_from for a in p.actions if isinstance(a, PutRecord)] == [TAKEN_OVER_FROM]

    def test_its_hami_spec_goes_in_a_step_after_every_record_step(self) -> None:
        p = plan(
            inputs(
                layout(mig(1), mig(2)),
                hami=[hami_record(mig(1)), hami_record(mig(2))],
                specs=[hami_spec(mig(1)), hami_spec(mig(2))],
            )
        )
        kinds = [type(step.actions[0]) for step in p.steps]
        assert kinds == [PutRecord, PutRecord, RemoveHamiSpec, RemoveHamiSpec]
        assert hami_specs_removed(p) == {mig(1), mig(2)}


class TestAnActiveHamiInstanceIsAdoptedForItsPodAndKeepsHamisSpec:
    def test_the_pod_list_adopts_it_and_the_takeover_marks_it_then_removes_hamis_file(self) -> None:
        p = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))], active=[pod("pod-a", mig(1))]))
        adopt, finish = p.steps
        ours = table(p)[mig(1)]
        assert (ours.state, ours.owner, ours.taken_over_from) == (
            State.ACTIVE,
            pod("pod-a", mig(1)).owner,
            TAKEN_OVER_FROM,
        )
        # The mark goes into the adoption's own write: no crash leaves an unmarked record of it.
        assert adopt.actions[0] == PutRecord(ours)
        assert finish.actions == (RemoveHamiRecord(record_filename(mig(1)), ours.name, mig(1)),)

    def test_it_is_reported_adopted_active_once(self) -> None:
        p = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))], active=[pod("pod-a", mig(1))]))
        assert [r.identity for r in p.report.adopted_active] == [Identity(1, 0, mig(1))]
        assert p.report.restored_idle == p.report.preserved_foreign == ()

    def test_its_hami_spec_stays_while_the_idle_ones_go(self) -> None:
        p = plan(
            inputs(
                layout(mig(1), mig(2), mig(3)),
                hami=[hami_record(u) for u in (mig(1), mig(2), mig(3))],
                specs=[hami_spec(u) for u in (mig(1), mig(2), mig(3))],
                active=[pod("pod-a", mig(1))],
            )
        )
        assert hami_specs_removed(p) == {mig(2), mig(3)}
        assert {u: r.state for u, r in table(p).items()} == {
            mig(1): State.ACTIVE,
            mig(2): State.IDLE,
            mig(3): State.IDLE,
        }
        assert set(hami_removed(p)) == {record_filename(u) for u in (mig(1), mig(2), mig(3))}

    def test_a_restart_while_its_pod_runs_keeps_the_mark_that_makes_teardown_remove_hamis_spec(self) -> None:
        before = inputs(layout(mig(1)), hami=[hami_record(mig(1))], active=[pod("pod-a", mig(1))])
        first = plan(before)
        again = plan(after(first, before))
        assert table(again)[mig(1)].taken_over_from == TAKEN_OVER_FROM
        assert [a for a in again.actions if isinstance(a, PutRecord)] == []


class TestACrashBetweenTheTwoWritesIsFinishedByTheNextPlan:
    def test_with_the_sidecars_record_on_disk_only_hamis_file_is_removed(self) -> None:
        """The state ``after-takeover-record`` leaves: our record is durable, HAMi's file is still there."""
        first = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))]))
        crashed = msgspec.structs.replace(
            inputs(layout(mig(1)), hami=[hami_record(mig(1))]),
            records=first.table,
            generation=first.generation,
        )
        p = plan(crashed)
        assert hami_removed(p) == [record_filename(mig(1))]
        assert table(p) == table(first)
        assert [a for a in p.actions if isinstance(a, PutRecord) and a.record.mig_uuid == mig(1)] == []
        assert p.report.errors == ()

    def test_the_finish_step_comes_after_the_step_that_restores_the_record(self) -> None:
        first = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))]))
        stale = msgspec.structs.replace(first.table[0], cdi_device="")
        crashed = msgspec.structs.replace(
            inputs(layout(mig(1)), hami=[hami_record(mig(1))]), records=(stale,), generation=first.generation
        )
        p = plan(crashed)
        order = [type(a) for a in p.actions if isinstance(a, PutRecord | RemoveHamiRecord)]
        assert order == [PutRecord, RemoveHamiRecord]

    def test_a_hami_file_naming_an_instance_the_sidecar_owns_by_its_own_record_is_a_conflict(self) -> None:
        """The sidecar's record wins as it is (provenance unchanged), HAMi's file stays for the
        operator and the conflict is named."""
        first = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))]))
        own = msgspec.structs.replace(first.table[0], taken_over_from="")
        conflicting = msgspec.structs.replace(
            inputs(layout(mig(1)), hami=[hami_record(mig(1))]),
            records=(own,),
            generation=first.generation,
        )
        p = plan(conflicting)
        assert table(p)[mig(1)] == own
        assert hami_removed(p) == []
        assert [a for a in p.actions if isinstance(a, PutRecord)] == []
        assert p.report.preserved_foreign == ()
        [line] = p.report.errors
        assert record_filename(mig(1)) in line
        assert "already owns" in line
        assert own.name in line

    def test_a_second_plan_over_a_complete_takeover_changes_nothing(self) -> None:
        before = inputs(
            layout(mig(1), mig(2)),
            hami=[hami_record(mig(1)), hami_record(mig(2))],
            specs=[hami_spec(mig(1)), hami_spec(mig(2))],
            active=[pod("pod-a", mig(1))],
        )
        first = plan(before)
        second = plan(after(first, before))
        assert table(second) == table(first)
        assert second.generation == first.generation
        assert hami_removed(second) == []
        assert hami_specs_removed(second) == set()
        assert all(isinstance(a, EnsureCdi) for a in second.actions)


class TestAHamiRecordThatDoesNotMatchIsKeptAndItsInstanceForeign:
    def test_a_wrong_gi_id_touches_nothing_even_with_adoption_on(self) -> None:
        p = plan(
            inputs(layout(mig(1)), hami=[hami_record(mig(1), gi_id=9)], specs=[hami_spec(mig(1))], adopt=True)
        )
        assert p.steps == ()
        assert foreign(p) == {mig(1)}
        assert p.table == ()
        (error,) = p.report.errors
        assert record_filename(mig(1)) in error
        assert "GPU instance ID is 1, the record says 9" in error

    def test_a_bad_version_touches_nothing_even_with_adoption_on(self) -> None:
        p = plan(inputs(layout(mig(2)), hami=[hami_record(mig(2), version=2)], adopt=True))
        assert p.steps == ()
        assert foreign(p) == {mig(2)}
        (error,) = p.report.errors
        assert record_filename(mig(2)) in error
        assert "unsupported version 2" in error

    def test_an_orphan_gi_a_kept_file_points_at_is_never_destroyed(self) -> None:
        """A GI with no CI is an orphan that adoption removes on an idle GPU - unless HAMi's file
        still speaks for it."""
        gpu = layout(mig(1))
        bare = msgspec.structs.replace(
            gpu, gpu_instances=(msgspec.structs.replace(gpu.gpu_instances[0], compute_instances=()),)
        )
        p = plan(inputs(bare, hami=[hami_record(mig(1))], adopt=True))
        assert [a for a in p.actions if isinstance(a, DestroyOwned)] == []
        assert p.report.removed_orphan_gis == ()
        assert len(p.report.preserved_foreign) == 1

    def test_the_others_are_converted_but_no_hami_spec_is_removed_while_one_is_kept(self) -> None:
        p = plan(
            inputs(
                layout(mig(1), mig(2), mig(3)),
                hami=[hami_record(mig(1)), hami_record(mig(2), gi_id=7), hami_record(mig(3), version=0)],
                specs=[hami_spec(u) for u in (mig(1), mig(2), mig(3))],
            )
        )
        assert hami_removed(p) == [record_filename(mig(1))]
        assert hami_specs_removed(p) == set()
        assert foreign(p) == {mig(2), mig(3)}
        assert touched_gis(p) == {1}

    def test_the_sidecars_own_spec_of_a_kept_instance_is_not_removed(self) -> None:
        p = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1), gi_id=9)], cdi_files=[mig(1)]))
        assert [a for a in p.actions if isinstance(a, RemoveCdi)] == []

    def test_no_file_is_both_kept_and_converted(self) -> None:
        files = [hami_record(mig(1)), hami_record(mig(2), gi_id=7), hami_record(mig(3), version=3)]
        p = plan(inputs(layout(mig(1), mig(2), mig(3)), hami=files, active=[pod("pod-a", mig(1))]))
        removed = set(hami_removed(p))
        named = {f.filename for f in files if any(f.filename in e for e in p.report.errors)}
        assert removed == {record_filename(mig(1))}
        assert named == {record_filename(mig(2)), record_filename(mig(3))}
        assert not removed & named


class TestAHamiRecordNeverOutranksTheSidecarsOwn:
    def test_a_gi_the_sidecar_keeps_aside_is_not_taken_on_hamis_word(self) -> None:
        """The sidecar's own record of GI 1 contradicts the hardware (wrong CI ID): it is kept aside,
        and HAMi's record of the same instance does not convert it."""
        ours = OwnershipRecord(
            gpu_uuid=GPU0,
            profile="1g.10gb",
            gi_profile_id=19,
            ci_profile_id=0,
            placement=Placement(0, 1),
            state=State.IDLE,
            gpu_instance_id=1,
            compute_instance_id=5,
            mig_uuid=mig(1),
            cdi_device=f"{KIND}={mig(1)}",
            boot_id=BOOT,
            since=NOW,
        )
        p = plan(inputs(layout(mig(1)), hami=[hami_record(mig(1))], records=[ours]))
        assert hami_removed(p) == []
        assert touched_gis(p) == set()
        assert any(record_filename(mig(1)) in e for e in p.report.errors)


class TestWithTheTakeoverTurnedOffEveryHamiFileIsKept:
    def test_nothing_is_converted_adopted_or_removed_and_every_file_is_named(self) -> None:
        p = plan(
            inputs(
                layout(mig(1), mig(2)),
                hami=[hami_record(mig(1)), hami_record(mig(2), version=2)],
                specs=[hami_spec(mig(1))],
                adopt=True,
                takeover=False,
            )
        )
        assert p.steps == ()
        assert foreign(p) == {mig(1), mig(2)}
        assert all("--no-hami-takeover" in e for e in p.report.errors)
        assert {
            f
            for f in (record_filename(mig(1)), record_filename(mig(2)))
            if any(f in e for e in p.report.errors)
        } == {
            record_filename(mig(1)),
            record_filename(mig(2)),
        }
