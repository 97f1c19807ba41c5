"""The simulated libnvidia-ml, driven through pynvml's own wrappers, says what real hardware says."""

from __future__ import annotations

from collections.abc import Callable
from ctypes import byref, c_uint
from pathlib import Path

import pynvml as nv
import pytest

from sidecar.nvml.sim import SimError, SimulatedHardware, install, uninstall
from sidecar.nvml.sim.procfs import sync_proc, write_proc_static

MakeHw = Callable[..., SimulatedHardware]


def _gi(dev: object, profile_id: int, start: int, size: int) -> object:
    p = nv.c_nvmlGpuInstancePlacement_t(start, size)
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(dev, profile_id, byref(p))


def _full_ci(gi: object, ci_index: int) -> object:
    info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, ci_index, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    return nv.nvmlGpuInstanceCreateComputeInstance(gi, info.id)


def _code(exc: pytest.ExceptionInfo[nv.NVMLError]) -> int:
    return int(exc.value.value)


@pytest.fixture
def dev(h100: SimulatedHardware) -> object:
    nv.nvmlInit()
    return nv.nvmlDeviceGetHandleByIndex(0)


class TestGpuInstanceIds:
    @pytest.mark.parametrize(
        ("profile_id", "start", "size", "gi_id"),
        [(9, 4, 4, 2), (5, 0, 4, 1), (14, 2, 2, 4), (19, 6, 1, 13), (0, 0, 8, 0), (15, 6, 2, 6)],
    )
    def test_a100_gives_the_ids_real_drivers_give(
        self, make_hw: MakeHw, profile_id: int, start: int, size: int, gi_id: int
    ) -> None:
        make_hw(("a100-40gb", 1))
        nv.nvmlInit()
        gi = _gi(nv.nvmlDeviceGetHandleByIndex(0), profile_id, start, size)
        assert nv.nvmlGpuInstanceGetInfo(gi).id == gi_id

    def test_a30_numbers_1g_at_0_and_1_and_2g_at_2_as_3_4_and_2(self, make_hw: MakeHw) -> None:
        make_hw(("a30", 1))
        nv.nvmlInit()
        dev = nv.nvmlDeviceGetHandleByIndex(0)
        ids = [
            nv.nvmlGpuInstanceGetInfo(_gi(dev, pid, s, z)).id
            for pid, s, z in [(14, 0, 1), (14, 1, 1), (5, 2, 2)]
        ]
        assert ids == [3, 4, 2]

    def test_h100_numbers_the_seven_1g_instances_7_to_13(self, dev: object) -> None:
        assert [nv.nvmlGpuInstanceGetInfo(_gi(dev, 19, s, 1)).id for s in range(7)] == list(range(7, 14))


