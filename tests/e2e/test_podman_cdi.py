"""A real CDI consumer: podman runs a container with ``--device`` set to the CDI name the sidecar
answered, and the device nodes of the sidecar's spec are inside it.

The spec is the one the sidecar wrote for an instance it created on the simulated node; podman's own
CDI library resolves the name from it (an unknown name is refused), and the OCI runtime makes the
device nodes in the container from the spec's type, major and minor numbers, so no GPU is needed.
The image is built from local files (a static probe binary, ``cdi_probe/``), as no image registry is
reachable. podman reads specs from ``/etc/cdi`` and ``/var/run/cdi`` only, so it runs in a private
mount namespace with a tmpfs on ``/run`` holding a copy of the sidecar's CDI directory: nothing of the
machine changes. Skipped where podman cannot run a container (not root, no podman, or a kernel or
sandbox that refuses it; the reason is printed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_process import Sidecar, allocate_one

pytestmark = [pytest.mark.e2e, pytest.mark.go]

HERE = Path(__file__).resolve().parent
IMAGE = "localhost/hami-mig-sidecar-cdi-probe:test"
RUN_TIMEOUT_S = 180  # a hang guard: podman's first run sets up its storage


def _mode(file_mode: int | None, kind: str) -> str:
    """The mode string Go's FileMode prints for a device node (``Dcrw-rw-rw-``)."""
    bits = 0o666 if file_mode is None else file_mode
    perms = "".join(ch if bits & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return "D" + ("c" if kind == "c" else "") + perms


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The podman command line that can run the probe image here, or a skip saying why not."""
    tool, go = shutil.which("podman"), shutil.which("go")
    if tool is None or go is None or os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root, podman, unshare and go")
    root = tmp_path_factory.mktemp("probe")
    rootfs = root / "rootfs"
    rootfs.mkdir()
    built = subprocess.run(
        [go, "build", "-o", str(rootfs / "probe"), "."],
        cwd=HERE / "cdi_probe", env={**os.environ, "CGO_ENABLED": "0"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    with tarfile.open(root / "rootfs.tar", "w") as tar:
        tar.add(rootfs / "probe", arcname="probe")
    # crun refuses hybrid cgroup hierarchies; runc runs there. Default ulimits above the hard limits
    # of a sandboxed root fail setrlimit, so they are set low.
    conf = root / "containers.conf"
    runtime = 'runtime = "runc"\n' if shutil.which("runc") else ""
    conf.write_text(
        f'[engine]\n{runtime}[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n'
    )
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    imported = subprocess.run(
        [tool, "import", str(root / "rootfs.tar"), IMAGE],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if imported.returncode != 0:
        pytest.skip(f"podman import fails here: {imported.stderr.strip()}")
    command = ["env", f"CONTAINERS_CONF={conf}", tool]
    plain = subprocess.run(
        [*command, "run", "--rm", "--network", "none", IMAGE, "/probe"],
        capture_output=True, text=True, check=False, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    if plain.returncode != 0:
        subprocess.run([tool, "rmi", "-f", IMAGE], capture_output=True, check=False, env=env)
        pytest.skip(f"podman cannot run a container here: {plain.stderr.strip()}")
    yield command
    subprocess.run([tool, "rmi", "-f", IMAGE], capture_output=True, check=False, env=env)


def _run_with_specs(
    podman: list[str], cdi_dir: Path, device: str, paths: list[str]
) -> subprocess.CompletedProcess[str]:
    """``podman run --device DEVICE`` in a private mount namespace whose /run/cdi is a copy of cdi_dir."""
    script = (
        f'set -e; mount -t tmpfs tmpfs /run; mkdir -p /run/cdi; cp "{cdi_dir}"/*.json /run/cdi/; exec "$@"'
    )
    unshare = shutil.which("unshare") or "unshare"
    return subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh",
         *podman, "run", "--rm", "--network", "none", "--device", device, IMAGE, "/probe", *paths],
        capture_output=True, text=True, check=False, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip


def test_podman_injects_the_device_nodes_of_the_spec_the_sidecar_wrote(
    podman: list[str], sidecar: Sidecar
) -> None:
    sidecar.recover()
    device = allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
    assert device.cdi_device.endswith("=" + device.mig_uuid)
    [spec_file] = sidecar.cdi_dir.glob("*.json")
    spec = json.loads(spec_file.read_text())
    [entry] = spec["devices"]
    edits = entry["containerEdits"]
    nodes = edits["deviceNodes"]
    assert any("nvidia-cap" in n["path"] for n in nodes)

    ran = _run_with_specs(podman, sidecar.cdi_dir, device.cdi_device, [n["path"] for n in nodes])
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    for node in nodes:
        assert f"path {node['path']} {_mode(node.get('fileMode'), node.get('type', 'c'))}" in lines
    for variable in edits.get("env", []):
        assert f"env {variable}" in lines

    # The name resolves through the spec, not by luck: one no spec defines is refused.
    unknown = device.cdi_device.rsplit("=", 1)[0] + "=MIG-00000000-0000-0000-0000-000000000000"
    refused = _run_with_specs(podman, sidecar.cdi_dir, unknown, [])
    assert refused.returncode != 0
    assert "unresolvable CDI devices" in refused.stderr
