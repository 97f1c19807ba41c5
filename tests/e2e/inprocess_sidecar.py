"""A real sidecar served from inside the test process, over a Unix socket, on the simulated backend.

The same composition root as ``serve`` (``app.open_app`` then ``Application.start``), so requests
cross the real gRPC edge (decoding, validation, error mapping) while a test can run thousands of
them without a process start each. What a test compares lives outside the sidecar's memory: the
record files, the CDI files and the simulated hardware's state file.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import msgspec
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc
from sidecar_process import snapshot_dir

from sidecar.app import Application, open_app
from sidecar.config import ServeConfig, SimGpu
from sidecar.nvml.sim import SimulatedHardware

CALL_TIMEOUT_S = 30.0


class InProcessSidecar:
    """The started application, a stub bound to its socket, and its paths."""

    def __init__(self, root: Path, app: Application, config: ServeConfig) -> None:
        self.root = root
        self.app = app
        self.config = config
        self.socket = config.socket
        self.state_dir = config.state_dir
        assert config.cdi_dir is not None
        assert config.sim_state is not None
        self.cdi_dir = config.cdi_dir
        self.sim_state = config.sim_state
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.stub: Any = pb_grpc.MigSidecarStub(self.channel)

    def gpu_uuids(self) -> list[str]:
        gpus = self.stub.ListGpus(pb.ListGpusRequest(), timeout=CALL_TIMEOUT_S).gpus
        return [g.uuid for g in sorted(gpus, key=lambda g: g.index)]

    def world(self) -> tuple[bytes, dict[str, bytes], dict[str, bytes], list[Any]]:
        """Everything a rejected call must leave as it was: GetState (serialized), the record and CDI
        files byte for byte, and the simulated hardware's layout."""
        state = self.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
        return (
            state.SerializeToString(deterministic=True),
            snapshot_dir(self.state_dir),
            snapshot_dir(self.cdi_dir),
            SimulatedHardware.open(self.sim_state).layouts(),
        )

    def close(self) -> None:
        self.channel.close()
        self.app.shutdown()


@contextmanager
def inprocess_sidecar(
    sim_gpus: str = "h100-80gb:1,a100-40gb:1", **overrides: Any
) -> Iterator[InProcessSidecar]:
    """Start one sidecar in this process (not recovered yet); stop it and remove its files after.

    Paths sit under a short temp root: a Unix socket address is limited to 107 bytes. ``overrides``
    replace ``ServeConfig`` fields (an idle policy, say)."""
    root = Path(tempfile.mkdtemp(prefix="hmi"))
    gpus = tuple(SimGpu(model, int(count)) for model, count in (g.split(":") for g in sim_gpus.split(",")))
    config = ServeConfig(
        socket=root / "s.sock",
        state_dir=root / "state",
        cdi_dir=root / "cdi",
        backend="simulated",
        sim_state=root / "hw.json",
        sim_gpus=gpus,
        reconcile_interval_s=3600.0,  # no background round while a test compares snapshots
        shutdown_grace_s=2.0,
    )
    config = msgspec.structs.replace(config, **overrides)
    app = open_app(config)
    try:
        app.start()
    except BaseException:
        app.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        raise
    car = InProcessSidecar(root, app, config)
    try:
        yield car
    finally:
        car.close()
        shutil.rmtree(root, ignore_errors=True)
