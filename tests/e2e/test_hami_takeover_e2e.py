"""Taking over HAMi's in-process lifecycle at Recover, on the simulated node, without a drain.

Instances are made with ``sim create`` (as HAMi made them), HAMi's records and CDI specs are written
byte for byte as HAMi writes them (``hami_format``); then a real sidecar recovers."""

from __future__ import annotations

from typing import Any

import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami_format import record_filename, spec_filename, write_record, write_spec
from sidecar_process import Sidecar, instances

pytestmark = pytest.mark.e2e


def hami_instance(car: Sidecar, profile: str, start: int, size: int) -> dict[str, Any]:
    """Create an instance on GPU 0 as HAMi would and leave HAMi's record and spec for it."""
    car.sim("create", "--gpu", "0", "--profile", profile, "--placement", f"{start}:{size}")
    gpu = car.hardware()[0]
    gi = next(g for g in gpu["gis"] if g["placement"]["start"] == start)
    ci = gi["cis"][0]
    car.state_dir.mkdir(parents=True, exist_ok=True)
    car.cdi_dir.mkdir(parents=True, exist_ok=True)
    write_record(car.state_dir, ci["mig_uuid"], gpu["uuid"], profile, start, size, gi["id"], ci["id"])
    write_spec(car.cdi_dir, ci["mig_uuid"], gpu["uuid"], 0, gi["id"], ci["id"])
    return {"uuid": ci["mig_uuid"], "gi": gi["id"], "ci": ci["id"], "gpu": gpu["uuid"]}


def test_two_idle_hami_instances_are_taken_over_and_their_files_replaced(sidecar: Sidecar) -> None:
    a = hami_instance(sidecar, "1g.10gb", 0, 1)
    b = hami_instance(sidecar, "1g.10gb", 1, 1)
    report = sidecar.recover()
    assert not report.errors
    assert {r.mig_uuid for r in report.restored_idle} == {a["uuid"], b["uuid"]}
    assert {u: i.state for u, i in instances(sidecar).items()} == {a["uuid"]: pb.IDLE, b["uuid"]: pb.IDLE}
    assert not (sidecar.state_dir / record_filename(a["uuid"])).exists()
    assert not (sidecar.cdi_dir / spec_filename(b["uuid"])).exists()
    assert {r["taken_over_from"] for r in sidecar.records().values()} == {"hami"}
