"""Named crash points for crash-safety tests.

``crashpoint("record-creating")`` ends the process at once (``os._exit``, like kill -9: no cleanup, no
flush) when the environment variable ``HAMI_MIG_SIDECAR_CRASH_AT`` names that point. The variable is read
once at import; in production it is unset and a crash point costs one string comparison.

The points, in the order a transaction meets them, are listed in ``POINTS``; tests iterate over it.
"""

from __future__ import annotations

import os
import sys

ENV = "HAMI_MIG_SIDECAR_CRASH_AT"

POINTS: tuple[str, ...] = (
    # create (architecture section 5, step 5)
    "after-record-creating",
    "after-create-gi",
    "after-record-gi",
    "after-create-ci",
    "after-record-ci",
    "after-write-cdi",
    # reclaim (step 4)
    "after-record-deleting",
    "after-destroy-ci",
    "after-destroy-gi",
    "after-remove-cdi",
    # an Allocate's inline retry of an ERROR instance in its way: destroyed, the create not begun
    "after-inline-error-retry",
    # SyncActive: the pending reservations taken (memory only), nothing idled or reactivated yet
    "after-sync-pending",
    # a destroy that found a file that is not ours at the spec's path: kept, the record not yet deleted
    "after-foreign-cdi-kept",
)

_armed = os.environ.get(ENV, "")


def crashpoint(name: str) -> None:
    """Exit the process immediately if ``name`` is the armed crash point."""
    if _armed and name == _armed:
        sys.stderr.write(f"crashpoint {name}: exiting\n")
        sys.stderr.flush()
        os._exit(137)
