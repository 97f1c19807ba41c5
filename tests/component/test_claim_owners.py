"""Claim owners beside pod owners: a DRA kubelet plugin's claims and HAMi's pods on one lifecycle.

A claim's Allocate creates, reuses and repeats as a pod's does, keyed by the claim's uid. The two
kinds never touch each other's ACTIVE instances: a pod's Release, SyncActive, Recover's pod list and
the undos see pods only, a claim's Release its own claim only, and a claim's instance stays ACTIVE
across a restart whatever the pod list says. Outcomes are asserted on the simulated hardware, the
records on disk and the CDI files.
"""

from __future__ import annotations

import pytest
from lifecycle_world import Dev, World, active_of, recovery_of, restart

from sidecar.lifecycle.faults import apply_xid
from sidecar.lifecycle.idle_trim import IdleTrimmer
from sidecar.lifecycle.reconciler import Reconciler
from sidecar.lifecycle.undo import Skip
from sidecar.model import errors
from sidecar.model.domain import (
    ActiveAllocation,
    AllocateResult,
    AllocationKey,
    ClaimRef,
    Owner,
    OwnerKind,
    PodRef,
    State,
)
from sidecar.model.idle_policy import IdleSettings
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import Placement, XidEvent

CREATE_GI = "nvmlDeviceCreateGpuInstanceWithPlacement"
SMALL: Dev = (0, "1g.10gb", 0, 1)
OTHER: Dev = (0, "1g.10gb", 1, 1)


def by_mig(world: World) -> dict[str, OwnershipRecord]:
    return {r.mig_uuid or r.name: r for r in world.record_files().values()}


def state_of(world: World, result: AllocateResult, device: int = 0) -> State:
    return by_mig(world)[result.devices[device].identity.mig_uuid].state


class TestAClaimsAllocate:
    def test_it_creates_an_instance_recorded_for_the_claims_request(self, world: World) -> None:
        result = world.allocate_claim("claim-a", SMALL, request="gpu/small")

        [device] = result.devices
        assert device.outcome.value == "CREATED"
        assert device.identity.mig_uuid in world.live_mig_uuids()
        record = by_mig(world)[device.identity.mig_uuid]
        assert record.state is State.ACTIVE
        assert record.owner == Owner.of_claim(ClaimRef("claim-a", "default", "name-claim-a"), 0, "gpu/small")
        if world.cdi.enabled:
            assert device.cdi_device == f"k8s.hami.io/mig={device.identity.mig_uuid}"
            assert world.cdi_spec_is_current(0, device.identity)
        else:
            assert device.cdi_device == ""
        world.assert_consistent()

    def test_a_released_claims_instance_is_reused_by_the_next_claim_without_a_gi_created(
        self, world: World
    ) -> None:
        first = world.allocate_claim("claim-a", SMALL).devices[0]
        released = world.lifecycle.release("claim-a", OwnerKind.CLAIM)
        assert [r.identity for r in released] == [first.identity]
        assert by_mig(world)[first.identity.mig_uuid].owner is None
        world.hw.reset_call_counts()

        second = world.allocate_claim("claim-b", SMALL).devices[0]

        assert second.outcome.value == "REUSED"
        assert second.identity == first.identity
        assert world.hw.call_counts().get(CREATE_GI, 0) == 0
        assert by_mig(world)[first.identity.mig_uuid].owner == Owner.of_claim(
            ClaimRef("claim-b", "default", "name-claim-b"), 0, "gpu"
        )
        world.assert_consistent()

    def test_a_pods_released_instance_is_reused_by_a_claim_and_the_claims_by_a_pod(
        self, world: World
    ) -> None:
        """IDLE instances belong to no one: either kind reuses what the other gave back."""
        pods = world.allocate("pod-a", SMALL).devices[0]
        world.lifecycle.release("pod-a")
        claims = world.allocate_claim("claim-a", SMALL).devices[0]
        world.lifecycle.release("claim-a", OwnerKind.CLAIM)
        again = world.allocate("pod-b", SMALL).devices[0]
        assert pods.identity == claims.identity == again.identity
        assert [claims.outcome.value, again.outcome.value] == ["REUSED", "REUSED"]

    def test_a_repeat_is_already_allocated_and_changes_nothing(self, world: World) -> None:
        first = world.allocate_claim("claim-a", SMALL, OTHER)
        before = world.everything()

        again = world.allocate_claim("claim-a", SMALL, OTHER)

        assert [d.outcome.value for d in again.devices] == ["ALREADY_ALLOCATED"] * 2
        assert [d.identity for d in again.devices] == [d.identity for d in first.devices]
        assert world.everything() == before

    def test_other_devices_for_the_same_claim_are_a_key_conflict_and_change_nothing(
        self, world: World
    ) -> None:
        world.allocate_claim("claim-a", SMALL)
        before = world.everything()

        with pytest.raises(errors.KeyConflict):
            world.allocate_claim("claim-a", OTHER)
        with pytest.raises(errors.KeyConflict):
            world.allocate_claim("claim-a", SMALL, request="other")

        assert world.everything() == before

    def test_it_is_all_or_nothing(self, world: World) -> None:
        """The second device's placement is a pod's: the first device's create is undone."""
        world.allocate("pod-a", OTHER)
        before = world.everything()

        with pytest.raises(errors.PlacementBusy):
            world.allocate_claim("claim-a", SMALL, OTHER)

        assert world.everything() == before

    def test_a_pod_and_a_claim_with_the_same_uid_hold_one_instance_each(self, world: World) -> None:
        pods = world.allocate("same-uid", SMALL).devices[0]
        claims = world.allocate_claim("same-uid", OTHER).devices[0]

        assert claims.outcome.value == "CREATED"
        assert pods.identity != claims.identity
        world.lifecycle.release("same-uid", OwnerKind.CLAIM)
        assert {r.mig_uuid: r.state for r in world.record_files().values()} == {
            pods.identity.mig_uuid: State.ACTIVE,
            claims.identity.mig_uuid: State.IDLE,
        }

    def test_a_pods_allocate_over_a_claims_instance_is_placement_busy(self, world: World) -> None:
        world.allocate_claim("claim-a", (0, "2g.20gb", 0, 2))
        before = world.everything()
        with pytest.raises(errors.PlacementBusy):
            world.allocate("pod-a", SMALL)
        assert world.everything() == before


