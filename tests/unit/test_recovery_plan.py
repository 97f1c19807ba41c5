"""The recovery planner on plain values: one class per rule, names that read as the rule.

``plan`` is pure, so every test builds the inputs by hand (records, a live GI/CI layout, CDI files,
active allocations) and asserts the plan: the actions, the resulting table of owned records, and the
report. A small H100-like profile table is enough; the rules do not depend on the model.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plain_board import TABLE, profiles

from sidecar.model import errors
from sidecar.model.domain import ActiveAllocation, Identity, Owner, PodRef, Reservation, State
from sidecar.model.ownership import OwnershipRecord, parse_record_name, record_name
from sidecar.model.recovery_plan.actions import (
    DeleteRecord,
    DestroyOwned,
    EnsureCdi,
    Plan,
    PutRecord,
    RemoveCdi,
    settle_report,
)
from sidecar.model.recovery_plan.inputs import CorruptFile, Inputs, LiveGpu, LiveGpuInstance
from sidecar.model.recovery_plan.plan import plan
from sidecar.nvml.port import ComputeInstanceInfo, GpuInfo, GpuInstanceInfo, Placement

GPU0 = "GPU-00000000-aaaa-4aaa-8aaa-000000000000"
GPU1 = "GPU-11111111-aaaa-4aaa-8aaa-111111111111"
BOOT = "boot-now"
OLD_BOOT = "boot-before"
NOW = "2030-01-01T00:00:00Z"
KIND = "k8s.hami.io/mig"

PROFILES = profiles()
PROFILE_ID = {name: v[0] for name, v in TABLE.items()}
CI_PROFILE_ID = {name: v[1] for name, v in TABLE.items()}


def mig(n: int) -> str:
    return f"MIG-{n:08x}-bbbb-5bbb-8bbb-{n:012x}"


def live_gi(
    gpu: str,
    gi_id: int,
    profile: str,
    start: int,
    size: int,
    *ci_uuids: str,
    ci_profile: int | None = None,
) -> LiveGpuInstance:
    """A GI with one CI per given MIG UUID (CI IDs 0, 1, ...; full-size CI profile unless told)."""
    cip = CI_PROFILE_ID[profile] if ci_profile is None else ci_profile
    return LiveGpuInstance(
        info=GpuInstanceInfo(gpu, gi_id, PROFILE_ID[profile], Placement(start, size)),
        compute_instances=tuple(
            ComputeInstanceInfo(gpu, gi_id, ci_id, cip, uuid) for ci_id, uuid in enumerate(ci_uuids)
        ),
    )


def live_gpu(
    uuid: str, *gis: LiveGpuInstance, processes: int = 0, mig_enabled: bool = True, minor: int = 0
) -> LiveGpu:
    info = GpuInfo(
        index=minor,
        uuid=uuid,
        minor=minor,
        model="NVIDIA H100 80GB HBM3",
        memory_mb=81559,
        mig_current=mig_enabled,
        mig_pending=mig_enabled,
    )
    return LiveGpu(
        info=info, profiles=PROFILES, gpu_instances=gis if mig_enabled else (), processes=processes
    )


def owner(pod: str, device: int = 0) -> Owner:
    return Owner(PodRef(pod, "default", f"name-{pod}"), "main", 0, device)


def rec(  # noqa: PLR0917 - positional fields keep the scenario tables readable as rows
    gpu: str,
    profile: str,
    start: int,
    size: int,
    state: State,
    gi_id: int | None = None,
    ci_id: int | None = None,
    mig_uuid: str | None = None,
    *,
    boot: str = BOOT,
    holder: Owner | None = None,
    generation: int = 0,
    cdi: bool = True,
) -> OwnershipRecord:
    return OwnershipRecord(
        gpu_uuid=gpu,
        profile=profile,
        gi_profile_id=PROFILE_ID[profile],
        ci_profile_id=CI_PROFILE_ID[profile],
        placement=Placement(start, size),
        state=state,
        gpu_instance_id=gi_id,
        compute_instance_id=ci_id,
        mig_uuid=mig_uuid,
        owner=holder,
        activated_generation=generation,
        cdi_device=f"{KIND}={mig_uuid}" if mig_uuid and cdi else "",
        boot_id=boot,
        since="2029-12-31T00:00:00Z",
    )


def alloc(  # noqa: PLR0917 - positional fields keep the scenario tables readable as rows
    pod: str, gpu: str, profile: str, start: int, size: int, gi_id: int, ci_id: int, mig_uuid: str
) -> ActiveAllocation:
    return ActiveAllocation(
        owner=owner(pod),
        reservation=Reservation(gpu, profile, Placement(start, size)),
        identity=Identity(gi_id, ci_id, mig_uuid),
    )


def inputs(
    *gpus: LiveGpu,
    records: Iterable[OwnershipRecord] = (),
    active: Iterable[ActiveAllocation] = (),
    corrupt: Iterable[CorruptFile] = (),
    cdi_files: Iterable[str] = (),
    adopt: bool = False,
    cdi: bool = True,
    generation: int = 0,
) -> Inputs:
    uuids = [ci.mig_uuid for g in gpus for gi in g.gpu_instances for ci in gi.compute_instances]
    return Inputs(
        active=tuple(active),
        records=tuple(records),
        corrupt=tuple(corrupt),
        gpus=tuple(gpus),
        cdi_files=tuple(cdi_files),
        cdi_devices={u: f"{KIND}={u}" for u in uuids} if cdi else {},
        boot_id=BOOT,
        adopt_existing=adopt,
        generation=generation,
        now=NOW,
    )


def table(p: Plan) -> dict[str, OwnershipRecord]:
    return {r.name: r for r in p.table}


def writes(p: Plan) -> dict[str, OwnershipRecord]:
    return {a.record.name: a.record for a in p.actions if isinstance(a, PutRecord)}


def deletes(p: Plan) -> set[str]:
    return {a.name for a in p.actions if isinstance(a, DeleteRecord)}


def destroyed(p: Plan) -> set[tuple[str, int]]:
    """(GPU UUID, GI ID) of every GPU instance the plan destroys."""
    return {
        (a.record.gpu_uuid, a.record.gpu_instance_id)
        for a in p.actions
        if isinstance(a, DestroyOwned) and a.record.gpu_instance_id is not None
    }


def removed_cdi(p: Plan) -> set[str]:
    return {a.mig_uuid for a in p.actions if isinstance(a, RemoveCdi)}


def ensured_cdi(p: Plan) -> set[str]:
    return {a.identity.mig_uuid for a in p.actions if isinstance(a, EnsureCdi)}


def foreign_gis(p: Plan) -> set[tuple[str, int]]:
    """(GPU UUID, start) of every preserved foreign instance."""
    return {(r.reservation.gpu_uuid, r.reservation.placement.start) for r in p.report.preserved_foreign}


def name(gpu: str, start: int, size: int) -> str:
    return record_name(gpu, Placement(start, size))


# -- rule 1 ------------------------------------------------------------------------------------------


class TestActiveAllocationsAreAdoptedOnlyWhenTheyMatchTheHardwareExactly:
    def test_an_exact_match_becomes_an_active_record_owned_by_the_allocation(self) -> None:
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))),
                active=[alloc("pod-a", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1))],
                generation=4,
            )
        )
        record = table(p)[name(GPU0, 0, 1)]
        assert record.state is State.ACTIVE
        assert record.owner == owner("pod-a")
        assert record.identity == Identity(3, 0, mig(1))
        assert (record.gi_profile_id, record.ci_profile_id) == (19, 0)
        assert record.activated_generation == 5
        assert record.boot_id == BOOT
        assert record.cdi_device == f"{KIND}={mig(1)}"
        assert writes(p) == {record.name: record}
        assert p.generation == 5
        assert [r.identity for r in p.report.adopted_active] == [Identity(3, 0, mig(1))]
        assert ensured_cdi(p) == {mig(1)}

    def test_an_allocation_already_recorded_active_for_the_same_owner_is_not_rewritten(self) -> None:
        existing = rec(GPU0, "1g.10gb", 0, 1, State.ACTIVE, 3, 0, mig(1), holder=owner("pod-a"), generation=7)
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))),
                records=[existing],
                active=[alloc("pod-a", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1))],
                generation=2,
            )
        )
        assert table(p) == {existing.name: existing}
        assert writes(p) == {}
        assert p.generation == 7

    def test_an_idle_record_named_by_an_allocation_becomes_active_again(self) -> None:
        existing = rec(GPU0, "3g.40gb", 4, 4, State.IDLE, 2, 0, mig(2), generation=3)
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4, mig(2))),
                records=[existing],
                active=[alloc("pod-b", GPU0, "3g.40gb", 4, 4, 2, 0, mig(2))],
                generation=3,
            )
        )
        record = writes(p)[existing.name]
        assert (record.state, record.owner, record.activated_generation, record.since) == (
            State.ACTIVE,
            owner("pod-b"),
            4,
            NOW,
        )

    def test_in_a_repeated_recover_an_idle_record_named_by_an_allocation_stays_idle(self) -> None:
        """The list may predate the release that idled it; only the fenced SyncActive reactivates."""
        existing = msgspec.structs.replace(
            rec(GPU0, "3g.40gb", 4, 4, State.IDLE, 2, 0, mig(2), generation=3), idled_generation=4
        )
        listed = alloc("pod-b", GPU0, "3g.40gb", 4, 4, 2, 0, mig(2))
        p = plan(
            msgspec.structs.replace(
                inputs(
                    live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4, mig(2))),
                    records=[existing],
                    active=[listed],
                    generation=4,
                ),
                recovered=True,
            )
        )
        assert table(p) == {existing.name: existing}
        assert writes(p) == {}
        assert p.generation == 4
        assert p.report.adopted_active == ()
        assert [r.identity for r in p.report.restored_idle] == [Identity(2, 0, mig(2))]
        [line] = p.report.errors
        assert str(listed.key) in line
        assert mig(2) in line

    @pytest.mark.parametrize("holder", [None, owner("pod-a")], ids=["released", "another pod's"])
    def test_in_a_repeated_recover_an_error_record_named_by_an_allocation_stays_error(
        self, holder: Owner | None
    ) -> None:
        """Its destroy failed: never reused, and the listed pod does not guard it from the reconciler."""
        failed = msgspec.structs.replace(
            rec(GPU0, "3g.40gb", 4, 4, State.ERROR, 2, 0, mig(2), holder=holder), last_error="destroy failed"
        )
        listed = alloc("pod-b", GPU0, "3g.40gb", 4, 4, 2, 0, mig(2))
        p = plan(
            msgspec.structs.replace(
                inputs(
                    live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4, mig(2))),
                    records=[failed],
                    active=[listed],
                    cdi_files=[mig(2)],
                ),
                recovered=True,
            )
        )
        assert table(p) == {failed.name: failed}
        assert p.actions == ()
        assert p.report.adopted_active == p.report.restored_idle == ()
        assert p.referenced_mig_uuids == frozenset()
        [line] = p.report.errors
        assert str(listed.key) in line
        assert mig(2) in line

    def test_in_a_repeated_recover_an_error_record_of_the_listed_owner_is_adopted(self) -> None:
        """Recoverer's own adoption of that pod whose record could not be written: the pod holds it."""
        listed = alloc("pod-b", GPU0, "3g.40gb", 4, 4, 2, 0, mig(2))
        failed = rec(GPU0, "3g.40gb", 4, 4, State.ERROR, 2, 0, mig(2), holder=listed.owner)
        p = plan(
            msgspec.structs.replace(
                inputs(
                    live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4, mig(2))),
                    records=[failed],
                    active=[listed],
                ),
                recovered=True,
            )
        )
        record = table(p)[failed.name]
        assert (record.state, record.owner) == (State.ACTIVE, listed.owner)
        assert writes(p) == {failed.name: record}
        assert [r.identity for r in p.report.adopted_active] == [Identity(2, 0, mig(2))]
        assert p.referenced_mig_uuids == {mig(2)}
        assert p.report.errors == ()

    def test_the_pod_annotation_wins_over_a_record_that_disagrees_with_the_hardware(self) -> None:
        stale = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 3, 0, mig(9))
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))),
                records=[stale],
                active=[alloc("pod-a", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1))],
            )
        )
        assert writes(p)[stale.name].mig_uuid == mig(1)
        assert p.report.preserved_foreign == ()

    def test_a_repeated_identical_allocation_counts_once(self) -> None:
        a = alloc("pod-a", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))), active=[a, a]))
        assert len(p.report.adopted_active) == 1

    @pytest.mark.parametrize(
        ("allocation", "complaint"),
        [
            pytest.param(alloc("p", GPU0, "1g.10gb", 0, 1, 3, 0, mig(99)), "MIG UUID", id="other MIG UUID"),
            pytest.param(alloc("p", GPU0, "1g.10gb", 0, 1, 4, 0, mig(1)), "does not exist", id="other GI ID"),
            pytest.param(alloc("p", GPU0, "1g.10gb", 0, 1, 3, 1, mig(1)), "not 1", id="other CI ID"),
            pytest.param(alloc("p", GPU0, "3g.40gb", 0, 1, 3, 0, mig(1)), "profile", id="other profile"),
            pytest.param(alloc("p", GPU0, "1g.10gb", 1, 1, 3, 0, mig(1)), "placement", id="other placement"),
            pytest.param(
                alloc("p", GPU1, "1g.10gb", 0, 1, 3, 0, mig(1)), "not on this node", id="unknown GPU"
            ),
        ],
    )
    def test_any_mismatch_is_unverifiable_and_plans_nothing(
        self, allocation: ActiveAllocation, complaint: str
    ) -> None:
        with pytest.raises(errors.UnverifiableState, match=complaint) as caught:
            plan(
                inputs(
                    live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))),
                    # Rules that would otherwise act: a stale record and an orphan GI with adoption on.
                    records=[rec(GPU0, "1g.10gb", 5, 1, State.IDLE, 12, 0, mig(5))],
                    active=[allocation],
                    adopt=True,
                )
            )
        assert caught.value.metadata["allocations"] == "p/0/0"

    def test_one_key_listed_pending_and_with_an_identity_is_unverifiable(self) -> None:
        held = alloc("p", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1))
        pending = ActiveAllocation(held.owner, held.reservation)
        with pytest.raises(errors.UnverifiableState, match="listed twice"):
            plan(inputs(live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))), active=[held, pending]))

    def test_an_instance_with_two_compute_instances_is_unverifiable(self) -> None:
        with pytest.raises(errors.UnverifiableState, match="2 compute instances"):
            plan(
                inputs(
                    live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1), mig(2))),
                    active=[alloc("p", GPU0, "3g.40gb", 0, 4, 1, 0, mig(1))],
                )
            )

    def test_an_allocation_on_a_gpu_with_mig_disabled_is_unverifiable(self) -> None:
        with pytest.raises(errors.UnverifiableState, match="MIG is disabled"):
            plan(
                inputs(
                    live_gpu(GPU0, mig_enabled=False),
                    active=[alloc("p", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1))],
                )
            )

    def test_two_pods_claiming_one_instance_is_unverifiable(self) -> None:
        with pytest.raises(errors.UnverifiableState, match="both claim"):
            plan(
                inputs(
                    live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))),
                    active=[
                        alloc("pod-a", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1)),
                        alloc("pod-b", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1)),
                    ],
                )
            )

    def test_one_key_with_two_reservations_is_unverifiable(self) -> None:
        with pytest.raises(errors.UnverifiableState, match="listed twice"):
            plan(
                inputs(
                    live_gpu(
                        GPU0,
                        live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(1)),
                        live_gi(GPU0, 8, "1g.10gb", 1, 1, mig(2)),
                    ),
                    active=[
                        alloc("pod-a", GPU0, "1g.10gb", 0, 1, 7, 0, mig(1)),
                        alloc("pod-a", GPU0, "1g.10gb", 1, 1, 8, 0, mig(2)),
                    ],
                )
            )

    def test_a_verified_instance_whose_record_file_is_corrupt_stays_foreign(self) -> None:
        corrupt = CorruptFile(name(GPU0, 0, 1), "bad checksum")
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))),
                active=[alloc("pod-a", GPU0, "1g.10gb", 0, 1, 3, 0, mig(1))],
                corrupt=[corrupt],
                cdi_files=[mig(1)],
            )
        )
        assert p.actions == ()
        assert table(p) == {}
        assert foreign_gis(p) == {(GPU0, 0)}
        assert any(corrupt.name in e and "corrupt" in e for e in p.report.errors)


