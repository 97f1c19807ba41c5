"""The descriptor budget: the socket's connections fit under the limit, past the sidecar's own files and
the health listener's, and ``serve`` starts with the soft limit raised as far as the hard one."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from sidecar.edge import descriptors

BESIDE = descriptors.RESERVED + descriptors.HEALTH_CONNECTIONS


@pytest.mark.parametrize(
    ("soft", "wanted", "cap"),
    [
        (1_048_576, 1024, 1024),  # a container's usual limit: the flag's value
        (4096, 1024, 1024),
        (1024, 1024, 1024 - BESIDE),  # a low limit leaves fewer
        (BESIDE + 1, 1024, 1),
        (resource.RLIM_INFINITY, 7, 7),
    ],
)
def test_the_cap_is_the_flag_or_what_the_limit_leaves(soft: int, wanted: int, cap: int) -> None:
    assert descriptors.connection_cap(wanted, soft) == cap


def test_a_limit_that_leaves_no_connection_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=f"RLIMIT_NOFILE\\) of {BESIDE} leaves no room for connections"):
        descriptors.connection_cap(1024, BESIDE)


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    """In a child process whose soft limit starts low (the test process's own stays as it is)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard <= 64:
        pytest.skip(f"needs a finite hard descriptor limit above 64, not {hard}")
    script = (
        "import json, resource\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (64, {hard}))\n"
        "from sidecar.edge import descriptors\n"
        "limit = descriptors.raise_soft_limit()\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "print(json.dumps([limit.was, limit.soft, limit.hard, *now]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == [64, hard, hard, hard, hard]