class TestTheKindsNeverReleaseEachOther:
    def test_sync_active_with_an_empty_pod_list_idles_pods_and_leaves_claims_active(
        self, world: World
    ) -> None:
        pods = world.allocate("pod-a", SMALL)
        claims = world.allocate_claim("claim-a", OTHER)

        idled, _ = world.lifecycle.sync_active(world.lifecycle.generation, [])

        assert [r.identity for r in idled] == [pods.devices[0].identity]
        assert state_of(world, pods) is State.IDLE
        assert state_of(world, claims) is State.ACTIVE

    def test_a_pods_release_leaves_a_claim_of_the_same_uid_active(self, world: World) -> None:
        claims = world.allocate_claim("uid-1", SMALL)
        before = world.everything()
        assert world.lifecycle.release("uid-1") == []
        assert world.everything() == before
        assert state_of(world, claims) is State.ACTIVE

    def test_a_claims_release_leaves_pods_and_other_claims_active(self, world: World) -> None:
        pods = world.allocate("uid-1", SMALL)
        other = world.allocate_claim("claim-b", OTHER)
        mine = world.allocate_claim("uid-1", (1, "1g.10gb", 0, 1))

        released = world.lifecycle.release("uid-1", OwnerKind.CLAIM)

        assert [r.identity for r in released] == [mine.devices[0].identity]
        assert state_of(world, pods) is State.ACTIVE
        assert state_of(world, other) is State.ACTIVE
        assert state_of(world, mine) is State.IDLE

    def test_the_undos_never_touch_a_claims_instance(self, world: World) -> None:
        claims = world.allocate_claim("uid-1", SMALL)
        mig_uuid = claims.devices[0].identity.mig_uuid
        before = world.everything()

        assert world.lifecycle.undo_allocate("uid-1", 0) == ([], [])
        undone = world.lifecycle.undo_device(mig_uuid, AllocationKey("uid-1", 0, 0))

        assert undone.skipped is Skip.OTHER_OWNER
        assert "claim uid-1" in undone.detail
        assert world.everything() == before

    def test_a_faulted_claims_instance_is_destroyed_at_its_release(self, world: World) -> None:
        claims = world.allocate_claim("claim-a", SMALL)
        [record] = world.record_files().values()
        assert record.gpu_instance_id is not None
        event = XidEvent(record.gpu_uuid, 79, record.gpu_instance_id, record.compute_instance_id)
        assert apply_xid(world.ctx, event, frozenset()).faulted
        world.lifecycle.sync_active(world.lifecycle.generation, [])
        assert state_of(world, claims) is State.ACTIVE  # faulted, still its claim's

        world.lifecycle.release("claim-a", OwnerKind.CLAIM)

        assert claims.devices[0].identity.mig_uuid not in world.live_mig_uuids()
        assert world.record_files() == {}

    def test_reclaim_and_the_idle_trim_never_take_a_claims_instance(self, world: World) -> None:
        claims = world.allocate_claim("claim-a", SMALL)
        mig_uuid = claims.devices[0].identity.mig_uuid
        with pytest.raises(errors.NotIdle):
            world.lifecycle.reclaim_idle(world.uuid(0), [mig_uuid])
        trimmer = IdleTrimmer(world.ctx, IdleSettings(ttl_s=1.0, max_idle_per_gpu=0), clock=lambda: 1e12)
        Reconciler(world.lifecycle, idle=trimmer).run_once()
        assert state_of(world, claims) is State.ACTIVE
        assert mig_uuid in world.live_mig_uuids()


