"""The socket is the one way in: no second sidecar may take it from a live one, and ``status`` says in
one line why it cannot ask. Real ``serve`` processes on the simulated backend."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory

pytestmark = pytest.mark.e2e


class TestALiveSocketIsNeverTaken:
    def test_a_second_sidecar_with_another_state_dir_and_the_same_socket_exits_and_leaves_it(
        self, sidecar: Sidecar, sidecar_factory: SidecarFactory
    ) -> None:
        inode = sidecar.socket.stat().st_ino
        second = sidecar_factory(start=False)  # its own state directory and hardware
        second.socket = sidecar.socket
        code = second.spawn().wait(timeout=60)
        assert code != 0
        assert f"another process is serving on the socket {sidecar.socket}" in second.log_text()
        assert "removed stale socket" not in second.log_text()
        assert sidecar.socket.stat().st_ino == inode
        assert sidecar.info().api_version == "v1"

    def test_a_socket_nobody_answers_on_is_still_replaced(self, sidecar: Sidecar) -> None:
        sidecar.kill9()
        sidecar.restart()
        assert sidecar.log_event("removed stale socket")["socket"] == str(sidecar.socket)


def status(car: Sidecar, *args: str) -> subprocess.CompletedProcess[str]:
    """``status`` run from the sidecar's root directory, so a relative ``--socket`` means its socket."""
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "status", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=CALL_TIMEOUT_S,
        cwd=car.root,
    )


class TestStatusSaysWhyInOneLine:
    def test_a_relative_socket_path_works(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        result = status(sidecar, "--socket", sidecar.socket.name)
        assert result.returncode == 0, result.stderr
        assert "INSTANCES" in result.stdout

    def test_a_socket_nobody_answers_on_is_one_clear_line(self, sidecar: Sidecar) -> None:
        sidecar.kill9()  # the socket file stays behind
        result = status(sidecar, "--socket", sidecar.socket.name)
        assert result.returncode == 1
        assert result.stderr.splitlines() == [
            f"hami-mig-sidecar status: nothing answers on {sidecar.socket}: connection refused"
            " (a stale socket; is the sidecar running?)"
        ]

    def test_a_missing_relative_socket_is_named_by_its_absolute_path(self, sidecar: Sidecar) -> None:
        result = status(sidecar, "--socket", "missing.sock")
        assert result.returncode == 1
        assert result.stderr.splitlines() == [
            f"hami-mig-sidecar status: no sidecar socket at {sidecar.root / 'missing.sock'}"
            " (is the sidecar running?)"
        ]

    def test_a_path_that_is_no_socket_is_one_clear_line(self, sidecar: Sidecar) -> None:
        result = status(sidecar, "--socket", "sidecar.log")
        assert result.returncode == 1
        assert result.stderr.splitlines() == [
            f"hami-mig-sidecar status: {sidecar.root / 'sidecar.log'} is not a socket (is --socket right?)"
        ]
