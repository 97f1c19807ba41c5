"""The state of the simulated hardware, where it lives, and the rules that change it.

The state is *the hardware*: GPUs with their MIG mode, GPU instances, compute instances, MIG UUIDs,
plus the operator's knobs (busy markers, injected faults, lost GPUs, latency). It lives either in
memory (tests) or in a JSON file that several processes share, like a real driver shared by the
sidecar and ``nvidia-smi``: every access takes a ``flock`` on a lock file beside the state file around
its read-modify-write, so a ``sim`` command and a running sidecar see each other's changes at their
next call. A call reads one small file and writes only when something changed.

The rules (``create_gi``, ``destroy_gi`` …) are plain functions over the state that raise
``SimError(code)`` with the ``nvmlReturn_t`` a real driver returns; the library in ``simulated`` turns
them into C-style return codes, and the Python test knobs share them, so an instance created by a
knob obeys the same placement and overlap rules as one created through NVML.

The state structs are mutable on purpose: they are the machine, changed in place under the lock and
encoded whole; values handed out to callers (``layout``) are frozen copies.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import msgspec

from sidecar.nvml import profiles
from sidecar.nvml.port import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
)

STATE_VERSION = 1
# A namespace for MIG UUIDs: version-5 UUIDs like the ones real R470+ drivers print.
_MIG_NAMESPACE = uuid.UUID("6f1b7c2e-3d4a-5b6c-8d9e-0a1b2c3d4e5f")


class SimError(Exception):
    """A simulated NVML failure: ``code`` is the nvmlReturn_t the call returns."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (nvml code {code})")
        self.code = code
        self.message = message


class SimCi(msgspec.Struct):
    id: int
    profile_id: int
    start: int  # compute slices inside the GI
    size: int
    mig_uuid: str
    serial: int


class SimGi(msgspec.Struct):
    id: int
    profile_id: int
    start: int  # memory slices
    size: int
    serial: int
    cis: list[SimCi] = msgspec.field(default_factory=list)


class SimGpu(msgspec.Struct):
    index: int
    uuid: str
    model: str  # profiles.MODELS key
    minor: int
    mig_current: bool
    mig_pending: bool
    lost: bool = False
    gis: list[SimGi] = msgspec.field(default_factory=list)


class SimFault(msgspec.Struct):
    """Fail matching calls with ``code``: skip ``after`` matching calls, then fail ``times`` of them."""

    op: str  # a C function name, an alias (create-gi …) or "any"
    code: int
    after: int = 0
    times: int = 1


class SimState(msgspec.Struct):
    version: int = STATE_VERSION
    boot_id: str = ""
    next_serial: int = 1
    gpus: list[SimGpu] = msgspec.field(default_factory=list)
    busy: list[str] = msgspec.field(default_factory=list)  # MIG or GPU UUIDs with a running process
    faults: list[SimFault] = msgspec.field(default_factory=list)
    latency: dict[str, float] = msgspec.field(default_factory=dict)  # op (name or alias) -> seconds


# -- building and numbering ---------------------------------------------------------------------------


def new_state(gpus: list[tuple[str, int]], mig_enabled: bool = True) -> SimState:
    """A freshly booted node: GPUs in the given order, minor = index, no instances."""
    state = SimState(boot_id=str(uuid.uuid4()))
    for key, count in gpus:
        m = profiles.model(key)
        for _ in range(count):
            index = len(state.gpus)
            state.gpus.append(
                SimGpu(
                    index=index,
                    uuid=f"GPU-{uuid.uuid4()}",
                    model=m.key,
                    minor=index,
                    mig_current=mig_enabled,
                    mig_pending=mig_enabled,
                )
            )
    return state


def take_serial(state: SimState) -> int:
    serial = state.next_serial
    state.next_serial += 1
    return serial


def model_of(gpu: SimGpu) -> profiles.GpuModel:
    return profiles.model(gpu.model)


def require_mig(gpu: SimGpu) -> None:
    if not gpu.mig_current:
        raise SimError(NVML_ERROR_NOT_SUPPORTED, f"MIG mode is disabled on GPU {gpu.index}")


def gi_profile(gpu: SimGpu, profile_id: int) -> profiles.GiProfile:
    p = model_of(gpu).profile_by_id(profile_id)
    if p is None:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"GPU {gpu.index} has no GI profile ID {profile_id}")
    return p


