"""A real CDI consumer: podman runs a container with ``--device`` set to the CDI names the sidecar
answered, and the device nodes of the sidecar's spec are inside it; with the driver's name beside the
instance's, so are the simulated node's ``nvidia-smi`` and ``libcuda.so.1``.

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
from driver_cdi_build import DriverCdiBinaries, driver_cdi_binaries
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory, allocate_one, gpu_uuid

pytestmark = [pytest.mark.e2e, pytest.mark.go]
__all__ = ["driver_cdi_binaries"]

HERE = Path(__file__).resolve().parent
IMAGE = "localhost/hami-mig-sidecar-cdi-probe:test"
RUN_TIMEOUT_S = 180  # a hang guard: podman's first run sets up its storage


def allocate_answer(  # noqa: PLR0917 - reads like the reservation it requests
    car: Sidecar, pod: str, gpu: int, profile: str, start: int, size: int
) -> pb.AllocateResponse:
    """The whole Allocate answer for one device (``allocate_one`` returns the device alone)."""
    request = pb.AllocateRequest(
        pod=pb.PodRef(uid=pod, namespace="default", name=pod),
        container_name="main",
        container_index=0,
        devices=[pb.DeviceRequest(device_index=0, gpu_uuid=gpu_uuid(car, gpu), profile=profile,
                                  placement=pb.Placement(start=start, size=size))],
    )  # fmt: skip
    answer: pb.AllocateResponse = car.stub.Allocate(request, timeout=CALL_TIMEOUT_S)
    return answer


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
    podman: list[str], cdi_dir: Path, device: str | list[str], paths: list[str]
) -> subprocess.CompletedProcess[str]:
    """``podman run --device DEVICE...`` in a private mount namespace whose /run/cdi is a copy of cdi_dir."""
    devices = [device] if isinstance(device, str) else device
    script = (
        f'set -e; mount -t tmpfs tmpfs /run; mkdir -p /run/cdi; cp "{cdi_dir}"/*.json /run/cdi/; exec "$@"'
    )
    unshare = shutil.which("unshare") or "unshare"
    return subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh",
         *podman, "run", "--rm", "--network", "none", *(f"--device={d}" for d in devices),
         IMAGE, "/probe", *paths],
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


def test_podman_gives_the_container_the_driver_through_the_names_the_sidecar_answered(
    podman: list[str], sidecar_factory: SidecarFactory, driver_cdi_binaries: DriverCdiBinaries
) -> None:
    """The instance's name and the driver's, as an Allocate answers them: the container gets the
    simulated node's ``nvidia-smi``, the driver's ``libcuda.so`` with ``libcuda.so.1`` linked by the
    spec's hooks (NVIDIA's ``nvidia-cdi-hook``, run by the runtime), and the control nodes."""
    car = sidecar_factory(
        extra_args=["--driver-cdi-command", str(driver_cdi_binaries.command),
                    "--nvidia-cdi-hook-path", str(driver_cdi_binaries.hook)]
    )  # fmt: skip
    car.recover()
    answer = allocate_answer(car, "pod-a", 0, "1g.10gb", 0, 1)
    [device] = answer.devices
    names = [device.cdi_device, *answer.driver_cdi_devices]
    assert len(names) == 2
    lib = "/usr/lib/x86_64-linux-gnu"
    paths = [
        f"{lib}/libcuda.so.1", f"{lib}/libcuda.so", f"{lib}/libcuda.so.580.65.06", "/usr/bin/nvidia-smi",
        "/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
    ]  # fmt: skip
    ran = _run_with_specs(podman, car.cdi_dir, names, paths)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert f"link {lib}/libcuda.so.1 libcuda.so.580.65.06" in lines, lines
    assert f"link {lib}/libcuda.so libcuda.so.1" in lines, lines
    assert not [line for line in lines if line.startswith("missing")], lines
    assert "env NVIDIA_VISIBLE_DEVICES=void" in lines

    # The instance's name alone gives its device nodes and no driver: what the issue measured.
    alone = _run_with_specs(podman, car.cdi_dir, device.cdi_device, paths)
    assert alone.returncode == 0, alone.stderr
    assert f"missing {lib}/libcuda.so.1" in alone.stdout.splitlines()
    assert "missing /usr/bin/nvidia-smi" in alone.stdout.splitlines()
