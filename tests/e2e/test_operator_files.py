"""Every metric the alert rules and the dashboard of ``deploy/`` name is exported by a running sidecar.

A real sidecar is driven through what the rules and panels watch (a created, a reused and a
reclaiming Allocate, an NVML failure, an IDLE instance, an Xid), then ``/metrics`` is scraped; a name in
``deploy/prometheus-rules.yaml`` or ``deploy/grafana-dashboard.json`` that the page does not carry
fails the test, so the files cannot drift from the code. The files' structure (strict decoding, every
expression parsed as PromQL, broken copies failing) is checked in ``integration/manifests``.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory, allocate_one, error_info

pytestmark = pytest.mark.e2e

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC = re.compile(r"\bhami_mig_sidecar_[a-z0-9_]+\b")


def rule_metrics(text: str) -> set[str]:
    names = set(METRIC.findall(text))
    assert names, "the rules name no metric of the sidecar"
    return names


def dashboard_metrics(text: str) -> set[str]:
    """The metric names of every panel query and variable of the dashboard."""
    board = json.loads(text)
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    queries += [json.dumps(v.get("query", "")) for v in board["templating"]["list"]]
    assert queries, "no panel query"
    assert all(q.strip() for q in queries), "a panel without a query"
    return {name for q in queries for name in METRIC.findall(q)}


def scrape(car: Sidecar) -> set[str]:
    """The sample names on the sidecar's ``/metrics`` page."""
    port = car.log_event("serving")["metrics"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=CALL_TIMEOUT_S) as answer:
        page = answer.read().decode()
    return {sample.name for family in text_string_to_metric_families(page) for sample in family.samples}


def drive(car: Sidecar) -> None:
    car.recover()
    assert allocate_one(car, "pod-a", 0, "1g.10gb", 0, 1).outcome == pb.CREATED
    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=CALL_TIMEOUT_S)
    assert allocate_one(car, "pod-b", 0, "1g.10gb", 0, 1).outcome == pb.REUSED
    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-b"), timeout=CALL_TIMEOUT_S)
    held = allocate_one(car, "pod-c", 0, "2g.20gb", 0, 2)  # reclaims the IDLE 1g.10gb at 0:1
    car.sim("fault", "create-gi", "INSUFFICIENT_RESOURCES")
    with pytest.raises(grpc.RpcError) as failed:
        allocate_one(car, "pod-d", 0, "1g.10gb", 4, 1)
    assert error_info(failed.value)[1] == "NVML_ERROR"
    allocate_one(car, "pod-e", 0, "1g.10gb", 5, 1)
    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-e"), timeout=CALL_TIMEOUT_S)  # stays IDLE
    car.log_event("watching critical Xid events on 1 GPU(s)")
    car.sim("xid", "--gpu", "0", "--gi", str(held.gpu_instance_id), "79")  # pod-c's instance faulted
    car.log_event("Xid faulted instances")


class TestMetricsNamedByTheOperatorFiles:
    def test_every_metric_of_the_rules_and_the_dashboard_is_exported(
        self, sidecar_factory: SidecarFactory
    ) -> None:
        car = sidecar_factory(extra_args=["--metrics-address", "127.0.0.1:0"], sim_gpus="h100-80gb:1")
        drive(car)
        exported = scrape(car)
        named = rule_metrics((DEPLOY / "prometheus-rules.yaml").read_text())
        named |= dashboard_metrics((DEPLOY / "grafana-dashboard.json").read_text())
        assert len(named) >= 10
        missing = sorted(named - exported)
        assert not missing, f"named in deploy/ but not exported: {missing}"

    def test_a_name_the_sidecar_does_not_export_is_caught(self, sidecar_factory: SidecarFactory) -> None:
        car = sidecar_factory(extra_args=["--metrics-address", "127.0.0.1:0"], sim_gpus="h100-80gb:1")
        drive(car)
        text = (DEPLOY / "prometheus-rules.yaml").read_text()
        drifted = text.replace(
            "hami_mig_sidecar_pending_cdi_removals", "hami_mig_sidecar_cdi_removals_pending"
        )
        assert drifted != text
        assert "hami_mig_sidecar_cdi_removals_pending" in rule_metrics(drifted) - scrape(car)
