"""Which MIG device a compute instance is: its MIG UUID, proven from NVML, never guessed."""

from __future__ import annotations

from typing import Any

import pynvml

from sidecar.nvml.port import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    NvmlError,
)


class UnprovableMigUuidError(NvmlError):
    """No MIG device reports a CI's GI and CI IDs: its MIG UUID cannot be proven (code UNKNOWN)."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def proven_mig_uuid(gpu_uuid: str, parent: Any, device: Any, gi_id: int, ci_id: int) -> str:
    """The MIG UUID of CI ``ci_id`` in GI ``gi_id``, proven, never guessed.

    nvml.h documents ``nvmlComputeInstanceInfo_t.device`` as the *parent* device, while drivers
    that DRA and others were tested on put the MIG device there. Its UUID is taken only when it
    is a ``MIG-`` UUID whose device reports this GI and CI; otherwise the MIG devices of the GPU
    are walked (``GetMigDeviceHandleByIndex``; empty indices answer NOT_FOUND) for the one with
    these IDs. None matching -> NvmlError UNKNOWN: a create fails (and is undone) rather than
    recording the parent GPU's UUID, or another instance's, as this instance's identity."""
    uuid = _text(pynvml.nvmlDeviceGetUUID(device))
    if uuid.startswith("MIG-") and _mig_ids(device, is_mig=True) == (gi_id, ci_id):
        return uuid
    for index in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(parent))):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
        except pynvml.NVMLError as exc:
            if exc.value in (NVML_ERROR_NOT_FOUND, NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        if _mig_ids(mig) == (gi_id, ci_id):
            found = _text(pynvml.nvmlDeviceGetUUID(mig))
            if found.startswith("MIG-"):
                return found
    raise UnprovableMigUuidError(
        f"read the MIG UUID of CI {ci_id} in GI {gi_id} on {gpu_uuid}",
        NVML_ERROR_UNKNOWN,
        "no MIG device reports this GPU instance and compute instance",
    )


def _mig_ids(device: Any, *, is_mig: bool = False) -> tuple[int, int] | None:
    """(GI ID, CI ID) of a MIG device handle; None for a handle that is not one.

    ``is_mig``: the handle's UUID is a ``MIG-`` UUID, which only a MIG device has, so the
    IsMigDeviceHandle query is skipped (the ID reads refuse a physical GPU's handle anyway)."""
    try:
        if not is_mig and not pynvml.nvmlDeviceIsMigDeviceHandle(device).value:
            return None
        return int(pynvml.nvmlDeviceGetGpuInstanceId(device)), int(
            pynvml.nvmlDeviceGetComputeInstanceId(device)
        )
    except pynvml.NVMLError as exc:
        if exc.value in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
            return None
        raise
