"""The domain errors, one small hierarchy, each carrying the contract's ``reason``.

``server`` maps every one of them to a gRPC status plus ``google.rpc.ErrorInfo`` (domain
``migsidecar.hami.io``); nothing else in the code base knows about gRPC. The hierarchy, with each
class's gRPC code and reason::

    SidecarError                      (reason, code, metadata)
    ├── InvalidRequest                INVALID_ARGUMENT  INVALID_REQUEST
    │   ├── UnknownProfile            INVALID_ARGUMENT  UNKNOWN_PROFILE
    │   └── IllegalPlacement          INVALID_ARGUMENT  ILLEGAL_PLACEMENT
    ├── UnknownGpu                    NOT_FOUND         UNKNOWN_GPU
    ├── UnknownInstance               NOT_FOUND         UNKNOWN_INSTANCE  (ReclaimIdle: no owned instance)
    ├── NotRecovered                  FAILED_PRECONDITION NOT_RECOVERED
    ├── PlacementBusy                 FAILED_PRECONDITION PLACEMENT_BUSY   (metadata names the blocker)
    ├── KeyConflict                   FAILED_PRECONDITION KEY_CONFLICT
    ├── MigDisabled                   FAILED_PRECONDITION MIG_DISABLED
    ├── NotIdle                       FAILED_PRECONDITION NOT_IDLE         (ReclaimIdle: named, not IDLE)
    ├── Reserved                      FAILED_PRECONDITION RESERVED         (a pending reservation keeps it)
    ├── UnverifiableState             FAILED_PRECONDITION UNVERIFIABLE_STATE
    │   └── ComputeInstanceNotOurs                        (a CI in a GI recorded bare: never destroyed)
    ├── InstanceInUse                 UNAVAILABLE       INSTANCE_IN_USE
    ├── NvmlFailure                   UNAVAILABLE       NVML_ERROR        (wraps nvml.port.NvmlError)
    └── StateWriteFailed              UNAVAILABLE       STATE_WRITE_FAILED

UNAVAILABLE means "the same call may succeed later, with the same key"; the Go client retries nothing
else. ``nvml_errors`` is the one boundary where the port's ``NvmlError`` becomes ``NvmlFailure``.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping

from sidecar.nvml.port import NvmlError


class Code(enum.Enum):
    """The gRPC status codes the contract uses, named as gRPC names them (kept gRPC-free here)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"


class SidecarError(Exception):
    reason: str = "INTERNAL"
    code: Code = Code.UNAVAILABLE

    def __init__(self, message: str, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})


class InvalidRequest(SidecarError):
    reason = "INVALID_REQUEST"
    code = Code.INVALID_ARGUMENT


class UnknownProfile(InvalidRequest):
    reason = "UNKNOWN_PROFILE"


class IllegalPlacement(InvalidRequest):
    reason = "ILLEGAL_PLACEMENT"


class UnknownGpu(SidecarError):
    reason = "UNKNOWN_GPU"
    code = Code.NOT_FOUND


class UnknownInstance(SidecarError):
    """A MIG UUID that names no instance this sidecar owns on that GPU (foreign ones included)."""

    reason = "UNKNOWN_INSTANCE"
    code = Code.NOT_FOUND


class NotRecovered(SidecarError):
    reason = "NOT_RECOVERED"
    code = Code.FAILED_PRECONDITION


class PlacementBusy(SidecarError):
    reason = "PLACEMENT_BUSY"
    code = Code.FAILED_PRECONDITION


class KeyConflict(SidecarError):
    reason = "KEY_CONFLICT"
    code = Code.FAILED_PRECONDITION


class MigDisabled(SidecarError):
    reason = "MIG_DISABLED"
    code = Code.FAILED_PRECONDITION


class NotIdle(SidecarError):
    """An owned instance named for a reclaim that is not IDLE (ACTIVE, ERROR, in flight): never destroyed."""

    reason = "NOT_IDLE"
    code = Code.FAILED_PRECONDITION


class Reserved(SidecarError):
    """A reclaim named an IDLE instance a pending reservation keeps, or a MIG disable met a pending
    reservation on its GPU: refused unless forced (``force``); ``guarded_by`` names the reservation."""

    reason = "RESERVED"
    code = Code.FAILED_PRECONDITION


class UnverifiableState(SidecarError):
    reason = "UNVERIFIABLE_STATE"
    code = Code.FAILED_PRECONDITION


class InstanceInUse(SidecarError):
    reason = "INSTANCE_IN_USE"
    code = Code.UNAVAILABLE


class Overloaded(SidecarError):
    """The edge already holds as many calls as it admits (``sidecar.edge.admission``); nothing was
    done, and the same request may succeed a moment later."""

    reason = "OVERLOADED"
    code = Code.RESOURCE_EXHAUSTED


class NvmlFailure(SidecarError):
    reason = "NVML_ERROR"
    code = Code.UNAVAILABLE


class StateWriteFailed(SidecarError):
    reason = "STATE_WRITE_FAILED"
    code = Code.UNAVAILABLE


class ComputeInstanceNotOurs(UnverifiableState):
    """A destroy found a CI in a GPU instance whose record stands for a bare GI: not ours to destroy.

    Nothing of ours creates a CI in such a GI (see ``OwnershipRecord.may_own_unrecorded_ci``), so one
    there now was made by someone else. The destroy leaves everything as it is: the record stays on
    disk for the operator and the instance leaves the table (foreign: preserved, never reused,
    blocking its placement), which is what recovery's planner decides by the same rule at gather."""


class nvml_errors:  # noqa: N801 - used as a function: ``with nvml_errors("...")``
    """The one boundary where ``NvmlError`` becomes the domain's ``NvmlFailure`` (cause kept).

    A plain context manager, not a generator: every NVML call of a decision passes through one."""

    __slots__ = ("_operation",)

    def __init__(self, operation: str) -> None:
        self._operation = operation

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        if isinstance(exc, NvmlError):
            raise NvmlFailure(
                f"{self._operation}: {exc.message} (nvml code {exc.code})",
                {"nvml_code": str(exc.code), "operation": exc.operation},
            ) from exc