def find_gi(gpu: SimGpu, gi_id: int) -> SimGi:
    for gi in gpu.gis:
        if gi.id == gi_id:
            return gi
    raise SimError(NVML_ERROR_NOT_FOUND, f"GPU {gpu.index} has no GPU instance {gi_id}")


def find_ci(gpu: SimGpu, gi: SimGi, ci_id: int) -> SimCi:
    for ci in gi.cis:
        if ci.id == ci_id:
            return ci
    raise SimError(NVML_ERROR_NOT_FOUND, f"GPU {gpu.index} GI {gi.id} has no compute instance {ci_id}")


def mig_devices(gpu: SimGpu) -> list[tuple[SimGi, SimCi]]:
    """MIG devices are compute instances, enumerated in (GI ID, CI ID) order; a bare GI is none."""
    gis = sorted(gpu.gis, key=lambda g: g.id)
    return [(gi, ci) for gi in gis for ci in sorted(gi.cis, key=lambda c: c.id)]


def free_placements(gpu: SimGpu, profile: profiles.GiProfile) -> list[int]:
    """Legal starts of ``profile`` that overlap no existing GI."""
    return [
        s
        for s in profile.starts
        if all(s + profile.size <= gi.start or gi.start + gi.size <= s for gi in gpu.gis)
    ]


def remaining_capacity(gpu: SimGpu, profile: profiles.GiProfile) -> int:
    existing = sum(1 for gi in gpu.gis if gi.profile_id == profile.id)
    return max(0, min(profile.instance_count - existing, len(free_placements(gpu, profile))))


def auto_placement(gpu: SimGpu, profile: profiles.GiProfile) -> int:
    """The start the driver picks when none is given: block the fewest still-free placements of other
    profiles, lowest start on a tie. Real drivers change this policy between releases; the sidecar
    never relies on it (it always passes a placement)."""
    free = free_placements(gpu, profile)
    if not free:
        raise SimError(NVML_ERROR_INSUFFICIENT_RESOURCES, f"no free placement for {profile.name}")
    others = [p for p in model_of(gpu).profiles if p.id != profile.id]

    def blocked(start: int) -> int:
        return sum(
            1
            for p in others
            for s in free_placements(gpu, p)
            if s < start + profile.size and start < s + p.size
        )

    return min(free, key=lambda s: (blocked(s), s))


# -- the rules ----------------------------------------------------------------------------------------


def create_gi(state: SimState, gpu: SimGpu, profile_id: int, start: int | None, size: int | None) -> SimGi:
    """nvmlDeviceCreateGpuInstance(WithPlacement): strict where the go-nvml mock is permissive.

    Placement not in the profile's list -> INVALID_ARGUMENT; instance count exhausted or overlap with
    an existing GI -> INSUFFICIENT_RESOURCES (real drivers never say "already exists")."""
    require_mig(gpu)
    profile = gi_profile(gpu, profile_id)
    if start is None:
        start = auto_placement(gpu, profile)
    elif start not in profile.starts or size != profile.size:
        raise SimError(
            NVML_ERROR_INVALID_ARGUMENT, f"placement {start}:{size} is not legal for {profile.name}"
        )
    existing = sum(1 for gi in gpu.gis if gi.profile_id == profile.id)
    if existing >= profile.instance_count:
        raise SimError(
            NVML_ERROR_INSUFFICIENT_RESOURCES,
            f"{profile.name}: all {profile.instance_count} instances exist",
        )
    if start not in free_placements(gpu, profile):
        raise SimError(
            NVML_ERROR_INSUFFICIENT_RESOURCES,
            f"placement {start}:{profile.size} overlaps an existing GPU instance",
        )
    gi = SimGi(
        id=profiles.gpu_instance_id(model_of(gpu).memory_slices, start, profile.size),
        profile_id=profile.id,
        start=start,
        size=profile.size,
        serial=take_serial(state),
    )
    gpu.gis.append(gi)
    gpu.gis.sort(key=lambda g: g.id)
    return gi


def ci_profile(gpu: SimGpu, gi: SimGi, ci_profile_id: int) -> profiles.CiProfile:
    if not 0 <= ci_profile_id < profiles.CI_PROFILE_COUNT:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"CI profile {ci_profile_id} out of range")
    gp = gi_profile(gpu, gi.profile_id)
    for cp in gp.ci_profiles:
        if cp.id == ci_profile_id:
            return cp
    raise SimError(NVML_ERROR_NOT_SUPPORTED, f"CI profile {ci_profile_id} is not supported in a {gp.name} GI")