# -- rule 2 ------------------------------------------------------------------------------------------


class TestVerifiedRecordsWithoutAnActivePodAreRestoredIdle:
    def test_an_idle_record_that_matches_stays_idle_without_a_write(self) -> None:
        idle = rec(GPU0, "3g.40gb", 0, 4, State.IDLE, 1, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))), records=[idle]))
        assert table(p) == {idle.name: idle}
        assert writes(p) == {}
        assert [r.identity for r in p.report.restored_idle] == [Identity(1, 0, mig(1))]

    def test_an_active_record_whose_pod_is_gone_becomes_idle_without_an_owner(self) -> None:
        active = rec(GPU0, "3g.40gb", 0, 4, State.ACTIVE, 1, 0, mig(1), holder=owner("gone"), generation=6)
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))), records=[active]))
        restored = writes(p)[active.name]
        assert (restored.state, restored.owner, restored.since) == (State.IDLE, None, NOW)
        assert restored.activated_generation == 6
        assert table(p) == {active.name: restored}
        # Going IDLE takes a fresh generation, as a release does: a SyncActive fenced with any
        # generation handed out before cannot hand the instance back to the pod that is gone.
        assert restored.idled_generation == p.generation == 7

    def test_the_generation_never_falls_below_a_records_idle_generation(self) -> None:
        idle = msgspec.structs.replace(
            rec(GPU0, "3g.40gb", 0, 4, State.IDLE, 1, 0, mig(1), generation=3), idled_generation=9
        )
        p = plan(
            inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))), records=[idle], generation=2)
        )
        assert table(p) == {idle.name: idle}
        assert p.generation == 9

    def test_a_record_from_an_earlier_boot_is_restored_when_its_mig_uuid_is_still_live(self) -> None:
        idle = rec(GPU0, "1g.10gb", 2, 1, State.IDLE, 9, 0, mig(3), boot=OLD_BOOT)
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 9, "1g.10gb", 2, 1, mig(3))), records=[idle]))
        assert table(p) == {idle.name: idle}
        assert p.report.dropped_stale_records == ()


