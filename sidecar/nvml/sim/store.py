"""Where the simulated hardware's state lives: in memory (tests) or in a JSON file shared by processes.

Like a real driver shared by the sidecar and ``nvidia-smi``: every access takes a ``flock`` on a lock
file beside the state file around its read-modify-write, so a ``sim`` command and a running sidecar
see each other's changes at their next call. A call reads one small file and writes only when
something changed. Every call is also counted per C function (``CallCounters``).

Two kinds of access: ``transaction`` hands out the mutable state and looks for a change afterwards
(it encodes the whole state and compares); ``query`` hands out the frozen ``StateView`` of the same
state, which nothing can change, so it skips that look. Most simulated calls are queries.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import msgspec

from sidecar.nvml.sim.counters import CallCounters
from sidecar.nvml.sim.procfs import Layout, layout_key, sync_changed, sync_proc, write_proc_static
from sidecar.nvml.sim.state import SimState, StateView, decode_view

# -- where the state lives ----------------------------------------------------------------------------


class Query(Protocol):
    """One query's access to the state, under the store's lock."""

    @property
    def view(self) -> StateView:
        """The state as it is, frozen."""
        ...

    def state(self) -> SimState:
        """The mutable state, for the library's own bookkeeping (a fault's countdown on a query): once
        asked for, the query ends like a transaction, writing back what changed."""
        ...


class StateStore(Protocol):
    """Access to the state under a lock. ``transaction`` writes back only if the state changed;
    ``query`` reads a frozen view and writes nothing unless ``Query.state`` was asked for.

    ``call=NAME`` also counts one call of the C function ``NAME``, under the same lock, so a count is
    never lost to a concurrent caller and always sits beside the state change it caused."""

    proc_root: Path | None

    def transaction(self, call: str | None = None) -> contextlib.AbstractContextManager[SimState]: ...

    def query(self, call: str | None = None) -> contextlib.AbstractContextManager[Query]: ...

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


class MemoryStore:
    """State in this process only (tests). A re-entrant lock serialises threads.

    The view for queries is decoded from the encoded state the first time a query follows a
    transaction; a transaction drops it, whether or not its body finished."""

    def __init__(self, state: SimState, proc_root: Path | None) -> None:
        self._state = state
        self._view: StateView | None = None
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
            self._count(call)
            self._view = None
            yield self._state
            self._sync(self._state)

    def query(self, call: str | None = None) -> contextlib.AbstractContextManager[Query]:
        return _MemoryQuery(self, call)

    def _count(self, call: str | None) -> None:
        if call is not None:
            self._calls[call] = self._calls.get(call, 0) + 1

    def _current_view(self) -> StateView:
        if self._view is None:
            # The first query after a transaction; one whose body raised has not synced /proc yet.
            self._sync(self._state)
            self._view = decode_view(_ENCODER.encode(self._state))
        return self._view

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


class _MemoryQuery:
    __slots__ = ("_call", "_store", "_writing", "view")
    view: StateView

    def __init__(self, store: MemoryStore, call: str | None) -> None:
        self._store, self._call, self._writing = store, call, False

    def __enter__(self) -> _MemoryQuery:
        store = self._store
        store._lock.acquire()
        try:
            store._count(self._call)
            self.view = store._current_view()
        except BaseException:
            store._lock.release()
            raise
        return self

    def state(self) -> SimState:
        self._writing = True
        self._store._view = None
        return self._store._state

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if self._writing and exc_type is None:
                self._store._sync(self._store._state)
        finally:
            self._store._lock.release()


class _Cached:
    """The state as this process last read or wrote it, and how to tell that the file is unchanged.

    ``raw`` is the file's content; the mutable state (with its layout) and the frozen view are decoded
    from it when first asked for, so a process that only queries never decodes the mutable state."""

    __slots__ = ("_layout", "_state", "_view", "file_id", "generation", "raw")

    def __init__(
        self,
        generation: int,
        file_id: tuple[int, int, int, int],  # st_dev, st_ino, st_size, st_mtime_ns of the state file
        raw: bytes,
        state: SimState | None = None,
        layout: Layout | None = None,
    ) -> None:
        self.generation, self.file_id, self.raw = generation, file_id, raw
        self._state, self._layout = state, layout
        self._view: StateView | None = None

    def state(self) -> SimState:
        if self._state is None:
            self._state = _DECODER.decode(self.raw)
            self._layout = layout_key(self._state)  # before any body can change the state
        return self._state

    def layout(self) -> Layout:
        """The layout of ``raw`` (``state`` was asked for first, so it was taken before any change)."""
        assert self._layout is not None
        return self._layout

    def view(self) -> StateView:
        if self._view is None:
            self._view = decode_view(self.raw)
        return self._view


class _Descriptors:
    """A store's open files, apart from the store so that they are closed when it is collected."""

    __slots__ = ("lock", "state")

    def __init__(self) -> None:
        self.lock: int | None = None
        self.state: int | None = None  # the state file as last opened, read or written

    def close(self) -> None:
        for fd in (self.lock, self.state):
            if fd is not None:
                os.close(fd)
        self.lock = self.state = None


_FILE_STORES: weakref.WeakSet[FileStore] = weakref.WeakSet()


def _forget_lock_files() -> None:
    """In a forked child, every store opens its own lock file at its next access: an inherited
    descriptor shares the parent's flock, which would lock nothing between the two. Closing the
    child's copy leaves the parent's lock alone. (The state file's descriptor is only read and
    fstat'ed, which a shared descriptor does as well.)"""
    for store in list(_FILE_STORES):
        fd, store._fds.lock = store._fds.lock, None
        if fd is not None:
            os.close(fd)