def ci_free_starts(gi: SimGi, cp: profiles.CiProfile) -> list[int]:
    end = cp.slice_count
    return [s for s in cp.starts if all(s + end <= c.start or c.start + c.size <= s for c in gi.cis)]


def create_ci(state: SimState, gpu: SimGpu, gi: SimGi, ci_profile_id: int, start: int | None = None) -> SimCi:
    """A CI in ``gi`` with a fresh MIG UUID; compute-slice overlap or count -> INSUFFICIENT_RESOURCES."""
    cp = ci_profile(gpu, gi, ci_profile_id)
    if start is not None and start not in cp.starts:
        raise SimError(NVML_ERROR_INVALID_ARGUMENT, f"CI placement {start} is not legal")
    if sum(1 for c in gi.cis if c.profile_id == cp.id) >= cp.instance_count:
        raise SimError(NVML_ERROR_INSUFFICIENT_RESOURCES, "all compute instances of that profile exist")
    free = ci_free_starts(gi, cp)
    if start is None:
        if not free:
            raise SimError(NVML_ERROR_INSUFFICIENT_RESOURCES, "no free compute slices in the GPU instance")
        start = free[0]
    elif start not in free:
        raise SimError(NVML_ERROR_INSUFFICIENT_RESOURCES, "CI placement overlaps another compute instance")
    used = {c.id for c in gi.cis}
    serial = take_serial(state)
    ci = SimCi(
        id=next(i for i in range(len(used) + 1) if i not in used),  # lowest free ID
        profile_id=cp.id,
        start=start,
        size=cp.slice_count,
        mig_uuid=f"MIG-{uuid.uuid5(_MIG_NAMESPACE, f'{gpu.uuid}/{state.boot_id}/{serial}')}",
        serial=serial,
    )
    gi.cis.append(ci)
    gi.cis.sort(key=lambda c: c.id)
    return ci


def destroy_ci(state: SimState, gpu: SimGpu, gi: SimGi, ci: SimCi) -> None:
    """IN_USE while a process runs on the MIG device."""
    if ci.mig_uuid in state.busy:
        raise SimError(NVML_ERROR_IN_USE, f"processes are running on {ci.mig_uuid}")
    gi.cis.remove(ci)


def destroy_gi(state: SimState, gpu: SimGpu, gi: SimGi) -> None:
    """IN_USE while it has compute instances (unlike the go-nvml mock) or processes."""
    if gi.cis:
        raise SimError(NVML_ERROR_IN_USE, f"GPU instance {gi.id} still has {len(gi.cis)} compute instance(s)")
    gpu.gis.remove(gi)


def reboot(state: SimState) -> None:
    """A node reboot: instances, busy markers and lost GPUs are gone, pending MIG modes apply."""
    state.boot_id = str(uuid.uuid4())
    state.busy.clear()
    for gpu in state.gpus:
        gpu.gis.clear()
        gpu.lost = False
        gpu.mig_current = gpu.mig_pending


# -- where the state lives ----------------------------------------------------------------------------


class StateStore(Protocol):
    """Access to the state under a lock. ``transaction`` writes back only if the state changed.

    ``transaction(call=NAME)`` also counts one call of the C function ``NAME``, under the same lock, so
    a count is never lost to a concurrent caller and always sits beside the state change it caused."""

    proc_root: Path | None

    def transaction(self, call: str | None = None) -> contextlib.AbstractContextManager[SimState]: ...

    def call_counts(self) -> dict[str, int]: ...

    def reset_call_counts(self) -> None: ...


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(SimState)


def layout_key(state: SimState) -> bytes:
    """What the fake /proc tree depends on; the tree is rewritten only when this changes."""
    return _ENCODER.encode([state.boot_id, [(g.minor, g.gis) for g in state.gpus]])


class MemoryStore:
    """State in this process only (tests). A re-entrant lock serialises threads."""

    def __init__(self, state: SimState, proc_root: Path | None) -> None:
        self._state = state
        self._lock = threading.RLock()
        self._calls: dict[str, int] = {}
        self.proc_root = proc_root
        self._written = b""
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

    def _sync(self, state: SimState) -> None:
        if self.proc_root is None:
            return
        encoded = layout_key(state)
        if encoded != self._written:
            sync_proc(self.proc_root, state)
            self._written = encoded