class TestRecordsWhoseInstanceIsGoneAreDroppedWithTheirCdiFile:
    def test_a_record_without_a_live_gi_is_dropped_and_its_cdi_file_removed(self) -> None:
        idle = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0), records=[idle], cdi_files=[mig(1)]))
        assert deletes(p) == {idle.name}
        assert removed_cdi(p) == {mig(1)}
        assert table(p) == {}
        assert p.report.dropped_stale_records == (idle.name,)
        assert destroyed(p) == set()

    def test_the_cdi_file_is_removed_before_the_record(self) -> None:
        idle = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0), records=[idle], cdi_files=[mig(1)]))
        assert p.actions == (RemoveCdi(mig(1)), DeleteRecord(idle.name))

    def test_a_record_on_a_gpu_with_mig_disabled_is_dropped(self) -> None:
        """No GPU instance outlives MIG mode going off: the GPU is listed and its instance is gone."""
        idle = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0, mig_enabled=False), records=[idle], cdi_files=[mig(1)]))
        assert deletes(p) == {idle.name}
        assert removed_cdi(p) == {mig(1)}

    def test_a_record_from_an_earlier_boot_on_a_gpu_nvml_does_not_list_is_dropped(self) -> None:
        idle = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1), boot=OLD_BOOT)
        p = plan(inputs(live_gpu(GPU1), records=[idle], cdi_files=[mig(1)]))
        assert deletes(p) == {idle.name}
        assert removed_cdi(p) == {mig(1)}
        assert p.report.dropped_stale_records == (idle.name,)


