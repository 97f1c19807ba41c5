"""``ownership.live_record``: the one place a record takes its values from a live GI and CI."""

from __future__ import annotations

import pytest

from sidecar.model.domain import Identity, State
from sidecar.model.ownership import live_record, record_name
from sidecar.nvml.port import ComputeInstanceInfo, GpuInstanceInfo, Placement

GPU = "GPU-11111111-2222-3333-4444-555555555555"
MIG = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
GI = GpuInstanceInfo(GPU, 5, 14, Placement(4, 2))


def test_a_complete_instance_names_its_gi_and_ci() -> None:
    record = live_record(
        "2g.20gb", GI, ComputeInstanceInfo(GPU, 5, 0, 1, MIG), state=State.IDLE, boot_id="b", since="t"
    )
    assert record.name == record_name(GPU, Placement(4, 2))
    assert (record.gi_profile_id, record.ci_profile_id) == (14, 1)
    assert record.identity == Identity(5, 0, MIG)
    assert (record.state, record.boot_id, record.since, record.owner) == (State.IDLE, "b", "t", None)


def test_a_bare_gi_names_the_ci_profile_it_would_have() -> None:
    record = live_record("2g.20gb", GI, None, state=State.DELETING, ci_profile_id=1, boot_id="b", since="t")
    assert (record.gpu_instance_id, record.compute_instance_id, record.mig_uuid) == (5, None, None)
    assert record.ci_profile_id == 1


def test_a_bare_gi_without_a_ci_profile_is_a_caller_bug() -> None:
    with pytest.raises(AssertionError):
        live_record("2g.20gb", GI, None, state=State.DELETING, boot_id="b", since="t")
