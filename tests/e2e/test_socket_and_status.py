"""The socket is the one way in: no second sidecar may take it from a live one, and ``status`` says in
one line why it cannot ask. Real ``serve`` processes on the simulated backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory, allocate_one

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
        removed = [
            json.loads(line)["socket"]
            for line in sidecar.log_text().splitlines()
            if line.startswith("{") and json.loads(line)["msg"] == "removed stale socket"
        ]
        assert removed == [str(sidecar.socket), f"{sidecar.socket}.health"]  # and the health listener's


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


def test_every_command_resolves_a_relative_socket_against_the_working_directory(sidecar: Sidecar) -> None:
    sidecar.recover()
    relative = sidecar.socket.name
    for command in (
        ["status", "--socket", relative],
        ["health", "--socket", relative],
        ["call", "GetInfo", "--socket", relative],
        ["reclaim", "--gpu", "0", "--socket", relative],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "sidecar", *command],
            capture_output=True, text=True, check=False, timeout=CALL_TIMEOUT_S, cwd=sidecar.root,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stderr)
        missing = subprocess.run(
            [sys.executable, "-m", "sidecar", *command[:-1], "missing.sock"],
            capture_output=True, text=True, check=False, timeout=CALL_TIMEOUT_S, cwd=sidecar.root,
        )  # fmt: skip
        assert missing.returncode == 1
        asked = "missing.sock.health" if command[0] == "health" else "missing.sock"  # its own listener
        assert missing.stderr.splitlines() == [
            f"hami-mig-sidecar {command[0]}: no sidecar socket at {sidecar.root / asked}"
            " (is the sidecar running?)"
        ]


class TestStatusBeforeRecover:
    def test_the_sidecars_own_instances_are_owned_but_unverified_not_foreign(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        mine = allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1).mig_uuid
        sidecar.sim("create", "--gpu", "1", "--profile", "1g.10gb", "--placement", "0:1")  # nobody's
        sidecar.restart()  # its table is empty until the plugin's Recover

        before = status(sidecar, "--socket", sidecar.socket.name)
        assert before.returncode == 0, before.stderr
        unverified, _, foreign = before.stdout.partition("FOREIGN (not owned; never touched)")
        assert "OWNED, NOT YET VERIFIED" in unverified
        [row] = [line for line in unverified.splitlines() if mine in line]
        assert row.split()[0] == "0"
        assert row.split()[-1].startswith("mig-GPU-")
        assert mine not in foreign
        [other] = [line for line in foreign.splitlines() if line.startswith("1 ")]
        assert other.split()[1:3] == ["1g.10gb", "0:1"]
        state = sidecar.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
        assert [f.recorded_as != "" for f in state.gpus[0].foreign] == [True]
        assert [f.recorded_as for f in state.gpus[1].foreign] == [""]

        sidecar.recover()
        after = status(sidecar, "--socket", sidecar.socket.name).stdout
        assert "OWNED, NOT YET VERIFIED" not in after
        instances, _, foreign = after.partition("FOREIGN (not owned; never touched)")
        assert mine in instances
        assert mine not in foreign


class TestCallAnswersInOneLineAndInTime:
    def test_a_following_stream_ends_at_its_timeout_with_one_line(self, sidecar: Sidecar) -> None:
        """``--timeout`` bounds a stream too; without it ``follow`` would run until Ctrl-C (and
        ``cli`` would run out its own bound of CALL_TIMEOUT_S)."""
        sidecar.recover()
        result = sidecar.cli(
            "call", "WatchHealth", '{"follow": true}', "--timeout", "1", "--socket", str(sidecar.socket)
        )
        assert result.returncode == 1
        assert result.stderr.splitlines() == [
            "hami-mig-sidecar call WatchHealth: DEADLINE_EXCEEDED: Deadline Exceeded"
        ]
        assert sidecar.info().api_version == "v1"

    def test_a_refusal_and_its_metadata_are_one_line(self, sidecar: Sidecar) -> None:
        sidecar.recover()
        result = sidecar.cli("call", "Release", '{"pod_uid": "a b"}', "--socket", str(sidecar.socket))
        assert result.returncode == 1
        assert result.stderr.splitlines() == [
            "hami-mig-sidecar call Release: INVALID_ARGUMENT INVALID_REQUEST: request: 'a b' is not a pod UID"
            " (field=pod_uid)"
        ]
