"""End-to-end helper: a real ``python -m sidecar serve`` process on the simulated backend.

Every e2e test talks to the sidecar exactly as HAMi's Go plugin does: gRPC over a Unix socket. The
simulated hardware lives in a state file (``sim_state``) that outlives the process, so a test can
kill -9 the sidecar, restart it on the same paths and see what recovery makes of the "hardware".

Usage::

    def test_something(sidecar: Sidecar) -> None:          # started, not yet recovered
        sidecar.recover()                                   # Recover with no active allocations
        info = sidecar.stub.GetInfo(pb.GetInfoRequest())
        sidecar.sim("create", "--gpu", "0", "--profile", "1g.10gb", "--placement", "0:1")
        sidecar.kill9()
        sidecar.restart()

    def test_other(sidecar_factory: SidecarFactory) -> None:
        car = sidecar_factory(extra_args=["--no-cdi"], env={"HAMI_MIG_SIDECAR_CRASH_AT": "after-create-gi"})

Paths are short on purpose: a Unix socket address is limited to 107 bytes and pytest's ``tmp_path`` is
long, so everything lives under ``tempfile.mkdtemp(prefix="hms")``:
``<root>/s.sock``, ``<root>/state``, ``<root>/cdi``, ``<root>/hw.json``; the process's stderr (JSON log
lines) goes to ``<root>/sidecar.log`` and is readable as ``.log_text()``.

The names of this module (``Sidecar``, ``SidecarFactory``, the fixtures ``sidecar`` and
``sidecar_factory``, and the attributes and methods of ``Sidecar``) are used by every e2e test: keep
them stable.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from hami.migsidecar.v1 import migsidecar_pb2_grpc as pb_grpc

from sidecar.nvml.sim import GpuLayout, SimulatedHardware

DEFAULT_SIM_GPUS = "h100-80gb:2,a100-40gb:1"
START_TIMEOUT_S = 60.0  # generous: two shared cores, a cold interpreter importing grpc and pynvml
STOP_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 30.0


def error_info(err: grpc.RpcError) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(status code, ErrorInfo reason, ErrorInfo metadata) of a failed call; reason "" if none attached."""
    call: Any = err
    status = rpc_status.from_call(call)
    reason, metadata = "", {}
    if status is not None:
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reason, metadata = info.reason, dict(info.metadata)
    return call.code(), reason, metadata


