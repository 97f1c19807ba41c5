"""The sidecar process a soak drives (``soak.py``): started on its files, killed with SIGKILL, started
again on the same files and recovered with what the clients hold, sometimes killed inside that Recover.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

TIMEOUT_S = 60.0
RECOVER_ATTEMPTS = 50
# Channels reconnect within a second of a restart instead of after grpc's default backoff (minutes).
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000))


class Sidecar:
    """The sidecar process under test, killed and started again on the same files."""

    def __init__(self, root: Path, gpus: str, extra: list[str]) -> None:
        self.root, self.socket = root, root / "s.sock"
        self.hw_file, self.cdi_dir = root / "hw.json", root / "cdi"
        self.command = [
            sys.executable, "-m", "sidecar", "serve", "--backend", "simulated",
            "--sim-state", str(self.hw_file), "--sim-gpus", gpus,
            "--state-dir", str(root / "state"), "--cdi-dir", str(self.cdi_dir),
            "--socket", str(self.socket), "--log-level", "WARNING", *extra,
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
        self.log = (root / "sidecar.log").open("ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.recover_retries = 0

    def _spawn(self) -> Any:
        """Start the process and wait for its socket; a stub on a new channel (the last one closed)."""
        self.proc = subprocess.Popen(self.command, env=self.env, stderr=self.log)
        if self.channel is not None:
            self.channel.close()
        self.channel = grpc.insecure_channel(f"unix://{self.socket}", options=CHANNEL_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=60)
        return pb_grpc.MigSidecarStub(self.channel)

    def start(self, active: list[Any]) -> Any:
        """Start it, wait for the socket, Recover with ``active``; the stub."""
        stub = self._spawn()
        for attempt in range(RECOVER_ATTEMPTS):
            try:
                stub.Recover(pb.RecoverRequest(active=active), timeout=TIMEOUT_S)
                return stub
            except grpc.RpcError as err:  # an injected fault: retried, as the plugin retries it
                if err.code() is not grpc.StatusCode.UNAVAILABLE or attempt == RECOVER_ATTEMPTS - 1:
                    raise
                self.recover_retries += 1
                time.sleep(0.2)
        raise AssertionError("unreachable")

    def start_killed_in_recover(self, active: list[Any], after_s: float) -> None:
        """Start it and call Recover, with a SIGKILL ``after_s`` into the call."""
        stub = self._spawn()
        assert self.proc is not None
        killer = threading.Timer(after_s, self.proc.send_signal, (signal.SIGKILL,))
        killer.start()
        with contextlib.suppress(grpc.RpcError):  # killed inside it, or an injected fault
            stub.Recover(pb.RecoverRequest(active=active), timeout=TIMEOUT_S)
        killer.join()
        self.proc.wait(timeout=30)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.log.close()
