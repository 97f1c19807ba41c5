"""Every change of the MIG layout leaves one line at the default level naming the instance.

An operator who finds an instance in ``nvidia-smi mig -lgi`` (or misses one) reads the sidecar's log
to learn when and for whom it was made, reused, reclaimed, destroyed, adopted or put in ERROR; each
line carries the GPU, profile, placement, MIG UUID and holder (``lifecycle.logs.hardware_change``).
The lines are read as the JSON formatter writes them.
"""

from __future__ import annotations

import json
import logging

import pytest
from lifecycle_world import World, active_of, restart

from sidecar.lifecycle.logs import JsonFormatter
from sidecar.model import errors
from sidecar.nvml.port import NVML_ERROR_UNKNOWN

FOREVER = 1000


def hardware_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    """The hardware-change lines logged so far at INFO or above, as JSON documents; then forgets them."""
    formatter = JsonFormatter()
    lines = [
        json.loads(formatter.format(r)) for r in caplog.records if r.getMessage().startswith("MIG instance")
    ]
    caplog.clear()
    return lines


def test_create_reuse_reclaim_destroy_each_leave_one_line_naming_the_instance(
    cdi_world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world = cdi_world
    caplog.set_level(logging.INFO)
    gpu = world.uuid(0)

    first = world.allocate("pod-a", (0, "1g.10gb", 0, 1)).devices[0].identity.mig_uuid
    [created] = hardware_lines(caplog)
    assert created["msg"] == "MIG instance created"
    assert created["level"] == "INFO"
    assert (created["action"], created["gpu"], created["profile"], created["placement"]) == (
        "created", gpu, "1g.10gb", "0:1",
    )  # fmt: skip
    assert created["mig_uuid"] == first
    assert created["owner"] == "default/name-pod-a (pod-a) container main"

    world.lifecycle.release("pod-a")
    assert hardware_lines(caplog) == []  # a release changes no hardware
    reused = world.allocate("pod-b", (0, "1g.10gb", 0, 1)).devices[0].identity.mig_uuid
    [line] = hardware_lines(caplog)
    assert (line["action"], line["mig_uuid"], line["placement"]) == ("reused", first, "0:1")
    assert reused == first
    assert line["owner"].startswith("default/name-pod-b (pod-b)")

    world.lifecycle.release("pod-b")
    caplog.clear()
    big = world.allocate("pod-c", (0, "3g.40gb", 0, 4)).devices[0].identity.mig_uuid
    reclaimed, made = hardware_lines(caplog)
    assert (reclaimed["action"], reclaimed["mig_uuid"], reclaimed["placement"]) == ("reclaimed", first, "0:1")
    assert reclaimed["owner"] == "-"  # an IDLE instance has no holder
    assert (made["action"], made["mig_uuid"], made["profile"], made["placement"]) == (
        "created", big, "3g.40gb", "0:4",
    )  # fmt: skip

    world.lifecycle.undo_allocate("pod-c", 0)
    [destroyed] = hardware_lines(caplog)
    assert (destroyed["action"], destroyed["mig_uuid"], destroyed["placement"]) == ("destroyed", big, "0:4")
    assert destroyed["owner"].startswith("default/name-pod-c (pod-c)")
    assert big not in world.live_mig_uuids()


def test_a_destroy_that_fails_leaves_one_error_line_with_the_nvml_failure(
    cdi_world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world = cdi_world
    caplog.set_level(logging.INFO)
    idle = world.allocate("pod-a", (0, "1g.10gb", 4, 1)).devices[0].identity.mig_uuid
    world.lifecycle.release("pod-a")
    caplog.clear()
    world.hw.inject_fault("destroy-ci", NVML_ERROR_UNKNOWN, times=FOREVER)
    with pytest.raises(errors.NvmlFailure):
        world.allocate("pod-b", (0, "3g.40gb", 4, 4))
    [line] = hardware_lines(caplog)
    assert (line["msg"], line["level"], line["action"]) == ("MIG instance ERROR", "ERROR", "ERROR")
    assert (line["gpu"], line["profile"], line["placement"], line["mig_uuid"]) == (
        world.uuid(0), "1g.10gb", "4:1", idle,
    )  # fmt: skip
    assert line["error"].endswith("Unknown Error (nvml code 999)")


def test_recovery_adopting_a_pods_instance_leaves_one_line(
    cdi_world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world = cdi_world
    held = world.allocate("pod-a", (1, "2g.20gb", 0, 2))
    mig = held.devices[0].identity.mig_uuid
    caplog.set_level(logging.INFO)
    caplog.clear()
    restart(world).recover(active_of("pod-a", held))
    [line] = hardware_lines(caplog)
    assert (line["action"], line["gpu"], line["mig_uuid"], line["placement"]) == (
        "adopted", world.uuid(1), mig, "0:2",
    )  # fmt: skip
    assert line["owner"].startswith("default/name-pod-a (pod-a)")
