"""What real hardware does and the tables once got wrong: the full CI, the MIG UUID, MIG-off queries."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sidecar.nvml import profiles
from sidecar.nvml.port import NVML_ERROR_UNKNOWN, NvmlError, Placement
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall


@pytest.fixture
def board() -> Iterator[tuple[SimulatedHardware, PynvmlBackend]]:
    hw = SimulatedHardware.create([(key, 1) for key in profiles.MODELS])
    install(hw)
    port = PynvmlBackend(retry_wait=False)
    try:
        yield hw, port
    finally:
        port.close()
        uninstall()


def _gpu(hw: SimulatedHardware, key: str) -> tuple[int, str]:
    index = list(profiles.MODELS).index(key)
    return index, hw.gpu_uuid(index)


class TestTheFullComputeInstance:
    @pytest.mark.parametrize(
        ("key", "name", "sms"),
        [("h100-80gb", "1g.20gb", 26), ("h100-94gb", "1g.24gb", 26), ("h200-141gb", "1g.35gb", 26)],
    )
    def test_a_hopper_double_memory_1g_gets_ci_7_with_every_sm_of_the_gi(
        self, board: tuple[SimulatedHardware, PynvmlBackend], key: str, name: str, sms: int
    ) -> None:
        hw, port = board
        index, gpu = _gpu(hw, key)
        (profile,) = [p for p in port.gpu_instance_profiles(gpu) if p.name == name]
        assert (profile.ci_profile_id, profile.multiprocessor_count) == (7, sms)
        gi = port.create_gpu_instance(gpu, profile.id, profile.placements[0])
        ci = port.create_compute_instance(gpu, gi.id, profile.ci_profile_id)
        assert ci.profile_id == 7
        assert [c.profile_id for c in hw.layout(index).gis[0].cis] == [7]
        # the simulated driver's own CI table: CI 0 has a plain slice's 16 SMs, CI 7 the GI's
        table = {c.id: c.multiprocessor_count for c in profiles.model(key).profile_by_name(name).ci_profiles}  # type: ignore[union-attr]
        assert table == {0: 16, 7: sms}

    def test_a100_s_double_memory_1g_keeps_ci_0(self, board: tuple[SimulatedHardware, PynvmlBackend]) -> None:
        hw, port = board
        _, gpu = _gpu(hw, "a100-80gb")
        (profile,) = [p for p in port.gpu_instance_profiles(gpu) if p.name == "1g.20gb"]
        assert profile.ci_profile_id == 0
        assert [c.id for c in profiles.model("a100-80gb").profile_by_name("1g.20gb").ci_profiles] == [0]  # type: ignore[union-attr]

    def test_a_gi_seen_once_supplies_its_real_ci_table(
        self, board: tuple[SimulatedHardware, PynvmlBackend]
    ) -> None:
        hw, port = board
        index, gpu = _gpu(hw, "b200")
        hw.create_instance(index, "1g.45gb", 0, 2)
        gi = port.gpu_instances(gpu)[0]
        port.compute_instances(gpu, gi.id)  # reads the GI's CI profiles
        (profile,) = [p for p in port.gpu_instance_profiles(gpu) if p.name == "1g.45gb"]
        assert profile.ci_profile_id == 7


class TestTheMigUuidIsProven:
    def test_a_driver_that_answers_the_parent_still_yields_the_mig_uuid(
        self, board: tuple[SimulatedHardware, PynvmlBackend]
    ) -> None:
        hw, port = board
        index, gpu = _gpu(hw, "h100-80gb")
        hw.set_ci_info_device(parent=True)
        for start in (0, 1, 2):
            gi = port.create_gpu_instance(gpu, 19, Placement(start, 1))
            ci = port.create_compute_instance(gpu, gi.id, 0)
            (live,) = [g for g in hw.layout(index).gis if g.id == gi.id]
            assert ci.mig_uuid == live.cis[0].mig_uuid != gpu
        listed = {
            (g.id, c.mig_uuid) for g in port.gpu_instances(gpu) for c in port.compute_instances(gpu, g.id)
        }
        assert listed == {(g.id, g.cis[0].mig_uuid) for g in hw.layout(index).gis}

    def test_the_direct_answer_is_used_when_it_is_a_matching_mig_device(
        self, board: tuple[SimulatedHardware, PynvmlBackend]
    ) -> None:
        hw, port = board
        index, gpu = _gpu(hw, "a30")
        gi = port.create_gpu_instance(gpu, 14, Placement(3, 1))
        hw.reset_call_counts()
        ci = port.create_compute_instance(gpu, gi.id, 0)
        assert ci.mig_uuid == hw.layout(index).gis[0].cis[0].mig_uuid
        assert "nvmlDeviceGetMigDeviceHandleByIndex" not in hw.call_counts()

    def test_an_unprovable_mig_uuid_fails_the_call(
        self, board: tuple[SimulatedHardware, PynvmlBackend]
    ) -> None:
        hw, port = board
        _, gpu = _gpu(hw, "h100-80gb")
        hw.set_ci_info_device(parent=True)
        gi = port.create_gpu_instance(gpu, 19, Placement(0, 1))
        hw.inject_fault("nvmlDeviceGetMigDeviceHandleByIndex", "NOT_FOUND", times=100)
        with pytest.raises(NvmlError) as failed:
            port.create_compute_instance(gpu, gi.id, 0)
        assert failed.value.code == NVML_ERROR_UNKNOWN
        assert (
            hw.layout(list(profiles.MODELS).index("h100-80gb")).gis[0].cis == ()
        )  # the adapter undid its CI


def test_gi_profile_queries_answer_not_supported_while_mig_is_off() -> None:
    hw = SimulatedHardware.create([("a100-40gb", 1)], mig_enabled=False)
    install(hw)
    port = PynvmlBackend(retry_wait=False)
    try:
        assert port.gpu_instance_profiles(hw.gpu_uuid(0)) == []
        hw.set_mig_mode(0, True)
        assert len(port.gpu_instance_profiles(hw.gpu_uuid(0))) == 7
    finally:
        port.close()
        uninstall()


@pytest.mark.parametrize("key", list(profiles.MODELS))
def test_every_profile_creates_at_every_legal_placement(key: str) -> None:
    """On an empty GPU of each model, through the adapter: the GI, then its full CI with the GI's SMs."""
    hw = SimulatedHardware.create([(key, 1)])
    install(hw)
    port = PynvmlBackend(retry_wait=False)
    try:
        gpu = hw.gpu_uuid(0)
        offered = port.gpu_instance_profiles(gpu)
        assert sorted(p.name for p in offered) == sorted(p.name for p in profiles.model(key).profiles)
        for p in offered:
            model_row = profiles.model(key).profile_by_id(p.id)
            assert model_row is not None
            assert p.ci_profile_id == model_row.full_ci_profile_id
            for placement in p.placements:
                gi = port.create_gpu_instance(gpu, p.id, placement)
                ci = port.create_compute_instance(gpu, gi.id, p.ci_profile_id)
                assert (gi.placement, ci.profile_id) == (placement, p.ci_profile_id)
                (full,) = [c for c in model_row.ci_profiles if c.id == ci.profile_id]
                assert full.multiprocessor_count == p.multiprocessor_count
                port.destroy_compute_instance(gpu, gi.id, ci.id)
                port.destroy_gpu_instance(gpu, gi.id)
    finally:
        port.close()
        uninstall()
