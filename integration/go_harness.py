"""Harness and fixtures for the Go side: the Go binaries, built once, and a sidecar they can restart.

The fixtures are imported by the test module rather than living in a conftest.py: several test
directories import names from "conftest", and a second conftest module would shadow theirs.

The Go client module lives in ``integration/goclient``. These tests build its mock device plugin
(``go build``) and its end-to-end test binary (``go test -c``) once per run, then drive a real
``python -m sidecar serve`` process on the simulated backend with them, exactly over the socket
HAMi's plugin would use. The sidecar process handle comes from ``tests/e2e/sidecar_process.py``.

A Go program cannot restart a process that pytest owns, so a restart is a handshake through two
files: the Go side runs ``restart_command`` (touch ``restart.req``, wait for ``restart.done``) and
``GoRunner.run`` services the request (kill -9, start again on the same paths) while it waits for
the Go process.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GOCLIENT = REPO / "integration" / "goclient"
CDISCHEMA = REPO / "integration" / "cdischema"
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from driver_cdi_build import DriverCdiBinaries, driver_cdi_binaries  # noqa: E402
from sidecar_process import Sidecar  # noqa: E402

__all__ = ["DriverCdiBinaries", "driver_cdi_binaries"]

GO_TIMEOUT_S = 300.0  # building pulls nothing new but compiles grpc: slow on two shared cores
RUN_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class GoBinaries:
    mockplugin: Path
    e2e: Path
    cdischema: Path

    def e2e_tests(self) -> list[str]:
        """The names of the tests compiled into the e2e binary (``-test.list``), without running
        any: the binary is the one place that knows every Test function in ``e2e/``."""
        result = subprocess.run(
            [str(self.e2e), "-test.list", "."],
            capture_output=True, text=True, check=False, timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
        if result.returncode != 0:
            pytest.fail(f"{self.e2e} -test.list failed:\n{result.stdout}\n{result.stderr}")
        return [line for line in result.stdout.splitlines() if line.strip()]


class GoRunner:
    """Runs Go programs against one sidecar and restarts the sidecar when they ask for it."""

    def __init__(self, car: Sidecar, mockplugin: Path) -> None:
        self.car = car
        self.mockplugin = mockplugin
        self.request = car.root / "restart.req"
        self.done = car.root / "restart.done"
        self.restarts = 0
        # The CDI name of the node's driver the sidecar hands out beside each instance's, once a test
        # restarts it with --driver-cdi-command; the Go side reads it as MIGSIDECAR_DRIVER_CDI.
        self.driver_device = ""

    @property
    def restart_command(self) -> str:
        return f"touch {self.request} && while [ ! -e {self.done} ]; do sleep 0.05; done && rm -f {self.done}"

    @property
    def sim_command(self) -> str:
        """The ``sim`` subcommand on this sidecar's simulated hardware; the Go side appends arguments."""
        return shlex.join([sys.executable, "-m", "sidecar", "sim", "--sim-state", str(self.car.sim_state)])

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "MIGSIDECAR_SOCKET": str(self.car.socket),
            "MIGSIDECAR_CDI_DIR": str(self.car.cdi_dir),
            "MIGSIDECAR_RESTART_CMD": self.restart_command,
            "MIGSIDECAR_SIM_CMD": self.sim_command,
            "MIGSIDECAR_MOCKPLUGIN": str(self.mockplugin),
            **({"MIGSIDECAR_DRIVER_CDI": self.driver_device} if self.driver_device else {}),
        }

    def run(
        self, args: Sequence[str], during: Mapping[float, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``args`` to completion, servicing restart requests; ``during`` maps seconds after
        the start to an action on the sidecar ("start") for tests that begin with it down."""
        pending = dict(during or {})
        log = self.car.root / f"go-{time.monotonic_ns()}.out"
        with log.open("w+") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, text=True, env=self.env())
            began = time.monotonic()
            while proc.poll() is None:
                if self.request.exists():
                    self.request.unlink()
                    self.car.kill9()
                    self.car.start()
                    self.restarts += 1
                    self.done.touch()
                for at, action in sorted(pending.items()):
                    if time.monotonic() - began >= at:
                        del pending[at]
                        assert action == "start", action
                        self.car.start()
                if time.monotonic() - began > RUN_TIMEOUT_S:
                    proc.kill()
                    proc.wait()
                    pytest.fail(f"{args[0]} ran longer than {RUN_TIMEOUT_S}s:\n{log.read_text()}")
                time.sleep(0.05)
            out.seek(0)
            text = out.read()
        return subprocess.CompletedProcess(args, proc.returncode, text, "")


@pytest.fixture(scope="session", name="go_binaries")
def go_binaries_fixture() -> Iterator[GoBinaries]:
    """The mock plugin and the e2e test binary, built once into a temporary directory."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("the Go toolchain is not installed")
    out = Path(tempfile.mkdtemp(prefix="hmsgo"))
    env = {**os.environ, "GOFLAGS": "-mod=readonly"}
    for module, args in (
        (GOCLIENT, [go, "build", "-o", str(out / "mockplugin"), "./cmd/mockplugin"]),
        (GOCLIENT, [go, "test", "-c", "-o", str(out / "e2e.test"), "./e2e"]),
        (CDISCHEMA, [go, "build", "-o", str(out / "cdischema"), "."]),
    ):
        result = subprocess.run(
            args, cwd=module, env=env, capture_output=True, text=True, check=False, timeout=GO_TIMEOUT_S
        )
        if result.returncode != 0:
            pytest.fail(f"{' '.join(args[1:])} failed:\n{result.stdout}\n{result.stderr}")
    yield GoBinaries(mockplugin=out / "mockplugin", e2e=out / "e2e.test", cdischema=out / "cdischema")
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(name="go_sidecar")
def go_sidecar_fixture() -> Iterator[Sidecar]:
    """A started sidecar (h100-80gb:2,a100-40gb:1), not yet recovered: the Go client recovers it."""
    root = Path(tempfile.mkdtemp(prefix="hms"))
    car = Sidecar(root, (), None, "h100-80gb:2,a100-40gb:1")
    car.start()
    yield car
    car.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(name="go_runner")
def go_runner_fixture(go_sidecar: Sidecar, go_binaries: GoBinaries) -> GoRunner:
    return GoRunner(go_sidecar, go_binaries.mockplugin)


def require_kube_binaries(*extra: str) -> None:
    """Skip, or fail under CI, unless ``make kube-binaries`` built etcd and kube-apiserver, and the
    ``extra`` programs (kube-scheduler) (the Go tests against a real API server skip without them,
    and a skipped Go test tested nothing)."""
    go = shutil.which("go")
    gopath = subprocess.run(
        [go or "go", "env", "GOPATH"], capture_output=True, text=True, check=False
    ).stdout.strip()
    missing = [
        name
        for name in ("etcd", "kube-apiserver", *extra)
        if shutil.which(name) is None and not (Path(gopath) / "bin" / name).exists()
    ]
    if missing:
        message = (
            f"{' and '.join(missing)} not built: `make kube-binaries` builds them (about 10 minutes once)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"{message}; .ci/run builds them")
        pytest.skip(message)
