"""The fake driver root of the simulated node: what a host-installed NVIDIA driver puts on a node, as
files NVIDIA's CDI library (nvcdi) finds and a container runtime mounts, with nothing that runs.

- The driver's libraries in ``usr/lib/x86_64-linux-gnu``, each ``lib<name>.so.<driver version>`` (the
  version the simulated NVML reports): ELF shared objects with the real SONAME and no code. nvcdi reads
  each library's SONAME to make the ``libcuda.so.1 -> libcuda.so.<version>`` links of its
  ``create-symlinks`` hook; an empty file would lose them. They are written here rather than built
  with a compiler so that the simulator needs none.
- ``nvidia-smi`` and the other binaries nvcdi looks for in ``usr/bin``: executable shell scripts.
- The GSP firmware files in ``lib/firmware/nvidia/<version>``.
- The device nodes in ``dev``: ``nvidiactl``, ``nvidia-modeset``, ``nvidia<minor>`` per GPU (the
  ``nvidia-frontend`` major of the fake ``/proc/devices``), ``nvidia-uvm`` and ``nvidia-uvm-tools``
  (its ``nvidia-uvm`` major). nvcdi takes only character devices, which only root can make; as
  anyone else they are left out (``build`` says which), and a container gets no control node from
  the driver's CDI device.

``build`` is idempotent and rewrites nothing that is already right.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
from collections.abc import Iterable
from pathlib import Path

from sidecar.nvml.sim.cabi import DRIVER_VERSION
from sidecar.nvml.sim.procfs import NVIDIA_FRONTEND_MAJOR, NVIDIA_UVM_MAJOR

LIBRARY_DIR = "usr/lib/x86_64-linux-gnu"
BINARY_DIR = "usr/bin"
# lib<name>.so.<version> -> its SONAME, as the driver ships them (a subset: the compute and NVML ones).
LIBRARIES = {
    "libcuda.so": "libcuda.so.1",
    "libcudadebugger.so": "libcudadebugger.so.1",
    "libnvidia-ml.so": "libnvidia-ml.so.1",
    "libnvidia-nvvm.so": "libnvidia-nvvm.so.4",
    "libnvidia-ptxjitcompiler.so": "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-opencl.so": "libnvidia-opencl.so.1",
    "libnvidia-cfg.so": "libnvidia-cfg.so.1",
    "libnvidia-allocator.so": "libnvidia-allocator.so.1",
}
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
NVIDIACTL_MINOR = 255
NVIDIA_MODESET_MINOR = 254


def elf_stub(soname: str) -> bytes:
    """A 64-bit little-endian x86-64 ELF shared object whose only content is its SONAME.

    One PT_LOAD over the file (addresses equal file offsets) and a PT_DYNAMIC, plus the sections
    ``.dynstr``, ``.dynamic`` and ``.shstrtab``: the program headers are what the dynamic loader and
    ``ldconfig`` read, the sections what Go's ``debug/elf`` (nvcdi) reads."""
    ehsize, phentsize, shentsize = 64, 56, 64
    dynstr = b"\0" + soname.encode() + b"\0"
    shstrtab = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    dynstr_off = ehsize + 2 * phentsize
    dynamic_off = _align(dynstr_off + len(dynstr), 8)
    dt_soname, dt_strtab, dt_strsz = 14, 5, 10
    dynamic = struct.pack("<4qQqQ", dt_soname, 1, dt_strtab, dynstr_off, dt_strsz, len(dynstr), 0) + b"\0" * 8
    shstrtab_off = dynamic_off + len(dynamic)
    shoff = _align(shstrtab_off + len(shstrtab), 8)
    size = shoff + 4 * shentsize
    pt_load, pt_dynamic, pf_r, pf_w = 1, 2, 4, 2
    header = struct.pack(
        "<4sBBBBB7sHHIQQQIHHHHHH",
        b"\x7fELF", 2, 1, 1, 0, 0, b"\0" * 7,  # ELFCLASS64, little-endian, version 1, System V ABI
        3, 62, 1,  # ET_DYN, EM_X86_64, EV_CURRENT
        0, ehsize, shoff, 0, ehsize, phentsize, 2, shentsize, 4, 3,
    )  # fmt: skip
    programs = struct.pack("<IIQQQQQQ", pt_load, pf_r | pf_w, 0, 0, 0, size, size, 0x1000) + struct.pack(
        "<IIQQQQQQ",
        pt_dynamic,
        pf_r | pf_w,
        dynamic_off,
        dynamic_off,
        dynamic_off,
        len(dynamic),
        len(dynamic),
        8,
    )
    sht_strtab, sht_dynamic, shf_write, shf_alloc = 3, 6, 1, 2
    sections = b"\0" * shentsize + b"".join(
        struct.pack("<IIQQQQIIQQ", name, kind, flags, offset, offset, length, link, 0, align, entsize)
        for name, kind, flags, offset, length, link, align, entsize in (
            (1, sht_strtab, shf_alloc, dynstr_off, len(dynstr), 0, 1, 0),
            (9, sht_dynamic, shf_write | shf_alloc, dynamic_off, len(dynamic), 1, 8, 16),
            (18, sht_strtab, 0, shstrtab_off, len(shstrtab), 0, 1, 0),
        )
    )
    body = bytearray(size - len(sections))
    body[: len(header)] = header
    body[ehsize : ehsize + len(programs)] = programs
    body[dynstr_off : dynstr_off + len(dynstr)] = dynstr
    body[dynamic_off : dynamic_off + len(dynamic)] = dynamic
    body[shstrtab_off : shstrtab_off + len(shstrtab)] = shstrtab
    return bytes(body) + sections


