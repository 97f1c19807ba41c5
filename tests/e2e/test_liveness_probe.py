"""The liveness probe's command turns unhealthy when the NVML backend hangs, and healthy again after.

The hang is a simulator latency of ten minutes on the GI destroy of the reconciler's idle trim
(``--idle-ttl``): the call the reconciler makes never returns on its own within the test. With
``--stuck-threshold 2`` the health service answers NOT_SERVING once it has run that long; removing
the latency (the driver recovering) lets the call return, and the next Check answers SERVING. No
timing is asserted: the test waits (bounded) for each state the sidecar must reach.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from grpc_health.v1 import health_pb2
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory, allocate_one

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "hami.migsidecar.v1.MigSidecar"
WAIT_S = 120.0  # a bound on waiting for a state, never a measured duration


def wait_for(car: Sidecar, what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"the sidecar never reached: {what}\n{car.log_text()}")
        time.sleep(0.1)


def probe(car: Sidecar, *service: str) -> tuple[int, str]:
    """What kubelet's exec probe sees: the exit status and output of ``hami-mig-sidecar health``."""
    result = car.cli("health", "--socket", str(car.socket), *(("--service", service[0]) if service else ()))
    return result.returncode, result.stdout + result.stderr


def test_a_hung_nvml_call_of_the_reconciler_fails_the_probe_until_it_returns(
    sidecar_factory: SidecarFactory,
) -> None:
    car = sidecar_factory(extra_args=["--idle-ttl", "1", "--stuck-threshold", "2"], sim_gpus="h100-80gb:1")
    car.recover()
    assert probe(car) == (0, "(process): SERVING\n")
    assert probe(car, SERVICE)[0] == 0
    device = allocate_one(car, "pod-1", 0, "1g.10gb", 0, 1)
    car.sim("latency", "destroy-gi", "600")
    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-1"), timeout=CALL_TIMEOUT_S)

    # The reconciler trims the IDLE instance after its TTL and hangs in the GI destroy.
    wait_for(car, "health NOT_SERVING", lambda: car.health_status() == NOT_SERVING)
    code, output = probe(car)
    assert code == 1
    assert output == "(process): NOT_SERVING\n"
    assert probe(car, SERVICE) == (1, f"{SERVICE}: NOT_SERVING\n")
    stuck = car.log_event("stuck: health NOT_SERVING")
    assert stuck["part"] in {"nvml", "reconciler"}
    assert stuck["seconds"] >= 2  # logged rounded to 0.1 s
    # The call has not returned: the teardown it belongs to still holds the instance's record.
    assert [r["state"] for r in car.records().values()] == ["DELETING"]

    car.sim("latency", "destroy-gi", "0")  # the driver answers again
    wait_for(car, "health SERVING", lambda: car.health_status() == SERVING)
    assert probe(car) == (0, "(process): SERVING\n")
    assert probe(car, SERVICE) == (0, f"{SERVICE}: SERVING\n")
    car.log_event("no longer stuck: health SERVING")
    # The trim the hang held up completed: the instance is gone from the hardware and the records.
    wait_for(car, "the trimmed instance gone", lambda: not car.records())
    assert all(not g["gis"] for g in car.hardware()), device.mig_uuid
