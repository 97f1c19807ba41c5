"""What recovery's gather reads: plain values only (pure)."""

from __future__ import annotations

import msgspec

from sidecar.model.domain import ActiveAllocation
from sidecar.model.hami_files import HamiSpec
from sidecar.model.hami_takeover import HamiRecordFile
from sidecar.model.ownership import OwnershipRecord
from sidecar.nvml.port import ComputeInstanceInfo, GpuInfo, GpuInstanceInfo, GpuInstanceProfile


class LiveGpuInstance(msgspec.Struct, frozen=True):
    """One GI as NVML lists it, with every CI inside it."""

    info: GpuInstanceInfo
    compute_instances: tuple[ComputeInstanceInfo, ...] = ()


class LiveGpu(msgspec.Struct, frozen=True):
    """One physical GPU: its profile table and, when MIG is enabled, its live layout."""

    info: GpuInfo
    profiles: tuple[GpuInstanceProfile, ...] = ()
    gpu_instances: tuple[LiveGpuInstance, ...] = ()
    processes: int = 0


class CorruptFile(msgspec.Struct, frozen=True):
    """A record file that exists but cannot be trusted (``records.CorruptRecord``, as a plain value)."""

    name: str
    why: str


class Inputs(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``plan`` decides from. Plain values only; ``gather`` builds it, tests write it by hand."""

    active: tuple[ActiveAllocation, ...] = ()
    records: tuple[OwnershipRecord, ...] = ()
    corrupt: tuple[CorruptFile, ...] = ()
    gpus: tuple[LiveGpu, ...] = ()
    cdi_files: tuple[str, ...] = ()  # MIG UUIDs that have a spec file of this sidecar's kind
    # MIG UUID -> the file it was found in (found by content: the name may differ from the derived one)
    cdi_paths: dict[str, str] = msgspec.field(default_factory=dict)
    # MIG UUID -> qualified CDI device name of every live CI ("" or absent with CDI disabled)
    cdi_devices: dict[str, str] = msgspec.field(default_factory=dict)
    boot_id: str = ""
    # HAMi's in-process lifecycle's files (``hami_takeover``); empty with the takeover turned off.
    hami_records: tuple[HamiRecordFile, ...] = ()
    hami_specs: tuple[HamiSpec, ...] = ()
    hami_takeover: bool = True  # False: HAMi's files are all kept and their instances stay foreign
    adopt_existing: bool = False
    # True for a Recover repeated while the sidecar serves: its pod list may be older than the
    # activations since, and it carries no generation fence, so it never demotes ACTIVE to IDLE.
    recovered: bool = False
    generation: int = 0  # the lifecycle's generation before recovery (at least the stored ceiling)
    generation_ceiling: int = 0  # what the ``generation`` file holds (0 when missing: a first run)
    now: str = ""  # RFC 3339 UTC, stamped into ``since`` of records whose state changes
