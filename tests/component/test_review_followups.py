"""Follow-ups of a correctness review: judgement calls, decided and pinned here, one class per finding.

Every test failed before the fix its class names; they run over the simulated hardware through the
real pynvml adapter, records and CDI code, and assert the NVML layout, the record files, the CDI files
and what later transactions see.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator

from lifecycle_world import BOOT_ID, World

from sidecar.cdi import CdiSpecs
from sidecar.domain import ActiveAllocation, AllocateResult, Owner, PodRef, State
from sidecar.lifecycle import Lifecycle
from sidecar.reconciler import Reconciler
from sidecar.records import RecordStore
from sidecar.recovery import Recovery


def restart(world: World) -> Recovery:
    """Forget everything in memory, keep hardware and files; a new lifecycle, not yet recovered."""
    world.records.close()
    records = RecordStore(world.records.directory)
    records.open()
    cdi = CdiSpecs(world.cdi.directory, kind=world.cdi.kind, proc_root=world.cdi.proc_root)
    world.records, world.cdi = records, cdi
    world.lifecycle = Lifecycle(world.port, records, cdi, BOOT_ID)
    return Recovery(world.lifecycle, world.port, records, cdi, BOOT_ID, adopt_existing=False)


def recovery_of(world: World) -> Recovery:
    """A Recovery over the running lifecycle (a repeated Recover RPC)."""
    return Recovery(world.lifecycle, world.port, world.records, world.cdi, BOOT_ID, adopt_existing=False)


def active_of(pod: str, result: AllocateResult) -> list[ActiveAllocation]:
    """What the plugin reads back from the pod annotation after a successful Allocate."""
    return [
        ActiveAllocation(
            owner=Owner(PodRef(pod, "default", f"name-{pod}"), "main", 0, device.device_index),
            reservation=device.reservation,
            identity=device.identity,
        )
        for device in result.devices
    ]


@contextlib.contextmanager
def files_cannot_grow_past(size: int) -> Iterator[None]:
    """Every file write of this process beyond ``size`` bytes fails (EFBIG), as on a full disk.

    Python ignores SIGXFSZ, so the write returns an error instead of ending the process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def state_of(world: World) -> dict[str, State]:
    return {r.name: r.state for r in world.lifecycle.instances()}


class TestAnInstanceAPodHoldsIsNeverDestroyedBeforeTheFirstSyncActive:
    """Finding A: Recover sets the referenced MIG UUIDs from its own active allocations."""

    def test_an_adopted_instance_whose_record_could_not_be_written_stays_on_the_gpu(
        self, world: World
    ) -> None:
        """The pod's instance verifies live, but writing its record fails during Recover: it is ERROR
        in the table. The pod still runs on it, so the reconciler must leave its hardware alone."""
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        [record] = world.record_files().values()
        recovery = restart(world)
        (world.records.directory / f"{record.name}.json").unlink()  # Recover must write it again
        before = world.layout()

        with files_cannot_grow_past(16):
            report = recovery.recover(active_of("pod-a", held))

        assert report.errors
        assert state_of(world) == {record.name: State.ERROR}
        assert world.lifecycle.referenced_mig_uuids == {held.devices[0].identity.mig_uuid}
        Reconciler(world.lifecycle).run_once()
        assert world.layout() == before
        assert state_of(world) == {record.name: State.ERROR}

    def test_once_a_sync_active_no_longer_lists_it_the_reconciler_destroys_it(self, world: World) -> None:
        """The guard is the plugin's latest view: a SyncActive that does not list the MIG UUID ends it."""
        held = world.allocate("pod-a", (0, "1g.10gb", 0, 1))
        [record] = world.record_files().values()
        recovery = restart(world)
        (world.records.directory / f"{record.name}.json").unlink()
        with files_cannot_grow_past(16):
            recovery.recover(active_of("pod-a", held))

        world.lifecycle.sync_active(world.lifecycle.generation, [])
        report = Reconciler(world.lifecycle).run_once()

        assert [ref.reservation for ref in report.destroyed] == [record.reservation]
        assert world.everything() == (set(), {}, set())