class TestRecordsOnAGpuNvmlDoesNotListAreKeptUntouched:
    """A GPU NVML does not list may only be hidden (a device filter, a GPU being reset) and come
    back with its instances: nothing verifies the instance is gone, so its record and CDI spec stay
    on disk as they are, out of the table, and the report says so. The next Recover that sees the
    GPU judges them as usual."""

    @pytest.mark.parametrize(
        "record",
        [
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1)), id="idle"),
            pytest.param(
                rec(GPU0, "1g.10gb", 0, 1, State.ACTIVE, 7, 0, mig(1), holder=owner("pod-a")), id="active"
            ),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.ERROR, 7, 0, mig(1)), id="error"),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.DELETING, 7, 0, mig(1)), id="deleting"),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.CREATING, 7), id="creating"),
        ],
    )
    def test_the_record_and_its_cdi_spec_stay_and_the_report_says_so(self, record: OwnershipRecord) -> None:
        spec = [record.mig_uuid] if record.mig_uuid else []
        p = plan(inputs(live_gpu(GPU1), records=[record], cdi_files=spec, adopt=True))
        assert p.actions == ()
        assert table(p) == {}
        assert p.report.dropped_stale_records == ()
        assert p.report.restored_idle == p.report.preserved_foreign == ()
        [line] = p.report.errors
        assert f"GPU {GPU0} is not visible; record kept" in line
        assert record.name in line

    def test_the_other_gpus_recover_as_usual(self) -> None:
        hidden = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1))
        seen = rec(GPU1, "1g.10gb", 0, 1, State.ACTIVE, 7, 0, mig(2), holder=owner("gone"))
        p = plan(
            inputs(
                live_gpu(GPU1, live_gi(GPU1, 7, "1g.10gb", 0, 1, mig(2)), minor=1),
                records=[hidden, seen],
                cdi_files=[mig(1), mig(2), mig(3)],
            )
        )
        assert table(p)[seen.name].state is State.IDLE
        assert hidden.name not in table(p)
        assert deletes(p) == set()
        assert removed_cdi(p) == {mig(3)}  # a stray; the hidden instance's spec stays
        assert ensured_cdi(p) == {mig(2)}

    def test_after_a_reboot_a_record_whose_placement_holds_another_instance_is_dropped(self) -> None:
        old = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1), boot=OLD_BOOT)
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(2))), records=[old], cdi_files=[mig(1)]
            )
        )
        assert deletes(p) == {old.name}
        assert removed_cdi(p) == {mig(1)}
        assert foreign_gis(p) == {(GPU0, 0)}

    def test_a_record_whose_placement_is_covered_by_a_larger_gi_is_dropped_and_the_gi_is_foreign(
        self,
    ) -> None:
        idle = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(2))), records=[idle]))
        assert deletes(p) == {idle.name}
        assert foreign_gis(p) == {(GPU0, 0)}
        assert destroyed(p) == set()


class TestARecordThatContradictsTheLiveInstanceMakesItForeign:
    @pytest.mark.parametrize(
        "record",
        [
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(9)), id="other MIG UUID"),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 8, 0, mig(1)), id="other GI ID"),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.ACTIVE, 7, 1, mig(1)), id="other CI ID"),
            pytest.param(
                msgspec.structs.replace(
                    rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1)), gi_profile_id=15
                ),
                id="other profile",
            ),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.CREATING, 8), id="creating with other GI ID"),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.DELETING, 7, 0, mig(9)), id="deleting other CI"),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.ERROR, 8, 0, mig(1)), id="error with other GI ID"),
            # Only a CREATING record may own a CI it never recorded; lifecycle's destroy refuses the same.
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.ERROR, 7), id="error without CI ID, GI has a CI"),
            pytest.param(rec(GPU0, "1g.10gb", 0, 1, State.ERROR), id="error without GI ID, GI has a CI"),
        ],
    )
    def test_the_instance_is_preserved_and_the_record_kept_for_the_operator(
        self, record: OwnershipRecord
    ) -> None:
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(1))),
                records=[record],
                cdi_files=sorted({mig(1), record.mig_uuid or mig(1)}),
                adopt=True,
            )
        )
        assert p.actions == ()
        assert table(p) == {}
        assert foreign_gis(p) == {(GPU0, 0)}
        assert p.report.adopted_foreign == ()
        assert any(record.name in e and "kept for the operator" in e for e in p.report.errors)

    def test_a_creating_record_without_a_gi_id_does_not_claim_a_complete_instance(self) -> None:
        creating = rec(GPU0, "1g.10gb", 0, 1, State.CREATING)
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(1))), records=[creating]))
        assert p.actions == ()
        assert foreign_gis(p) == {(GPU0, 0)}


class TestARecordFromAnEarlierBootClaimsOnlyAnInstanceWithItsMigUuid:
    """GI IDs are reused and placements repeat, so after a reboot a GI someone else made can match a
    record of the earlier boot by placement, profile and GI ID. Only the MIG UUID survives nothing but
    its own instance: a record of an earlier boot whose MIG UUID no live CI in its GI has is stale. It
    is dropped with its CDI file and the GI is left to the unowned rule (foreign, or adopted)."""

    @pytest.mark.parametrize(
        ("record", "gi"),
        [
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.CREATING, 1, boot=OLD_BOOT),
                live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(9)),
                id="creating with GI ID, a complete instance",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.CREATING, 1, boot=OLD_BOOT),
                live_gi(GPU0, 1, "3g.40gb", 0, 4),
                id="creating with GI ID, a bare GI",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.CREATING, boot=OLD_BOOT),
                live_gi(GPU0, 1, "3g.40gb", 0, 4),
                id="creating without GI ID, a bare GI",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.DELETING, 1, boot=OLD_BOOT),
                live_gi(GPU0, 1, "3g.40gb", 0, 4),
                id="deleting a bare GI",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.ERROR, 1, boot=OLD_BOOT),
                live_gi(GPU0, 1, "3g.40gb", 0, 4),
                id="error with GI ID, a bare GI",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.ERROR, boot=OLD_BOOT),
                live_gi(GPU0, 1, "3g.40gb", 0, 4),
                id="error without GI ID, a bare GI",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.DELETING, 1, 0, mig(1), boot=OLD_BOOT),
                live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(9)),
                id="deleting, another MIG UUID",
            ),
        ],
    )
    def test_it_is_dropped_and_the_gi_at_its_placement_is_foreign(
        self, record: OwnershipRecord, gi: LiveGpuInstance
    ) -> None:
        p = plan(inputs(live_gpu(GPU0, gi), records=[record], cdi_files=[mig(1)]))
        assert destroyed(p) == set()
        assert table(p) == {}
        assert deletes(p) == {record.name}
        assert p.report.dropped_stale_records == (record.name,)
        assert foreign_gis(p) == {(GPU0, 0)}
        assert removed_cdi(p) == {mig(1)}  # no live owned instance has this spec file

    def test_with_adoption_the_complete_instance_it_matched_is_adopted_under_this_boot(self) -> None:
        old = rec(GPU0, "3g.40gb", 0, 4, State.CREATING, 1, boot=OLD_BOOT)
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(9))), records=[old], adopt=True))
        assert destroyed(p) == set()
        adopted = table(p)[old.name]
        assert (adopted.state, adopted.identity, adopted.boot_id) == (
            State.IDLE,
            Identity(1, 0, mig(9)),
            BOOT,
        )
        assert [r.identity for r in p.report.adopted_foreign] == [Identity(1, 0, mig(9))]

    def test_a_deleting_record_whose_mig_uuid_is_still_live_finishes_its_delete(self) -> None:
        deleting = rec(GPU0, "3g.40gb", 0, 4, State.DELETING, 1, 0, mig(1), boot=OLD_BOOT)
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))), records=[deleting]))
        assert destroyed(p) == {(GPU0, 1)}


