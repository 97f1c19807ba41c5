"""How the pynvml adapter makes a call: errors mapped at one boundary, transient codes retried.

Errors are mapped at one boundary (``mapped``, ``port_error``): every ``pynvml.NVMLError`` becomes
``port.NvmlError(operation, code, message)`` raised ``from`` the original, and so does pynvml's
``NVMLLibraryMismatchError`` (as FUNCTION_NOT_FOUND), which is not an ``NVMLError``.

Retries are bounded (``attempts``) and only for transient codes:

* TIMEOUT and NOT_READY, for every call: the driver was busy and said so;
* IN_USE, for destroys only: right after a container exits the driver can still hold the instance for
  a moment. For a create, IN_USE is not transient and fails at once.

Everything else fails closed on the first error. ``retry_wait=False`` turns the waits off (tests)
without touching ``time.sleep``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import pynvml
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential, wait_none

from sidecar.nvml.port import NVML_ERROR_IN_USE, NVML_ERROR_NOT_READY, NVML_ERROR_TIMEOUT, NvmlError

T = TypeVar("T")

TRANSIENT_CODES = frozenset({NVML_ERROR_TIMEOUT, NVML_ERROR_NOT_READY})
TRANSIENT_DESTROY_CODES = TRANSIENT_CODES | {NVML_ERROR_IN_USE}
NVML_ERROR_FUNCTION_NOT_FOUND = 13  # nvml.h; the symbol is missing from the loaded library


def port_error(operation: str, exc: pynvml.NVMLError | pynvml.NVMLLibraryMismatchError) -> NvmlError:
    """The port's ``NvmlError`` for a pynvml exception.

    ``NVMLLibraryMismatchError`` is not an ``NVMLError``: pynvml raises it from the unversioned
    wrappers it decorates with ``throwOnVersionMismatch`` (``nvmlDeviceGetComputeRunningProcesses``
    calls the ``_v3`` symbol) when the loaded ``libnvidia-ml`` lacks that symbol. It is the library's
    FUNCTION_NOT_FOUND in other clothes, and is mapped as such so that callers fail closed the usual
    way instead of meeting an exception nobody expects."""
    if isinstance(exc, pynvml.NVMLError):
        return NvmlError(operation, int(exc.value), str(exc))
    return NvmlError(operation, NVML_ERROR_FUNCTION_NOT_FOUND, str(exc))


@contextlib.contextmanager
def mapped(operation: str) -> Iterator[None]:
    """Raise ``port_error`` for any pynvml exception of the block (``from`` it)."""
    try:
        yield
    except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
        raise port_error(operation, exc) from exc


class Caller:
    """Runs one adapter operation: mapped errors, at most ``attempts`` tries of transient codes."""

    def __init__(self, retry_wait: bool = True, attempts: int = 3) -> None:
        self._wait = wait_exponential(multiplier=0.5, max=4) if retry_wait else wait_none()
        self._attempts = max(1, attempts)

    def run(self, operation: str, fn: Callable[[], T], transient: frozenset[int] = TRANSIENT_CODES) -> T:
        """``fn()``, its errors mapped, retried only for ``transient`` codes.

        The first attempt runs bare: building tenacity's retry state costs about as much as a
        read-only driver call, and nearly every call succeeds the first time. Only a transient
        failure enters tenacity, which replays that failure as its own first attempt, so the waits
        and the attempt count are exactly those of a loop that started in tenacity."""
        try:
            return fn()
        except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
            failed = port_error(operation, exc)
            failed.__cause__ = exc
            if failed.code not in transient or self._attempts <= 1:
                raise failed from exc
        first: NvmlError | None = failed

        def retryable(exc: BaseException) -> bool:
            return isinstance(exc, NvmlError) and exc.code in transient

        for attempt in Retrying(
            stop=stop_after_attempt(self._attempts),
            wait=self._wait,
            retry=retry_if_exception(retryable),
            reraise=True,
        ):
            with attempt, mapped(operation):
                if first is not None:
                    replayed, first = first, None
                    raise replayed
                return fn()
        raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover
