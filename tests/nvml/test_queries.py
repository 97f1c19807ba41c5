"""Queries, the C functions that only read, run on a frozen view of the hardware: none of them can change
it, and a query's call is counted, faulted and shared between processes as any other call."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from ctypes import byref, c_char_p, c_uint, c_ulonglong, create_string_buffer
from pathlib import Path
from typing import Any

import msgspec
import pynvml as nv
import pytest

from sidecar.nvml.sim import SimError, SimulatedHardware, SimulatedLibrary, install, uninstall
from sidecar.nvml.sim.cabi import FUNCTIONS, QUERIES, query
from sidecar.nvml.sim.state import SimState, StateView, decode_view
from sidecar.nvml.sim.store import FileStore

H100_1G, H100_2G = 19, 14  # GI profile IDs of 1g.10gb and 2g.20gb on an H100
SHARED = nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED


def _node(hw: SimulatedHardware) -> SimulatedHardware:
    """An A100 and two H100s with every kind of thing a query reads: GIs with and without a CI, a
    busy MIG device, a busy GPU, a GPU with MIG disabled, a pending fault and a latency on other ops."""
    hw.create_instance(0, "3g.20gb", 4, 4)
    busy = hw.create_instance(1, "1g.10gb", 0, 1)
    hw.create_instance(1, "2g.20gb", 2, 2, with_ci=False)
    assert busy.mig_uuid is not None
    hw.set_busy(busy.mig_uuid)
    hw.set_busy(hw.gpu_uuid(0))
    hw.set_mig_mode(2, enabled=False)
    hw.inject_fault("create-gi", "IN_USE", after=3)
    hw.set_latency("destroy-gi", 0.5)
    hw.set_ci_info_device(parent=True)
    return hw


@pytest.fixture(params=["file", "memory"])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SimulatedHardware]:
    gpus = [("a100-40gb", 1), ("h100-80gb", 2)]
    if request.param == "file":
        hw = SimulatedHardware.init_file(tmp_path / "hw.json", gpus)
    else:
        hw = SimulatedHardware.create(gpus, proc_root=tmp_path / "proc")
    yield _node(hw)
    uninstall()


def _cis(hw: SimulatedHardware, gi_id: int) -> list[str]:
    return [ci.mig_uuid for ci in next(g for g in hw.layout(1).gis if g.id == gi_id).cis]


def _bytes(hw: SimulatedHardware) -> bytes:
    return msgspec.json.encode(hw.state())


class _Handles:
    """One handle of every kind, taken through pynvml's own wrappers."""

    def __init__(self, hw: SimulatedHardware) -> None:
        nv.nvmlInit()
        self.gpu = nv.nvmlDeviceGetHandleByIndex(1)
        gi = next(g for g in hw.layout(1).gis if g.cis)
        assert gi.mig_uuid is not None
        self.mig_uuid = gi.mig_uuid
        self.mig = nv.nvmlDeviceGetHandleByUUID(gi.mig_uuid)
        self.gi_id = gi.id
        self.gi = nv.nvmlDeviceGetGpuInstanceById(self.gpu, gi.id)
        self.ci_id = gi.cis[0].id
        self.ci = nv.nvmlGpuInstanceGetComputeInstanceById(self.gi, self.ci_id)
        self.event_set = nv.nvmlEventSetCreate()


def _gi_info_v2() -> Any:
    info = nv.c_nvmlGpuInstanceProfileInfo_v2_t()
    info.version = nv.nvmlGpuInstanceProfileInfo_v2
    return info


def _ci_info_v2() -> Any:
    info = nv.c_nvmlComputeInstanceProfileInfo_v2_t()
    info.version = nv.nvmlComputeInstanceProfileInfo_v2
    return info


def _uint() -> Any:
    return byref(c_uint())


