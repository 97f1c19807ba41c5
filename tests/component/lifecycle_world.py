"""A lifecycle over simulated hardware, in process: the real pynvml adapter, records and CDI code.

Also the helpers every component test file needs: ``restart`` (what a killed sidecar leaves behind:
hardware and files stay, a fresh lifecycle and its ``Recoverer``), ``recovery_of`` (a repeated Recover
on the running lifecycle), ``active_of`` (the pod annotation after an Allocate), ``gis`` (one GPU's
layout) and ``files_cannot_grow_past`` (a full disk).
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sidecar.lifecycle.context import LifecycleContext
from sidecar.lifecycle.facade import Lifecycle
from sidecar.lifecycle.inventory import LayoutRecordingPort
from sidecar.lifecycle.recover import Recoverer
from sidecar.model.domain import (
    ActiveAllocation,
    AllocateRequest,
    AllocateResult,
    ClaimRef,
    DeviceRequest,
    Identity,
    Owner,
    PodRef,
    Reservation,
    State,
)
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import GpuInfo, NvmlError, Placement
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall
from sidecar.store.cdi import CdiSpecs
from sidecar.store.records import RecordStore

BOOT_ID = "0b5b8e4a-7a57-4a3b-9a57-6f2f0c1a0b1c"

# (gpu index, profile, start, size)
Dev = tuple[int, str, int, int]
# What the hardware shows: (gpu index, GI ID, GI profile ID, placement, ((CI ID, MIG UUID), ...))
LiveGi = tuple[int, int, int, str, tuple[tuple[int, str], ...]]


@dataclass
class World:
    hw: SimulatedHardware
    port: PynvmlBackend
    records: RecordStore
    cdi: CdiSpecs
    cdi_dir: Path
    ctx: LifecycleContext
    lifecycle: Lifecycle
    gpus: list[GpuInfo]

    def uuid(self, index: int) -> str:
        return self.gpus[index].uuid

    def request(
        self, pod: str, *devices: Dev, container_index: int = 0, first_index: int = 0
    ) -> AllocateRequest:
        return AllocateRequest(
            pod=PodRef(pod, "default", f"name-{pod}"),
            container_name="main",
            container_index=container_index,
            devices=tuple(
                DeviceRequest(first_index + i, Reservation(self.uuid(g), profile, Placement(start, size)))
                for i, (g, profile, start, size) in enumerate(devices)
            ),
        )

    def allocate(self, pod: str, *devices: Dev, container_index: int = 0) -> AllocateResult:
        return self.lifecycle.allocate(self.request(pod, *devices, container_index=container_index))

    def claim_request(self, claim: str, *devices: Dev, request: str = "gpu") -> AllocateRequest:
        """A DRA kubelet plugin's Allocate: the claim as owner, each device answering ``request``."""
        return AllocateRequest(
            pod=PodRef(""),
            container_name="",
            container_index=0,
            devices=tuple(
                DeviceRequest(i, Reservation(self.uuid(g), profile, Placement(start, size)), request)
                for i, (g, profile, start, size) in enumerate(devices)
            ),
            claim=ClaimRef(claim, "default", f"name-{claim}"),
        )

    def allocate_claim(self, claim: str, *devices: Dev, request: str = "gpu") -> AllocateResult:
        return self.lifecycle.allocate(self.claim_request(claim, *devices, request=request))

    def layout(self) -> set[LiveGi]:
        """Every GI and its CIs as the (simulated) driver reports them through NVML.

        A test that polls while a reconciler runs can see a GI listed and then destroyed before its
        CIs are listed (NOT_FOUND): the listing then starts over, as a snapshot taken a moment later."""
        while True:
            try:
                return self._layout_once()
            except NvmlError as exc:
                if not exc.not_found:
                    raise

    def _layout_once(self) -> set[LiveGi]:
        out: set[LiveGi] = set()
        for gpu in self.gpus:
            if not self.port.gpu(gpu.uuid).mig_current:
                continue
            for gi in self.port.gpu_instances(gpu.uuid):
                cis = tuple((c.id, c.mig_uuid) for c in self.port.compute_instances(gpu.uuid, gi.id))
                out.add((gpu.index, gi.id, gi.profile_id, str(gi.placement), cis))
        return out

    def live_mig_uuids(self) -> set[str]:
        return {mig for *_, cis in self.layout() for _, mig in cis}

    def record_files(self) -> dict[str, OwnershipRecord]:
        valid, corrupt = self.records.load_all()
        assert corrupt == {}
        return valid

    def states(self) -> dict[str, State]:
        return {name: r.state for name, r in self.record_files().items()}

    def cdi_spec_is_current(self, gpu: int, identity: Identity) -> bool:
        """The instance's spec file exists and holds exactly what ``CdiSpecs.ensure`` would write."""
        path = self.cdi.spec_path(identity.mig_uuid)
        return path.is_file() and path.read_bytes() == self.cdi.render(self.gpus[gpu].minor, identity)

    def cdi_files(self) -> set[str]:
        if not self.cdi_dir.exists():
            return set()
        return {p.name for p in self.cdi_dir.iterdir()}

    def everything(self) -> tuple[set[LiveGi], dict[str, OwnershipRecord], set[str]]:
        """Hardware, records on disk and CDI files: what "nothing changed" compares."""
        return self.layout(), self.record_files(), self.cdi_files()

    def assert_consistent(self) -> None:
        """No GI/CI without a record, no record without its GI/CI, table == files, CDI files == owned.

        ``foreign`` GIs made by a test through the simulator are excluded by the caller's setup: every
        GI here must be owned. ERROR records may have lost their CI (a GI destroy failed after it).
        """
        files = self.record_files()
        assert {r.name: r for r in self.lifecycle.instances()} == files
        live = {(g, gi_id): (placement, cis) for g, gi_id, _, placement, cis in self.layout()}
        claimed: set[tuple[int, int]] = set()
        for r in files.values():
            g = next(gpu.index for gpu in self.gpus if gpu.uuid == r.gpu_uuid)
            assert r.gpu_instance_id is not None, f"{r.name} has no GI"
            assert (g, r.gpu_instance_id) in live, f"{r.name} names GI {r.gpu_instance_id}, which is gone"
            placement, cis = live[(g, r.gpu_instance_id)]
            assert placement == str(r.placement)
            if r.state is not State.ERROR:
                assert cis == ((r.compute_instance_id, r.mig_uuid),)
            claimed.add((g, r.gpu_instance_id))
        assert set(live) == claimed, f"GIs without a record: {set(live) - claimed}"
        if self.cdi.enabled:
            wanted = {
                self.cdi.spec_path(r.mig_uuid).name
                for r in files.values()
                if r.mig_uuid is not None and r.state in (State.ACTIVE, State.IDLE)
            }
            assert wanted <= self.cdi_files()
        else:
            assert self.cdi_files() == set()


