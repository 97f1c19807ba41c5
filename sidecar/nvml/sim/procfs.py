"""The fake /proc tree of the simulated node: /proc/devices, the MIG capability files, mig-minors and
boot_id, kept in step with the instance layout (CDI generation reads them as on a real node)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec

from sidecar.nvml import profiles
from sidecar.nvml.sim.state import SimState

# -- the fake /proc tree ------------------------------------------------------------------------------

NVIDIA_CAPS_MAJOR = 508
NVIDIA_FRONTEND_MAJOR = 195
NVIDIA_UVM_MAJOR = 509
_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  5 /dev/tty
  5 /dev/console
 10 misc
136 pts
{frontend} nvidia-frontend
226 drm
{caps} nvidia-caps
{uvm} nvidia-uvm

Block devices:
  7 loop
  8 sd
259 blkext
"""
ACCESS_MODE = 292  # 0444: access capabilities are readable by everyone
CONFIG_MODE = 256  # 0400: creating/destroying instances is for root only


def _cap_file(minor: int, mode: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def _atomic_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_proc_static(root: Path, state: SimState) -> None:
    """Files that do not follow the instance layout: /proc/devices, mig/config and monitor, mig-minors."""
    _atomic_text(
        root / "devices",
        _DEVICES.format(caps=NVIDIA_CAPS_MAJOR, frontend=NVIDIA_FRONTEND_MAJOR, uvm=NVIDIA_UVM_MAJOR),
    )
    caps = root / "driver" / "nvidia" / "capabilities"
    _atomic_text(caps / "mig" / "config", _cap_file(1, CONFIG_MODE))
    _atomic_text(caps / "mig" / "monitor", _cap_file(2, ACCESS_MODE))
    lines = ["config 1", "monitor 2"]
    for g in range(32):
        for i in range(15):
            lines.append(f"gpu{g}/gi{i}/access {profiles.gi_access_minor(g, i)}")
            lines.extend(f"gpu{g}/gi{i}/ci{c}/access {profiles.ci_access_minor(g, i, c)}" for c in range(8))
    _atomic_text(root / "driver" / "nvidia-caps" / "mig-minors", "\n".join(lines) + "\n")


def _write_if_changed(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            return
    except FileNotFoundError:
        pass
    _atomic_text(path, text)


def sync_proc(root: Path, state: SimState, only: set[int] | None = None) -> None:
    """Make the per-instance access files and boot_id match the state (create, update, remove).

    Runs after every create or destroy, so it only writes what differs: an unchanged file is read,
    not rewritten. ``only``: the indices of the GPUs whose instances changed (their minors did not);
    the other GPUs' files are left as they are."""
    _write_if_changed(root / "sys" / "kernel" / "random" / "boot_id", state.boot_id + "\n")
    caps = root / "driver" / "nvidia" / "capabilities"
    gpus = state.gpus if only is None else [g for g in state.gpus if g.index in only]
    wanted: dict[Path, str] = {}
    for gpu in gpus:
        mig = caps / f"gpu{gpu.minor}" / "mig"
        mig.mkdir(parents=True, exist_ok=True)
        for gi in gpu.gis:
            gi_dir = mig / f"gi{gi.id}"
            wanted[gi_dir / "access"] = _cap_file(profiles.gi_access_minor(gpu.minor, gi.id), ACCESS_MODE)
            for ci in gi.cis:
                text = _cap_file(profiles.ci_access_minor(gpu.minor, gi.id, ci.id), ACCESS_MODE)
                wanted[gi_dir / f"ci{ci.id}" / "access"] = text
    gpu_dirs = caps.glob("gpu*") if only is None else [caps / f"gpu{g.minor}" for g in gpus]
    for gpu_dir in gpu_dirs:
        for gi_dir in (gpu_dir / "mig").glob("gi*"):
            if gi_dir / "access" not in wanted:
                shutil.rmtree(gi_dir, ignore_errors=True)
                continue
            for ci_dir in gi_dir.glob("ci*"):
                if ci_dir / "access" not in wanted:
                    shutil.rmtree(ci_dir, ignore_errors=True)
    for path, text in wanted.items():
        _write_if_changed(path, text)


# -- when to sync -------------------------------------------------------------------------------------

_GIS_ENCODER = msgspec.json.Encoder()

Layout = tuple[str, tuple[tuple[int, bytes], ...]]  # boot ID, then (minor, encoded GIs) per GPU


def layout_key(state: SimState) -> Layout:
    """What the fake /proc tree depends on; the tree is rewritten only when this changes."""
    return state.boot_id, tuple((g.minor, _GIS_ENCODER.encode(g.gis)) for g in state.gpus)


def sync_changed(root: Path, state: SimState, before: Layout | None, after: Layout) -> None:
    """Bring the fake /proc tree from ``before`` to ``after``: only the GPUs whose instances changed,
    unless the boot, the GPU count or a minor number changed (then every GPU)."""
    if before == after:
        return
    if before is None or before[0] != after[0] or [m for m, _ in before[1]] != [m for m, _ in after[1]]:
        sync_proc(root, state)
        return
    pairs = zip(state.gpus, before[1], after[1], strict=True)
    sync_proc(root, state, only={gpu.index for gpu, old, new in pairs if old != new})
