"""The CDI device of the node's driver: one spec file, written at startup, named beside every instance.

An instance's spec (``sidecar.store.cdi``) gives a container the instance's device nodes and nothing
else; a process there also needs the driver: ``libcuda.so.1`` and the other libraries, ``nvidia-smi``,
the control nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``), the
``nvidia-cdi-hook`` hooks that link and cache the libraries, and the environment. Those are the same
for every GPU and MIG device of a node (NVIDIA's CDI library, nvcdi, calls them the common edits), so
they live in one spec of a kind of its own, ``<kind>-driver`` (``k8s.hami.io/mig-driver``), as its one
device ``common``, in ``<vendor>-<class>.json`` of the CDI directory. Each answer names that device
once beside the instances': a runtime de-duplicates device nodes and mounts by path across devices
but not hooks, so copying the edits into every instance's spec would run the hooks once per instance.

The spec is built by NVIDIA's library, not here: ``--driver-cdi-command`` (the Go command
``hami-mig-driver-cdi``, shipped in the image) runs nvcdi against ``--driver-root`` and prints the
spec. What it prints is read back and checked before it is written (``check``): its kind and one
device, and the driver's files it names, so a driver root that holds no driver (the wrong
``--driver-root``) fails the start instead of handing out containers without one. The file is
written atomically, like the instances' specs, and only over a file of the same kind; another
writer's file at that name is left alone and the start fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import msgspec

from sidecar.model.errors import StateWriteFailed
from sidecar.store.cdi_format import parse_kind
from sidecar.store.durable import TEMP_MARKER, atomic_write

DEFAULT_COMMAND = "hami-mig-driver-cdi"
DEFAULT_HOOK_PATH = "/usr/bin/nvidia-cdi-hook"
# serve's settings of the driver spec (``sidecar.config`` makes them flags), as ``FlagSpec``'s fields:
# flag, dest, help, default (None: unset), switch, metavar.
FLAGS = (
    ("--driver-cdi-command", "driver_cdi_command",
     "The command that prints the CDI spec of the node's driver (libraries, binaries, control nodes, hooks), "
     "run once at startup; its device's name is handed out beside each instance's. Empty: none (containers "
     "get the instances' device nodes only). Not found on PATH: a warning, and none.",
     DEFAULT_COMMAND, False, "COMMAND"),
    ("--driver-root", "driver_root",
     "Where the node's NVIDIA driver is seen from here: / for a host-installed driver, /run/nvidia/driver "
     "for the GPU Operator's (HAMi's chart value nvidiaDriverRoot). The simulated backend has its own.",
     "/", False, "DIR"),
    ("--host-driver-root", "host_driver_root",
     "--driver-root as the node's container runtime sees it, when this container mounts it elsewhere.",
     None, False, "DIR"),
    ("--nvidia-cdi-hook-path", "nvidia_cdi_hook_path",
     "nvidia-cdi-hook's path on the node, named by the driver spec's hooks (HAMi's chart value "
     "nvidiaHookPath).",
     DEFAULT_HOOK_PATH, False, "PATH"),
)  # fmt: skip
DEVICE_NAME = "common"
KIND_SUFFIX = "-driver"
FILE_MODE = 0o644
DIR_MODE = 0o755
COMMAND_TIMEOUT_S = 120.0  # nvcdi walks the driver root; seconds on a real node, a guard against a hang
# What a container needs to run CUDA and see its GPU; a spec without them is no driver.
REQUIRED_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_LIBCUDA_RE = re.compile(r"libcuda\.so\.[0-9]+\.[0-9.]+")


class DriverSettings(msgspec.Struct, frozen=True):
    """The validated ``FLAGS``."""

    command: str = DEFAULT_COMMAND  # "": no driver spec
    root: Path = Path("/")
    host_root: Path | None = None  # None: ``root``
    hook_path: str = DEFAULT_HOOK_PATH


def settings(
    raw: Mapping[str, str | None], origin: Mapping[str, str], error: type[Exception]
) -> DriverSettings:
    """``FLAGS`` from the resolved text of each and where it came from; ``error`` for a bad one."""
    root = (raw["driver_root"] or "").strip()
    hook = (raw["nvidia_cdi_hook_path"] or "").strip()
    host = (raw["host_driver_root"] or "").strip()
    for dest, value in (("driver_root", root), ("nvidia_cdi_hook_path", hook), ("host_driver_root", host)):
        if (value or dest != "host_driver_root") and not value.startswith("/"):
            raise error(f"{origin[dest]}: {raw[dest]!r} is not an absolute path")
    command = (raw["driver_cdi_command"] or "").strip()
    return DriverSettings(command, Path(root), Path(host) if host else None, hook)


class DriverSpecError(RuntimeError):
    """The driver's CDI spec could not be built, read or written; the message says which and why."""


class _Node(msgspec.Struct):
    path: str


class _Mount(msgspec.Struct, rename="camel"):
    host_path: str
    container_path: str


class _Hook(msgspec.Struct, rename="camel"):
    hook_name: str
    path: str


class _Edits(msgspec.Struct, rename="camel"):
    device_nodes: list[_Node] = msgspec.field(default_factory=list)
    mounts: list[_Mount] = msgspec.field(default_factory=list)
    hooks: list[_Hook] = msgspec.field(default_factory=list)
    env: list[str] = msgspec.field(default_factory=list)