os.register_at_fork(after_in_child=_forget_lock_files)


class FileStore:
    """State in a JSON file shared by processes; ``<file>.lock`` is flocked around every access.

    Writes go to a temp file renamed over the state, so a reader never sees half a file. No fsync:
    the simulated hardware does not need to survive a crash of the host it is simulated on.

    Every simulated NVML call is one transaction or query, so each is kept cheap without giving up
    the sharing: the lock file stays open (one ``flock`` per access, no open/close), and the
    file's content is kept between accesses and reused only while both the write generation in
    ``<file>.calls`` and the state file's identity (device, inode, size, mtime) are what this process
    last saw, so a change by any other process, or an edit of the file by hand, is read at the next
    call. The identity comes from an ``fstat`` of the state file kept open, cheaper than a ``stat`` of
    its path: a file renamed over it or deleted leaves the open one with no link, and the path is
    opened again. A transaction that raises drops the kept state: it may have been changed half-way."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._path = os.fspath(path)  # stat on every call: a str spares building the Path's string
        self.lock_path = path.with_name(path.name + ".lock")
        self.proc_root: Path | None = path.with_name(path.name + ".proc")
        self._thread_lock = threading.RLock()
        self._fds = _Descriptors()
        weakref.finalize(self, self._fds.close)
        self._depth = 0
        self._counters = CallCounters(path.with_name(path.name + ".calls"))
        self._cached: _Cached | None = None
        _FILE_STORES.add(self)

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
        """The lock file's descriptor, opened once per process (``_forget_lock_files``)."""
        fd = self._fds.lock
        if fd is None:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:
                self.lock_path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            self._fds.lock = fd
        return fd

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Thread lock, then the flock; re-entrant within a thread (the flock is taken once)."""
        self._acquire()
        try:
            yield
        finally:
            self._release()

    def _acquire(self) -> None:
        self._thread_lock.acquire()
        try:
            if self._depth == 0:
                fcntl.flock(self._lock_file(), fcntl.LOCK_EX)
            self._depth += 1
        except BaseException:
            self._thread_lock.release()
            raise

    def _release(self) -> None:
        try:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._lock_file(), fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _write(self, data: bytes) -> None:
        """Replace the state file with ``data``; the new file is the one kept open from now on."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # as open() does
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            tmp.replace(self.path)
        except BaseException:
            os.close(fd)
            raise
        self._keep_open(fd)
        self._counters.bump_generation()

    def _keep_open(self, fd: int | None) -> None:
        old, self._fds.state = self._fds.state, fd
        if old is not None:
            os.close(old)

    def _file_id(self) -> tuple[int, int, int, int]:
        """Device, inode, size and mtime of the file at the state's path, opened again if the one
        kept open is no longer linked there (replaced or deleted)."""
        fd = self._fds.state
        if fd is not None:
            st = os.fstat(fd)
            if st.st_nlink:
                return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
            self._keep_open(None)
        try:
            fd = os.open(self._path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(f"simulated hardware state {self.path} does not exist") from None
        self._keep_open(fd)
        st = os.fstat(fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def _read(self) -> bytes:
        """The content of the state file kept open (``_file_id`` opened it)."""
        fd = self._fds.state
        assert fd is not None
        chunks, offset = [], 0
        while chunk := os.pread(fd, 1 << 16, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)

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

    def query(self, call: str | None = None) -> contextlib.AbstractContextManager[Query]:
        return _FileQuery(self, call)

    def _begin(self, call: str | None) -> _Cached:
        """Under the flock (taken by the caller): count ``call``; the file's content, re-read only if
        changed. Until the access ends cleanly, nothing is kept (``_end``)."""
        if call is not None:
            self._counters.add(call)
        cached, self._cached = self._cached, None
        generation, file_id = self._counters.generation(), self._file_id()
        if cached is None or cached.generation != generation or cached.file_id != file_id:
            cached = _Cached(generation, file_id, self._read())
        return cached

    def _end(self, cached: _Cached, changed: bool) -> None:
        """After a clean access: write the state back if ``changed`` says it may have changed and it
        did; keep it for the next access."""
        if changed:
            state = cached.state()
            encoded = _ENCODER.encode(state)
            if encoded != cached.raw:
                self._write(encoded)
                layout = layout_key(state)
                if layout != cached.layout():
                    assert self.proc_root is not None
                    sync_changed(self.proc_root, state, cached.layout(), layout)
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
        store._acquire()
        try:
            self._cached = store._begin(self._call)
            return self._cached.state()
        except BaseException:
            store._release()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:
                assert self._cached is not None
                self._store._end(self._cached, changed=True)
        finally:
            self._store._release()


class _FileQuery:
    """``FileStore.query``: the same lock and counting as a transaction; the body gets the frozen
    view, so the state cannot have changed unless ``state`` was asked for."""

    __slots__ = ("_cached", "_call", "_store", "_writing", "view")
    _cached: _Cached
    view: StateView

    def __init__(self, store: FileStore, call: str | None) -> None:
        self._store, self._call, self._writing = store, call, False

    def __enter__(self) -> _FileQuery:
        store = self._store
        store._acquire()
        try:
            self._cached = store._begin(self._call)
            self.view = self._cached.view()
        except BaseException:
            store._release()
            raise
        return self

    def state(self) -> SimState:
        self._writing = True
        return self._cached.state()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:
                self._store._end(self._cached, changed=self._writing)
        finally:
            self._store._release()
