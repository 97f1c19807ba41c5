"""RankPlacements over a real lifecycle: classes from the table, the foreign GIs and the records left
aside, read-only, and no NVML call once the GPU's profile table and foreign view are cached."""

from __future__ import annotations

import pytest
from lifecycle_world import World, restart

from sidecar.model import errors
from sidecar.model.advice import FOREIGN, Cost
from sidecar.model.ownership import record_name
from sidecar.nvml.port import Placement


def layout_with_every_class(world: World) -> dict[str, str]:
    """GPU 0 (H100, 8 memory slices): ACTIVE 1g at 0, IDLE 1g at 1, IDLE 2g at 2:2, the rest free."""
    world.allocate("pod-a", (0, "1g.10gb", 0, 1))
    idle_1g = world.allocate("pod-b", (0, "1g.10gb", 1, 1)).devices[0].identity.mig_uuid
    idle_2g = world.allocate("pod-c", (0, "2g.20gb", 2, 2)).devices[0].identity.mig_uuid
    world.lifecycle.release("pod-b")
    world.lifecycle.release("pod-c")
    return {"1g": idle_1g, "2g": idle_2g}


def classes(world: World, gpu: int, profile: str) -> list[tuple[int, Cost]]:
    return [(r.placement.start, r.cost) for r in world.lifecycle.rank_placements(world.uuid(gpu), profile)]


class TestClasses:
    def test_reuse_then_free_then_reclaim_then_blocked_as_allocate_would_do_there(self, world: World) -> None:
        idle = layout_with_every_class(world)

        ranked = world.lifecycle.rank_placements(world.uuid(0), "1g.10gb")

        assert [(r.placement.start, r.cost) for r in ranked] == [
            (1, Cost.REUSE),
            (4, Cost.FREE),  # best fit: keeps the free run 5..7 whole
            (5, Cost.FREE),
            (6, Cost.FREE),
            (2, Cost.RECLAIM),
            (3, Cost.RECLAIM),
            (0, Cost.BLOCKED),
        ]
        assert ranked[0].idle_mig_uuid == idle["1g"]
        assert [v.mig_uuid for v in ranked[4].reclaim] == [idle["2g"]]
        assert ranked[-1].blocker == "ACTIVE"

    def test_a_gi_made_outside_the_sidecar_blocks_its_placements(self, world: World) -> None:
        world.hw.create_instance(0, "3g.40gb", 4, 4)

        assert classes(world, 0, "3g.40gb") == [(0, Cost.FREE), (4, Cost.BLOCKED)]
        assert world.lifecycle.rank_placements(world.uuid(0), "3g.40gb")[1].blocker == FOREIGN

    def test_a_corrupt_record_file_blocks_the_placement_its_name_was_written_for(self, world: World) -> None:
        world.records.path(record_name(world.uuid(0), Placement(4, 4))).write_bytes(b"{not json")
        restart(world).recover([])  # advice, like Allocate, never scans the directory: recovery finds it

        ranked = world.lifecycle.rank_placements(world.uuid(0), "3g.40gb")

        assert [(r.placement.start, r.cost, r.blocker) for r in ranked] == [
            (0, Cost.FREE, ""),
            (4, Cost.BLOCKED, "corrupt_record"),
        ]

    def test_a_create_in_flight_blocks_its_placement(self, world: World) -> None:
        """A CREATING record is written before the GI is created: advice never steers onto it."""
        world.hw.inject_fault("create-ci", 999)
        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "3g.40gb", 4, 4))  # the undo removes everything again
        assert classes(world, 0, "3g.40gb") == [(0, Cost.FREE), (4, Cost.FREE)]


class TestReadOnlyAndCheap:
    def test_ranking_changes_nothing_on_the_hardware_on_disk_or_in_cdi(self, world: World) -> None:
        layout_with_every_class(world)
        before = world.everything()

        for profile in ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"):
            world.lifecycle.rank_placements(world.uuid(0), profile)

        assert world.everything() == before

    def test_once_the_gpu_is_known_a_ranking_makes_no_nvml_call_at_all(self, world: World) -> None:
        layout_with_every_class(world)
        world.hw.reset_call_counts()
        world.lifecycle.rank_placements(world.uuid(0), "1g.10gb")
        first = sum(world.hw.call_counts().values())
        world.hw.reset_call_counts()

        world.lifecycle.rank_placements(world.uuid(0), "2g.20gb")

        assert world.hw.call_counts() == {}
        assert first > 0  # the first one reads the MIG mode and lists the GIs, once

    def test_the_foreign_view_is_listed_afresh_after_a_recover(self, world: World) -> None:
        assert classes(world, 0, "3g.40gb") == [(0, Cost.FREE), (4, Cost.FREE)]
        world.hw.create_instance(0, "3g.40gb", 4, 4)
        restart(world).recover([])

        assert classes(world, 0, "3g.40gb") == [(0, Cost.FREE), (4, Cost.BLOCKED)]


class TestRefusals:
    def test_an_unknown_profile_is_unknown_profile(self, world: World) -> None:
        with pytest.raises(errors.UnknownProfile):
            world.lifecycle.rank_placements(world.uuid(0), "9g.99gb")

    def test_an_unknown_gpu_is_unknown_gpu(self, world: World) -> None:
        with pytest.raises(errors.UnknownGpu):
            world.lifecycle.rank_placements("GPU-00000000-0000-0000-0000-000000000000", "1g.10gb")

    def test_before_recovery_nothing_is_ranked(self, world: World) -> None:
        restart(world)
        with pytest.raises(errors.NotRecovered):
            world.lifecycle.rank_placements(world.uuid(0), "1g.10gb")
