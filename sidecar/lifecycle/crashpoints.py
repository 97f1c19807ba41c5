"""Named crash points for crash-safety tests.

``crashpoint("record-creating")`` ends the process at once (``os._exit``, like kill -9: no cleanup, no
flush) when the environment variable ``HAMI_MIG_SIDECAR_CRASH_AT`` names that point. The variable is read
once at import; in production it is unset and a crash point costs one string comparison.

The points, in the order a transaction meets them, are listed in ``POINTS``; tests iterate over it.

``raising_at(name)`` is the in-process form for tests that run the lifecycle without a process of
its own: the point raises ``Crashed`` instead of exiting. ``Crashed`` is a ``BaseException``, so no
``except Exception`` (an undo, a rollback, an ERROR mark) runs on its way out, as none runs after a
kill -9; what is left on disk and on the hardware is what the process would have left.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

ENV = "HAMI_MIG_SIDECAR_CRASH_AT"

POINTS: tuple[str, ...] = (
    # create (``docs/architecture.md``, "Crash safety")
    "after-record-creating",
    "after-create-gi",
    "after-record-gi",
    "after-create-ci",
    "after-write-cdi",
    # takeover of a HAMi record at Recover: the sidecar's record is durable, HAMi's file not yet gone;
    # then HAMi's file is gone too
    "after-takeover-record",
    "after-remove-hami-record",
    # the idle policy's background trim: chosen and re-checked under the GPU lock, before its destroy
    # (the destroy itself then meets the reclaim points below)
    "before-idle-trim",
    # reclaim (step 4)
    "after-record-deleting",
    "after-destroy-ci",
    "after-destroy-gi",
    "after-remove-cdi",
    # UndoAllocate: after each created instance is destroyed, after each reused one is IDLE again
    "after-undo-destroy-one",
    "after-undo-idle-one",
    # ReclaimIdle: after each IDLE instance is destroyed
    "after-reclaim-idle-one",
    # SetMigMode(enabled=false, reclaim_idle=true): the IDLE instances are gone, MIG not yet disabled
    "after-reclaim-for-disable",
    # an Allocate's inline retry of an ERROR instance in its way: destroyed, the create not begun
    "after-inline-error-retry",
    # SyncActive: the pending reservations taken (memory only), nothing idled or reactivated yet
    "after-sync-pending",
    # a destroy that found a file that is not ours at the spec's path: kept, the record not yet deleted
    "after-foreign-cdi-kept",
)

_armed = os.environ.get(ENV, "")
_raising = ""


class Crashed(BaseException):
    """The in-process crash ``raising_at`` arms: unwinds past every ``except Exception``."""


def crashpoint(name: str) -> None:
    """Exit the process immediately if ``name`` is the armed crash point."""
    if _armed and name == _armed:
        sys.stderr.write(f"crashpoint {name}: exiting\n")
        sys.stderr.flush()
        os._exit(137)
    if _raising and name == _raising:
        raise Crashed(name)


@contextlib.contextmanager
def raising_at(name: str) -> Iterator[None]:
    """Within the block, reaching crash point ``name`` raises ``Crashed`` (tests only; one at a time)."""
    global _raising  # noqa: PLW0603 - the one switch, read on every crash point
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}")
    _raising = name
    try:
        yield
    finally:
        _raising = ""
