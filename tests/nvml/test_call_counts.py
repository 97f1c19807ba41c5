"""The simulated hardware counts every NVML call by C function name, across processes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pynvml
import pytest

from sidecar.nvml.port import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_INSUFFICIENT_RESOURCES, NvmlError, Placement
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall
from sidecar.nvml.sim.cli import register

CREATE_GI = "nvmlDeviceCreateGpuInstanceWithPlacement"
CREATE_CI = "nvmlGpuInstanceCreateComputeInstance"


def sim(state: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", "--sim-state", str(state), *argv])
    return int(args.func(args))


class TestCountingCallsInOneProcess:
    def test_a_gpu_instance_create_costs_the_create_and_one_info_read(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = port.gpus()[0].uuid  # caches the device handle, as the sidecar does at start
        h100.reset_call_counts()
        port.create_gpu_instance(gpu, 19, Placement(0, 1))
        assert h100.call_counts() == {CREATE_GI: 1, "nvmlGpuInstanceGetInfo": 1}

    def test_counts_accumulate_per_c_function_name(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = port.gpus()[0].uuid
        h100.reset_call_counts()
        for start in (0, 1, 2):
            gi = port.create_gpu_instance(gpu, 19, Placement(start, 1))
            port.create_compute_instance(gpu, gi.id, 0)
        counts = h100.call_counts()
        # Each CI create takes the handle of the GI made just before: no lookup by ID.
        assert (counts[CREATE_GI], counts[CREATE_CI], counts.get("nvmlDeviceGetGpuInstanceById", 0)) == (
            3,
            3,
            0,
        )

    def test_a_call_that_fails_is_counted_because_the_caller_made_it(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = port.gpus()[0].uuid
        port.create_gpu_instance(gpu, 19, Placement(0, 1))
        h100.reset_call_counts()
        h100.inject_fault("create-gi", "TIMEOUT", times=1)
        port.create_gpu_instance(gpu, 19, Placement(1, 1))  # the retry succeeds
        with pytest.raises(NvmlError) as refused:
            port.create_gpu_instance(gpu, 19, Placement(1, 1))  # overlap: refused, not retried
        assert refused.value.code == NVML_ERROR_INSUFFICIENT_RESOURCES
        assert h100.call_counts()[CREATE_GI] == 3

    def test_knobs_are_not_nvml_calls_and_are_not_counted(self, h100: SimulatedHardware) -> None:
        h100.create_instance(0, "1g.10gb", 0, 1)
        h100.set_busy(h100.layout(0).gis[0].cis[0].mig_uuid)
        assert h100.call_counts() == {}

    def test_a_reset_starts_from_zero_and_leaves_the_layout_alone(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = port.gpus()[0].uuid
        port.create_gpu_instance(gpu, 19, Placement(0, 1))
        h100.reset_call_counts()
        assert h100.call_counts() == {}
        assert [gi.placement for gi in h100.layout(0).gis] == [Placement(0, 1)]
        assert port.gpu_instances(gpu)[0].placement == Placement(0, 1)
        assert h100.call_counts()["nvmlDeviceGetGpuInstances"] > 0


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "hw.json"
    SimulatedHardware.init_file(path, [("h100-80gb", 1)])
    return path


def _create_one_instance_through_the_adapter(state: Path, start: int = 0) -> None:
    install(SimulatedHardware.open(state))
    try:
        port = PynvmlBackend(retry_wait=False)
        gpu = port.gpus()[0].uuid
        gi = port.create_gpu_instance(gpu, 19, Placement(start, 1))
        port.create_compute_instance(gpu, gi.id, 0)
        port.close()
    finally:
        uninstall()


class TestCountsSharedThroughTheStateFile:
    def test_calls_made_by_another_process_are_in_the_counts(self, state: Path) -> None:
        script = textwrap.dedent(
            f"""
            from pathlib import Path
            from sidecar.nvml.pynvml_backend import PynvmlBackend
            from sidecar.nvml.sim import SimulatedHardware, install
            install(SimulatedHardware.open(Path({str(state)!r})))
            port = PynvmlBackend(retry_wait=False)
            port.gpu_instances(port.gpus()[0].uuid)
            port.close()
            """
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
        _create_one_instance_through_the_adapter(state)
        counts = SimulatedHardware.open(state).call_counts()
        assert counts["nvmlInitWithFlags"] == 2
        assert counts["nvmlDeviceGetCount_v2"] == 2
        assert (counts[CREATE_GI], counts[CREATE_CI]) == (1, 1)

    def test_a_reset_by_one_user_is_seen_by_another_that_keeps_counting(self, state: Path) -> None:
        first, second = SimulatedHardware.open(state), SimulatedHardware.open(state)
        _create_one_instance_through_the_adapter(state)
        bare = first.create_instance(0, "1g.10gb", 1, 1, with_ci=False)
        install(first)
        try:
            port = PynvmlBackend(retry_wait=False)
            gpu = port.gpus()[0].uuid
            second.reset_call_counts()
            port.create_compute_instance(gpu, bare.id, 0)
            port.close()
        finally:
            uninstall()
        counts = second.call_counts()
        assert counts[CREATE_CI] == 1
        assert CREATE_GI not in counts
        assert counts == first.call_counts()

    def test_initialising_new_hardware_over_the_file_starts_new_counts(self, state: Path) -> None:
        _create_one_instance_through_the_adapter(state)
        SimulatedHardware.init_file(state, [("a30", 1)], overwrite=True)
        assert SimulatedHardware.open(state).call_counts() == {}

    def test_the_time_inside_the_driver_grows_with_its_calls_and_a_reset_zeroes_it(self, state: Path) -> None:
        hw = SimulatedHardware.open(state)
        hw.reset_call_counts()
        assert hw.store.driver_ns() == 0
        _create_one_instance_through_the_adapter(state)
        spent = hw.store.driver_ns()
        assert spent > 0
        _create_one_instance_through_the_adapter(state, start=1)
        assert hw.store.driver_ns() > spent
        hw.reset_call_counts()
        assert hw.store.driver_ns() == 0

    def test_a_damaged_counter_file_is_reinitialised_instead_of_misread(self, state: Path) -> None:
        state.with_name(state.name + ".calls").write_bytes(b"not a counter table")
        _create_one_instance_through_the_adapter(state)
        assert SimulatedHardware.open(state).call_counts()[CREATE_GI] == 1


class TestTheStatsCommand:
    def test_stats_json_lists_calls_per_function_and_the_total(
        self, state: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        _create_one_instance_through_the_adapter(state)
        capsys.readouterr()
        assert sim(state, "stats", "--json") == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["calls"][CREATE_GI], doc["calls"][CREATE_CI]) == (1, 1)
        assert doc["total"] == sum(doc["calls"].values())
        assert doc["driver_ms"] > 0
        assert doc["reset"] is False

    def test_stats_reset_prints_the_counts_then_starts_from_zero(
        self, state: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        _create_one_instance_through_the_adapter(state)
        capsys.readouterr()
        assert sim(state, "stats", "--reset") == 0
        table = capsys.readouterr().out.splitlines()
        assert [CREATE_GI, "1"] in [line.split() for line in table]
        assert table[-2].startswith("time inside the simulated driver: ")
        assert table[-1] == "counts reset"
        assert SimulatedHardware.open(state).call_counts() == {}
        assert SimulatedHardware.open(state).store.driver_ns() == 0

    def test_stats_of_missing_hardware_is_refused(self, tmp_path: Path) -> None:
        assert sim(tmp_path / "absent.json", "stats") == 1


PROFILE_INFO = "nvmlDeviceGetGpuInstanceProfileInfoV"
CI_PROFILE_INFO = "nvmlGpuInstanceGetComputeInstanceProfileInfoV"


class TestTheAdapterReadsStaticFactsOnceAndTheLayoutEveryTime:
    def test_listing_gpu_instances_again_reads_no_profile_table_but_sees_a_new_instance(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = port.gpus()[0].uuid
        assert port.gpu_instances(gpu) == []
        h100.reset_call_counts()
        h100.create_instance(0, "3g.40gb", 4, 4)  # behind the adapter's back
        assert [(g.id, g.placement) for g in port.gpu_instances(gpu)] == [(2, Placement(4, 4))]
        counts = h100.call_counts()
        assert PROFILE_INFO not in counts
        assert counts["nvmlDeviceGetGpuInstances"] == len(port.gpu_instance_profiles(gpu))

    def test_listing_compute_instances_again_reads_no_ci_profile_table_but_sees_a_new_ci(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = port.gpus()[0].uuid
        gi = h100.create_instance(0, "3g.40gb", 4, 4, with_ci=False)
        assert port.compute_instances(gpu, gi.id) == []
        h100.reset_call_counts()
        ci = port.create_compute_instance(gpu, gi.id, 2)
        assert [(c.id, c.mig_uuid) for c in port.compute_instances(gpu, gi.id)] == [(ci.id, ci.mig_uuid)]
        assert CI_PROFILE_INFO not in h100.call_counts()

    def test_a_gpu_instance_of_another_profile_uses_that_profile_s_ci_table(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = port.gpus()[0].uuid
        small = h100.create_instance(0, "1g.10gb", 0, 1)
        assert len(port.compute_instances(gpu, small.id)) == 1
        big = h100.create_instance(0, "3g.40gb", 4, 4, with_ci=False)
        made = [port.create_compute_instance(gpu, big.id, 0) for _ in range(3)]  # three 1-slice CIs
        listed = port.compute_instances(gpu, big.id)
        assert [c.mig_uuid for c in listed] == [c.mig_uuid for c in made]

    def test_reading_a_gpu_again_costs_one_mig_mode_read_and_sees_a_mode_change(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        first = port.gpus()[0]
        h100.set_mig_mode(0, False)
        h100.reset_call_counts()
        again = port.gpu(first.uuid)
        assert (again.mig_current, again.mig_pending) == (False, False)
        assert (again.index, again.uuid, again.minor, again.model, again.memory_mb) == (
            first.index,
            first.uuid,
            first.minor,
            first.model,
            first.memory_mb,
        )
        assert h100.call_counts() == {"nvmlDeviceGetMigMode": 1}

    def test_after_a_mig_mode_change_the_handle_and_every_cached_fact_are_read_again(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        """nvml.h: the mode change may rebind the device; its handle and minor number may change."""
        gpu = port.gpus()[0].uuid
        port.gpu_instances(gpu)
        h100.reset_call_counts()
        port.set_mig_mode(gpu, False)
        port.set_mig_mode(gpu, True)
        h100.reset_call_counts()
        port.gpu(gpu)
        port.gpu_instances(gpu)
        counts = h100.call_counts()
        assert counts["nvmlDeviceGetHandleByUUID"] == 1
        assert counts["nvmlDeviceGetMinorNumber"] == 1
        assert counts[PROFILE_INFO] == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT  # the table, read again

    def test_a_gpu_that_fell_off_the_bus_fails_although_its_facts_are_cached(
        self, h100: SimulatedHardware, port: PynvmlBackend
    ) -> None:
        gpu = port.gpus()[0].uuid
        h100.lose_gpu(0)
        with pytest.raises(NvmlError) as lost:
            port.gpu(gpu)
        assert lost.value.code == NVML_ERROR_GPU_IS_LOST
        with pytest.raises(NvmlError):
            port.gpus()