class TestStrictness:
    def test_a_1g_at_slice_3_blocks_a_3g_at_0_4_with_insufficient_resources(self, dev: object) -> None:
        _gi(dev, 19, 3, 1)
        with pytest.raises(nv.NVMLError) as exc:
            _gi(dev, 9, 0, 4)
        assert _code(exc) == nv.NVML_ERROR_INSUFFICIENT_RESOURCES
        assert str(exc.value) == "Insufficient Resources"

    def test_an_overlapping_create_is_insufficient_resources_not_already_exists(self, dev: object) -> None:
        _gi(dev, 14, 2, 2)
        with pytest.raises(nv.NVMLError) as exc:
            _gi(dev, 14, 2, 2)
        assert _code(exc) == nv.NVML_ERROR_INSUFFICIENT_RESOURCES

    def test_an_exhausted_instance_count_is_insufficient_resources(self, dev: object) -> None:
        _gi(dev, 20, 0, 1)  # 1g.10gb+me exists once per GPU
        with pytest.raises(nv.NVMLError) as exc:
            _gi(dev, 20, 3, 1)
        assert _code(exc) == nv.NVML_ERROR_INSUFFICIENT_RESOURCES
        assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 20) == 0

    @pytest.mark.parametrize(("start", "size"), [(1, 4), (4, 2), (7, 1)])
    def test_a_placement_not_in_the_list_is_an_invalid_argument(
        self, dev: object, start: int, size: int
    ) -> None:
        with pytest.raises(nv.NVMLError) as exc:
            _gi(dev, 9 if size == 4 else 19, start, size)
        assert _code(exc) == nv.NVML_ERROR_INVALID_ARGUMENT

    def test_destroying_a_gpu_instance_with_a_compute_instance_is_in_use(self, dev: object) -> None:
        gi = _gi(dev, 9, 0, 4)
        _full_ci(gi, nv.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlGpuInstanceDestroy(gi)
        assert _code(exc) == nv.NVML_ERROR_IN_USE
        assert str(exc.value) == "In use by another client"

    def test_a_busy_mig_device_refuses_its_compute_instance_destroy(
        self, h100: SimulatedHardware, dev: object
    ) -> None:
        ci = _full_ci(_gi(dev, 9, 0, 4), nv.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        mig_uuid = nv.nvmlDeviceGetUUID(nv.nvmlComputeInstanceGetInfo(ci).device)
        h100.set_busy(mig_uuid)
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlComputeInstanceDestroy(ci)
        assert _code(exc) == nv.NVML_ERROR_IN_USE
        mig = nv.nvmlDeviceGetHandleByUUID(mig_uuid)
        assert len(nv.nvmlDeviceGetComputeRunningProcesses(mig)) == 1
        assert len(nv.nvmlDeviceGetComputeRunningProcesses(dev)) == 1
        h100.set_busy(mig_uuid, False)
        nv.nvmlComputeInstanceDestroy(ci)
        assert h100.layout(0).gis[0].cis == ()

    def test_a_stale_handle_is_an_invalid_argument_even_after_the_same_id_returns(self, dev: object) -> None:
        old = _gi(dev, 9, 0, 4)
        nv.nvmlGpuInstanceDestroy(old)
        new = _gi(dev, 9, 0, 4)
        assert nv.nvmlGpuInstanceGetInfo(new).id == 1
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlGpuInstanceGetInfo(old)
        assert _code(exc) == nv.NVML_ERROR_INVALID_ARGUMENT

    def test_by_id_lookups_of_missing_instances_are_not_found(self, dev: object) -> None:
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlDeviceGetGpuInstanceById(dev, 1)
        assert _code(exc) == nv.NVML_ERROR_NOT_FOUND
        gi = _gi(dev, 9, 0, 4)
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
        assert _code(exc) == nv.NVML_ERROR_NOT_FOUND

    def test_profile_indices_the_gpu_lacks_are_not_supported_and_out_of_range_ones_invalid(
        self, dev: object
    ) -> None:
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, nv.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
        assert _code(exc) == nv.NVML_ERROR_NOT_SUPPORTED
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlDeviceGetGpuInstanceProfileInfo(dev, nv.NVML_GPU_INSTANCE_PROFILE_COUNT)
        assert _code(exc) == nv.NVML_ERROR_INVALID_ARGUMENT


class TestMigMode:
    def test_with_mig_disabled_instances_are_not_supported_but_placements_still_answer(
        self, make_hw: MakeHw
    ) -> None:
        make_hw(("h100-80gb", 1), mig_enabled=False)
        nv.nvmlInit()
        dev = nv.nvmlDeviceGetHandleByIndex(0)
        for call in (lambda: _gi(dev, 9, 0, 4), lambda: nv.nvmlDeviceGetGpuInstanceById(dev, 1)):
            with pytest.raises(nv.NVMLError) as exc:
                call()
            assert _code(exc) == nv.NVML_ERROR_NOT_SUPPORTED
        count = c_uint(0)
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(dev, 9, None, byref(count))
        assert count.value == 2
        assert nv.nvmlDeviceGetMaxMigDeviceCount(dev) == 0

    def test_hopper_toggles_mig_mode_at_once(self, make_hw: MakeHw) -> None:
        make_hw(("h100-80gb", 1), mig_enabled=False)
        nv.nvmlInit()
        dev = nv.nvmlDeviceGetHandleByIndex(0)
        assert nv.nvmlDeviceSetMigMode(dev, nv.NVML_DEVICE_MIG_ENABLE) == nv.NVML_SUCCESS
        assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]

    def test_ampere_keeps_the_new_mode_pending_until_a_reboot(self, make_hw: MakeHw) -> None:
        hw = make_hw(("a100-40gb", 1), mig_enabled=False)
        nv.nvmlInit()
        dev = nv.nvmlDeviceGetHandleByIndex(0)
        assert nv.nvmlDeviceSetMigMode(dev, nv.NVML_DEVICE_MIG_ENABLE) == nv.NVML_ERROR_RESET_REQUIRED
        assert nv.nvmlDeviceGetMigMode(dev) == [0, 1]
        hw.reboot()
        assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]

    def test_mig_mode_cannot_be_disabled_while_gpu_instances_exist(self, dev: object) -> None:
        _gi(dev, 9, 0, 4)
        assert nv.nvmlDeviceSetMigMode(dev, nv.NVML_DEVICE_MIG_DISABLE) == nv.NVML_ERROR_IN_USE
        assert nv.nvmlDeviceGetMigMode(dev) == [1, 0]  # refused, yet pending like any IN_USE refusal

    def test_a_change_refused_because_a_process_runs_stays_pending_until_a_reset(
        self, h100: SimulatedHardware, dev: object
    ) -> None:
        """nvidia-smi: "MIG mode is in pending disable state for GPU ...: In use by another client"."""
        h100.set_busy(h100.gpu_uuid(0))
        assert nv.nvmlDeviceSetMigMode(dev, nv.NVML_DEVICE_MIG_DISABLE) == nv.NVML_ERROR_IN_USE
        assert nv.nvmlDeviceGetMigMode(dev) == [1, 0]
        h100.reset_gpu(0)
        assert nv.nvmlDeviceGetMigMode(dev) == [0, 0]

    def test_asking_for_the_current_mode_again_withdraws_a_pending_change(
        self, h100: SimulatedHardware, dev: object
    ) -> None:
        h100.set_busy(h100.gpu_uuid(0))
        assert nv.nvmlDeviceSetMigMode(dev, nv.NVML_DEVICE_MIG_DISABLE) == nv.NVML_ERROR_IN_USE
        assert nv.nvmlDeviceSetMigMode(dev, nv.NVML_DEVICE_MIG_ENABLE) == nv.NVML_SUCCESS
        assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]

    def test_ampere_refused_while_a_process_runs_keeps_the_new_mode_pending_until_a_reboot(
        self, make_hw: MakeHw
    ) -> None:
        hw = make_hw(("a100-40gb", 1), mig_enabled=False)
        hw.set_busy(hw.gpu_uuid(0))
        nv.nvmlInit()
        dev = nv.nvmlDeviceGetHandleByIndex(0)
        assert nv.nvmlDeviceSetMigMode(dev, nv.NVML_DEVICE_MIG_ENABLE) == nv.NVML_ERROR_IN_USE
        assert nv.nvmlDeviceGetMigMode(dev) == [0, 1]
        hw.reboot()
        assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]


