"""Records recovery left aside for a GPU NVML did not list, when the GPU comes back while serving.

Recoverer keeps such records on disk, out of the table, in case the GPU returns with its instances.
If it returns without them (reset while hidden) and a create overlaps one, the create must neither
overwrite the record silently nor leave its CDI spec describing an instance that is gone."""

from __future__ import annotations

import pytest
from lifecycle_world import World, restart

from sidecar.model import errors
from sidecar.model.domain import Outcome
from sidecar.model.ownership import OwnershipRecord, record_name
from sidecar.nvml.port import Placement


def hide_the_last_gpu_and_reset_it(world: World) -> None:
    """A Recover that does not see the last GPU, which loses its instances meanwhile and comes back."""
    recovery = restart(world)
    with world.hw.store.transaction() as state:
        hidden = state.gpus.pop()
    report = recovery.recover([])
    assert any("is not visible; record kept" in line for line in report.errors)
    hidden.gis.clear()  # a GPU reset while it was hidden: its instances are gone
    with world.hw.store.transaction() as state:
        state.gpus.append(hidden)


@pytest.mark.parametrize(
    ("profile", "placement"),
    [("1g.5gb", Placement(0, 1)), ("2g.10gb", Placement(0, 2))],
    ids=["same", "overlapping"],
)
def test_a_create_over_a_record_left_aside_drops_it_with_its_cdi_spec(
    world: World, profile: str, placement: Placement
) -> None:
    old = world.allocate("pod-a", (2, "1g.5gb", 0, 1)).devices[0]
    world.lifecycle.release("pod-a")
    aside = world.records.path(record_name(world.uuid(2), Placement(0, 1)))
    hide_the_last_gpu_and_reset_it(world)
    assert aside.exists()

    created = world.allocate("pod-c", (2, profile, placement.start, placement.size)).devices[0]

    assert created.outcome is Outcome.CREATED
    assert [r.mig_uuid for r in world.record_files().values()] == [created.identity.mig_uuid]
    assert not [name for name in world.cdi_files() if old.identity.mig_uuid in name]
    world.assert_consistent()


def test_a_record_without_a_boot_id_keeps_its_placement_busy_after_its_instance_is_gone(world: World) -> None:
    """A record without a boot id was made or edited by hand and is the operator's: a create over its
    placement neither overwrites nor deletes it, even once the instance it names is gone."""
    world.allocate("pod-a", (0, "3g.40gb", 0, 4))
    world.lifecycle.release("pod-a")
    [record] = world.record_files().values()
    fields = {f: getattr(record, f) for f in record.__struct_fields__}
    world.records.put(OwnershipRecord(**{**fields, "boot_id": ""}))
    assert record.gpu_instance_id is not None
    world.hw.destroy_instance(0, record.gpu_instance_id)  # the operator removed the instance by hand
    restart(world).recover([])
    before = world.everything()

    with pytest.raises(errors.PlacementBusy) as caught:
        world.allocate("pod-b", (0, "1g.10gb", 0, 1))

    assert caught.value.metadata["blocker"] == "record_without_boot_id"
    assert caught.value.metadata["file"] == str(world.records.path(record.name))
    assert world.everything() == before
    assert world.allocate("pod-b", (0, "1g.10gb", 4, 1)).devices[0].outcome is Outcome.CREATED