class Sidecar:
    """One sidecar process and its paths. ``stub``/``health`` are bound to the current process."""

    def __init__(
        self,
        root: Path,
        extra_args: Sequence[str],
        env: Mapping[str, str] | None,
        sim_gpus: str,
    ) -> None:
        self.root = root
        self.socket = root / "s.sock"
        self.state_dir = root / "state"
        self.cdi_dir = root / "cdi"
        self.sim_state = root / "hw.json"
        self.log_path = root / "sidecar.log"
        self.sim_gpus = sim_gpus
        self.extra_args: list[str] = list(extra_args)
        self.env: dict[str, str] = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.channel: grpc.Channel | None = None
        self.stub: Any = None
        self.health: Any = None

    # -- process control ---------------------------------------------------------------------------------
    def command(self) -> list[str]:
        """The serve command line; ``--no-cdi`` in ``extra_args`` drops ``--cdi-dir`` (mutually exclusive)."""
        return [
            sys.executable, "-m", "sidecar", "serve",
            "--backend", "simulated",
            "--sim-state", str(self.sim_state),
            "--sim-gpus", self.sim_gpus,
            "--state-dir", str(self.state_dir),
            *([] if "--no-cdi" in self.extra_args else ["--cdi-dir", str(self.cdi_dir)]),
            "--socket", str(self.socket),
            "--reconcile-interval", "0.2",
            "--shutdown-grace", "2",
            # serve's default reserve trims in the background after an Allocate; a test gets exactly
            # the layout it makes unless it asks for a reserve (its own flag comes later and wins)
            "--idle-reserve", "off",
            *self.extra_args,
        ]  # fmt: skip

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process without waiting for it (for tests that expect it to fail)."""
        environ = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_MIG_SIDECAR_")}
        environ.update(self.env)
        with self.log_path.open("ab") as log:
            log.write(f"--- start {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, env=environ)
        return self.proc

    def start(self) -> None:
        """Spawn and wait until the socket answers GetInfo; fail the test with the log if it does not."""
        proc = self.spawn()
        self._connect()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            code = proc.poll()
            if code is not None:
                pytest.fail(f"sidecar exited with {code} before serving:\n{self.log_text()}")
            if self.socket.exists():
                try:
                    self.stub.GetInfo(pb.GetInfoRequest(), timeout=2)
                except grpc.RpcError:
                    pass
                else:
                    return
            if time.monotonic() > deadline:
                self.kill9()
                pytest.fail(
                    f"sidecar did not answer on {self.socket} within {START_TIMEOUT_S}s:\n{self.log_text()}"
                )
            time.sleep(0.05)

    def _connect(self) -> None:
        self._disconnect()
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.stub = pb_grpc.MigSidecarStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def _disconnect(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> int | None:
        """SIGKILL, like a node OOM kill or a crash: no cleanup, the socket file stays behind."""
        self._disconnect()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(timeout=STOP_TIMEOUT_S)

    def terminate(self) -> int | None:
        """SIGTERM and wait; returns the exit code (0 for a clean graceful shutdown)."""
        self._disconnect()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"sidecar ignored SIGTERM for {STOP_TIMEOUT_S}s:\n{self.log_text()}")

    def restart(self, extra_args: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> None:
        """Stop (SIGTERM if still running) and start again on the same paths and simulated hardware.

        ``extra_args``/``env`` replace the previous ones when given; None keeps them."""
        if self.running:
            self.terminate()
        if extra_args is not None:
            self.extra_args = list(extra_args)
        if env is not None:
            self.env = dict(env)
        self.start()

    # -- conveniences --------------------------------------------------------------------------------------
    def sim(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``python -m sidecar sim --sim-state <hw.json> *args`` — operate the simulated hardware."""
        result = subprocess.run(
            [sys.executable, "-m", "sidecar", "sim", "--sim-state", str(self.sim_state), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=CALL_TIMEOUT_S,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"sim {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``python -m sidecar *args`` with this sidecar's environment (for status, records verify)."""
        return subprocess.run(
            [sys.executable, "-m", "sidecar", *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=CALL_TIMEOUT_S,
        )

    def recover(self, active: Iterable[Any] = ()) -> Any:
        """Recover with the given ``pb.ActiveAllocation``s (none by default); returns RecoverResponse."""
        return self.stub.Recover(pb.RecoverRequest(active=list(active)), timeout=CALL_TIMEOUT_S)

    def info(self) -> Any:
        return self.stub.GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT_S)

    def gpus(self) -> list[pb.Gpu]:
        return list(self.stub.ListGpus(pb.ListGpusRequest(), timeout=CALL_TIMEOUT_S).gpus)

    def health_status(self, service: str = "") -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        return int(self.health.Check(request, timeout=CALL_TIMEOUT_S).status)

    # -- what is on the "hardware" and on disk (read directly, not through the sidecar) ---------------------
    def sim_list(self) -> dict[str, Any]:
        """``sim list --json``: ``boot_id``, ``gpus`` (each with ``gis`` and their ``cis``), ``faults``."""
        doc: dict[str, Any] = json.loads(self.sim("list", "--json").stdout)
        return doc

    def hardware(self) -> list[dict[str, Any]]:
        """The GPU layouts as the simulated driver reports them (``sim list --json``'s ``gpus``)."""
        gpus: list[dict[str, Any]] = self.sim_list()["gpus"]
        return gpus

    def sim_stats(self) -> dict[str, Any] | None:
        """``sim stats --json`` (NVML calls per operation), or None where this build's simulator has none."""
        result = self.sim("stats", "--json", check=False)
        if result.returncode != 0:
            return None
        doc: dict[str, Any] = json.loads(result.stdout)
        return doc

    def records(self) -> dict[str, dict[str, Any]]:
        """Record file stem -> the record inside its envelope, read from the state directory.

        The reconciler may delete a record between the listing and its read (every 0.2 s by default):
        that record is left out, as if the listing had come a moment later."""
        found: dict[str, dict[str, Any]] = {}
        for path in sorted(self.state_dir.glob("mig-*.json")):
            try:
                found[path.stem] = json.loads(path.read_bytes())["record"]
            except FileNotFoundError:
                continue  # deleted between the listing and the read
        return found

    def cdi_files(self) -> list[str]:
        """Names of the entries in the CDI directory ([] when it does not exist)."""
        return sorted(p.name for p in self.cdi_dir.iterdir()) if self.cdi_dir.exists() else []

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_event(self, msg: str) -> dict[str, Any]:
        """The newest JSON log line with this ``msg``, waiting (bounded) for it to be written.

        The socket answers as soon as the server starts, a moment before the "serving" line is
        logged, so a test that reads the log right after ``start()`` must wait for the line."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            events: list[dict[str, Any]] = [
                json.loads(line)
                for line in self.log_text().splitlines()
                if line.startswith("{") and json.loads(line).get("msg") == msg
            ]
            if events:
                return events[-1]
            if time.monotonic() > deadline:
                pytest.fail(f"no {msg!r} log line within {START_TIMEOUT_S}s:\n{self.log_text()}")
            time.sleep(0.02)

    def close(self) -> None:
        if self.running:
            self.kill9()
        self._disconnect()


def snapshot_dir(directory: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every regular file under ``directory`` ({} when it does not exist):
    equal snapshots mean nothing was written, renamed or removed there. A file deleted between the
    listing and its read (a background round removing a record or spec) is left out, as if the
    listing had come a moment later."""
    if not directory.exists():
        return {}
    found: dict[str, bytes] = {}
    for path in sorted(directory.rglob("*")):
        if not path.is_file():
            continue
        try:
            found[str(path.relative_to(directory))] = path.read_bytes()
        except FileNotFoundError:
            continue  # deleted between the listing and the read
    return found


# -- what a plugin sends and reads, shared by the tests that talk about one device at a time ----------------


def gpu_uuid(car: Sidecar, index: int) -> str:
    """The UUID of the GPU at NVML index ``index``, as ListGpus reports it."""
    return str(next(g.uuid for g in car.gpus() if g.index == index))


def allocate_one(  # noqa: PLR0917 - reads like the reservation it requests
    car: Sidecar, pod: str, gpu: int, profile: str, start: int, size: int
) -> Any:
    """Allocate one device (device 0 of container 0 of ``pod``) at a placement; returns that device."""
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        devices=[
            pb.DeviceRequest(
                device_index=0,
                gpu_uuid=gpu_uuid(car, gpu),
                profile=profile,
                placement=pb.Placement(start=start, size=size),
            )
        ],
    )
    return car.stub.Allocate(request, timeout=CALL_TIMEOUT_S).devices[0]


def annotation(pod: str, device: Any) -> Any:
    """The ActiveAllocation the plugin reads back from ``hami.io/vgpu-mig-allocations``."""
    return pb.ActiveAllocation(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        device_index=device.device_index,
        gpu_uuid=device.gpu_uuid,
        profile=device.profile,
        placement=device.placement,
        mig_uuid=device.mig_uuid,
        gpu_instance_id=device.gpu_instance_id,
        compute_instance_id=device.compute_instance_id,
    )


def failure(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """``call()`` must fail: its (code, reason, metadata)."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return error_info(caught.value)


def instances(car: Sidecar) -> dict[str, Any]:
    """MIG UUID -> owned instance as GetState reports it."""
    state = car.stub.GetState(pb.GetStateRequest(), timeout=CALL_TIMEOUT_S)
    return {i.mig_uuid: i for g in state.gpus for i in g.instances}


def states(car: Sidecar) -> dict[str, int]:
    """MIG UUID -> InstanceState of every owned instance, as GetState reports it."""
    return {mig_uuid: i.state for mig_uuid, i in instances(car).items()}


def layouts(car: Sidecar) -> list[GpuLayout]:
    """The GPU layouts as typed values, read from the simulated hardware's state file."""
    return SimulatedHardware.open(car.sim_state).layouts()


class SidecarFactory(Protocol):
    def __call__(
        self,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        sim_gpus: str = DEFAULT_SIM_GPUS,
        start: bool = True,
        root: Path | None = None,
    ) -> Sidecar: ...


# The fixtures every e2e test takes; conftest.py hands them to pytest.
@pytest.fixture
def sidecar_factory() -> Iterator[SidecarFactory]:
    """Make sidecars (started and answering unless ``start=False``); all are stopped and removed after.

    ``root`` reuses another sidecar's directory (same socket, state and hardware): how a test builds a
    second sidecar that must be refused by the first one's lock."""
    made: list[Sidecar] = []
    roots: list[Path] = []

    def make(
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        sim_gpus: str = DEFAULT_SIM_GPUS,
        start: bool = True,
        root: Path | None = None,
    ) -> Sidecar:
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="hms"))
            roots.append(root)
        car = Sidecar(root, extra_args, env, sim_gpus)
        made.append(car)
        if start:
            car.start()
        return car

    yield make
    for car in made:
        car.close()
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sidecar(sidecar_factory: SidecarFactory) -> Sidecar:
    """A started sidecar on h100-80gb:2,a100-40gb:1 simulated GPUs, not yet recovered."""
    return sidecar_factory()