class TestMigDevices:
    def test_a_gpu_instance_without_a_compute_instance_has_no_mig_device(self, dev: object) -> None:
        _gi(dev, 9, 0, 4)
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, 0)
        assert _code(exc) == nv.NVML_ERROR_NOT_FOUND

    def test_mig_devices_are_enumerated_by_gpu_instance_id_not_creation_order(self, dev: object) -> None:
        for start in (6, 0, 4):
            _full_ci(_gi(dev, 14 if start < 6 else 15, start, 2), 1 if start < 6 else 0)
        ids = [
            nv.nvmlDeviceGetGpuInstanceId(nv.nvmlDeviceGetMigDeviceHandleByIndex(dev, i)) for i in range(3)
        ]
        assert ids == [3, 5, 6]

    def test_every_compute_instance_creation_gets_a_fresh_mig_uuid(self, dev: object) -> None:
        gi = _gi(dev, 9, 0, 4)
        first = nv.nvmlComputeInstanceGetInfo(_full_ci(gi, 2))
        first_uuid = nv.nvmlDeviceGetUUID(first.device)
        nv.nvmlComputeInstanceDestroy(nv.nvmlGpuInstanceGetComputeInstanceById(gi, first.id))
        second = nv.nvmlComputeInstanceGetInfo(_full_ci(gi, 2))
        assert second.id == first.id == 0
        assert nv.nvmlDeviceGetUUID(second.device) != first_uuid
        assert nv.nvmlDeviceGetUUID(second.device).startswith("MIG-")

    def test_a_mig_uuid_resolves_to_a_mig_handle_that_knows_its_parent(self, dev: object) -> None:
        info = nv.nvmlComputeInstanceGetInfo(_full_ci(_gi(dev, 5, 0, 4), 3))
        mig = nv.nvmlDeviceGetHandleByUUID(nv.nvmlDeviceGetUUID(info.device))
        assert nv.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        assert nv.nvmlDeviceIsMigDeviceHandle(dev).value == 0
        assert (nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig)) == (1, 0)
        parent = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert nv.nvmlDeviceGetUUID(parent) == nv.nvmlDeviceGetUUID(dev)
        assert nv.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 4g.40gb"


