"""Durable file replacement: the one write path of record and CDI files (style habits 6-8)."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

TEMP_MARKER = ".tmp-"
"""Marks ``atomic_write``'s temp files: ``.<name>.tmp-<random>`` never ends in ``.json``."""


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in ``directory`` durable (rename alone is atomic, not durable)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory -> fsync -> rename -> fsync dir.

    The temp name ``.<name>.tmp-<random>`` starts with a dot and does not end in ``.json``, so neither
    this module nor a CDI scanner ever reads a half-written file. ``fchmod`` sets ``mode`` exactly,
    whatever the umask. Raises OSError; the temp file is removed on failure."""
    tmp = path.with_name(f".{path.stem}{TEMP_MARKER}{secrets.token_hex(8)}")
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
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
