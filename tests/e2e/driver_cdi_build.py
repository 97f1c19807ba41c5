"""The Go side of the driver-CDI tests, built once per session: the sidecar's ``hami-mig-driver-cdi``
command, the test binary of ``integration/drivercdi`` (its comparison with nvcdi's own spec) and
NVIDIA's ``nvidia-cdi-hook``, which a container runtime runs for the driver spec's hooks."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

MODULE = Path(__file__).resolve().parents[2] / "integration" / "drivercdi"
BUILD_TIMEOUT_S = 900  # a cold build fetches and compiles nvidia-container-toolkit's packages


class DriverCdiBinaries(msgspec.Struct, frozen=True):
    command: Path  # hami-mig-driver-cdi
    compare: Path  # the drivercdi package's test binary
    hook: Path  # NVIDIA's nvidia-cdi-hook at the module's pinned version (a tool of the module)


@pytest.fixture(scope="session")
def driver_cdi_binaries(tmp_path_factory: pytest.TempPathFactory) -> DriverCdiBinaries:
    go = shutil.which("go")
    if go is None:
        pytest.skip("needs the Go toolchain")
    out = tmp_path_factory.mktemp("drivercdi")
    # go-nvml's cgo bindings declare deprecated NVML functions; their warnings are noise here.
    env = {**os.environ, "CGO_ENABLED": "1", "CGO_CFLAGS": "-O2 -Wno-deprecated-declarations"}
    for argv in (
        [go, "build", "-o", str(out / "hami-mig-driver-cdi"), "./cmd/hami-mig-driver-cdi"],
        [go, "test", "-c", "-o", str(out / "drivercdi.test"), "."],
        [
            go,
            "build",
            "-o",
            str(out / "nvidia-cdi-hook"),
            "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook",
        ],
    ):
        built = subprocess.run(
            argv, cwd=MODULE, env=env, capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT_S
        )
        assert built.returncode == 0, built.stderr
    return DriverCdiBinaries(
        command=out / "hami-mig-driver-cdi", compare=out / "drivercdi.test", hook=out / "nvidia-cdi-hook"
    )
