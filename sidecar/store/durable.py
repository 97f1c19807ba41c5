"""Durable file replacement, shared by the ownership records and the CDI specs.

``atomic_write`` replaces a file so that a crash at any point leaves either the old content or the
new, never a mix: temp file in the same directory, fsync, rename over the target, fsync of the
directory (the rename alone is atomic, not durable). On tmpfs, where the only crash is a process's
death, ``rewrite_in_place`` gives the same guarantee for a small file in one ``pwrite``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import random
import resource
import struct
from pathlib import Path

TEMP_MARKER = ".tmp-"
"""In every temp name (``.<stem>.tmp-<random>``): a dotfile no reader loads, swept on start."""


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable (rename alone is atomic, not durable)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_suffix() -> str:
    """16 random hex digits. Uniqueness is all a temp name needs (``O_EXCL`` refuses a clash), and
    the process's own generator draws them without the system call ``secrets`` makes each time."""
    return f"{random.getrandbits(64):016x}"


def atomic_write(path: Path, data: bytes, mode: int, dir_fd: int | None = None) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory -> fsync -> rename -> fsync dir.

    The temp name ``.<name>.tmp-<random>`` starts with a dot and does not end in ``.json``, so neither
    this module nor a CDI scanner ever reads a half-written file. ``fchmod`` sets ``mode`` exactly,
    whatever the umask. ``dir_fd``, when given, is an open descriptor of ``path``'s directory to fsync
    (a caller that writes there often keeps one instead of opening the directory every time).
    Raises OSError; the temp file is removed on failure. Plain ``os`` calls on strings: on tmpfs,
    building ``Path`` objects costs more than the system calls themselves."""
    target = os.fspath(path)
    directory, name = os.path.split(target)
    stem = name.rsplit(".", 1)[0] if "." in name[1:] else name
    directory = directory or "."
    tmp = f"{directory}/.{stem}{TEMP_MARKER}{_temp_suffix()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)  # noqa: PTH105 - strings on the hot path (see above)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # noqa: PTH108
        raise
    if dir_fd is None:
        fsync_dir(path.parent)
    else:
        os.fsync(dir_fd)


TMPFS_MAGIC = 0x01021994  # linux/magic.h
_STATFS_BYTES = 256  # more than struct statfs on any 64-bit Linux (120 bytes); f_type comes first


def on_tmpfs(directory: Path) -> bool:
    """Whether ``directory`` is on tmpfs (statfs's f_type); False whenever that cannot be told."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(_STATFS_BYTES)
        if libc.statfs(os.fsencode(directory), buf) != 0:
            return False
        (f_type,) = struct.unpack_from("l", buf.raw)
    except (OSError, AttributeError, struct.error):
        return False
    return bool(f_type == TMPFS_MAGIC)


class ShortWriteError(OSError):
    """``rewrite_in_place`` wrote part of the new content: the file is neither old nor new."""


def rewrite_in_place(path: Path, data: bytes, old: bytes) -> bytes | None:
    """Overwrite the file at ``path``, which holds ``old``, from its first byte with ``data`` in one
    ``pwrite``, padded with spaces to the length of ``old`` so that no byte of it is left after the
    new content. Returns the bytes the file now holds; None, writing nothing, when they would pass
    the first page or the process's file-size limit (a write past that limit is cut short).

    Only for a file on tmpfs, and only to replace a whole, sound file (the caller read it): tmpfs
    keeps nothing across a power loss, so a crash there is the death of a process, and a write that
    stays within one page the file already holds is copied whole or not begun when the writer is
    killed (the kernel looks for a fatal signal between pages, not inside one, and needs no memory
    for a page it has). The file is then the old content or the new, as after a rename, in one
    system call instead of seven. The trailing spaces are JSON whitespace: every reader takes them
    as the end of the document. Unlike a rename, a reader in another process that reads during the
    copy can see a mix (``records verify``, which takes no lock). ShortWriteError if the kernel wrote
    part of it all the same."""
    padded = data if len(data) >= len(old) else data + b" " * (len(old) - len(data))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if len(padded) > mmap.PAGESIZE or (limit != resource.RLIM_INFINITY and limit < len(padded)):
        return None
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        written = os.pwrite(fd, padded, 0)
    finally:
        os.close(fd)
    if written != len(padded):
        why = f"short write in place ({written} of {len(padded)} bytes)"
        raise ShortWriteError(errno.EIO, why, str(path))
    return padded
