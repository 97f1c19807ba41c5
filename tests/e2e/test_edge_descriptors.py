"""A flood of connections on the socket never starves the probes: they still connect and answer SERVING.

The sidecar runs with a descriptor limit of 512 (set in the child before it execs the sidecar, soft
and hard alike, so that ``serve`` cannot raise it) and a client opens as many bare connections to
its socket as that limit, which never send a byte, the cheapest way to hold a descriptor of the
sidecar. Without a bound grpc accepts them until the process has no descriptor left and the
probe's own connection finds none (DEADLINE_EXCEEDED). The probes run the manifests' exact command
lines, their socket the test's. No timing is asserted: the test waits (bounded) for each state.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc
from helpers_e2e import wait_until
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory

from sidecar.edge import descriptors

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 512
SHIPPED_SOCKET = "/var/lib/hami/mig-sidecar/sidecar.sock"
# Runs in the child, then becomes the sidecar: ``python -c LOWER_LIMIT -m sidecar serve ...``.
LOWER_LIMIT = (
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, {LIMIT})); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def probe_commands(car: Sidecar) -> dict[str, list[str]]:
    """The startup, readiness and liveness probes of ``deploy/daemonset.yaml``, on ``car``'s socket."""
    manifest = (ROOT / "deploy" / "daemonset.yaml").read_text()
    found = re.findall(r"(\w+Probe):\s*\n\s*exec:\s*\n\s*command: (\[[^\]]*\])", manifest)
    script = Path(sys.executable).parent / "hami-mig-sidecar"
    commands = {}
    for probe, text in found:
        command = json.loads(text)
        assert command[0] == "hami-mig-sidecar"
        assert SHIPPED_SOCKET in command
        commands[probe] = [str(script), *(str(car.socket) if a == SHIPPED_SOCKET else a for a in command[1:])]
    assert set(commands) == {"startupProbe", "readinessProbe", "livenessProbe"}
    return commands


def run_probe(command: list[str]) -> tuple[int, str]:
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=CALL_TIMEOUT_S)
    return done.returncode, done.stdout + done.stderr


def descriptors_of(pid: int) -> int:
    return sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def closed_by_peer(conn: socket.socket) -> bool:
    try:
        return conn.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError as exc:
        return exc.errno in {errno.ECONNRESET, errno.EPIPE}


@contextlib.contextmanager
def bare_connections(path: Path, count: int) -> Iterator[list[socket.socket]]:
    """``count`` connections to ``path`` that send nothing; closed on the way out."""
    need = count + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"the test process may open {hard} descriptors, it needs {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            opened.append(conn)
            conn.settimeout(CALL_TIMEOUT_S)
            conn.connect(str(path))
            conn.setblocking(False)  # closed_by_peer looks without waiting
        yield opened
    finally:
        for conn in opened:
            conn.close()


def own_channel(car: Sidecar) -> grpc.Channel:
    """A channel with a connection of its own (grpc shares one between equal channels otherwise)."""
    return grpc.insecure_channel(f"unix://{car.socket}", options=[("grpc.use_local_subchannel_pool", 1)])


def answers_on_a_new_connection(car: Sidecar) -> bool:
    with own_channel(car) as channel:
        try:
            info = pb_grpc.MigSidecarStub(channel).GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError:
            return False
    return bool(info.recovered)


def test_connections_up_to_the_descriptor_limit_leave_the_probes_serving(
    sidecar_factory: SidecarFactory,
) -> None:
    car = sidecar_factory(sim_gpus="h100-80gb:1", start=False)
    serve = car.command()
    car.command = lambda: [sys.executable, "-c", LOWER_LIMIT, *serve[1:]]  # type: ignore[method-assign]
    car.start()
    car.recover()
    assert car.proc is not None
    pid = car.proc.pid
    probes = probe_commands(car)
    cap = LIMIT - descriptors.RESERVED - descriptors.HEALTH_CONNECTIONS

    own = descriptors_of(pid)

    with bare_connections(car.socket, LIMIT) as flood:
        # The sidecar has taken the flood in: it closed each connection past its cap, or it ran out
        # of descriptors (what happens without a cap: grpc logs it and stops accepting).
        wait_until(
            "the flood taken in",
            lambda: (
                sum(map(closed_by_peer, flood)) >= LIMIT - cap
                or "File descriptor limit reached" in car.log_text()
            ),
            car=car,
        )
        for probe in ("livenessProbe", "startupProbe"):
            assert run_probe(probes[probe]) == (0, "(process): SERVING\n"), probe
        assert run_probe(probes["readinessProbe"]) == (0, "hami.migsidecar.v1.MigSidecar: SERVING\n")
        held = sum(not closed_by_peer(conn) for conn in flood)
        in_use = descriptors_of(pid)
        # A new connection past the cap is closed at once: a client sees UNAVAILABLE, and retries.
        with own_channel(car) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.MigSidecarStub(channel).GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # The test's own channel holds one of the main socket's places too.
    assert 0 < held <= cap - 1
    assert in_use <= own + cap  # the sidecar's own files keep their reserve
    serving = car.log_event("serving")
    limits = (serving["descriptor_limit_was"], serving["descriptor_limit"], serving["descriptor_hard_limit"])
    assert limits == (LIMIT, LIMIT, LIMIT)  # soft at hard already: nothing to raise
    assert serving["max_connections"] == cap
    assert serving["health_socket"] == f"{car.socket}.health"
    # Once the flood has gone, a new connection is served again.
    wait_until("a new connection served", lambda: answers_on_a_new_connection(car), car=car)