# Every query with arguments that make it succeed on ``_node``; a query missing here fails the test.
QUERY_ARGS: dict[str, Callable[[_Handles], tuple[Any, ...]]] = {
    "nvmlInit": lambda h: (),
    "nvmlInit_v2": lambda h: (),
    "nvmlInitWithFlags": lambda h: (0,),
    "nvmlShutdown": lambda h: (),
    "nvmlErrorString": lambda h: (3,),
    "nvmlEventSetCreate": lambda h: (byref(nv.c_nvmlEventSet_t()),),
    "nvmlDeviceRegisterEvents": lambda h: (h.gpu, c_ulonglong(nv.nvmlEventTypeXidCriticalError), h.event_set),
    "nvmlEventSetFree": lambda h: (h.event_set,),
    "nvmlSystemGetDriverVersion": lambda h: (create_string_buffer(80), c_uint(80)),
    "nvmlDeviceGetCount": lambda h: (_uint(),),
    "nvmlDeviceGetCount_v2": lambda h: (_uint(),),
    "nvmlDeviceGetHandleByIndex": lambda h: (c_uint(1), byref(nv.c_nvmlDevice_t())),
    "nvmlDeviceGetHandleByIndex_v2": lambda h: (c_uint(1), byref(nv.c_nvmlDevice_t())),
    "nvmlDeviceGetHandleByUUID": lambda h: (c_char_p(h.mig_uuid.encode()), byref(nv.c_nvmlDevice_t())),
    "nvmlDeviceGetName": lambda h: (h.mig, create_string_buffer(96), c_uint(96)),
    "nvmlDeviceGetUUID": lambda h: (h.mig, create_string_buffer(96), c_uint(96)),
    "nvmlDeviceGetMinorNumber": lambda h: (h.gpu, _uint()),
    "nvmlDeviceGetIndex": lambda h: (h.gpu, _uint()),
    "nvmlDeviceGetMemoryInfo": lambda h: (h.mig, byref(nv.c_nvmlMemory_t())),
    "nvmlDeviceGetMigMode": lambda h: (h.gpu, _uint(), _uint()),
    "nvmlDeviceGetMaxMigDeviceCount": lambda h: (h.gpu, _uint()),
    "nvmlDeviceGetMigDeviceHandleByIndex": lambda h: (h.gpu, c_uint(0), byref(nv.c_nvmlDevice_t())),
    "nvmlDeviceIsMigDeviceHandle": lambda h: (h.mig, _uint()),
    "nvmlDeviceGetGpuInstanceId": lambda h: (h.mig, _uint()),
    "nvmlDeviceGetComputeInstanceId": lambda h: (h.mig, _uint()),
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": lambda h: (h.mig, byref(nv.c_nvmlDevice_t())),
    "nvmlDeviceGetComputeRunningProcesses_v3": lambda h: (
        h.gpu,
        byref(c_uint(4)),
        (nv.c_nvmlProcessInfo_v3_t * 4)(),
    ),
    "nvmlDeviceGetGpuInstanceProfileInfoV": lambda h: (h.gpu, c_uint(0), byref(_gi_info_v2())),
    "nvmlDeviceGetGpuInstanceProfileInfo": lambda h: (
        h.gpu,
        c_uint(0),
        byref(nv.c_nvmlGpuInstanceProfileInfo_t()),
    ),
    "nvmlDeviceGetGpuInstanceProfileInfoByIdV": lambda h: (h.gpu, c_uint(H100_1G), byref(_gi_info_v2())),
    "nvmlDeviceGetGpuInstancePossiblePlacements_v2": lambda h: (
        h.gpu,
        c_uint(H100_1G),
        (nv.c_nvmlGpuInstancePlacement_t * 8)(),
        byref(c_uint(8)),
    ),
    "nvmlDeviceGetGpuInstanceRemainingCapacity": lambda h: (h.gpu, c_uint(H100_1G), _uint()),
    "nvmlDeviceGetGpuInstances": lambda h: (
        h.gpu,
        c_uint(H100_2G),
        (nv.c_nvmlGpuInstance_t * 8)(),
        _uint(),
    ),
    "nvmlDeviceGetGpuInstanceById": lambda h: (h.gpu, c_uint(h.gi_id), byref(nv.c_nvmlGpuInstance_t())),
    "nvmlGpuInstanceGetInfo": lambda h: (h.gi, byref(nv.c_nvmlGpuInstanceInfo_t())),
    "nvmlGpuInstanceGetComputeInstanceProfileInfoV": lambda h: (
        h.gi,
        c_uint(0),
        c_uint(SHARED),
        byref(_ci_info_v2()),
    ),
    "nvmlGpuInstanceGetComputeInstanceProfileInfo": lambda h: (
        h.gi,
        c_uint(0),
        c_uint(SHARED),
        byref(nv.c_nvmlComputeInstanceProfileInfo_t()),
    ),
    "nvmlGpuInstanceGetComputeInstanceRemainingCapacity": lambda h: (h.gi, c_uint(0), _uint()),
    "nvmlGpuInstanceGetComputeInstancePossiblePlacements": lambda h: (
        h.gi,
        c_uint(0),
        (nv.c_nvmlComputeInstancePlacement_t * 8)(),
        byref(c_uint(8)),
    ),
    "nvmlGpuInstanceGetComputeInstances": lambda h: (
        h.gi,
        c_uint(0),
        (nv.c_nvmlComputeInstance_t * 8)(),
        _uint(),
    ),
    "nvmlGpuInstanceGetComputeInstanceById": lambda h: (
        h.gi,
        c_uint(h.ci_id),
        byref(nv.c_nvmlComputeInstance_t()),
    ),
    "nvmlComputeInstanceGetInfo": lambda h: (h.ci, byref(nv.c_nvmlComputeInstanceInfo_t())),
    "nvmlComputeInstanceGetInfo_v2": lambda h: (h.ci, byref(nv.c_nvmlComputeInstanceInfo_t())),
}