class _Device(msgspec.Struct, rename="camel"):
    name: str
    container_edits: _Edits


class _Spec(msgspec.Struct, rename="camel"):
    cdi_version: str
    kind: str
    devices: list[_Device]


_DECODER = msgspec.json.Decoder(_Spec)


class DriverSummary(msgspec.Struct, frozen=True):
    """What the driver's device gives a container, as ``probe`` and the start log report it."""

    name: str  # the qualified CDI name
    driver_root: str
    libcuda: str  # the host path of libcuda.so.<version>
    device_nodes: tuple[str, ...]
    mounts: int
    hooks: int
    missing_nodes: tuple[str, ...]  # REQUIRED_NODES the spec lacks (nodes nvcdi did not find)


def driver_kind(instance_kind: str) -> str:
    """``k8s.hami.io/mig`` -> ``k8s.hami.io/mig-driver``; ValueError when that breaks the CDI rules."""
    parse_kind(instance_kind + KIND_SUFFIX)
    return instance_kind + KIND_SUFFIX


def spec_path(directory: Path, kind: str) -> Path:
    vendor, cls = parse_kind(kind)
    return directory / f"{vendor}-{cls}.json"


def generate(
    command: str, driver_root: Path, host_driver_root: Path | None, hook_path: str, kind: str
) -> bytes:
    """What ``command`` prints for this driver root; DriverSpecError when it fails."""
    argv = [
        command,
        f"--driver-root={driver_root}",
        f"--host-driver-root={host_driver_root or driver_root}",
        f"--nvidia-cdi-hook-path={hook_path}",
        f"--kind={kind}",
        f"--name={DEVICE_NAME}",
    ]
    try:
        ran = subprocess.run(argv, capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DriverSpecError(f"running {command} failed: {exc}") from exc
    if ran.returncode != 0:
        why = ran.stderr.decode(errors="replace").strip() or f"exit status {ran.returncode}"
        raise DriverSpecError(f"{command} found no driver under {driver_root}: {why}")
    return ran.stdout


def check(data: bytes, kind: str, driver_root: Path, host_driver_root: Path | None) -> DriverSummary:
    """Read the spec back: DriverSpecError unless it is one device of ``kind`` whose mounts include
    the driver's ``libcuda.so.<version>``, present under the driver root as this process sees it."""
    try:
        spec = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise DriverSpecError(f"the driver's CDI spec is not one: {exc}") from exc
    if spec.kind != kind or [d.name for d in spec.devices] != [DEVICE_NAME]:
        names = [d.name for d in spec.devices]
        raise DriverSpecError(f"the driver's CDI spec is of kind {spec.kind!r} with devices {names}")
    edits = spec.devices[0].container_edits
    libcuda = [m.host_path for m in edits.mounts if _LIBCUDA_RE.fullmatch(Path(m.container_path).name)]
    if not libcuda:
        raise DriverSpecError(
            f"the driver's CDI spec mounts no libcuda.so.<version>: no driver under {driver_root}"
        )
    host_root = host_driver_root or driver_root
    seen_here = driver_root / Path(libcuda[0]).relative_to(host_root)
    if not seen_here.is_file():
        raise DriverSpecError(f"the driver's CDI spec names {libcuda[0]}, which is not a file ({seen_here})")
    nodes = tuple(n.path for n in edits.device_nodes)
    return DriverSummary(
        name=f"{kind}={DEVICE_NAME}",
        driver_root=str(driver_root),
        libcuda=libcuda[0],
        device_nodes=nodes,
        mounts=len(edits.mounts),
        hooks=len(edits.hooks),
        missing_nodes=tuple(n for n in REQUIRED_NODES if n not in nodes),
    )


def publish(directory: Path, kind: str, data: bytes) -> Path:
    """Write the checked spec to its file unless it holds these bytes already; return the path.

    StateWriteFailed when the write fails or the file there is another writer's (not of ``kind``)."""
    path = spec_path(directory, kind)
    try:
        current = path.read_bytes()
    except FileNotFoundError:
        current = None
    except OSError as exc:
        raise StateWriteFailed(f"reading CDI spec {path} failed: {exc}", {"file": str(path)}) from exc
    if current == data:
        return path
    if current is not None and _kind_of(current) != kind:
        raise StateWriteFailed(
            f"{path} is not this sidecar's driver spec (not of kind {kind}); it is left untouched",
            {"file": str(path)},
        )
    try:
        directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for leftover in directory.glob(f".{path.name}{TEMP_MARKER}*"):  # a crash inside an earlier write
            leftover.unlink(missing_ok=True)
        atomic_write(path, data, FILE_MODE)
    except OSError as exc:
        raise StateWriteFailed(f"writing CDI spec {path} failed: {exc}", {"file": str(path)}) from exc
    return path


def _kind_of(data: bytes) -> str | None:
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    kind = value.get("kind") if isinstance(value, dict) else None
    return kind if isinstance(kind, str) else None


def find_command(command: str) -> str | None:
    """``command``'s path (a name is looked up on PATH), or None when there is no such executable."""
    if "/" in command:
        return command if os.access(command, os.X_OK) else None
    return shutil.which(command)