class TestARecordWithoutABootIdIsKeptAsideAndNeverActedUpon:
    """Every writer stamps the boot ID, so a record without one was made or edited by hand. It was
    judged as this boot's: a CREATING one had recovery destroy the bare GI at its placement, while
    ``records verify`` called it stale. Now recovery keeps it aside - on disk untouched with its CDI
    spec, out of the table, the GI at its placement foreign - and names it in the errors."""

    @pytest.mark.parametrize(
        ("record", "gi"),
        [
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.CREATING, 1, boot=""),
                live_gi(GPU0, 1, "3g.40gb", 0, 4),
                id="creating with GI ID, a bare GI",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.CREATING, boot=""),
                live_gi(GPU0, 1, "3g.40gb", 0, 4),
                id="creating without GI ID, a bare GI",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.DELETING, 1, 0, mig(1), boot=""),
                live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1)),
                id="deleting",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.ERROR, 1, 0, mig(1), boot=""),
                live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1)),
                id="error",
            ),
            pytest.param(
                rec(GPU0, "3g.40gb", 0, 4, State.IDLE, 1, 0, mig(1), boot=""),
                live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1)),
                id="idle, matching the live instance",
            ),
        ],
    )
    def test_nothing_is_destroyed_written_or_adopted_and_the_gi_is_foreign(
        self, record: OwnershipRecord, gi: LiveGpuInstance
    ) -> None:
        specs = [record.mig_uuid] if record.mig_uuid else []
        p = plan(inputs(live_gpu(GPU0, gi), records=[record], cdi_files=specs, adopt=True))
        assert p.actions == ()  # its spec file, if any, stays too
        assert table(p) == {}
        assert foreign_gis(p) == {(GPU0, 0)}
        assert p.report.adopted_foreign == p.report.restored_idle == ()
        assert p.report.dropped_stale_records == ()
        [line] = p.report.errors
        assert record.name in line
        assert "boot ID" in line

    @pytest.mark.parametrize("gpu", [live_gpu(GPU0), live_gpu(GPU1)], ids=["GI gone", "GPU not listed"])
    def test_it_is_kept_even_where_nothing_is_live(self, gpu: LiveGpu) -> None:
        record = rec(GPU0, "1g.10gb", 2, 1, State.IDLE, 9, 0, mig(1), boot="")
        p = plan(inputs(gpu, records=[record], cdi_files=[mig(1)]))
        assert p.actions == ()
        assert p.report.dropped_stale_records == ()
        [line] = p.report.errors
        assert record.name in line

    def test_a_pod_that_verifies_against_the_live_instance_still_adopts_it(self) -> None:
        """Rule 1 vouches for the instance by the pod's annotation, not by the record."""
        record = rec(GPU0, "3g.40gb", 0, 4, State.IDLE, 1, 0, mig(1), boot="")
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))),
                records=[record],
                active=[alloc("pod-a", GPU0, "3g.40gb", 0, 4, 1, 0, mig(1))],
            )
        )
        adopted = table(p)[record.name]
        assert (adopted.state, adopted.boot_id) == (State.ACTIVE, BOOT)
        assert p.report.errors == ()


class TestInterruptedCreatesAreUndoneAndInterruptedDeletesFinished:
    def test_a_creating_record_whose_gi_was_never_made_is_dropped(self) -> None:
        creating = rec(GPU0, "3g.40gb", 4, 4, State.CREATING, holder=owner("pod-a"))
        p = plan(inputs(live_gpu(GPU0), records=[creating]))
        assert p.actions == (DeleteRecord(creating.name),)
        assert table(p) == {}

    def test_a_bare_gi_at_the_placement_of_a_creating_record_without_gi_id_is_destroyed(self) -> None:
        creating = rec(GPU0, "3g.40gb", 4, 4, State.CREATING, holder=owner("pod-a"))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4)), records=[creating]))
        assert destroyed(p) == {(GPU0, 2)}
        assert p.report.dropped_stale_records == (creating.name,)

    def test_a_creating_record_with_its_gi_recorded_has_the_gi_destroyed(self) -> None:
        creating = rec(GPU0, "3g.40gb", 4, 4, State.CREATING, 2, holder=owner("pod-a"))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4)), records=[creating]))
        (action,) = p.actions
        assert isinstance(action, DestroyOwned)
        assert (action.record.state, action.record.gpu_instance_id) == (State.DELETING, 2)
        assert table(p) == {}

    def test_an_unrecorded_full_size_ci_inside_the_recorded_gi_is_destroyed_with_it(self) -> None:
        creating = rec(GPU0, "3g.40gb", 4, 4, State.CREATING, 2, holder=owner("pod-a"))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4, mig(5))), records=[creating]))
        (action,) = p.actions
        assert isinstance(action, DestroyOwned)
        assert action.record.identity == Identity(2, 0, mig(5))

    def test_a_ci_of_another_profile_inside_the_recorded_gi_is_not_claimed(self) -> None:
        creating = rec(GPU0, "3g.40gb", 4, 4, State.CREATING, 2, holder=owner("pod-a"))
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4, mig(5), ci_profile=0)), records=[creating]
            )
        )
        assert destroyed(p) == set()
        assert foreign_gis(p) == {(GPU0, 4)}

    def test_a_complete_creating_record_is_undone_and_its_cdi_file_left_to_the_destroy(self) -> None:
        creating = rec(GPU0, "1g.10gb", 3, 1, State.CREATING, 10, 0, mig(4), holder=owner("pod-a"))
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 10, "1g.10gb", 3, 1, mig(4))),
                records=[creating],
                cdi_files=[mig(4)],
            )
        )
        assert destroyed(p) == {(GPU0, 10)}
        assert removed_cdi(p) == set()  # destroy_owned removes it after the hardware is gone
        assert ensured_cdi(p) == set()

    def test_a_deleting_record_has_its_destroy_finished(self) -> None:
        deleting = rec(GPU0, "7g.80gb", 0, 8, State.DELETING, 0, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 0, "7g.80gb", 0, 8, mig(1))), records=[deleting]))
        assert p.actions == (DestroyOwned(deleting),)
        assert p.report.dropped_stale_records == (deleting.name,)

    def test_a_deleting_record_whose_ci_is_already_gone_still_destroys_the_gi(self) -> None:
        deleting = rec(GPU0, "7g.80gb", 0, 8, State.DELETING, 0, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 0, "7g.80gb", 0, 8)), records=[deleting]))
        assert destroyed(p) == {(GPU0, 0)}

    def test_a_deleting_record_whose_gi_is_gone_is_dropped_with_its_cdi_file(self) -> None:
        deleting = rec(GPU0, "7g.80gb", 0, 8, State.DELETING, 0, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0), records=[deleting], cdi_files=[mig(1)]))
        assert p.actions == (RemoveCdi(mig(1)), DeleteRecord(deleting.name))