class TestKnobs:
    def test_a_fault_fails_exactly_the_requested_calls_then_the_operation_works_again(
        self, h100: SimulatedHardware, dev: object
    ) -> None:
        h100.inject_fault("create-gi", "IN_USE", after=1, times=2)
        _gi(dev, 19, 0, 1)
        for start in (1, 1):
            with pytest.raises(nv.NVMLError) as exc:
                _gi(dev, 19, start, 1)
            assert _code(exc) == nv.NVML_ERROR_IN_USE
        _gi(dev, 19, 1, 1)
        assert [g.placement.start for g in h100.layout(0).gis] == [0, 1]
        assert h100.faults() == []

    def test_a_lost_gpu_answers_gpu_is_lost_to_every_call_until_reboot(
        self, h100: SimulatedHardware, dev: object
    ) -> None:
        h100.lose_gpu(0)
        with pytest.raises(nv.NVMLError) as exc:
            nv.nvmlDeviceGetMigMode(dev)
        assert _code(exc) == nv.NVML_ERROR_GPU_IS_LOST
        h100.reboot()
        assert nv.nvmlDeviceGetMigMode(dev) == [1, 1]

    def test_knob_created_instances_obey_the_same_placement_rules(self, h100: SimulatedHardware) -> None:
        h100.create_instance(0, "3g.40gb", 0, 4)
        with pytest.raises(SimError) as exc:
            h100.create_instance(0, "1g.10gb", 2, 1)
        assert exc.value.code == nv.NVML_ERROR_INSUFFICIENT_RESOURCES

    def test_a_reboot_clears_instances_and_changes_the_boot_id(
        self, h100: SimulatedHardware, tmp_path: Path
    ) -> None:
        h100.create_instance(0, "7g.80gb", 0, 8)
        before = (tmp_path / "proc/sys/kernel/random/boot_id").read_text().strip()
        assert before == h100.boot_id
        h100.reboot()
        assert h100.layout(0).gis == ()
        assert (tmp_path / "proc/sys/kernel/random/boot_id").read_text().strip() not in ("", before)


class TestProcTree:
    def test_access_files_appear_on_create_with_the_driver_s_minors_and_vanish_on_destroy(
        self, make_hw: MakeHw, tmp_path: Path
    ) -> None:
        hw = make_hw(("h100-80gb", 2))
        gi = hw.create_instance(1, "3g.40gb", 4, 4)
        caps = tmp_path / "proc/driver/nvidia/capabilities/gpu1/mig"
        assert (
            caps / "gi2/access"
        ).read_text() == "DeviceFileMinor: 156\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
        assert (caps / "gi2/ci0/access").read_text().startswith("DeviceFileMinor: 157\n")
        assert "508 nvidia-caps" in (tmp_path / "proc/devices").read_text()
        assert "195 nvidia-frontend" in (tmp_path / "proc/devices").read_text()
        hw.destroy_instance(1, gi.id)
        assert not (caps / "gi2").exists()


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


class TestProcTreeKeptPerGpu:
    """Only the GPUs whose instances changed are synced; the tree must equal a full rebuild."""

    @pytest.mark.parametrize("shared", [False, True], ids=["memory", "file"])
    def test_after_changes_on_several_gpus_the_tree_is_what_a_full_rebuild_writes(
        self, tmp_path: Path, shared: bool
    ) -> None:
        gpus = [("h100-80gb", 3)]
        if shared:
            hw = SimulatedHardware.init_file(tmp_path / "hw.json", gpus)
        else:
            hw = SimulatedHardware.create(gpus, proc_root=tmp_path / "hw.json.proc")
        root = tmp_path / "hw.json.proc"
        a = hw.create_instance(0, "3g.40gb", 0, 4)
        hw.create_instance(2, "1g.10gb", 6, 1)
        b = hw.create_instance(1, "7g.80gb", 0, 8)
        hw.create_instance(0, "2g.20gb", 4, 2)
        hw.destroy_instance(1, b.id)
        hw.destroy_instance(0, a.id)
        kept = _tree(root)
        assert any("gpu0/mig/gi" in name for name in kept)  # the GPU-0 2g.20gb is there
        assert not any("gpu1/mig/gi" in name for name in kept)  # GPU 1's instance went
        rebuilt = tmp_path / "rebuilt"
        write_proc_static(rebuilt, hw.state())
        sync_proc(rebuilt, hw.state())
        assert kept == _tree(rebuilt)


class TestSharedStateFile:
    def test_two_libraries_on_one_state_file_see_each_other_s_changes(self, tmp_path: Path) -> None:
        state = tmp_path / "hw.json"
        SimulatedHardware.init_file(state, [("h100-80gb", 1)])
        sidecar_view = SimulatedHardware.open(state)
        operator_view = SimulatedHardware.open(state)
        install(sidecar_view)
        try:
            nv.nvmlInit()
            dev = nv.nvmlDeviceGetHandleByIndex(0)
            gi = _gi(dev, 9, 0, 4)
            assert [g.id for g in operator_view.layout(0).gis] == [1]
            operator_view.create_instance(0, "3g.40gb", 4, 4)
            operator_view.inject_fault("destroy-gi", 19)
            with pytest.raises(nv.NVMLError) as exc:
                nv.nvmlGpuInstanceDestroy(gi)
            assert _code(exc) == nv.NVML_ERROR_IN_USE
            assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(dev, 9) == 0
            assert (tmp_path / "hw.json.proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access").exists()
        finally:
            uninstall()
