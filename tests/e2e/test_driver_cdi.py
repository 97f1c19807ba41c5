"""The driver's CDI device: what a container needs beside an instance's device nodes.

The sidecar runs ``hami-mig-driver-cdi`` (NVIDIA's nvcdi over the driver root; the simulated node's
is a fake one with library stubs) at startup, writes its spec, and names its device in every Allocate
answer. The comparison with nvcdi's own spec for the same MIG device runs in
``integration/drivercdi`` (``TestWhatTheSidecarHandsOutIsWhatNvcdiGives``), driven from here against
this sidecar; it needs root (device nodes in the fake driver root, a private mount namespace where
``/proc/devices`` and ``/proc/driver/nvidia-caps/mig-minors`` are the simulated node's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from driver_cdi_build import DriverCdiBinaries, driver_cdi_binaries
from hami.migsidecar.v1 import migsidecar_pb2 as pb
from sidecar_process import CALL_TIMEOUT_S, Sidecar, SidecarFactory, allocate_one, gpu_uuid

pytestmark = [pytest.mark.e2e, pytest.mark.go, pytest.mark.xdist_group("go")]
__all__ = ["driver_cdi_binaries"]

DRIVER_DEVICE = "k8s.hami.io/mig-driver=common"
HOOK_PATH = "/usr/bin/nvidia-cdi-hook"
COMPARE_TIMEOUT_S = 120
COMPARE_TEST = "TestWhatTheSidecarHandsOutIsWhatNvcdiGives"


def _with_driver(factory: SidecarFactory, binaries: DriverCdiBinaries) -> Sidecar:
    return factory(
        extra_args=["--driver-cdi-command", str(binaries.command), "--nvidia-cdi-hook-path", HOOK_PATH]
    )


def _driver_root(car: Sidecar) -> Path:
    return car.sim_state.with_name(car.sim_state.name + ".driver")


def _edits(path: Path) -> dict[str, Any]:
    spec = json.loads(path.read_text())
    [device] = spec["devices"]
    edits: dict[str, Any] = device["containerEdits"]
    return edits


def test_the_driver_spec_holds_what_nvcdi_finds_under_the_simulated_driver_root(
    sidecar_factory: SidecarFactory, driver_cdi_binaries: DriverCdiBinaries
) -> None:
    car = _with_driver(sidecar_factory, driver_cdi_binaries)
    spec_file = car.cdi_dir / "k8s.hami.io-mig-driver.json"
    spec = json.loads(spec_file.read_text())
    assert (spec["kind"], [d["name"] for d in spec["devices"]]) == ("k8s.hami.io/mig-driver", ["common"])
    edits = _edits(spec_file)
    root = _driver_root(car)
    mounted = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    libcuda = "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06"
    assert mounted[libcuda] == f"{root}{libcuda}"
    assert mounted["/usr/bin/nvidia-smi"] == f"{root}/usr/bin/nvidia-smi"
    # libcuda.so -> libcuda.so.1 (read from the stub's SONAME); ldconfig in the update-ldcache hook
    # makes libcuda.so.1 -> libcuda.so.580.65.06 in the container.
    links = [h["args"] for h in edits["hooks"] if "create-symlinks" in h["args"]]
    assert any("libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so" in args for args in links), links
    ldcache = [h["args"] for h in edits["hooks"] if "update-ldcache" in h["args"]]
    assert ldcache == [["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"]]
    assert all(h["path"] == HOOK_PATH for h in edits["hooks"])
    assert "NVIDIA_VISIBLE_DEVICES=void" in edits["env"]
    if os.geteuid() == 0:  # the control nodes are character devices, which only root can make
        nodes = {n["path"] for n in edits["deviceNodes"]}
        assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= nodes


def test_every_allocate_answer_names_the_driver_device_once_for_new_and_reused_instances(
    sidecar_factory: SidecarFactory, driver_cdi_binaries: DriverCdiBinaries
) -> None:
    car = _with_driver(sidecar_factory, driver_cdi_binaries)
    car.recover()
    gpu = gpu_uuid(car, 0)
    two = pb.AllocateRequest(
        pod=pb.PodRef(uid="pod-a", namespace="default", name="pod-a"),
        container_name="main",
        container_index=0,
        devices=[
            pb.DeviceRequest(
                device_index=0, gpu_uuid=gpu, profile="1g.10gb", placement=pb.Placement(start=0, size=1)
            ),
            pb.DeviceRequest(
                device_index=1, gpu_uuid=gpu, profile="1g.10gb", placement=pb.Placement(start=1, size=1)
            ),
        ],
    )
    created = car.stub.Allocate(two, timeout=CALL_TIMEOUT_S)
    assert [d.outcome for d in created.devices] == [pb.CREATED, pb.CREATED]
    assert list(created.driver_cdi_devices) == [DRIVER_DEVICE]  # once for the container, not per device

    car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=CALL_TIMEOUT_S)
    reused = allocate_one(car, "pod-b", 0, "1g.10gb", 0, 1)
    assert reused.outcome == pb.REUSED
    again = car.stub.Allocate(
        pb.AllocateRequest(
            pod=pb.PodRef(uid="pod-b", namespace="default", name="pod-b"),
            container_name="main",
            container_index=0,
            devices=[pb.DeviceRequest(device_index=0, gpu_uuid=gpu, profile="1g.10gb",
                                      placement=pb.Placement(start=0, size=1))],
        ),
        timeout=CALL_TIMEOUT_S,
    )  # fmt: skip
    assert again.devices[0].outcome == pb.ALREADY_ALLOCATED
    assert list(again.driver_cdi_devices) == [DRIVER_DEVICE]


def test_without_the_command_the_sidecar_names_no_driver_device(sidecar: Sidecar) -> None:
    sidecar.recover()
    allocate_one(sidecar, "pod-a", 0, "1g.10gb", 0, 1)
    answer = sidecar.stub.Allocate(
        pb.AllocateRequest(
            pod=pb.PodRef(uid="pod-a", namespace="default", name="pod-a"),
            container_name="main",
            container_index=0,
            devices=[pb.DeviceRequest(device_index=0, gpu_uuid=gpu_uuid(sidecar, 0), profile="1g.10gb",
                                      placement=pb.Placement(start=0, size=1))],
        ),
        timeout=CALL_TIMEOUT_S,
    )  # fmt: skip
    assert list(answer.driver_cdi_devices) == []
    assert not (sidecar.cdi_dir / "k8s.hami.io-mig-driver.json").exists()


def test_a_driver_spec_that_names_no_driver_fails_the_start(
    sidecar_factory: SidecarFactory, tmp_path: Path
) -> None:
    """What the command prints is read back, not trusted: a spec without libcuda is no driver."""
    command = tmp_path / "no-driver"
    edits = {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}
    empty = {
        "cdiVersion": "0.5.0",
        "kind": "k8s.hami.io/mig-driver",
        "devices": [{"name": "common", "containerEdits": edits}],
    }
    command.write_text(f"#!/bin/sh\necho '{json.dumps(empty)}'\n")
    command.chmod(0o755)
    car = sidecar_factory(extra_args=["--driver-cdi-command", str(command)], start=False)
    ran = subprocess.run(car.command(), capture_output=True, text=True, check=False, timeout=60)
    assert ran.returncode != 0
    assert "cannot publish the driver's CDI spec" in ran.stderr
    assert "mounts no libcuda.so.<version>" in ran.stderr
    assert not (car.cdi_dir / "k8s.hami.io-mig-driver.json").exists()


@pytest.mark.parametrize("reuse", [False, True], ids=["new", "reused-idle"])
def test_a_container_gets_from_the_sidecars_names_what_nvcdi_gives_the_same_mig_device(
    sidecar_factory: SidecarFactory, driver_cdi_binaries: DriverCdiBinaries, reuse: bool
) -> None:
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare (device nodes in the driver root, a private mount namespace)")
    car = _with_driver(sidecar_factory, driver_cdi_binaries)
    car.recover()
    device = allocate_one(car, "pod-a", 0, "1g.10gb", 3, 1)
    if reuse:
        car.stub.Release(pb.ReleaseRequest(pod_uid="pod-a"), timeout=CALL_TIMEOUT_S)
        device = allocate_one(car, "pod-b", 0, "1g.10gb", 3, 1)
        assert device.outcome == pb.REUSED
    names = [device.cdi_device, DRIVER_DEVICE]
    gpu_minor = 0
    proc = car.sim_state.with_name(car.sim_state.name + ".proc")
    root = _driver_root(car)
    caps = proc / "driver" / "nvidia" / "capabilities" / f"gpu{gpu_minor}" / "mig"
    gi_dir = caps / f"gi{device.gpu_instance_id}"
    # On a node, nvidia-modprobe makes an instance's capability nodes; nvcdi takes only nodes it finds.
    for access in (gi_dir / "access", gi_dir / f"ci{device.compute_instance_id}" / "access"):
        minor = int(access.read_text().split("DeviceFileMinor:")[1].split()[0])
        node = root / "dev" / "nvidia-caps" / f"nvidia-cap{minor}"
        node.parent.mkdir(parents=True, exist_ok=True)
        if not node.exists():
            os.mknod(node, 0o020444, os.makedev(508, minor))
    mig = f"{device.mig_uuid}:{gpu_minor}:{device.gpu_instance_id}:{device.compute_instance_id}:3:1"
    script = (
        'set -e; mount --bind "$SIM_PROC/devices" /proc/devices; mount -t tmpfs tmpfs /proc/driver; '
        "mkdir -p /proc/driver/nvidia-caps; "
        'cp "$SIM_PROC/driver/nvidia-caps/mig-minors" /proc/driver/nvidia-caps/; exec "$@"'
    )
    env = {
        **os.environ,
        "SIM_PROC": str(proc),
        "DRIVERCDI_SIDECAR_CDI_DIR": str(car.cdi_dir),
        "DRIVERCDI_SIDECAR_NAMES": ",".join(names),
        "DRIVERCDI_DRIVER_ROOT": str(root),
        "DRIVERCDI_HOOK_PATH": HOOK_PATH,
        "DRIVERCDI_MIG": mig,
    }
    ran = subprocess.run(
        [unshare, "-m", "--propagation", "private", "sh", "-c", script, "sh",
         str(driver_cdi_binaries.compare), "-test.run", COMPARE_TEST, "-test.v"],
        env=env, capture_output=True, text=True, check=False, timeout=COMPARE_TIMEOUT_S,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert f"--- PASS: {COMPARE_TEST}" in ran.stdout