class TestAClaimsInstanceSurvivesARestart:
    def test_it_stays_active_through_a_recover_with_an_empty_pod_list(self, world: World) -> None:
        claims = world.allocate_claim("claim-a", SMALL)
        pods = world.allocate("pod-a", OTHER)
        before = world.record_files()

        report = restart(world).recover([])

        assert state_of(world, claims) is State.ACTIVE
        assert (
            by_mig(world)[claims.devices[0].identity.mig_uuid]
            == before[next(n for n, r in before.items() if r.mig_uuid == claims.devices[0].identity.mig_uuid)]
        )
        assert state_of(world, pods) is State.IDLE  # no pod list names it
        assert report.errors == ()
        world.assert_consistent()
        assert world.allocate_claim("claim-a", SMALL).devices[0].outcome.value == "ALREADY_ALLOCATED"
        world.lifecycle.release("claim-a", OwnerKind.CLAIM)
        assert state_of(world, claims) is State.IDLE

    def test_a_repeated_recover_keeps_it_active_too(self, world: World) -> None:
        claims = world.allocate_claim("claim-a", SMALL)
        recovery_of(world).recover([])
        assert state_of(world, claims) is State.ACTIVE

    def test_a_stale_pod_list_naming_its_instance_does_not_take_it(self, world: World) -> None:
        """The pod gave the instance back and the claim got it; the list still names the pod."""
        pods = world.allocate("pod-a", SMALL)
        stale = active_of("pod-a", pods)
        world.lifecycle.release("pod-a")
        claims = world.allocate_claim("claim-a", SMALL)
        assert claims.devices[0].identity == pods.devices[0].identity

        report = restart(world).recover(stale)

        record = by_mig(world)[claims.devices[0].identity.mig_uuid]
        assert record.state is State.ACTIVE
        assert record.owner is not None
        assert record.owner.kind is OwnerKind.CLAIM
        assert report.adopted_active == ()
        assert len(report.errors) == 1
        assert "claim claim-a/0" in report.errors[0]
        world.assert_consistent()

    def test_sync_active_naming_its_instance_for_a_pod_changes_nothing(self, world: World) -> None:
        claims = world.allocate_claim("claim-a", SMALL)
        device = claims.devices[0]
        listed = ActiveAllocation(Owner(PodRef("pod-x"), "main", 0, 0), device.reservation, device.identity)
        before = world.everything()
        assert world.lifecycle.sync_active(world.lifecycle.generation, [listed]) == ([], [])
        assert world.everything() == before


class TestTheIdlePolicyLearnsFromPodsOnly:
    def test_a_claims_allocate_teaches_it_nothing_a_pods_does(self, world: World) -> None:
        # kube-scheduler places a claim from slices that list IDLE instances; what the idle policy
        # learns is HAMi's scheduler, which cannot see them.
        world.allocate_claim("claim-a", SMALL)
        assert not world.ctx.choices.chosen

        world.allocate("pod-a", OTHER)
        assert dict(world.ctx.choices.chosen) == {("1g.10gb", Placement(1, 1)): 1}
