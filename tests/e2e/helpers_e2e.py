"""What several e2e test modules share, so that no test module imports another one.

The crash points a group of tests arms (``sidecar.lifecycle.crashpoints``), the kill at one of them
(``crash_during``), what a node must look like once recovery has run after it (``assert_converged``),
and the wait for background work (``wait_until``), bounded generously: never a timing assertion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import Sidecar, layouts

from sidecar.lifecycle import crashpoints

WAIT_S = 30.0  # an upper bound for background work, not a timing assertion

CREATE_POINTS = crashpoints.POINTS[: crashpoints.POINTS.index("after-write-cdi") + 1]
DELETE_POINTS = crashpoints.POINTS[
    crashpoints.POINTS.index("after-record-deleting") : crashpoints.POINTS.index("after-remove-cdi") + 1
]
TAKEOVER_POINTS = ("after-takeover-record", "after-remove-hami-record")


def wait_until(
    what: str, condition: Callable[[], bool], *, car: Sidecar | None = None, within: float = WAIT_S
) -> None:
    """Wait for ``condition``; past ``within`` seconds fail, with ``car``'s log when one is named."""
    deadline = time.monotonic() + within
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            log = f"\n{car.log_text()}" if car is not None else ""
            pytest.fail(f"still not true after {within}s: {what}{log}")
        pause.wait(0.05)


def crash_during(car: Sidecar, call: Callable[[], object]) -> None:
    """``call`` must end the process at its armed crash point (exit 137) instead of answering."""
    with pytest.raises(grpc.RpcError):
        call()
    assert car.proc is not None
    assert car.proc.wait(timeout=30) == 137


def assert_converged(car: Sidecar) -> None:
    """Every live GI has a verified ACTIVE/IDLE record and nothing else is left: no foreign instance,
    no record without its instance, no CDI file without a live owned instance."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=30)
    assert all(not g.foreign for g in state.gpus), "recovery left an instance without a record"
    owned = {(i.gpu_uuid, i.gpu_instance_id): i for g in state.gpus for i in g.instances}
    live = {(g.uuid, gi.id): gi for g in layouts(car) for gi in g.gis}
    assert set(owned) == set(live)
    for key, instance in owned.items():
        assert instance.state in (pb.ACTIVE, pb.IDLE)
        assert [c.mig_uuid for c in live[key].cis] == [instance.mig_uuid]
    assert len(list(car.state_dir.glob("mig-*.json"))) == len(owned)
    for spec in car.cdi_dir.glob("*.json"):
        assert any(i.mig_uuid in spec.name for i in owned.values()), f"stray CDI spec {spec.name}"