class TestNoQueryChangesTheHardware:
    def test_every_query_answers_and_leaves_the_state_byte_for_byte_as_it_was(
        self, node: SimulatedHardware
    ) -> None:
        assert set(QUERY_ARGS) == QUERIES  # a new query must be added here
        library = install(node)
        handles = _Handles(node)
        before = _bytes(node)
        node.reset_call_counts()
        for name, args in QUERY_ARGS.items():
            answer = getattr(library, name)(*args(handles))
            assert answer == (b"Not Supported" if name == "nvmlErrorString" else nv.NVML_SUCCESS), name
        assert _bytes(node) == before
        assert {name for name, n in node.call_counts().items() if n == 1} == QUERIES

    def test_every_query_given_a_handle_of_every_kind_leaves_the_state_as_it_was(
        self, node: SimulatedHardware
    ) -> None:
        """The error paths too: a GPU, MIG, GI or CI handle where another kind is wanted, a lost GPU
        and a GPU with MIG disabled."""
        library = install(node)
        handles = _Handles(node)
        kinds = [handles.gpu, handles.mig, handles.gi, handles.ci, nv.nvmlDeviceGetHandleByIndex(2)]
        node.lose_gpu(0)
        kinds.append(ctypes.cast(1 << 60, nv.c_nvmlDevice_t))  # GPU 0's handle, now lost
        before = _bytes(node)
        answers = set()
        for name, args in QUERY_ARGS.items():
            for kind in kinds:
                given = args(handles)
                if given and isinstance(given[0], ctypes._Pointer):
                    answers.add(getattr(library, name)(kind, *given[1:]))
        assert _bytes(node) == before
        wanted = {nv.NVML_ERROR_INVALID_ARGUMENT, nv.NVML_ERROR_GPU_IS_LOST, nv.NVML_ERROR_NOT_SUPPORTED}
        assert wanted <= answers

    def test_a_query_that_tries_to_change_the_hardware_fails_and_changes_nothing(
        self, node: SimulatedHardware
    ) -> None:
        attempts: list[Callable[[StateView], object]] = [
            lambda s: setattr(s.gpus[1], "lost", True),
            lambda s: next(gi for gi in s.gpus[1].gis if gi.cis).cis.clear(),  # type: ignore[attr-defined]
            lambda s: s.busy.append("GPU-x"),  # type: ignore[attr-defined]
            lambda s: s.latency.__setitem__("any", 9.0),  # type: ignore[index]  # the write a read-only view refuses
            lambda s: s.faults[0].__setattr__("after", 0),
        ]
        before = _bytes(node)
        for i, attempt in enumerate(attempts):
            name = f"nvmlSimTestRogue{i}"
            query(name)(lambda state, change=attempt: change(state))
            try:
                with pytest.raises((AttributeError, TypeError)):
                    getattr(SimulatedLibrary(node.store), name)()
            finally:
                del FUNCTIONS[name]
                QUERIES.discard(name)
        assert _bytes(node) == before
        install(node)
        nv.nvmlInit()
        assert len(nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(1))) == 1
        assert nv.nvmlDeviceGetHandleByIndex(1)  # GPU 1 is not lost


