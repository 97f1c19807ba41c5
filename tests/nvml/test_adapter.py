"""The pynvml adapter: the same read-only tests run against the simulated library and, when a real
driver is present, against real NVML; mutating and fault tests run on the simulated library only."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from sidecar.nvml import BackendUnavailableError, open_backend, profiles
from sidecar.nvml.port import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    NvmlError,
    Placement,
)
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import GiLayout, SimulatedHardware, install, uninstall

MakeHw = Callable[..., SimulatedHardware]


class TestReadingTheNode:
    def test_gpus_are_listed_in_index_order_with_their_identity(self, backend: PynvmlBackend) -> None:
        gpus = backend.gpus()
        assert [g.index for g in gpus] == list(range(len(gpus)))
        for g in gpus:
            assert g.uuid.startswith("GPU-")
            assert backend.gpu(g.uuid) == g
            assert g.memory_mb > 0

    def test_profiles_carry_ids_names_and_placements_not_indices(self, backend: PynvmlBackend) -> None:
        for g in backend.gpus():
            for p in backend.gpu_instance_profiles(g.uuid):
                assert not p.name.startswith("MIG ")
                assert p.placements, p.name
                assert all(pl.size == p.placements[0].size for pl in p.placements)

    def test_an_unknown_gpu_uuid_is_an_nvml_error(self, backend: PynvmlBackend) -> None:
        with pytest.raises(NvmlError) as exc:
            backend.gpu("GPU-00000000-0000-0000-0000-000000000000")
        assert isinstance(exc.value.__cause__, pynvml.NVMLError)
        assert "GPU-00000000" in str(exc.value)


class TestSimulatedProfiles:
    def test_the_a100_profiles_map_index_to_id_and_name_to_the_full_size_ci(
        self, backend: PynvmlBackend
    ) -> None:
        a100 = backend.gpus()[0]
        if a100.model != "NVIDIA A100-SXM4-40GB":
            pytest.skip("not the simulated A100")
        got = {
            p.name: (p.index, p.id, p.slice_count, p.ci_profile_id)
            for p in backend.gpu_instance_profiles(a100.uuid)
        }
        assert got == {
            "1g.5gb": (0, 19, 1, 0),
            "1g.5gb+me": (7, 20, 1, 0),
            "1g.10gb": (9, 15, 1, 0),
            "2g.10gb": (1, 14, 2, 1),
            "3g.20gb": (2, 9, 3, 2),
            "4g.20gb": (3, 5, 4, 3),
            "7g.40gb": (4, 0, 7, 4),
        }


class TestProfilesBeyondTheModelledGpus:
    """No modelled GPU has a 6- or 8-slice GI profile, so these tests register a board that has, with
    one more profile whose 5 compute slices have no known full-size CI profile."""

    @pytest.fixture
    def board(self, monkeypatch: pytest.MonkeyPatch, make_hw: MakeHw) -> SimulatedHardware:
        def gi(index: int, profile_id: int, name: str, slices: int, size: int) -> profiles.GiProfile:
            starts = tuple(range(0, 8 - size + 1, size))
            ci = profiles.full_ci_profile_id(slices)
            cis = (
                ()
                if ci is None
                else (
                    profiles.CiProfile(
                        id=ci, slice_count=slices, instance_count=1, starts=(0,), multiprocessor_count=slices
                    ),
                )
            )
            return profiles.GiProfile(
                index=index,
                id=profile_id,
                name=name,
                slice_count=slices,
                size=size,
                instance_count=len(starts),
                starts=starts,
                memory_mb=size * 1024,
                multiprocessor_count=slices,
                copy_engines=1,
                decoders=0,
                encoders=0,
                jpegs=0,
                ofas=0,
                ci_profiles=cis,
            )

        board = profiles.GpuProduct(
            key="test-8-slice",
            name="Test 8-slice board",
            memory_mb=8192,
            multiprocessor_count=8,
            memory_slices=8,
            max_mig_devices=8,
            resetless_mig_toggle=True,
            profiles=(
                gi(profiles.GI_PROFILE_1_SLICE, 19, "1g.1gb", 1, 1),
                gi(pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE, 40, "6g.6gb", 6, 6),
                gi(pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE, 41, "8g.8gb", 8, 8),
                gi(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX, 42, "5g.5gb", 5, 5),
            ),
        )
        monkeypatch.setitem(profiles.MODELS, board.key, board)
        return make_hw((board.key, 1))

    def test_six_and_eight_slice_profiles_get_their_full_size_compute_instance(
        self, board: SimulatedHardware
    ) -> None:
        port = PynvmlBackend(retry_wait=False)
        try:
            got = {p.name: p.ci_profile_id for p in port.gpu_instance_profiles(board.gpu_uuid(0))}
        finally:
            port.close()
        assert got["6g.6gb"] == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE
        assert got["8g.8gb"] == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE
        assert got["1g.1gb"] == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE

    def test_a_profile_without_a_known_full_size_compute_instance_is_not_offered(
        self, board: SimulatedHardware
    ) -> None:
        port = PynvmlBackend(retry_wait=False)
        try:
            names = [p.name for p in port.gpu_instance_profiles(board.gpu_uuid(0))]
        finally:
            port.close()
        assert "5g.5gb" not in names
        assert sorted(names) == ["1g.1gb", "6g.6gb", "8g.8gb"]


def ci_destroyed(hw: SimulatedHardware, port: PynvmlBackend) -> tuple[str, GiLayout]:
    """A 3g.40gb at 4:4 on GPU 0 whose CI the adapter has just destroyed (its GI destroy next)."""
    gi = hw.create_instance(0, "3g.40gb", 4, 4)
    gpu = hw.gpu_uuid(0)
    port.destroy_compute_instance(gpu, gi.id, 0)
    return gpu, gi


class TestInstances:
    def test_create_list_and_destroy_an_instance(self, h100: SimulatedHardware, port: PynvmlBackend) -> None:
        gpu = port.gpus()[0].uuid
        gi = port.create_gpu_instance(gpu, 9, Placement(4, 4))
        ci = port.create_compute_instance(gpu, gi.id, 2)
        assert (gi.id, gi.profile_id, gi.placement) == (2, 9, Placement(4, 4))
        assert port.gpu_instances(gpu) == [gi]
        assert port.compute_instances(gpu, gi.id) == [ci]
        assert h100.layout(0).gis[0].mig_uuid == ci.mig_uuid
        assert port.mig_device_processes(ci.mig_uuid) == 0
        h100.set_busy(ci.mig_uuid)
        assert (port.mig_device_processes(ci.mig_uuid), port.gpu_processes(gpu)) == (1, 1)
        h100.set_busy(ci.mig_uuid, False)
        port.destroy_compute_instance(gpu, gi.id, ci.id)
        port.destroy_gpu_instance(gpu, gi.id)
        assert h100.layout(0).gis == ()

    def test_the_gpu_instance_destroy_after_a_compute_instance_destroy_takes_its_handle(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu, gi = ci_destroyed(h100, port)
        h100.reset_call_counts()
        port.destroy_gpu_instance(gpu, gi.id)
        assert (h100.call_counts(), h100.layout(0).gis) == ({"nvmlGpuInstanceDestroy": 1}, ())

    def test_a_gpu_instance_destroyed_outside_between_the_two_destroys_is_not_found(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        """The remembered handle went stale: the GI destroy answers what a lookup by ID answers."""
        gpu, gi = ci_destroyed(h100, port)
        h100.destroy_instance(0, gi.id)
        other = h100.create_instance(0, "3g.40gb", 0, 4, with_ci=False)
        with pytest.raises(NvmlError) as exc:
            port.destroy_gpu_instance(gpu, gi.id)
        assert exc.value.not_found
        assert [g.id for g in h100.layout(0).gis] == [other.id]

    def test_a_handle_is_kept_only_for_the_next_mutating_call_on_its_gpu(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        """A CI destroy whose GI destroy does not come next (another create on the GPU in between):
        the GI destroy looks its GI up by ID, and destroys that GI, not the new one."""
        gpu, gi = ci_destroyed(h100, port)
        other = port.create_gpu_instance(gpu, 9, Placement(0, 4))
        h100.reset_call_counts()
        port.destroy_gpu_instance(gpu, gi.id)
        assert h100.call_counts() == {"nvmlDeviceGetGpuInstanceById": 1, "nvmlGpuInstanceDestroy": 1}
        assert [g.id for g in h100.layout(0).gis] == [other.id]
        # The new GI's own handle went to the destroy above, which took it and did not use it.
        h100.reset_call_counts()
        port.create_compute_instance(gpu, other.id, 2)
        assert h100.call_counts()["nvmlDeviceGetGpuInstanceById"] == 1

    def test_a_kept_handle_outlives_calls_on_other_gpus(self, make_hw: MakeHw) -> None:
        hw = make_hw(("h100-80gb", 2))
        port = PynvmlBackend(retry_wait=False)
        try:
            first, gi = ci_destroyed(hw, port)
            second = hw.gpu_uuid(1)
            made = port.create_gpu_instance(second, 9, Placement(0, 4))
            port.create_compute_instance(second, made.id, 2)
            hw.reset_call_counts()
            port.destroy_gpu_instance(first, gi.id)
            assert hw.call_counts() == {"nvmlGpuInstanceDestroy": 1}
            assert (hw.layout(0).gis, [g.id for g in hw.layout(1).gis]) == ((), [made.id])
        finally:
            port.close()

    def test_a_transient_failure_of_the_remembered_handle_is_retried_by_id(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu, gi = ci_destroyed(h100, port)
        h100.inject_fault("destroy-gi", NVML_ERROR_IN_USE, times=1)
        h100.reset_call_counts()
        port.destroy_gpu_instance(gpu, gi.id)
        assert h100.layout(0).gis == ()
        assert h100.call_counts() == {"nvmlGpuInstanceDestroy": 2, "nvmlDeviceGetGpuInstanceById": 1}

    def test_a_gpu_instance_without_a_compute_instance_is_listed_with_no_cis(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        h100.create_instance(0, "2g.20gb", 2, 2, with_ci=False)
        gpu = port.gpus()[0].uuid
        assert [g.id for g in port.gpu_instances(gpu)] == [4]
        assert port.compute_instances(gpu, 4) == []

    def test_mig_disabled_surfaces_as_not_supported(self, make_hw: object) -> None:
        make_hw(("h100-80gb", 1), mig_enabled=False)  # type: ignore[operator]
        port = PynvmlBackend(retry_wait=False)
        gpu = port.gpus()[0]
        assert (gpu.mig_current, gpu.mig_pending) == (False, False)
        with pytest.raises(NvmlError) as exc:
            port.gpu_instances(gpu.uuid)
        assert exc.value.code == NVML_ERROR_NOT_SUPPORTED
        assert port.set_mig_mode(gpu.uuid, True) == 0
        assert port.gpu(gpu.uuid).mig_current
        port.close()


class TestAProfileTableThatDidNotAnswer:
    """Ampere drivers answer GetGpuInstanceProfileInfo NOT_SUPPORTED for every index while MIG is
    disabled; the adapter must neither remember that empty table nor read "no GPU instances" from it."""

    @staticmethod
    def _every_profile_index_not_supported(hw: SimulatedHardware) -> None:
        hw.inject_fault("profile-info", "NOT_SUPPORTED", times=pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)

    def test_with_mig_disabled_listing_gpu_instances_is_not_supported(self, make_hw: MakeHw) -> None:
        hw = make_hw(("a100-40gb", 1), mig_enabled=False)
        port = PynvmlBackend(retry_wait=False)
        try:
            self._every_profile_index_not_supported(hw)
            with pytest.raises(NvmlError) as exc:
                port.gpu_instances(hw.gpu_uuid(0))
            assert exc.value.code == NVML_ERROR_NOT_SUPPORTED
            assert "disabled" in str(exc.value)
        finally:
            port.close()

    def test_instances_made_once_mig_is_enabled_are_listed(self, make_hw: MakeHw) -> None:
        hw = make_hw(("a100-40gb", 1), mig_enabled=False)
        port = PynvmlBackend(retry_wait=False)
        try:
            gpu = hw.gpu_uuid(0)
            self._every_profile_index_not_supported(hw)
            with pytest.raises(NvmlError):
                port.gpu_instances(gpu)
            hw.set_mig_mode(0, True)
            made = hw.create_instance(0, "3g.20gb", 4, 4)
            assert [(g.id, g.placement) for g in port.gpu_instances(gpu)] == [(made.id, Placement(4, 4))]
        finally:
            port.close()

    def test_with_mig_enabled_an_empty_table_fails_instead_of_hiding_instances(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = h100.gpu_uuid(0)
        made = h100.create_instance(0, "3g.40gb", 0, 4)
        self._every_profile_index_not_supported(h100)
        with pytest.raises(NvmlError) as exc:
            port.gpu_instances(gpu)
        assert exc.value.code == NVML_ERROR_NOT_SUPPORTED
        assert [g.id for g in port.gpu_instances(gpu)] == [made.id]  # read again, not remembered

    def test_a_compute_instance_profile_table_that_did_not_answer_hides_no_compute_instance(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = h100.gpu_uuid(0)
        made = h100.create_instance(0, "3g.40gb", 0, 4)
        h100.inject_fault(
            "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
            "NOT_SUPPORTED",
            times=pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
        )
        with pytest.raises(NvmlError) as exc:
            port.compute_instances(gpu, made.id)
        assert exc.value.code == NVML_ERROR_NOT_SUPPORTED
        assert [c.mig_uuid for c in port.compute_instances(gpu, made.id)] == [made.mig_uuid]


class TestAMigModeChange:
    """nvml.h: setting the MIG mode may unbind or reset the device, so its minor number and handle may
    change and the caller is expected to query them again. The adapter forgets what it cached."""

    def test_a_minor_number_renumbered_by_the_mode_change_is_read_again(self, tmp_path: Path) -> None:
        state = tmp_path / "hw.json"
        hw = SimulatedHardware.init_file(state, [("h100-80gb", 1)], mig_enabled=False)
        install(hw)
        port = PynvmlBackend(retry_wait=False)
        try:
            gpu = port.gpus()[0]
            assert gpu.minor == 0
            doc = json.loads(state.read_bytes())
            doc["gpus"][0]["minor"] = 3  # the driver rebinds the device and renumbers it
            state.write_text(json.dumps(doc))
            assert port.set_mig_mode(gpu.uuid, True) == 0
            again = port.gpu(gpu.uuid)
            assert (again.minor, again.mig_current) == (3, True)
            assert port.gpus()[0].minor == 3
        finally:
            port.close()
            uninstall()


class TestRetries:
    def test_in_use_on_a_destroy_is_retried_until_it_clears(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gi = h100.create_instance(0, "3g.40gb", 0, 4, with_ci=False)
        h100.inject_fault("destroy-gi", NVML_ERROR_IN_USE, times=2)
        port.destroy_gpu_instance(h100.gpu_uuid(0), gi.id)
        assert h100.layout(0).gis == ()

    def test_in_use_that_outlasts_the_attempts_reaches_the_caller(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gi = h100.create_instance(0, "3g.40gb", 0, 4, with_ci=False)
        h100.inject_fault("destroy-gi", NVML_ERROR_IN_USE, times=5)
        with pytest.raises(NvmlError) as exc:
            port.destroy_gpu_instance(h100.gpu_uuid(0), gi.id)
        assert exc.value.in_use
        assert h100.faults()[0].times == 2  # three attempts, no more
        assert [g.id for g in h100.layout(0).gis] == [gi.id]

    def test_a_create_is_not_retried_on_insufficient_resources(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        h100.inject_fault("create-gi", NVML_ERROR_INSUFFICIENT_RESOURCES, times=2)
        with pytest.raises(NvmlError) as exc:
            port.create_gpu_instance(h100.gpu_uuid(0), 9, Placement(0, 4))
        assert exc.value.code == NVML_ERROR_INSUFFICIENT_RESOURCES
        assert h100.faults()[0].times == 1

    def test_a_timeout_on_create_is_retried(self, h100: SimulatedHardware, port: PynvmlBackend) -> None:
        h100.inject_fault("create-gi", NVML_ERROR_TIMEOUT)
        gi = port.create_gpu_instance(h100.gpu_uuid(0), 9, Placement(0, 4))
        assert [g.id for g in h100.layout(0).gis] == [gi.id]


class TestTheErrorBoundary:
    def test_a_library_older_than_pynvml_is_an_nvml_error_not_a_library_mismatch(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        """pynvml turns FUNCTION_NOT_FOUND from a versioned symbol (here the _v3 process list) into
        ``NVMLLibraryMismatchError``, a plain Exception; callers must still see a port error."""
        gpu = port.gpus()[0].uuid
        h100.inject_fault("processes", "FUNCTION_NOT_FOUND")
        with pytest.raises(NvmlError) as exc:
            port.gpu_processes(gpu)
        assert exc.value.code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        assert isinstance(exc.value.__cause__, pynvml.NVMLLibraryMismatchError)
        assert gpu in str(exc.value)


class TestAReadBackThatTimesOut:
    """A create that succeeded is never issued again because reading the new instance back failed:
    the second create would meet the first one's instance (INSUFFICIENT_RESOURCES) and fail a request
    whose hardware step had worked."""

    def test_a_gpu_instance_read_back_timeout_is_retried_without_a_second_create(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        h100.inject_fault("nvmlGpuInstanceGetInfo", NVML_ERROR_TIMEOUT)
        gi = port.create_gpu_instance(h100.gpu_uuid(0), 9, Placement(4, 4))
        assert (gi.id, gi.profile_id, gi.placement) == (2, 9, Placement(4, 4))
        assert [(g.id, g.placement) for g in h100.layout(0).gis] == [(2, Placement(4, 4))]

    def test_a_compute_instance_read_back_timeout_is_retried_without_a_second_create(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = h100.gpu_uuid(0)
        gi = port.create_gpu_instance(gpu, 9, Placement(0, 4))
        h100.inject_fault("nvmlComputeInstanceGetInfo_v2", NVML_ERROR_TIMEOUT)
        ci = port.create_compute_instance(gpu, gi.id, 2)
        (made,) = h100.layout(0).gis[0].cis
        assert (ci.id, ci.mig_uuid) == (made.id, made.mig_uuid)

    def test_a_read_back_that_keeps_timing_out_reports_the_timeout_and_leaves_one_instance(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = h100.gpu_uuid(0)
        gi = port.create_gpu_instance(gpu, 9, Placement(0, 4))
        h100.inject_fault("nvmlComputeInstanceGetInfo_v2", NVML_ERROR_TIMEOUT, times=5)
        with pytest.raises(NvmlError) as exc:
            port.create_compute_instance(gpu, gi.id, 2)
        assert exc.value.code == NVML_ERROR_TIMEOUT
        assert len(h100.layout(0).gis[0].cis) == 1  # the lifecycle's undo finds and destroys it


class TestOpeningABackend:
    def test_the_simulated_backend_creates_its_state_file_and_proc_tree(self, tmp_path: Path) -> None:
        state = tmp_path / "hw.json"
        backend = open_backend("simulated", sim_state=state, sim_gpus="a30:2", retry_wait=False)
        try:
            assert backend.kind == "simulated"
            assert [g.model for g in backend.port.gpus()] == ["NVIDIA A30", "NVIDIA A30"]
            assert backend.proc_root == tmp_path / "hw.json.proc"
            assert (backend.proc_root / "sys/kernel/random/boot_id").read_text().strip()
            assert state.exists()
        finally:
            backend.close()
        assert pynvml.nvmlLib is None

    def test_a_missing_state_file_without_gpus_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(BackendUnavailableError, match="sim-gpus"):
            open_backend("simulated", sim_state=tmp_path / "missing.json")

    def test_the_nvml_backend_never_falls_back_to_the_simulator(self, real_driver: bool) -> None:
        if real_driver:
            pytest.skip("a real NVIDIA driver is present")
        with pytest.raises(BackendUnavailableError, match="--backend simulated"):
            open_backend("nvml", retry_wait=False)
        assert pynvml.nvmlLib is None

    def test_an_unknown_backend_kind_is_refused(self) -> None:
        with pytest.raises(BackendUnavailableError, match="unknown"):
            open_backend("mock")
