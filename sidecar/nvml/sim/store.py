"""Where the simulated hardware's state lives: in memory (tests) or in a JSON file shared by processes.

Like a real driver shared by the sidecar and ``nvidia-smi``: every access takes a ``flock`` on a lock
file beside the state file around its read-modify-write, so a ``sim`` command and a running sidecar
see each other's changes at their next call. A call reads one small file and writes only when
something changed. Every call is also counted per C function (``CallCounters``).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import msgspec

from sidecar.nvml.sim.procfs import sync_proc, write_proc_static
from sidecar.nvml.sim.state import SimState

# -- where the state lives ----------------------------------------------------------------------------


class StateStore(Protocol):
    """Access to the state under a lock. ``transaction`` writes back only if the state changed.

    ``transaction(call=NAME)`` also counts one call of the C function ``NAME``, under the same lock, so
    a count is never lost to a concurrent caller and always sits beside the state change it caused."""

    proc_root: Path | None

    def transaction(self, call: str | None = None) -> contextlib.AbstractContextManager[SimState]: ...

    def call_counts(self) -> dict[str, int]: ...

    def reset_call_counts(self) -> None: ...

    def add_driver_ns(self, ns: int) -> None: ...

    def driver_ns(self) -> int:
        """Wall-clock nanoseconds spent inside simulated calls since the last reset, summed over
        every process: the part of a decision's latency that stands for the driver (a benchmark
        subtracts it to see the sidecar's own share). Modelled latency (``set_latency``) is not in it."""
        ...


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(SimState)


Layout = tuple[str, tuple[tuple[int, bytes], ...]]  # boot ID, then (minor, encoded GIs) per GPU


def layout_key(state: SimState) -> Layout:
    """What the fake /proc tree depends on; the tree is rewritten only when this changes."""
    return state.boot_id, tuple((g.minor, _ENCODER.encode(g.gis)) for g in state.gpus)


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


class MemoryStore:
    """State in this process only (tests). A re-entrant lock serialises threads."""

    def __init__(self, state: SimState, proc_root: Path | None) -> None:
        self._state = state
        self._lock = threading.RLock()
        self._calls: dict[str, int] = {}
        self._driver_ns = 0
        self.proc_root = proc_root
        self._written: Layout | None = None
        if proc_root is not None:
            write_proc_static(proc_root, state)
            self._sync(state)

    @contextlib.contextmanager
    def transaction(self, call: str | None = None) -> Iterator[SimState]:
        with self._lock:
            if call is not None:
                self._calls[call] = self._calls.get(call, 0) + 1
            yield self._state
            self._sync(self._state)

    def call_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._calls)

    def reset_call_counts(self) -> None:
        with self._lock:
            self._calls.clear()
            self._driver_ns = 0

    def add_driver_ns(self, ns: int) -> None:
        """Call inside a transaction (its lock held)."""
        self._driver_ns += ns

    def driver_ns(self) -> int:
        with self._lock:
            return self._driver_ns

    def _sync(self, state: SimState) -> None:
        if self.proc_root is None:
            return
        layout = layout_key(state)
        sync_changed(self.proc_root, state, self._written, layout)
        self._written = layout


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
        self._slots: dict[str, int] = {}  # name -> offset, re-checked against the file on every use
        self._keys: dict[str, bytes] = {}  # name -> its NUL-padded slot key

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
        key = self._keys.get(name)
        if key is None:
            key = name.encode()
            if not 0 < len(key) <= self.NAME or b"\0" in key:
                raise ValueError(f"cannot count a call of {name!r}: not a C function name")
            key = self._keys[name] = key.ljust(self.NAME, b"\0")
        m = self._mapping()
        offset = self._slots.get(name)
        if offset is None or m[offset : offset + self.NAME] != key:  # first use, or a reset moved it
            offset = self._slot(m, key)
            self._slots[name] = offset
        (count,) = self._U64.unpack_from(m, offset + self.NAME)
        self._U64.pack_into(m, offset + self.NAME, count + 1)

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
            result[name.rstrip(b"\0").decode()] = self._U64.unpack_from(m, offset + self.NAME)[0]
        return result

    def reset(self) -> None:
        m = self._mapping()
        m[self.DRIVER_NS :] = bytes(self.SIZE - self.DRIVER_NS)

    def add_driver_ns(self, ns: int) -> None:
        m = self._mapping()
        (total,) = self._U64.unpack_from(m, self.DRIVER_NS)
        self._U64.pack_into(m, self.DRIVER_NS, total + ns)

    def driver_ns(self) -> int:
        value: int = self._U64.unpack_from(self._mapping(), self.DRIVER_NS)[0]
        return value

    def generation(self) -> int:
        value: int = self._U64.unpack_from(self._mapping(), len(self.MAGIC))[0]
        return value

    def bump_generation(self) -> int:
        value = self.generation() + 1
        self._U64.pack_into(self._mapping(), len(self.MAGIC), value)
        return value


class _Cached(msgspec.Struct, frozen=True):
    """The state as this process last read or wrote it, and how to tell that the file is unchanged."""

    generation: int
    file_id: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns of the state file
    raw: bytes
    state: SimState
    layout: Layout


