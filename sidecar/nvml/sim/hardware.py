"""The simulated node as a test or an operator sees it: layouts, and the knobs that change the hardware.

Knobs (``SimulatedHardware`` and the ``sim`` commands): create an instance no sidecar owns, mark a
MIG device busy (a process runs on it), inject faults (the next N calls of an operation fail with a
code), lose a GPU (every call on it -> GPU_IS_LOST), add latency, reboot the node. They change the same
state the library reads, under the same lock, and obey the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import msgspec

from sidecar.nvml import profiles
from sidecar.nvml.port import NVML_ERROR_IN_USE, NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_FOUND, Placement
from sidecar.nvml.sim import state as rules
from sidecar.nvml.sim.cabi import OP_ALIASES, known_op, parse_code
from sidecar.nvml.sim.state import SimError, SimFault, SimGpu, SimState
from sidecar.nvml.sim.store import FileStore, MemoryStore, StateStore

# -- the operator's view and knobs --------------------------------------------------------------------


class CiLayout(msgspec.Struct, frozen=True):
    id: int
    profile_id: int
    start: int
    size: int
    mig_uuid: str
    busy: bool


class GiLayout(msgspec.Struct, frozen=True):
    id: int
    profile_id: int
    profile: str
    placement: Placement
    cis: tuple[CiLayout, ...]

    @property
    def mig_uuid(self) -> str | None:
        return self.cis[0].mig_uuid if self.cis else None


class GpuLayout(msgspec.Struct, frozen=True):
    index: int
    uuid: str
    model: str
    name: str
    minor: int
    mig_current: bool
    mig_pending: bool
    lost: bool
    busy: bool
    gis: tuple[GiLayout, ...]


def _layout(state: SimState, gpu: SimGpu) -> GpuLayout:
    m = rules.model_of(gpu)
    gis = []
    for gi in sorted(gpu.gis, key=lambda g: g.id):
        p = rules.gi_profile(gpu, gi.profile_id)
        cis = tuple(
            CiLayout(c.id, c.profile_id, c.start, c.size, c.mig_uuid, c.mig_uuid in state.busy)
            for c in sorted(gi.cis, key=lambda c: c.id)
        )
        gis.append(GiLayout(gi.id, gi.profile_id, p.name, Placement(gi.start, gi.size), cis))
    return GpuLayout(
        gpu.index,
        gpu.uuid,
        m.key,
        m.name,
        gpu.minor,
        gpu.mig_current,
        gpu.mig_pending,
        gpu.lost,
        gpu.uuid in state.busy,
        tuple(gis),
    )


class SimulatedHardware:
    """A simulated GPU node: the state store plus the knobs a test or an operator turns.

    ``create`` keeps the hardware in memory (tests); ``open``/``init_file`` share it through a state
    file. The knobs change the same state the library reads, under the same lock, and obey the same
    rules (an unowned instance still needs a legal, free placement)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    @classmethod
    def create(
        cls, gpus: Sequence[tuple[str, int]], *, mig_enabled: bool = True, proc_root: Path | None = None
    ) -> SimulatedHardware:
        """In-memory hardware, e.g. ``create([("h100-80gb", 2)], proc_root=tmp_path / "proc")``."""
        return cls(MemoryStore(rules.new_state(list(gpus), mig_enabled), proc_root))

    @classmethod
    def open(cls, state_file: Path) -> SimulatedHardware:
        store = FileStore(state_file)
        if not state_file.exists():
            raise FileNotFoundError(f"simulated hardware state {state_file} does not exist (run `sim init`)")
        return cls(store)

    @classmethod
    def init_file(
        cls,
        state_file: Path,
        gpus: Sequence[tuple[str, int]],
        *,
        mig_enabled: bool = True,
        overwrite: bool = False,
    ) -> SimulatedHardware:
        return cls(FileStore.create(state_file, rules.new_state(list(gpus), mig_enabled), overwrite))

    @property
    def proc_root(self) -> Path | None:
        return self.store.proc_root

    # -- reading -------------------------------------------------------------------------------------

    def state(self) -> SimState:
        """A detached copy of the whole state."""
        with self.store.transaction() as state:
            return msgspec.json.decode(msgspec.json.encode(state), type=SimState)

    def call_counts(self) -> dict[str, int]:
        """Calls of each simulated C function since the hardware was created or the counts were reset,
        by C symbol (``nvmlDeviceCreateGpuInstanceWithPlacement`` …), summed over every process that
        uses this hardware. Faulted calls count too: the caller made them. Only functions called at
        least once appear. The numbers are exact and noise-free, which makes them the honest measure
        of what a decision costs in NVML round trips (each one a driver ioctl on a real node)."""
        return self.store.call_counts()

    def reset_call_counts(self) -> None:
        """Start counting from zero, calls and the store's ``driver_ns`` (the layout, faults and knobs
        are untouched)."""
        self.store.reset_call_counts()

    @property
    def boot_id(self) -> str:
        return self.state().boot_id

    def gpu_uuid(self, gpu_index: int) -> str:
        return self.state().gpus[gpu_index].uuid

    def layout(self, gpu_index: int) -> GpuLayout:
        with self.store.transaction() as state:
            return _layout(state, self._gpu(state, gpu_index))

    def layouts(self) -> list[GpuLayout]:
        with self.store.transaction() as state:
            return [_layout(state, g) for g in state.gpus]

    @staticmethod
    def _gpu(state: SimState, gpu_index: int) -> SimGpu:
        if not 0 <= gpu_index < len(state.gpus):
            raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"no GPU at index {gpu_index}")
        return state.gpus[gpu_index]

    # -- knobs ---------------------------------------------------------------------------------------

    def create_instance(
        self, gpu_index: int, profile_name: str, start: int, size: int, with_ci: bool = True
    ) -> GiLayout:
        """An instance no sidecar owns (what ``nvidia-smi mig -cgi … -C`` would leave behind)."""
        with self.store.transaction() as state:
            gpu = self._gpu(state, gpu_index)
            p = rules.model_of(gpu).profile_by_name(profile_name)
            if p is None:
                msg = f"GPU {gpu_index} has no profile {profile_name!r}"
                raise SimError(NVML_ERROR_INVALID_ARGUMENT, msg)
            gi = rules.create_gi(state, gpu, p.id, start, size)
            if with_ci:
                rules.create_ci(state, gpu, gi, p.full_ci_profile_id)
            layout = _layout(state, gpu)
        return next(g for g in layout.gis if g.id == gi.id)

    def destroy_instance(self, gpu_index: int, gi_id: int) -> None:
        """Destroy a GI's CIs, then the GI, as ``nvidia-smi mig -dci`` then ``-dgi`` would."""
        with self.store.transaction() as state:
            gpu = self._gpu(state, gpu_index)
            rules.require_mig(gpu)
            gi = rules.find_gi(gpu, gi_id)
            for ci in list(gi.cis):
                rules.destroy_ci(state, gpu, gi, ci)
            rules.destroy_gi(state, gpu, gi)

    def set_busy(self, uuid: str, busy: bool = True) -> None:
        """A process runs (or no longer runs) on a MIG device, or on a whole GPU for a GPU UUID."""
        with self.store.transaction() as state:
            known = {g.uuid for g in state.gpus} | {
                ci.mig_uuid for g in state.gpus for _, ci in rules.mig_devices(g)
            }
            if busy and uuid not in known:
                raise SimError(NVML_ERROR_NOT_FOUND, f"no GPU or MIG device with UUID {uuid}")
            if busy and uuid not in state.busy:
                state.busy.append(uuid)
            elif not busy and uuid in state.busy:
                state.busy.remove(uuid)

    def inject_fault(self, op: str, code: int | str, after: int = 0, times: int = 1) -> None:
        """The matching calls after the next ``after`` ones fail with ``code``, ``times`` times."""
        if not known_op(op):
            aliases = ", ".join(sorted(OP_ALIASES))
            raise ValueError(f"unknown operation {op!r}: a C function name, 'any' or one of {aliases}")
        if after < 0 or times < 1:
            raise ValueError("after must be >= 0 and times >= 1")
        with self.store.transaction() as state:
            state.faults.append(SimFault(op, parse_code(code), after, times))

    def faults(self) -> list[SimFault]:
        return self.state().faults

    def clear_faults(self) -> None:
        with self.store.transaction() as state:
            state.faults.clear()

    def set_latency(self, op: str, seconds: float) -> None:
        if not known_op(op):
            raise ValueError(f"unknown operation {op!r}")
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a latency is a finite number of seconds >= 0, not {seconds!r}")
        with self.store.transaction() as state:
            if seconds > 0:
                state.latency[op] = seconds
            else:
                state.latency.pop(op, None)

    def set_ci_info_device(self, parent: bool) -> None:
        """``nvmlComputeInstanceGetInfo().device`` answers the parent GPU (``parent``) or the MIG device."""
        with self.store.transaction() as state:
            state.ci_info_device_is_parent = parent

    def lose_gpu(self, gpu_index: int) -> None:
        """The GPU falls off the bus: every call on it answers GPU_IS_LOST until ``reboot``."""
        with self.store.transaction() as state:
            self._gpu(state, gpu_index).lost = True

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> None:
        """Set current and pending MIG mode directly (an operator with a GPU reset at hand)."""
        with self.store.transaction() as state:
            gpu = self._gpu(state, gpu_index)
            if not enabled and gpu.gis:
                raise SimError(NVML_ERROR_IN_USE, f"GPU {gpu_index} still has GPU instances")
            gpu.mig_current = gpu.mig_pending = enabled

    def reset_gpu(self, gpu_index: int) -> None:
        """A GPU reset: its instances vanish, a lost GPU is back, its pending MIG mode applies."""
        with self.store.transaction() as state:
            gpu = self._gpu(state, gpu_index)
            gone = {ci.mig_uuid for _, ci in rules.mig_devices(gpu)} | {gpu.uuid}
            state.busy[:] = [u for u in state.busy if u not in gone]
            gpu.gis.clear()
            gpu.lost = False
            gpu.mig_current = gpu.mig_pending

    def reboot(self) -> None:
        """Clears every GI/CI and busy marker, applies pending MIG modes, new boot_id."""
        with self.store.transaction() as state:
            rules.reboot(state)


def open_or_init(state_file: Path, sim_gpus: str | None) -> SimulatedHardware:
    """Open the hardware in ``state_file``, creating it from ``sim_gpus`` when it does not exist.

    A new file has MIG enabled on every GPU: a demo node is useful at once, and MIG mode changes
    are the operator's business (``SetMigMode`` over the API)."""
    if state_file.exists():
        return SimulatedHardware.open(state_file)
    if not sim_gpus:
        raise FileNotFoundError(
            f"simulated hardware state {state_file} does not exist; "
            "give --sim-gpus MODEL[:COUNT],... to create it"
        )
    try:
        return SimulatedHardware.init_file(state_file, profiles.parse_gpus(sim_gpus))
    except FileExistsError:  # another process created it first
        return SimulatedHardware.open(state_file)
