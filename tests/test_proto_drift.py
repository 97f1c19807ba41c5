"""The generated contract code is never edited by hand: regenerating it from the
.proto with ``scripts/gen-proto`` must reproduce the checked-in files byte for byte.

The Go half needs ``protoc-gen-go`` and ``protoc-gen-go-grpc`` (pinned in ``scripts/go-plugins.txt``).
Outside CI it is skipped when they are missing; with ``CI`` set (``.ci/run`` installs them) a missing
plugin is a failure, so drift can never hide behind a skip there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "api" / "hami" / "migsidecar" / "v1"
PYTHON_FILES = ("migsidecar_pb2.py", "migsidecar_pb2.pyi", "migsidecar_pb2_grpc.py")
GO_FILES = ("migsidecar.pb.go", "migsidecar_grpc.pb.go")


def _go_plugins_available() -> bool:
    go = shutil.which("go")
    if go is None:
        return False
    gopath = subprocess.run([go, "env", "GOPATH"], capture_output=True, text=True, check=True).stdout.strip()
    gobin = Path(gopath) / "bin"
    return all(
        shutil.which(name) or (gobin / name).exists() for name in ("protoc-gen-go", "protoc-gen-go-grpc")
    )


def _python_only(out: Path) -> subprocess.CompletedProcess[str]:
    """The Python half of ``scripts/gen-proto`` (same protoc, same flags) for machines without Go."""
    import grpc_tools  # noqa: PLC0415 - a dev dependency, needed only here

    include = Path(grpc_tools.__file__).parent / "_proto"
    return subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "-I", str(include),
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
            "hami/migsidecar/v1/migsidecar.proto",
        ],
        cwd=ROOT / "api",
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def go_available() -> bool:
    available = _go_plugins_available()
    if not available and os.environ.get("CI"):
        pytest.fail("CI is set but go or the protoc-gen-go plugins are missing (.ci/run installs them)")
    return available


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory, go_available: bool) -> Path:
    """Run the real generator once into a fresh directory; returns the directory of the v1 files."""
    out = tmp_path_factory.mktemp("gen")
    if go_available:
        result = subprocess.run(
            [str(ROOT / "scripts" / "gen-proto"), str(out)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable},
            check=False,
        )
    else:
        result = _python_only(out)
    assert result.returncode == 0, f"generation failed:\n{result.stdout}\n{result.stderr}"
    return out / "hami" / "migsidecar" / "v1"


@pytest.mark.parametrize("name", PYTHON_FILES)
def test_checked_in_python_code_matches_the_proto(regenerated: Path, name: str) -> None:
    assert (regenerated / name).exists(), f"gen-proto did not produce {name}"
    assert (regenerated / name).read_bytes() == (GENERATED / name).read_bytes(), (
        f"api/hami/migsidecar/v1/{name} differs from what scripts/gen-proto generates; run scripts/gen-proto"
    )


@pytest.mark.go
@pytest.mark.parametrize("name", GO_FILES)
def test_checked_in_go_code_matches_the_proto(regenerated: Path, go_available: bool, name: str) -> None:
    if not go_available:
        pytest.skip("go and the protoc-gen-go plugins are not installed (scripts/go-plugins.txt)")
    assert (regenerated / name).exists(), f"gen-proto did not produce {name}"
    assert (regenerated / name).read_bytes() == (GENERATED / name).read_bytes(), (
        f"api/hami/migsidecar/v1/{name} differs from what scripts/gen-proto generates; run scripts/gen-proto"
    )