class FileStore:
    """State in a JSON file shared by processes; ``<file>.lock`` is flocked around every access.

    Writes go to a temp file renamed over the state, so a reader never sees half a file. No fsync:
    the simulated hardware does not need to survive a crash of the host it is simulated on.

    Every simulated NVML call is one transaction, so a transaction is kept cheap without giving up
    the sharing: the lock file stays open (one ``flock`` per transaction, no open/close), and the
    decoded state is kept between transactions and reused only while both the write generation in
    ``<file>.calls`` and the state file's identity (device, inode, size, mtime) are what this process
    last saw, so a change by any other process, or an edit of the file by hand, is read at the next
    call. A transaction that raises drops the kept state: it may have been changed half-way."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._path = os.fspath(path)  # stat on every call: a str spares building the Path's string
        self.lock_path = path.with_name(path.name + ".lock")
        self.proc_root: Path | None = path.with_name(path.name + ".proc")
        self._thread_lock = threading.RLock()
        self._lock_fd: int | None = None
        self._lock_pid = 0
        self._depth = 0
        self._counters = CallCounters(path.with_name(path.name + ".calls"))
        self._cached: _Cached | None = None

    @staticmethod
    def create(path: Path, state: SimState, overwrite: bool = False) -> FileStore:
        store = FileStore(path)
        with store._locked():
            if path.exists() and not overwrite:
                raise FileExistsError(f"simulated hardware state {path} already exists")
            path.parent.mkdir(parents=True, exist_ok=True)
            store._write(_ENCODER.encode(state))
            store._counters.reset()  # new hardware, new counts
            assert store.proc_root is not None
            if store.proc_root.exists():
                shutil.rmtree(store.proc_root)
            write_proc_static(store.proc_root, state)
            sync_proc(store.proc_root, state)
        return store

    def _lock_file(self) -> int:
        """The lock file's descriptor, opened once per process. A forked child opens its own: an
        inherited descriptor shares the parent's flock, which would lock nothing between the two."""
        if self._lock_fd is None or self._lock_pid != os.getpid():
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                self.lock_path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            self._lock_fd, self._lock_pid = fd, os.getpid()
        return self._lock_fd

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Thread lock, then the flock; re-entrant within a thread (the flock is taken once)."""
        with self._thread_lock:
            if self._depth == 0:
                fcntl.flock(self._lock_file(), fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._lock_file(), fcntl.LOCK_UN)

    def _write(self, data: bytes) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(self.path)
        self._counters.bump_generation()

    def _file_id(self) -> tuple[int, int, int, int]:
        try:
            st = os.stat(self._path)  # noqa: PTH116 - once per simulated call: a str, not a Path
        except FileNotFoundError:
            raise FileNotFoundError(f"simulated hardware state {self.path} does not exist") from None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def call_counts(self) -> dict[str, int]:
        with self._locked():
            return self._counters.counts()

    def reset_call_counts(self) -> None:
        with self._locked():
            self._counters.reset()

    def add_driver_ns(self, ns: int) -> None:
        """Call inside a transaction (the flock held)."""
        self._counters.add_driver_ns(ns)

    def driver_ns(self) -> int:
        with self._locked():
            return self._counters.driver_ns()

    def transaction(self, call: str | None = None) -> contextlib.AbstractContextManager[SimState]:
        return _FileTransaction(self, call)

    def _begin(self, call: str | None) -> _Cached:
        """Under the flock (taken by the caller): count ``call``; the state, re-read only if changed."""
        if call is not None:
            self._counters.add(call)
        cached, self._cached = self._cached, None  # restored only if the body finishes cleanly
        generation, file_id = self._counters.generation(), self._file_id()
        if cached is None or (cached.generation, cached.file_id) != (generation, file_id):
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                raise FileNotFoundError(f"simulated hardware state {self.path} does not exist") from None
            state = _DECODER.decode(raw)
            cached = _Cached(generation, file_id, raw, state, layout_key(state))
        return cached

    def _commit(self, cached: _Cached) -> None:
        """Write the state back if the body changed it; keep it for the next transaction."""
        state = cached.state
        encoded = _ENCODER.encode(state)
        if encoded != cached.raw:
            self._write(encoded)
            layout = layout_key(state)
            if layout != cached.layout:
                assert self.proc_root is not None
                sync_changed(self.proc_root, state, cached.layout, layout)
            cached = _Cached(self._counters.generation(), self._file_id(), encoded, state, layout)
        self._cached = cached


class _FileTransaction:
    """``FileStore.transaction`` as a plain context manager: every simulated call makes one, and a
    generator-based one costs as much again as the rest of the transaction."""

    __slots__ = ("_cached", "_call", "_store")

    def __init__(self, store: FileStore, call: str | None) -> None:
        self._store, self._call = store, call
        self._cached: _Cached | None = None

    def __enter__(self) -> SimState:
        store = self._store
        store._thread_lock.acquire()
        try:
            if store._depth == 0:
                fcntl.flock(store._lock_file(), fcntl.LOCK_EX)
            store._depth += 1
            try:
                self._cached = store._begin(self._call)
            except BaseException:
                self._release()
                raise
        except BaseException:
            store._thread_lock.release()
            raise
        return self._cached.state

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:
                assert self._cached is not None
                self._store._commit(self._cached)
        finally:
            self._release()
            self._store._thread_lock.release()

    def _release(self) -> None:
        store = self._store
        store._depth -= 1
        if store._depth == 0:
            fcntl.flock(store._lock_file(), fcntl.LOCK_UN)