class TestErrorInstancesStayInErrorForTheReconciler:
    def test_an_error_record_is_kept_unchanged_with_its_cdi_file(self) -> None:
        failed = msgspec.structs.replace(
            rec(GPU0, "1g.10gb", 0, 1, State.ERROR, 7, 0, mig(1)), last_error="destroy failed"
        )
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(1))),
                records=[failed],
                cdi_files=[mig(1)],
            )
        )
        assert table(p) == {failed.name: failed}
        assert p.actions == ()
        assert p.report.restored_idle == ()

    def test_a_bare_gi_at_the_placement_of_an_error_record_without_gi_id_is_destroyed(self) -> None:
        """A create made the GI, failed, and its undo could not find the GI: as for CREATING."""
        failed = rec(GPU0, "3g.40gb", 4, 4, State.ERROR, holder=owner("pod-a"))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4)), records=[failed]))
        (step,) = p.steps
        (action,) = step.actions
        assert isinstance(action, DestroyOwned)
        assert (action.record.state, action.record.gpu_instance_id) == (State.DELETING, 2)
        assert step.on_failure is not None
        assert step.on_failure.gpu_instance_id == 2  # a destroy that fails leaves ERROR naming the GI
        assert table(p) == {}
        assert foreign_gis(p) == set()

    def test_an_error_record_without_gi_id_whose_gi_is_gone_is_dropped(self) -> None:
        failed = rec(GPU0, "3g.40gb", 4, 4, State.ERROR, holder=owner("pod-a"))
        p = plan(inputs(live_gpu(GPU0), records=[failed]))
        assert p.actions == (DeleteRecord(failed.name),)

    def test_an_error_record_whose_ci_is_already_destroyed_is_kept(self) -> None:
        failed = rec(GPU0, "1g.10gb", 0, 1, State.ERROR, 7, 0, mig(1))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1)), records=[failed]))
        assert table(p) == {failed.name: failed}
        assert destroyed(p) == set()


# -- rule 3 ------------------------------------------------------------------------------------------


class TestCorruptRecordsAreNeverTouched:
    def test_the_instance_at_a_corrupt_records_placement_is_foreign_even_with_adoption(self) -> None:
        corrupt = CorruptFile(name(GPU0, 0, 4), "truncated")
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1)), live_gi(GPU0, 2, "3g.40gb", 4, 4)),
                corrupt=[corrupt],
                cdi_files=[mig(1)],
                adopt=True,
            )
        )
        assert foreign_gis(p) == {(GPU0, 0)}
        assert p.report.adopted_foreign == ()
        assert removed_cdi(p) == set()
        assert destroyed(p) == {(GPU0, 2)}  # the other orphan GI is still removed
        assert not any(isinstance(a, (PutRecord, DeleteRecord)) and corrupt.name in str(a) for a in p.actions)
        assert any(corrupt.name in e for e in p.report.errors)

    def test_a_corrupt_file_whose_name_names_no_placement_is_reported(self) -> None:
        p = plan(inputs(live_gpu(GPU0), corrupt=[CorruptFile("not-a-record", "unknown field")]))
        assert p.actions == ()
        assert any("not-a-record" in e for e in p.report.errors)

    def test_record_names_parse_back_into_gpu_and_placement(self) -> None:
        assert parse_record_name(name(GPU1, 6, 1)) == (GPU1, Placement(6, 1))
        assert parse_record_name("mig-GPU-x-0-1") is None


# -- rule 4 ------------------------------------------------------------------------------------------


class TestUnownedInstancesArePreservedUnlessAdoptionIsEnabled:
    def test_without_adoption_every_unowned_gi_is_preserved_and_nothing_is_written(self) -> None:
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1)), live_gi(GPU0, 2, "3g.40gb", 4, 4))
            )
        )
        assert p.actions == ()
        assert foreign_gis(p) == {(GPU0, 0), (GPU0, 4)}
        assert p.report.preserved_foreign[0].identity == Identity(1, 0, mig(1))
        assert p.report.preserved_foreign[1].identity is None

    def test_with_adoption_a_complete_pair_gets_an_idle_record(self) -> None:
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))), adopt=True))
        record = table(p)[name(GPU0, 0, 4)]
        assert (record.state, record.identity, record.profile) == (
            State.IDLE,
            Identity(1, 0, mig(1)),
            "3g.40gb",
        )
        assert (record.gi_profile_id, record.ci_profile_id, record.boot_id) == (9, 2, BOOT)
        assert writes(p) == {record.name: record}
        assert [r.identity for r in p.report.adopted_foreign] == [Identity(1, 0, mig(1))]
        assert ensured_cdi(p) == {mig(1)}

    @pytest.mark.parametrize(
        "gi",
        [
            pytest.param(live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1), mig(2)), id="two compute instances"),
            pytest.param(
                live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1), ci_profile=0), id="a partial compute instance"
            ),
        ],
    )
    def test_with_adoption_a_gi_that_is_not_one_full_instance_is_preserved(self, gi: LiveGpuInstance) -> None:
        p = plan(inputs(live_gpu(GPU0, gi), adopt=True))
        assert p.actions == ()
        assert foreign_gis(p) == {(GPU0, 0)}


class TestOrphanGisAreRemovedOnlyWithAdoptionOnIdleGpus:
    def test_an_orphan_gi_on_an_idle_gpu_is_destroyed_records_first(self) -> None:
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4)), adopt=True))
        (action,) = p.actions
        assert isinstance(action, DestroyOwned)
        assert (action.record.state, action.record.gpu_instance_id, action.record.name) == (
            State.DELETING,
            2,
            name(GPU0, 4, 4),
        )
        assert [r.reservation.placement for r in p.report.removed_orphan_gis] == [Placement(4, 4)]
        assert table(p) == {}

    def test_an_orphan_gi_on_a_gpu_with_an_active_allocation_is_preserved(self) -> None:
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4), live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))),
                active=[alloc("pod-a", GPU0, "3g.40gb", 0, 4, 1, 0, mig(1))],
                adopt=True,
            )
        )
        assert destroyed(p) == set()
        assert foreign_gis(p) == {(GPU0, 4)}

    def test_an_orphan_gi_on_a_gpu_running_a_process_is_preserved(self) -> None:
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4), processes=1), adopt=True))
        assert destroyed(p) == set()
        assert foreign_gis(p) == {(GPU0, 4)}

    def test_an_orphan_gi_is_preserved_without_adoption(self) -> None:
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4))))
        assert destroyed(p) == set()

    def test_only_the_busy_gpu_keeps_its_orphan(self) -> None:
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 2, "3g.40gb", 4, 4), live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))),
                live_gpu(GPU1, live_gi(GPU1, 2, "3g.40gb", 4, 4), minor=1),
                active=[alloc("pod-a", GPU0, "3g.40gb", 0, 4, 1, 0, mig(1))],
                adopt=True,
            )
        )
        assert destroyed(p) == {(GPU1, 2)}