class CallCounters:
    """Calls per C function name in ``<state file>.calls``, shared by every process using that state,
    and the state file's write generation.

    Every simulated call is counted, so a count must not cost a rewrite of the state file: this file
    is a fixed table mapped (``MAP_SHARED``) into each process once, and a count is one 8-byte store
    into the mapping. Callers hold the state's flock, which serialises counting across processes.

    Layout: the 8-byte magic, the uint64 write generation, then ``SLOTS`` slots of 64 bytes, each a
    NUL-padded C function name (56 bytes) and a count; integers little-endian. A name takes the first
    empty slot the first time it is counted; a reset zeroes the slots. The generation only ever grows
    (a reset leaves it alone): ``FileStore`` bumps it on every state write, and a process whose cached
    state carries the current generation may skip reading and decoding the file. A file of the wrong
    size or magic is re-initialised, never shrunk, so a process that mapped it earlier is never cut
    short."""

    MAGIC = b"HMSCALL2"
    NAME = 56
    SLOT = 64
    SLOTS = 256
    HEADER = len(MAGIC) + 8
    SIZE = HEADER + SLOT * SLOTS
    _U64 = struct.Struct("<Q")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._slots: dict[str, int] = {}  # name -> offset, re-checked against the file on every use

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
        key = name.encode()
        if not 0 < len(key) <= self.NAME or b"\0" in key:
            raise ValueError(f"cannot count a call of {name!r}: not a C function name")
        key = key.ljust(self.NAME, b"\0")
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
        m[self.HEADER :] = bytes(self.SIZE - self.HEADER)

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
    layout: bytes


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
            st = self.path.stat()
        except FileNotFoundError:
            raise FileNotFoundError(f"simulated hardware state {self.path} does not exist") from None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def call_counts(self) -> dict[str, int]:
        with self._locked():
            return self._counters.counts()

    def reset_call_counts(self) -> None:
        with self._locked():
            self._counters.reset()

    @contextlib.contextmanager
    def transaction(self, call: str | None = None) -> Iterator[SimState]:
        with self._locked():
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
            state = cached.state
            yield state
            encoded = _ENCODER.encode(state)
            if encoded != cached.raw:
                self._write(encoded)
                layout = layout_key(state)
                if layout != cached.layout:
                    assert self.proc_root is not None
                    sync_proc(self.proc_root, state)
                cached = _Cached(self._counters.generation(), self._file_id(), encoded, state, layout)
            self._cached = cached


# -- the fake /proc tree ------------------------------------------------------------------------------

NVIDIA_CAPS_MAJOR = 508
_DEVICES = """Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  5 /dev/tty
  5 /dev/console
 10 misc
136 pts
195 nvidia-frontend
226 drm
{caps} nvidia-caps
509 nvidia-uvm

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
    _atomic_text(root / "devices", _DEVICES.format(caps=NVIDIA_CAPS_MAJOR))
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


def sync_proc(root: Path, state: SimState) -> None:
    """Make the per-instance access files and boot_id match the state (create, update, remove).

    Runs after every create or destroy, so it only writes what differs: an unchanged file is read,
    not rewritten."""
    _write_if_changed(root / "sys" / "kernel" / "random" / "boot_id", state.boot_id + "\n")
    caps = root / "driver" / "nvidia" / "capabilities"
    wanted: dict[Path, str] = {}
    for gpu in state.gpus:
        mig = caps / f"gpu{gpu.minor}" / "mig"
        mig.mkdir(parents=True, exist_ok=True)
        for gi in gpu.gis:
            gi_dir = mig / f"gi{gi.id}"
            wanted[gi_dir / "access"] = _cap_file(profiles.gi_access_minor(gpu.minor, gi.id), ACCESS_MODE)
            for ci in gi.cis:
                text = _cap_file(profiles.ci_access_minor(gpu.minor, gi.id, ci.id), ACCESS_MODE)
                wanted[gi_dir / f"ci{ci.id}" / "access"] = text
    for gpu_dir in caps.glob("gpu*"):
        for gi_dir in (gpu_dir / "mig").glob("gi*"):
            if gi_dir / "access" not in wanted:
                shutil.rmtree(gi_dir, ignore_errors=True)
                continue
            for ci_dir in gi_dir.glob("ci*"):
                if ci_dir / "access" not in wanted:
                    shutil.rmtree(ci_dir, ignore_errors=True)
    for path, text in wanted.items():
        _write_if_changed(path, text)
