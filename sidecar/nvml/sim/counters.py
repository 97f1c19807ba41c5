"""Calls per C function, the state file's write generation and the time spent inside simulated calls,
in a small fixed table beside the state file that every process maps into memory."""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path


class CallCounters:
    """Calls per C function name in ``<state file>.calls``, shared by every process using that state,
    and the state file's write generation.

    Every simulated call is counted, so a count must not cost a rewrite of the state file: this file
    is a fixed table mapped (``MAP_SHARED``) into each process once, and a count is one 8-byte store
    into the mapping. Callers hold the state's flock, which serialises counting across processes.

    Layout: the 8-byte magic, the uint64 write generation, the uint64 nanoseconds spent inside
    simulated calls (``driver_ns``; zeroed by a reset), then ``SLOTS`` slots of 64 bytes, each a
    NUL-padded C function name (56 bytes) and a count; integers little-endian. A name takes the first
    empty slot the first time it is counted; a reset zeroes the slots. The generation only ever grows
    (a reset leaves it alone): ``FileStore`` bumps it on every state write, and a process whose cached
    state carries the current generation may skip reading and decoding the file. A file of the wrong
    size or magic is re-initialised, never shrunk, so a process that mapped it earlier is never cut
    short."""

    MAGIC = b"HMSCALL3"
    NAME = 56
    SLOT = 64
    SLOTS = 256
    DRIVER_NS = len(MAGIC) + 8
    HEADER = DRIVER_NS + 8
    SIZE = HEADER + SLOT * SLOTS
    _U64 = struct.Struct("<Q")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        # name -> (its NUL-padded slot key, its slot's offset), re-checked against the file on every use
        self._slots: dict[str, tuple[bytes, int]] = {}

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size != self.SIZE or os.pread(fd, len(self.MAGIC), 0) != self.MAGIC:
                    os.pwrite(fd, self.MAGIC + bytes(self.SIZE - len(self.MAGIC)), 0)
                    os.ftruncate(fd, self.SIZE)
                self._map = mmap.mmap(fd, self.SIZE)
            finally:
                os.close(fd)  # the mapping keeps the file open
        return self._map

    def _offsets(self) -> Iterator[int]:
        return iter(range(self.HEADER, self.SIZE, self.SLOT))

    def add(self, name: str) -> None:
        """Count one call of ``name``; once per simulated call, so kept to a few operations."""
        m = self._map if self._map is not None else self._mapping()
        slot = self._slots.get(name)
        if slot is None or m[slot[1] : slot[1] + self.NAME] != slot[0]:  # first use, or a reset moved it
            key = self._key(name)
            slot = self._slots[name] = (key, self._slot(m, key))
        offset = slot[1] + self.NAME
        (count,) = self._U64.unpack_from(m, offset)
        self._U64.pack_into(m, offset, count + 1)

    def _key(self, name: str) -> bytes:
        key = name.encode()
        if not 0 < len(key) <= self.NAME or b"\0" in key:
            raise ValueError(f"cannot count a call of {name!r}: not a C function name")
        return key.ljust(self.NAME, b"\0")

    def _slot(self, m: mmap.mmap, key: bytes) -> int:
        for offset in self._offsets():
            name = m[offset : offset + self.NAME]
            if name == key:
                return offset
            if name[0] == 0:
                m[offset : offset + self.NAME] = key
                self._U64.pack_into(m, offset + self.NAME, 0)
                return offset
        raise RuntimeError(f"{self.path}: more than {self.SLOTS} distinct functions counted")

    def counts(self) -> dict[str, int]:
        m = self._mapping()
        result: dict[str, int] = {}
        for offset in self._offsets():
            name = m[offset : offset + self.NAME]
            if name[0] == 0:
                break
            count = self._U64.unpack_from(m, offset + self.NAME)[0]
            if count:  # a reset keeps the names in their slots, at zero
                result[name.rstrip(b"\0").decode()] = count
        return result

    def reset(self) -> None:
        """Zero the counts and ``driver_ns``. The names stay in their slots, so the next count of a
        function is the one-store fast path of ``add`` in every process, not a search for a slot."""
        m = self._mapping()
        self._U64.pack_into(m, self.DRIVER_NS, 0)
        for offset in self._offsets():
            if m[offset] == 0:
                break
            self._U64.pack_into(m, offset + self.NAME, 0)

    def add_driver_ns(self, ns: int) -> None:
        m = self._map if self._map is not None else self._mapping()
        (total,) = self._U64.unpack_from(m, self.DRIVER_NS)
        self._U64.pack_into(m, self.DRIVER_NS, total + ns)

    def driver_ns(self) -> int:
        value: int = self._U64.unpack_from(self._mapping(), self.DRIVER_NS)[0]
        return value

    def generation(self) -> int:
        m = self._map if self._map is not None else self._mapping()
        value: int = self._U64.unpack_from(m, len(self.MAGIC))[0]
        return value

    def bump_generation(self) -> int:
        value = self.generation() + 1
        self._U64.pack_into(self._mapping(), len(self.MAGIC), value)
        return value