def build(root: Path, gpu_minors: Iterable[int], version: str = DRIVER_VERSION) -> list[str]:
    """Make (or complete) the fake driver root at ``root``; return the device nodes it could not make."""
    for name, soname in LIBRARIES.items():
        _write(root / LIBRARY_DIR / f"{name}.{version}", elf_stub(soname), 0o755)
    for binary in BINARIES:
        _write(root / BINARY_DIR / binary, f"#!/bin/sh\necho '{binary} (simulated node)'\n".encode(), 0o755)
    for firmware in FIRMWARE:
        _write(root / "lib" / "firmware" / "nvidia" / version / firmware, b"", 0o644)
    nodes = {
        "nvidiactl": (NVIDIA_FRONTEND_MAJOR, NVIDIACTL_MINOR),
        "nvidia-modeset": (NVIDIA_FRONTEND_MAJOR, NVIDIA_MODESET_MINOR),
        "nvidia-uvm": (NVIDIA_UVM_MAJOR, 0),
        "nvidia-uvm-tools": (NVIDIA_UVM_MAJOR, 1),
    }
    nodes.update({f"nvidia{minor}": (NVIDIA_FRONTEND_MAJOR, minor) for minor in gpu_minors})
    missing = []
    for name, (major, minor) in sorted(nodes.items()):
        if not _char_device(root / "dev" / name, major, minor):
            missing.append(f"/dev/{name}")
    return missing


def _align(offset: int, to: int) -> int:
    return (offset + to - 1) // to * to


def _write(path: Path, data: bytes, mode: int) -> None:
    try:
        if path.read_bytes() == data and stat.S_IMODE(path.stat().st_mode) == mode:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    tmp.replace(path)


def _char_device(path: Path, major: int, minor: int) -> bool:
    """Make ``path`` the character device (major, minor) unless it is; False when that is not allowed."""
    try:
        info = os.lstat(path)
        if stat.S_ISCHR(info.st_mode) and info.st_rdev == os.makedev(major, minor):
            return True
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    except PermissionError:
        return False
    with contextlib.suppress(OSError):
        path.chmod(0o666)
    return True
