"""``MeteredPort``: an ``NvmlPort`` decorator that counts what the hardware did and times each call.

It sits directly on the backend, below every other layer of the port, so every caller (allocate,
rollback, reclaim, recovery, reconciler, the idle policy) is counted the same way, and a call is
counted once however many layers above it forward it. It counts GI creations and destructions and
NVML errors by operation and code (``NvmlMeter``: the Prometheus metrics implement it), and registers
every call for as long as it runs (``Busy``: the liveness probe implements it, so a call stuck in the
driver turns the health service NOT_SERVING). Neither is imported from here: both are upper layers,
and this module only names what it needs of them.

The sidecar's composition root (``sidecar.app.build``) is the one place that stacks the port's
decorators; read it for the order.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

from sidecar.nvml.port import (
    ComputeInstanceInfo,
    GpuInfo,
    GpuInstanceInfo,
    GpuInstanceProfile,
    IdleProof,
    NvmlError,
    NvmlPort,
    Placement,
    code_name,
)

_T = TypeVar("_T")


class NvmlMeter(Protocol):
    """Where the counts go."""

    def nvml_failed(self, operation: str, code: str) -> None:
        """One port call ``operation`` failed with the nvmlReturn_t named ``code`` (``code_name``)."""
        ...

    def gi_created(self) -> None: ...

    def gi_destroyed(self) -> None: ...


class Busy(Protocol):
    """What registers a running call (``sidecar.lifecycle.liveness.Liveness``)."""

    def running(self, part: str) -> AbstractContextManager[None]: ...


class MeteredPort:
    """An ``NvmlPort`` that forwards every call and counts creations, destructions and NVML errors."""

    def __init__(self, inner: NvmlPort, meter: NvmlMeter, busy: Busy | None = None) -> None:
        self.inner = inner
        self.meter = meter
        self.busy = busy

    def _call(self, operation: str, call: Callable[[], _T]) -> _T:
        try:
            if self.busy is None:
                return call()
            with self.busy.running("nvml"):
                return call()
        except NvmlError as exc:
            self.meter.nvml_failed(operation, code_name(exc.code))
            raise

    def gpus(self) -> list[GpuInfo]:
        return self._call("gpus", self.inner.gpus)

    def gpu(self, gpu_uuid: str) -> GpuInfo:
        return self._call("gpu", lambda: self.inner.gpu(gpu_uuid))

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> int:
        return self._call("set_mig_mode", lambda: self.inner.set_mig_mode(gpu_uuid, enabled))

    def gpu_instance_profiles(self, gpu_uuid: str) -> list[GpuInstanceProfile]:
        return self._call("gpu_instance_profiles", lambda: self.inner.gpu_instance_profiles(gpu_uuid))

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceInfo]:
        return self._call("gpu_instances", lambda: self.inner.gpu_instances(gpu_uuid))

    def compute_instances(self, gpu_uuid: str, gpu_instance_id: int) -> list[ComputeInstanceInfo]:
        return self._call(
            "compute_instances", lambda: self.inner.compute_instances(gpu_uuid, gpu_instance_id)
        )

    def create_gpu_instance(self, gpu_uuid: str, profile_id: int, placement: Placement) -> GpuInstanceInfo:
        info = self._call(
            "create_gpu_instance", lambda: self.inner.create_gpu_instance(gpu_uuid, profile_id, placement)
        )
        self.meter.gi_created()
        return info

    def create_compute_instance(
        self, gpu_uuid: str, gpu_instance_id: int, ci_profile_id: int
    ) -> ComputeInstanceInfo:
        return self._call(
            "create_compute_instance",
            lambda: self.inner.create_compute_instance(gpu_uuid, gpu_instance_id, ci_profile_id),
        )

    def destroy_compute_instance(self, gpu_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        self._call(
            "destroy_compute_instance",
            lambda: self.inner.destroy_compute_instance(gpu_uuid, gpu_instance_id, compute_instance_id),
        )

    def destroy_gpu_instance(self, gpu_uuid: str, gpu_instance_id: int) -> None:
        self._call("destroy_gpu_instance", lambda: self.inner.destroy_gpu_instance(gpu_uuid, gpu_instance_id))
        self.meter.gi_destroyed()

    def mig_device_processes(self, mig_uuid: str) -> int:
        return self._call("mig_device_processes", lambda: self.inner.mig_device_processes(mig_uuid))

    def prove_idle(self, gpu_uuid: str, mig_uuid: str) -> IdleProof:
        """One metered call for both reads; each failure is counted under the read that failed."""
        proof = self._call("gpu", lambda: self.inner.prove_idle(gpu_uuid, mig_uuid))
        if proof.failure is not None:
            self.meter.nvml_failed("mig_device_processes", code_name(proof.failure.code))
        return proof

    def gpu_processes(self, gpu_uuid: str) -> int:
        return self._call("gpu_processes", lambda: self.inner.gpu_processes(gpu_uuid))