# -- rule 5 ------------------------------------------------------------------------------------------


class TestCdiSpecsFollowLiveOwnedInstances:
    def test_every_live_owned_instance_has_its_spec_ensured_with_its_gpu_minor(self) -> None:
        idle = rec(GPU1, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1))
        p = plan(inputs(live_gpu(GPU1, live_gi(GPU1, 7, "1g.10gb", 0, 1, mig(1)), minor=3), records=[idle]))
        assert EnsureCdi(3, Identity(7, 0, mig(1))) in p.actions

    def test_an_adopted_instance_gets_its_spec_in_its_own_step_after_its_record(self) -> None:
        """A step stops at its first failure: a record that cannot be written publishes no spec, and
        the report moves the instance to ``preserved_foreign``."""
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1))), adopt=True))
        (step,) = p.steps
        assert step.actions == (PutRecord(table(p)[name(GPU0, 0, 4)]), EnsureCdi(0, Identity(1, 0, mig(1))))
        assert step.foreign_ref == p.report.adopted_foreign[0]

    def test_a_restored_instance_gets_its_spec_in_its_own_step_after_its_record(self) -> None:
        active = rec(GPU0, "1g.10gb", 0, 1, State.ACTIVE, 7, 0, mig(1), holder=owner("gone"))
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(1))), records=[active]))
        (step,) = p.steps
        assert step.actions == (PutRecord(table(p)[active.name]), EnsureCdi(0, Identity(7, 0, mig(1))))
        assert step.foreign_ref == p.report.restored_idle[0]

    def test_with_cdi_disabled_no_spec_is_ensured_and_records_carry_no_device_name(self) -> None:
        idle = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1), cdi=False)
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(1))), records=[idle], cdi=False))
        assert p.actions == ()
        assert table(p)[idle.name].cdi_device == ""

    def test_a_record_with_a_stale_device_name_is_rewritten(self) -> None:
        idle = msgspec.structs.replace(rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1)), cdi_device="")
        p = plan(inputs(live_gpu(GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(1))), records=[idle]))
        assert writes(p)[idle.name].cdi_device == f"{KIND}={mig(1)}"

    def test_spec_files_without_a_live_owned_instance_are_removed(self) -> None:
        idle = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 7, 0, mig(1))
        p = plan(
            inputs(
                live_gpu(
                    GPU0, live_gi(GPU0, 7, "1g.10gb", 0, 1, mig(1)), live_gi(GPU0, 8, "1g.10gb", 1, 1, mig(2))
                ),
                records=[idle],
                cdi_files=[mig(1), mig(2), mig(3)],
            )
        )
        assert removed_cdi(p) == {mig(2), mig(3)}


# -- the whole ---------------------------------------------------------------------------------------


def _after(p: Plan, before: Inputs) -> Inputs:
    """The inputs a second recovery would gather if every step of ``p`` succeeded."""
    gone = destroyed(p)
    gpus = tuple(
        msgspec.structs.replace(
            g, gpu_instances=tuple(gi for gi in g.gpu_instances if (g.info.uuid, gi.info.id) not in gone)
        )
        for g in before.gpus
    )
    files = set(before.cdi_files) - {a.mig_uuid for a in p.actions if isinstance(a, RemoveCdi)}
    files -= {a.record.mig_uuid for a in p.actions if isinstance(a, DestroyOwned) and a.record.mig_uuid}
    files |= {a.identity.mig_uuid for a in p.actions if isinstance(a, EnsureCdi)}
    return msgspec.structs.replace(before, records=p.table, gpus=gpus, cdi_files=tuple(sorted(files)))


class TestTheAppliedReportNamesOnlyStepsThatSucceeded:
    """``settle_report``: apply passes the steps that succeeded and those left foreign; every other
    step failed (into ERROR, named in ``failures``)."""

    @staticmethod
    def stale_record_and_orphan_at_one_placement() -> Plan:
        """After a reboot: a record of the earlier boot at 0:4 is dropped, and with adoption the bare
        GI there is an orphan to remove - two steps about the same record name."""
        old = rec(GPU0, "3g.40gb", 0, 4, State.CREATING, 1, boot=OLD_BOOT)
        return plan(inputs(live_gpu(GPU0, live_gi(GPU0, 1, "3g.40gb", 0, 4)), records=[old], adopt=True))

    def test_the_planned_report_names_every_step(self) -> None:
        p = self.stale_record_and_orphan_at_one_placement()
        assert p.report.dropped_stale_records == (name(GPU0, 0, 4),)
        assert [r.reservation.placement for r in p.report.removed_orphan_gis] == [Placement(0, 4)]

    def test_a_step_left_foreign_takes_nothing_from_a_done_step_about_the_same_record(self) -> None:
        p = self.stale_record_and_orphan_at_one_placement()
        drop, remove = p.steps

        report = settle_report(p.report, done=[drop], left_foreign=[remove])

        assert report.dropped_stale_records == (name(GPU0, 0, 4),)
        assert report.removed_orphan_gis == ()
        assert report.preserved_foreign == (remove.foreign_ref,)

    def test_a_failed_step_is_named_only_in_the_errors(self) -> None:
        p = self.stale_record_and_orphan_at_one_placement()
        drop, _ = p.steps

        report = settle_report(p.report, done=[drop], failures=["remove orphan failed"])

        assert report.removed_orphan_gis == report.preserved_foreign == ()
        assert report.dropped_stale_records == (name(GPU0, 0, 4),)
        assert report.errors == ("remove orphan failed",)


class TestRecoveryIsIdempotent:
    def test_a_second_plan_over_the_first_ones_outcome_changes_nothing(self) -> None:
        first_inputs = inputs(
            live_gpu(
                GPU0,
                live_gi(GPU0, 1, "3g.40gb", 0, 4, mig(1)),
                live_gi(GPU0, 11, "1g.10gb", 4, 1, mig(2)),
                live_gi(GPU0, 12, "1g.10gb", 5, 1),
            ),
            live_gpu(
                GPU1, live_gi(GPU1, 2, "3g.40gb", 4, 4, mig(3)), live_gi(GPU1, 1, "3g.40gb", 0, 4), minor=1
            ),
            records=[
                rec(GPU0, "1g.10gb", 4, 1, State.ACTIVE, 11, 0, mig(2), holder=owner("gone"), generation=2),
                rec(GPU0, "1g.10gb", 6, 1, State.IDLE, 13, 0, mig(4)),
                rec(GPU1, "3g.40gb", 4, 4, State.DELETING, 2, 0, mig(3)),
            ],
            active=[alloc("pod-a", GPU0, "3g.40gb", 0, 4, 1, 0, mig(1))],
            cdi_files=[mig(2), mig(3), mig(4), mig(8)],
            adopt=True,
        )
        first = plan(first_inputs)
        second = plan(_after(first, first_inputs))
        assert table(second) == table(first)
        assert second.generation == first.generation
        assert all(isinstance(a, EnsureCdi) for a in second.actions)
        assert second.report.removed_orphan_gis == ()
        assert second.report.dropped_stale_records == ()
        assert second.report.adopted_active == first.report.adopted_active