class TestTheViewIsTheState:
    def test_the_view_encodes_to_the_bytes_it_was_decoded_from(self, node: SimulatedHardware) -> None:
        """A field added to ``SimState`` and not to ``StateView`` (or the other way) fails here."""
        raw = _bytes(node)
        view = decode_view(raw)
        assert msgspec.json.encode(view, enc_hook=dict) == raw
        assert msgspec.json.encode(msgspec.json.decode(raw, type=SimState)) == raw

    def test_a_query_after_a_knob_refused_half_way_sees_what_a_transaction_sees(
        self, node: SimulatedHardware
    ) -> None:
        """In memory a refused ``destroy_instance`` keeps the CIs it destroyed before the refusal; on a
        file nothing is written. Either way a query answers what the next transaction reads."""
        gi = node.create_instance(1, "3g.40gb", 4, 4, with_ci=False)
        install(node)
        nv.nvmlInit()
        dev = nv.nvmlDeviceGetHandleByIndex(1)
        gi_handle = nv.nvmlDeviceGetGpuInstanceById(dev, gi.id)
        for _ in range(2):
            nv.nvmlGpuInstanceCreateComputeInstance(gi_handle, 0)
        node.set_busy(_cis(node, gi.id)[1])
        assert _ci_ids(gi_handle) == [0, 1]  # a query now, so the view of this state is kept
        with pytest.raises(SimError, match="processes are running"):
            node.destroy_instance(1, gi.id)
        assert _ci_ids(gi_handle) == ([0, 1] if isinstance(node.store, FileStore) else [1])
        assert len(_cis(node, gi.id)) == len(_ci_ids(gi_handle))


def _ci_ids(gi: object) -> list[int]:
    """The IDs of the CIs 0 and 1 that the GPU instance has, asked through queries."""
    found = []
    for ci_id in (0, 1):
        try:
            nv.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
        except nv.NVMLError_NotFound:
            continue
        found.append(ci_id)
    return found


class TestAQueryIsCountedAndFaultedLikeAnyCall:
    def test_a_fault_on_a_query_counts_down_in_the_file_other_users_read(self, tmp_path: Path) -> None:
        path = tmp_path / "hw.json"
        hw = SimulatedHardware.init_file(path, [("h100-80gb", 1)])
        hw.inject_fault("get-mig-mode", "TIMEOUT", after=1)
        install(hw)
        try:
            nv.nvmlInit()
            dev = nv.nvmlDeviceGetHandleByIndex(0)
            assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
            assert [(f.after, f.times) for f in SimulatedHardware.open(path).faults()] == [(0, 1)]
            with pytest.raises(nv.NVMLError_Timeout):
                nv.nvmlDeviceGetMigMode(dev)
            assert SimulatedHardware.open(path).faults() == []
            assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]
        finally:
            uninstall()
        assert hw.call_counts()["nvmlDeviceGetMigMode"] == 3

    def test_a_fault_on_another_operation_is_left_alone_by_queries(self, node: SimulatedHardware) -> None:
        install(node)
        handles = _Handles(node)
        nv.nvmlDeviceGetMigMode(handles.gpu)
        nv.nvmlDeviceGetComputeRunningProcesses(handles.mig)
        assert [(f.op, f.after, f.times) for f in node.faults()] == [("create-gi", 3, 1)]
