"""Behaviours a correctness review found unguarded, each pinned by the test that exposed it.

Every test here failed before the fix it names in its docstring; they run over the simulated
hardware through the real pynvml adapter, records and CDI code, and assert the NVML layout, the
record files and the CDI files.
"""

from __future__ import annotations

import pytest
from lifecycle_world import World

from sidecar import errors

NVML_ERROR_TIMEOUT = 10
NVML_ERROR_UNKNOWN = 999


class TestAFailedCreateLeavesNoUnrecordedInstance:
    @pytest.mark.parametrize("code", [NVML_ERROR_UNKNOWN, NVML_ERROR_TIMEOUT], ids=["unknown", "timeout"])
    def test_a_gpu_instance_made_by_a_create_that_then_failed_is_destroyed_by_the_undo(
        self, world: World, code: int
    ) -> None:
        """The driver made the GI, but reading its info failed (and a retry of the whole create then
        met the GI it had just made): the undo must find the bare GI at the exact placement instead
        of leaving it on the GPU without a record, where it would block the placement for good."""
        world.hw.inject_fault("nvmlGpuInstanceGetInfo", code, times=1)

        with pytest.raises(errors.NvmlFailure):
            world.allocate("pod-a", (0, "3g.40gb", 4, 4))

        assert world.everything() == (set(), {}, set())
        world.hw.clear_faults()
        assert world.allocate("pod-a", (0, "3g.40gb", 4, 4)).devices[0].identity.gpu_instance_id > 0