# -- the safety property -----------------------------------------------------------------------------

_SLOTS = [("7g.80gb", 0, 8, 0), ("3g.40gb", 0, 4, 1), ("3g.40gb", 4, 4, 2)] + [
    ("1g.10gb", n, 1, 7 + n) for n in range(7)
]


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[Inputs, dict[tuple[str, Placement], OwnershipRecord]]:
    """Random non-overlapping layouts on two GPUs and random, often wrong, records about them."""
    gpus: list[LiveGpu] = []
    records: list[OwnershipRecord] = []
    corrupt: list[CorruptFile] = []
    serial = 0
    for minor, uuid in enumerate((GPU0, GPU1)):
        gis: list[LiveGpuInstance] = []
        taken: list[Placement] = []
        for profile, start, size, gi_id in draw(st.permutations(_SLOTS)):
            here = Placement(start, size)
            if any(here.overlaps(t) for t in taken) or not draw(st.booleans()):
                continue
            taken.append(here)
            cis = draw(st.integers(0, 2))
            uuids = [mig(serial + i) for i in range(cis)]
            serial += cis
            gis.append(live_gi(uuid, gi_id, profile, start, size, *uuids))
        for profile, start, size, gi_id in _SLOTS:
            kind = draw(st.sampled_from(["none", "none", "record", "corrupt"]))
            if kind == "corrupt":
                corrupt.append(CorruptFile(name(uuid, start, size), "bad checksum"))
            elif kind == "record":
                records.append(
                    rec(
                        uuid,
                        profile,
                        start,
                        size,
                        draw(st.sampled_from(list(State))),
                        draw(st.sampled_from([None, gi_id, gi_id + 1])),
                        draw(st.sampled_from([None, 0, 1])),
                        draw(st.sampled_from([None, mig(0), mig(1), mig(2), mig(50)])),
                        boot=draw(st.sampled_from([BOOT, OLD_BOOT])),
                    )
                )
        gpus.append(live_gpu(uuid, *gis, processes=draw(st.integers(0, 1)), minor=minor))
    built = inputs(*gpus, records=records, corrupt=corrupt, adopt=draw(st.booleans()))
    return built, {(r.gpu_uuid, r.placement): r for r in records}


class TestPlanNeverDestroysHardwareItCannotVouchFor:
    # Derandomized: the gating run checks the same 150 scenarios every time, so a failure reproduces
    # and a pass means the same thing on every machine; no health check fails it for being slow.
    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(_scenarios())
    def test_every_destroyed_gi_is_a_verified_own_instance_or_an_adoptable_orphan(
        self, scenario: tuple[Inputs, dict[tuple[str, Placement], OwnershipRecord]]
    ) -> None:
        given_inputs, records_at = scenario
        p = plan(given_inputs)
        gpus = {g.info.uuid: g for g in given_inputs.gpus}
        corrupt = [parse_record_name(c.name) for c in given_inputs.corrupt]
        for action in p.actions:
            if not isinstance(action, DestroyOwned):
                continue
            target = action.record
            gpu = gpus[target.gpu_uuid]
            gi = next(g for g in gpu.gpu_instances if g.info.id == target.gpu_instance_id)
            assert gi.info.placement == target.placement
            assert not any(c == (target.gpu_uuid, target.placement) for c in corrupt)
            recorded = records_at.get((target.gpu_uuid, target.placement))
            live_mig_uuids = {ci.mig_uuid for ci in gi.compute_instances}
            if (
                recorded is not None
                # Of this boot, or proven by its MIG UUID: GI IDs and placements repeat after a reboot.
                and (recorded.boot_id == BOOT or recorded.mig_uuid in live_mig_uuids)
                and (
                    (
                        recorded.state in (State.CREATING, State.DELETING)
                        and (
                            recorded.gpu_instance_id == gi.info.id
                            or (recorded.gpu_instance_id is None and not gi.compute_instances)
                        )
                    )
                    or (
                        recorded.state is State.ERROR
                        and recorded.gpu_instance_id is None
                        and not gi.compute_instances
                    )
                )
            ):
                # An own instance: a CREATING/DELETING record whose GI (and CI, if any) verified, or
                # the bare GI of an ERROR record a failed create and undo left without a GI ID; from an
                # earlier boot only when its MIG UUID is live in that GI.
                assert recorded.gi_profile_id == gi.info.profile_id
                assert len(gi.compute_instances) <= 1
                if gi.compute_instances and recorded.mig_uuid is not None:
                    assert gi.compute_instances[0].mig_uuid == recorded.mig_uuid
                continue
            # Otherwise only an orphan: adoption on, no CI, no process, no record of this boot about it.
            assert given_inputs.adopt_existing
            assert not gi.compute_instances
            assert gpu.processes == 0
            assert recorded is None or recorded.boot_id != BOOT


class TestPendingReservations:
    """An allocation without runtime identity: scheduled, not yet allocated (``sidecar.model.pending``)."""

    def pending(self, pod: str, gpu: str, profile: str, start: int, size: int) -> ActiveAllocation:
        return ActiveAllocation(owner(pod), Reservation(gpu, profile, Placement(start, size)))

    def test_it_never_fails_recovery_and_is_handed_to_the_lifecycle(self) -> None:
        nowhere = self.pending("p", GPU1, "1g.10gb", 0, 1)  # not even a GPU of this node
        at_idle = self.pending("q", GPU0, "1g.10gb", 0, 1)
        idle = rec(GPU0, "1g.10gb", 0, 1, State.IDLE, 3, 0, mig(1))

        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))),
                records=[idle],
                active=[nowhere, at_idle],
            )
        )

        assert set(p.pending) == {nowhere, at_idle}
        assert table(p)[idle.name].state is State.IDLE
        assert destroyed(p) == set()
        assert list(p.report.errors) == []
        assert p.referenced_mig_uuids == frozenset()

    def test_the_error_instance_at_it_stays_error(self) -> None:
        broken = rec(GPU0, "1g.10gb", 0, 1, State.ERROR, 3, 0, mig(1))
        p = plan(
            inputs(
                live_gpu(GPU0, live_gi(GPU0, 3, "1g.10gb", 0, 1, mig(1))),
                records=[broken],
                active=[self.pending("q", GPU0, "1g.10gb", 0, 1)],
            )
        )
        assert table(p)[broken.name].state is State.ERROR
        assert destroyed(p) == set()

    def test_a_gpu_with_one_keeps_its_bare_gis_even_with_adoption(self) -> None:
        bare = live_gi(GPU0, 5, "1g.10gb", 4, 1)
        p = plan(inputs(live_gpu(GPU0, bare), active=[self.pending("q", GPU0, "1g.10gb", 0, 1)], adopt=True))
        assert destroyed(p) == set()
        assert foreign_gis(p) == {(GPU0, 4)}
