"""Durable file replacement, shared by the ownership records and the CDI specs.

``atomic_write`` replaces a file so that a crash at any point leaves either the old content or the
new, never a mix: temp file in the same directory, fsync, rename over the target, fsync of the
directory (the rename alone is atomic, not durable).
"""

from __future__ import annotations

import contextlib
import os
import random
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
