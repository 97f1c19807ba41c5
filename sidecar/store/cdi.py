"""Per-instance CDI spec files.

One spec file per MIG instance in the CDI directory, named ``<vendor>-<class>_<MIG UUID>.json`` (the
CDI library's ``GenerateTransientSpecName``), of a kind of its own (default ``k8s.hami.io/mig``): HAMi
already publishes MIG UUIDs under ``k8s.device-plugin.nvidia.com/gpu``, and the same qualified name in
two files of one directory is a conflict that makes the CDI cache drop the device. Each file holds one
device named by the MIG UUID, which is new on every creation, so a runtime's spec cache never serves a
stale entry for a re-created instance.

The spec is the smallest one that works (its format: ``docs/architecture.md``, "The state directory").
``cdiVersion`` is the minimum the content needs (older runtimes reject versions they do not know):
nothing here needs more than 0.3.0 (no ``hostPath``, no annotations, device names start with a
letter), except a dot in the class part of the kind, which needs 0.6.0.

Every node carries ``type`` and ``major`` because a runtime ``stat``s the host path of a node that
lacks them, and ``/dev/nvidia-caps/nvidia-cap<N>`` usually does not exist on the host (only
``nvidia-modprobe`` creates those nodes, and only when something asks); the runtime creates the nodes
inside the container from these numbers. Majors come from ``<proc>/devices``; the cap minors and modes
from the GI and CI ``access`` files. ``DeviceFileMode`` there is decimal (256 = 0o400) and goes into
``fileMode`` as the same number, which is how the CDI JSON encodes a Go ``os.FileMode``. The GPU's
node and ``/dev/nvidiactl`` carry the mode of the node under the driver root when it is there (a
runtime reads it from the host node of NVIDIA's spec, so a container gets the same either way).

An instance's spec is its device nodes only; the driver (libraries, binaries, the other control
nodes, hooks) is one device of its own for the whole node (``sidecar.store.driver_cdi``).

Files are written atomically (temp name not ending in .json, fsync, rename, fsync dir) with mode 0644,
as bytes that depend only on the inputs, so "identical" is a byte comparison. A crash inside a write
leaves its temp file behind; ``sweep_temp_files`` removes those of this kind at the next start. A
removal that fails is queued in memory for ``retry_removals`` (run by the reconciler). With CDI
disabled nothing is ever written and every method is a no-op.

Ownership: the file at a spec's path is this sidecar's only when it is a regular file (not a
symlink, not a directory) whose JSON reads as a spec of this kind whose devices are all named by
that MIG UUID (``not_ours``). Anything else there (another kind, another or a second MIG UUID, bytes
that are not such JSON, a truncated file whose kind cannot be read) belongs to someone else: it is
never overwritten nor removed, and ``ensure``/``remove`` raise ``ForeignSpecFile`` (UNAVAILABLE
STATE_WRITE_FAILED naming the file). A spec of this kind naming that MIG UUID whose content differs
from what ``render`` gives (wrong edits, another ``cdiVersion``, extra fields, a device entry that
is not what this sidecar writes) is this sidecar's, corrupt or outdated, and is rewritten. Writes
are atomic, so a truncated file is never one this sidecar left; it is left alone.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from pathlib import Path

import msgspec

from sidecar.model import hami_files
from sidecar.model.domain import MIG_UUID_RE, Identity
from sidecar.model.errors import StateWriteFailed
from sidecar.model.hami_files import HamiSpec
from sidecar.store.cdi_format import (
    ENCODER,
    HEADER_DECODER,
    ContainerEdits,
    Device,
    DeviceNode,
    Spec,
    minimum_cdi_version,
    parse_kind,
)
from sidecar.store.durable import TEMP_MARKER, atomic_write, fsync_dir
from sidecar.store.proc_nodes import read_access_file, read_char_majors

DEFAULT_KIND = "k8s.hami.io/mig"
PATH_LOCK_STRIPES = 64
FILE_MODE = 0o644
DIR_MODE = 0o755
NVIDIACTL_MINOR = 255


class ForeignSpecFile(StateWriteFailed):
    """The file at a spec's path is not this sidecar's spec for that MIG UUID: left untouched."""

    def __init__(self, path: Path, mig_uuid: str, why: str) -> None:
        super().__init__(
            f"{path} is not this sidecar's CDI spec for {mig_uuid} ({why}); it is left untouched",
            {"file": str(path), "mig_uuid": mig_uuid},
        )


class CdiSpecs:
    """The CDI files of this sidecar's kind in one directory, plus the queue of failed removals."""

    def __init__(
        self,
        directory: Path | None,
        kind: str = DEFAULT_KIND,
        proc_root: Path = Path("/proc"),
        dev_root: Path | None = None,
    ) -> None:
        """``directory`` None = CDI disabled (legacy mode).

        ``proc_root`` is ``/proc`` or the simulator's tree; ``dev_root`` the driver root whose ``dev``
        holds the GPU nodes (None: the nodes' modes are not read). ValueError for a kind that breaks
        the CDI vendor/class rules. Does no I/O."""
        self.directory = directory
        self.kind = kind
        self.proc_root = proc_root
        self.dev_root = dev_root
        self.vendor, self.cls = parse_kind(kind)
        self.cdi_version = minimum_cdi_version(kind)
        # ``atomic_write``'s temp name for a ``spec_path``: ``.<stem><TEMP_MARKER><random hex>``.
        self._temp_name = re.compile(
            r"\."
            + re.escape(f"{self.vendor}-{self.cls}_")
            + MIG_UUID_RE.pattern
            + re.escape(TEMP_MARKER)
            + r"[0-9a-f]+"
        )
        self._lock = threading.Lock()
        # path -> the MIG UUID it is the spec of, retried in the order they failed
        self._pending: dict[Path, str] = {}
        # Specs this process wrote or read back: path -> (minor, identity, stat signature). A spec
        # whose file still has that signature is known current and is neither rendered nor read again.
        self._current: dict[Path, tuple[int, Identity, tuple[int, int, int, int]]] = {}
        # One writer per spec file: a path's lock is one of a fixed set of stripes, so the set does not
        # grow with every MIG UUID ever seen. ``ensure`` takes one and never two at once (no deadlock).
        self._path_locks = tuple(threading.Lock() for _ in range(PATH_LOCK_STRIPES))
        self._spec_paths: dict[str, Path] = {}  # MIG UUID -> ``spec_path``, until its spec is removed

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def device_name(self, mig_uuid: str) -> str:
        """Qualified name ``vendor/class=MIG-...``; "" when disabled."""
        _check_mig_uuid(mig_uuid)
        return f"{self.kind}={mig_uuid}" if self.enabled else ""

    def spec_path(self, mig_uuid: str) -> Path:
        """``<dir>/<vendor>-<class>_<MIG UUID>.json``. ValueError when disabled (there is no path).

        Remembered per MIG UUID: every reuse asks, and building the ``Path`` costs more than the
        ``stat`` that tells the file current."""
        path = self._spec_paths.get(mig_uuid)
        if path is None:
            _check_mig_uuid(mig_uuid)
            if self.directory is None:
                raise ValueError("CDI is disabled: there are no spec files")
            path = self._spec_paths.setdefault(
                mig_uuid, self.directory / f"{self.vendor}-{self.cls}_{mig_uuid}.json"
            )
        return path

    def render(self, gpu_minor: int, identity: Identity) -> bytes:
        """The exact bytes ``ensure`` writes for this instance, read from ``<proc>`` now.

        Raises StateWriteFailed when ``<proc>`` lacks the majors or the access files (the instance's
        capability files vanish with the GI/CI, so this also catches an instance that is gone)."""
        _check_mig_uuid(identity.mig_uuid)
        caps = self.proc_root / "driver" / "nvidia" / "capabilities" / f"gpu{gpu_minor}" / "mig"
        gi_access = caps / f"gi{identity.gpu_instance_id}" / "access"
        ci_access = caps / f"gi{identity.gpu_instance_id}" / f"ci{identity.compute_instance_id}" / "access"
        try:
            majors = read_char_majors(self.proc_root)
            nvidia = majors.get("nvidia-frontend", majors.get("nvidia"))
            caps_major = majors.get("nvidia-caps")
            if nvidia is None or caps_major is None:
                raise ValueError(
                    f"{self.proc_root / 'devices'} lists no nvidia-frontend/nvidia or nvidia-caps"
                )
            gi_minor, gi_mode = read_access_file(gi_access)
            ci_minor, ci_mode = read_access_file(ci_access)
        except (OSError, ValueError) as exc:
            raise StateWriteFailed(
                f"reading device numbers for the CDI spec of {identity.mig_uuid} failed: {exc}"
            ) from exc
        gpu_node, ctl_node = f"/dev/nvidia{gpu_minor}", "/dev/nvidiactl"
        nodes = (
            DeviceNode(gpu_node, "c", nvidia, gpu_minor, self._node_mode(gpu_node)),
            DeviceNode(ctl_node, "c", nvidia, NVIDIACTL_MINOR, self._node_mode(ctl_node)),
            DeviceNode(f"/dev/nvidia-caps/nvidia-cap{gi_minor}", "c", caps_major, gi_minor, gi_mode),
            DeviceNode(f"/dev/nvidia-caps/nvidia-cap{ci_minor}", "c", caps_major, ci_minor, ci_mode),
        )
        spec = Spec(self.cdi_version, self.kind, (Device(identity.mig_uuid, ContainerEdits(nodes)),))
        # Struct fields encode in declaration order, so equal inputs give equal bytes.
        return msgspec.json.format(ENCODER.encode(spec), indent=2) + b"\n"

    def _node_mode(self, path: str) -> int | None:
        """The permission bits of the node at ``path`` under the driver root, as the container gets
        them from NVIDIA's spec (whose runtime reads them from the node); None when it is not there."""
        if self.dev_root is None:
            return None
        try:
            info = (self.dev_root / path.lstrip("/")).stat()
        except OSError:
            return None
        return stat.S_IMODE(info.st_mode) if stat.S_ISCHR(info.st_mode) else None

    def ensure(self, gpu_minor: int, identity: Identity) -> str:
        """Write the spec unless an identical valid one exists; return the qualified device name.

        "" when disabled. Raises errors.StateWriteFailed when /proc cannot be read or the write fails,
        ForeignSpecFile (one) when the file at the path is not this sidecar's (nothing written)."""
        if self.directory is None:
            return ""
        path = self.spec_path(identity.mig_uuid)
        with self._lock:
            # The file is wanted again: a queued removal must not take it away later.
            self._pending.pop(path, None)
            known = self._current.get(path)
            path_lock = self._path_locks[hash(path) % PATH_LOCK_STRIPES]
        if known is not None and known[:2] == (gpu_minor, identity) and _signature(path) == known[2]:
            return f"{self.kind}={identity.mig_uuid}"  # the name ``device_name`` gave when it was written
        data = self.render(gpu_minor, identity)
        with path_lock:  # one writer per file; the shared lock is never held across an fsync
            if self.owned_bytes(path, identity.mig_uuid) != data:  # ForeignSpecFile: not ours to write
                try:
                    self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
                    atomic_write(path, data, FILE_MODE)
                except OSError as exc:
                    raise StateWriteFailed(f"writing CDI spec {path} failed: {exc}") from exc
            signature = _signature(path)
        with self._lock:
            if signature is not None:
                self._current[path] = (gpu_minor, identity, signature)
        return self.device_name(identity.mig_uuid)

    def remove(self, mig_uuid: str, path: Path | None = None) -> bool:
        """Remove the spec of an instance; missing = done. On failure queue it and return False.

        ``path`` is the file ``list_mig_uuids`` found the MIG UUID in: that listing goes by content, and
        a spec of our kind may have another name than ``spec_path`` (written by hand, by an older
        version), which removing by the derived name would miss. Without it the derived name is used.
        ValueError for a path that is not a file name directly in the CDI directory: nothing outside it
        is ever removed. ForeignSpecFile when the file there is not this sidecar's (nothing removed,
        nothing queued: no retry makes it ours)."""
        if self.directory is None:
            return True
        if path is None:
            path = self.spec_path(mig_uuid)
        elif path.parent != self.directory or path.name in {"", ".", ".."}:
            raise ValueError(f"{path} is not in the CDI directory {self.directory}")
        with self._lock:
            self._current.pop(path, None)
            self._spec_paths.pop(mig_uuid, None)  # a MIG UUID is never minted again: bound the map
            self._pending.pop(path, None)
            try:
                self.owned_bytes(path, mig_uuid)
            except ForeignSpecFile:
                raise
            except StateWriteFailed:
                self._pending[path] = mig_uuid  # cannot tell now: the reconciler looks again
                return False
            if _unlink(path):
                return True
            self._pending[path] = mig_uuid
            return False

    def owned_bytes(self, path: Path, mig_uuid: str) -> bytes | None:
        """The bytes of this sidecar's spec for ``mig_uuid`` at ``path``; None when nothing is there.

        ForeignSpecFile when something that is not (``not_ours``); StateWriteFailed when the file
        cannot be inspected or read."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateWriteFailed(f"inspecting CDI spec {path} failed: {exc}", {"file": str(path)}) from exc
        if not stat.S_ISREG(info.st_mode):
            kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
            raise ForeignSpecFile(path, mig_uuid, kind)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateWriteFailed(f"reading CDI spec {path} failed: {exc}", {"file": str(path)}) from exc
        why = self.not_ours(data, mig_uuid)
        if why is not None:
            raise ForeignSpecFile(path, mig_uuid, why)
        return data

    def not_ours(self, data: bytes, mig_uuid: str) -> str | None:
        """Why ``data`` is not this sidecar's spec for ``mig_uuid``, or None when it is (see the
        module's "Ownership": its kind, and devices all named by that MIG UUID; the rest may differ)."""
        try:
            header = HEADER_DECODER.decode(data)
        except msgspec.DecodeError as exc:
            return f"not a CDI spec whose kind and device names can be read: {exc}"
        if header.kind != self.kind:
            return f"its kind is {header.kind!r}, not {self.kind!r}"
        names = sorted({device.name for device in header.devices})
        if names != [mig_uuid]:
            return f"it names the devices {names}, not {mig_uuid} alone"
        return None

    def pending_removals(self) -> list[str]:
        """Paths whose removal failed and waits for ``retry_removals``."""
        with self._lock:
            return [str(p) for p in self._pending]

    def retry_removals(self) -> list[str]:
        """Retry the queued removals; return the paths removed now.

        Ownership is judged again at each attempt: a file that is not this sidecar's now (another
        writer took the name meanwhile) leaves the queue untouched and is not reported removed."""
        removed: list[str] = []
        with self._lock:
            for path, mig_uuid in list(self._pending.items()):
                try:
                    still_queued_for = self._queued_is_ours(path, mig_uuid)
                except StateWriteFailed:
                    continue
                if not still_queued_for:
                    del self._pending[path]
                    continue
                if _unlink(path):
                    del self._pending[path]
                    removed.append(str(path))
        return removed

    def _queued_is_ours(self, path: Path, mig_uuid: str) -> bool:
        """Whether a queued removal's file is still what it was queued as: HAMi's spec of that MIG
        UUID (``remove_hami_spec``) or this sidecar's (``owned_bytes``). StateWriteFailed: unreadable."""
        if path.name == hami_files.spec_filename(mig_uuid):
            data = _read_bytes(path)
            spec = hami_files.recognize_spec(path.name, data) if data is not None else None
            return spec is not None and spec.mig_uuid == mig_uuid
        try:
            self.owned_bytes(path, mig_uuid)
        except ForeignSpecFile:
            return False
        return True

    def sweep_temp_files(self) -> list[str]:
        """Remove the temp files a crash inside ``ensure``'s atomic write left behind; return their paths.

        Called once at startup, with the state directory lock held, before anything is served: no write
        of this sidecar is in progress then. Only regular files named the way ``ensure`` names its temp
        files (a dotfile ``.<vendor>-<class>_<MIG UUID>.tmp-<hex>`` of this kind) are removed; the
        directory is shared with other CDI writers, whose files are not ours to judge. A file that
        cannot be removed stays for the next start (no reader takes a dotfile for a spec). A missing
        directory or disabled CDI sweeps nothing; StateWriteFailed when the directory cannot be listed."""
        if self.directory is None:
            return []
        removed: list[str] = []
        with self._lock:
            try:
                entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
            except FileNotFoundError:
                return []
            except OSError as exc:
                raise StateWriteFailed(f"listing CDI directory {self.directory} failed: {exc}") from exc
            for entry in entries:
                if not self._temp_name.fullmatch(entry.name):
                    continue
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    Path(entry.path).unlink()
                except OSError:  # gone meanwhile, or not removable now: the next start tries again
                    continue
                removed.append(entry.path)
            if removed:
                with contextlib.suppress(OSError):
                    fsync_dir(self.directory)
        return removed

    def list_mig_uuids(self) -> dict[str, Path]:
        """MIG UUID -> path of every spec file of this sidecar's kind in the directory (disabled: {}).

        Files of other kinds (HAMi's own ``k8s.device-plugin.nvidia.com-gpu.json``, other vendors) and
        files that do not parse are ignored: they are not ours to judge. A missing directory is empty."""
        if self.directory is None:
            return {}
        found: dict[str, Path] = {}
        try:
            entries = sorted(os.scandir(self.directory), key=lambda e: e.name)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise StateWriteFailed(f"listing CDI directory {self.directory} failed: {exc}") from exc
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(".json"):
                continue
            data = _read_bytes(Path(entry.path))
            if data is None:
                continue
            try:
                header = HEADER_DECODER.decode(data)
            except msgspec.DecodeError:
                continue
            if header.kind != self.kind:
                continue
            for device in header.devices:
                if MIG_UUID_RE.fullmatch(device.name):
                    found[device.name] = Path(entry.path)
        return found

    def hami_specs(self) -> list[HamiSpec]:
        """Every spec in the directory that is HAMi's dynamic MIG spec by all its content
        (``hami_files.recognize_spec``); files merely named like one are not listed. Disabled: []."""
        if self.directory is None:
            return []
        try:
            names = sorted(e.name for e in os.scandir(self.directory) if hami_files.is_spec_filename(e.name))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StateWriteFailed(f"listing CDI directory {self.directory} failed: {exc}") from exc
        found = []
        for name in names:
            data = _read_bytes(self.directory / name)
            spec = hami_files.recognize_spec(name, data) if data is not None else None
            if spec is not None:
                found.append(spec)
        return found

    def remove_hami_spec(self, mig_uuid: str) -> bool:
        """Remove HAMi's spec of ``mig_uuid`` once it is read again and still recognized as HAMi's.

        True when no spec of HAMi's for it is left (removed, missing, or the file there is not HAMi's
        and stays); False when the removal failed and is queued for ``retry_removals``."""
        if self.directory is None:
            return True
        path = self.directory / hami_files.spec_filename(mig_uuid)
        with self._lock:
            data = _read_bytes(path)
            spec = hami_files.recognize_spec(path.name, data) if data is not None else None
            if spec is None or spec.mig_uuid != mig_uuid:
                return True
            if _unlink(path):
                self._pending.pop(path, None)
                return True
            self._pending[path] = mig_uuid
            return False


def _check_mig_uuid(mig_uuid: str) -> None:
    # A MIG UUID becomes a file name and a CDI device name; the legacy "MIG-GPU-<uuid>/<gi>/<ci>" form
    # of R450/R460 drivers contains "/" and is valid as neither.
    if not MIG_UUID_RE.fullmatch(mig_uuid):
        raise ValueError(f"not a MIG UUID: {mig_uuid!r}")


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    """What tells a file from the one this process wrote: inode, size, mtime and ctime (None: missing).

    Any rewrite (a rename onto the name, an edit in place) changes the inode or the times."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_bytes(path: Path) -> bytes | None:
    """The file's bytes, or None when it is missing or unreadable (then it is rewritten or skipped)."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def _unlink(path: Path) -> bool:
    """Remove ``path`` durably; True when it is gone (or was never there)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        return False
    # The name is gone for every reader already; a lost fsync can at worst bring the file back after a
    # power cut, when recovery removes it again as a spec with no live instance.
    with contextlib.suppress(OSError):
        fsync_dir(path.parent)
    return True
