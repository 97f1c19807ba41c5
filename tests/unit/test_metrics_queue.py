"""The per-call metrics are queued by the call and applied by the next read of the registry: every
read counts every call made before it. The reads of a reuse are one metered port call, and an NVML
failure is still counted under the read that failed."""

from __future__ import annotations

import pytest

from sidecar.edge.metrics import DUE_LIMIT, Metrics
from sidecar.nvml.metered import MeteredPort
from sidecar.nvml.port import (
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_UNKNOWN,
    GpuInfo,
    IdleProof,
    NvmlError,
    code_name,
)

RPC_COUNT = "hami_mig_sidecar_rpc_duration_seconds_count"
ERRORS = "hami_mig_sidecar_nvml_errors_total"
GPU = GpuInfo(
    index=0,
    uuid="GPU-00000000-0000-0000-0000-000000000000",
    minor=0,
    model="NVIDIA H100 80GB HBM3",
    memory_mb=81559,
    mig_current=True,
    mig_pending=True,
)


def test_a_read_of_the_registry_counts_every_call_made_before_it() -> None:
    metrics = Metrics()
    for _ in range(3):
        metrics.observe_rpc("GetInfo", "OK", 0.001)
    metrics.observe_allocate(None, 0.002)

    assert metrics.registry.get_sample_value(RPC_COUNT, {"method": "GetInfo", "code": "OK"}) == 3
    assert (
        metrics.registry.get_sample_value(
            "hami_mig_sidecar_allocate_duration_seconds_count", {"outcome": "failed"}
        )
        == 1
    )


def test_a_scrape_restricted_by_name_counts_them_too() -> None:
    metrics = Metrics()
    metrics.observe_rpc("Release", "OK", 0.001)

    restricted = metrics.registry.restricted_registry([RPC_COUNT])
    counts = [s.value for family in restricted.collect() for s in family.samples if s.name == RPC_COUNT]

    assert counts == [1]


def test_a_full_queue_is_applied_without_waiting_for_a_read() -> None:
    metrics = Metrics()
    for _ in range(DUE_LIMIT):
        metrics.observe_rpc("GetState", "OK", 0.001)

    # The histogram's own samples, read around the registry (which would apply the queue itself).
    counts = [s.value for s in next(iter(metrics.rpc_latency.collect())).samples if s.name == RPC_COUNT]

    assert counts == [DUE_LIMIT]


class _Inner:
    def __init__(self, proof: IdleProof | None = None, fails: NvmlError | None = None) -> None:
        self.proof, self.fails = proof, fails

    def prove_idle(self, gpu_uuid: str, mig_uuid: str) -> IdleProof:
        if self.fails is not None:
            raise self.fails
        assert self.proof is not None
        return self.proof


def test_a_failed_lookup_in_a_proof_counts_under_the_lookup() -> None:
    metrics = Metrics()
    gone = NvmlError("look up MIG device", NVML_ERROR_NOT_FOUND, "Not Found")
    port = MeteredPort(_Inner(IdleProof(GPU, None, gone)), metrics)  # type: ignore[arg-type]

    proof = port.prove_idle(GPU.uuid, "MIG-00000000-0000-0000-0000-000000000000")

    assert proof.failure is gone
    labels = {"operation": "mig_device_processes", "code": "NOT_FOUND"}
    assert metrics.registry.get_sample_value(ERRORS, labels) == 1


def test_a_failed_mode_read_counts_under_the_gpu_read_and_raises() -> None:
    metrics = Metrics()
    broken = NvmlError("read GPU", NVML_ERROR_UNKNOWN, "Unknown Error")
    port = MeteredPort(_Inner(fails=broken), metrics)  # type: ignore[arg-type]

    with pytest.raises(NvmlError):
        port.prove_idle(GPU.uuid, "MIG-00000000-0000-0000-0000-000000000000")

    labels = {"operation": "gpu", "code": "UNKNOWN"}
    assert metrics.registry.get_sample_value(ERRORS, labels) == 1


def test_the_code_label_is_the_nvml_name_for_every_code_pynvml_knows() -> None:
    import pynvml  # noqa: PLC0415

    known = {
        getattr(pynvml, n): n.removeprefix("NVML_ERROR_") for n in dir(pynvml) if n.startswith("NVML_ERROR_")
    }
    assert known, "pynvml names no NVML_ERROR_ constant"
    for code, name in known.items():
        assert code_name(code) == name
    assert code_name(4242) == "CODE_4242"
    metrics = Metrics()
    refused = NvmlError("create GPU instance", NVML_ERROR_INSUFFICIENT_RESOURCES, "Insufficient Resources")
    port = MeteredPort(_Inner(fails=refused), metrics)  # type: ignore[arg-type]
    with pytest.raises(NvmlError):
        port.prove_idle(GPU.uuid, "MIG-00000000-0000-0000-0000-000000000000")
    labels = {"operation": "gpu", "code": "INSUFFICIENT_RESOURCES"}
    assert metrics.registry.get_sample_value(ERRORS, labels) == 1
    assert metrics.registry.get_sample_value(ERRORS, {"operation": "gpu", "code": "23"}) is None