def build_world(tmp_path: Path, *, cdi_enabled: bool) -> World:
    hw = SimulatedHardware.create([("h100-80gb", 2), ("a100-40gb", 1)], proc_root=tmp_path / "proc")
    install(hw)
    port = PynvmlBackend(retry_wait=False)
    # As on tmpfs (/var/run on a node): a record is rewritten in place. The e2e tests run the sidecar
    # with its state on a disk directory, where a record is replaced (temp file, rename).
    records = RecordStore(tmp_path / "state", in_place=True)
    records.open()
    cdi_dir = tmp_path / "cdi"
    cdi = CdiSpecs(cdi_dir if cdi_enabled else None, proc_root=tmp_path / "proc")
    ctx = LifecycleContext(LayoutRecordingPort(port), records, cdi, BOOT_ID)
    ctx.install([], 0)
    return World(hw, port, records, cdi, cdi_dir, ctx, Lifecycle(ctx), port.gpus())


# -- a restart, as the composition root performs it, and what the plugin sends to Recover ----------------


def restart(world: World, *, adopt: bool = False, boot_id: str = BOOT_ID) -> Recoverer:
    """Forget everything in memory, keep hardware and files; a new lifecycle, not yet recovered."""
    world.records.close()
    records = RecordStore(world.records.directory, in_place=True)
    records.open()
    cdi = CdiSpecs(world.cdi.directory, kind=world.cdi.kind, proc_root=world.cdi.proc_root)
    world.records, world.cdi = records, cdi
    world.ctx = LifecycleContext(LayoutRecordingPort(world.port), records, cdi, boot_id)
    world.lifecycle = Lifecycle(world.ctx)
    return Recoverer(world.ctx, adopt_existing=adopt)


def recovery_of(world: World, *, adopt: bool = False) -> Recoverer:
    """A Recoverer over the running lifecycle (a Recover RPC repeated while the sidecar serves)."""
    return Recoverer(world.ctx, adopt_existing=adopt)


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


def gis(world: World, gpu: int) -> set[tuple[str, int]]:
    """(placement, number of CIs) of every GI on one GPU."""
    return {(placement, len(cis)) for g, _, _, placement, cis in world.layout() if g == gpu}


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


# The fixtures every component test takes; conftest.py hands them to pytest.
@pytest.fixture(params=[True, False], ids=["cdi", "no-cdi"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    w = build_world(tmp_path, cdi_enabled=request.param)
    try:
        yield w
    finally:
        w.records.close()
        uninstall()


@pytest.fixture
def cdi_world(tmp_path: Path) -> Iterator[World]:
    w = build_world(tmp_path, cdi_enabled=True)
    try:
        yield w
    finally:
        w.records.close()
        uninstall()
