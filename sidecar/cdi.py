"""Per-instance CDI spec files (architecture section 7).

STUB — the interface below is fixed; the bodies are filled in by the records/CDI work.

One spec file per MIG instance in the CDI directory, named ``<vendor>-<class>_<MIG UUID>.json``, kind of
its own (default ``k8s.hami.io/mig``), one device named by the MIG UUID (unique per creation, so a
runtime cache never serves a stale entry), minimal ``cdiVersion``. Device edits: the parent
``/dev/nvidia<minor>`` and the GI and CI access nodes ``/dev/nvidia-caps/nvidia-cap<N>`` with type,
major, minor and file mode read from ``<proc>/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access``,
``.../ci<C>/access`` and ``<proc>/devices``. Written atomically (temp name not ending in .json, fsync,
rename, fsync dir), mode 0644. With CDI disabled nothing is ever written.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.domain import Identity

DEFAULT_KIND = "k8s.hami.io/mig"


class CdiSpecs:
    """The CDI files of this sidecar's kind in one directory, plus the queue of failed removals."""

    def __init__(self, directory: Path | None, kind: str = DEFAULT_KIND, proc_root: Path = Path("/proc")) -> None:
        """``directory`` None = CDI disabled (legacy mode). ``proc_root`` is ``/proc`` or the simulator's tree."""
        self.directory = directory
        self.kind = kind
        self.proc_root = proc_root

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def device_name(self, mig_uuid: str) -> str:
        """Qualified name ``vendor/class=MIG-...``; "" when disabled."""
        raise NotImplementedError

    def spec_path(self, mig_uuid: str) -> Path:
        raise NotImplementedError

    def ensure(self, gpu_minor: int, identity: Identity) -> str:
        """Write the spec unless an identical valid one exists; return the qualified device name.

        "" when disabled. Raises errors.StateWriteFailed when /proc cannot be read or the write fails."""
        raise NotImplementedError

    def is_current(self, gpu_minor: int, identity: Identity) -> bool:
        """True when the file exists and equals what ``ensure`` would write (disabled: True)."""
        raise NotImplementedError

    def remove(self, mig_uuid: str) -> bool:
        """Remove the spec of an instance; missing = done. On failure queue it and return False."""
        raise NotImplementedError

    def pending_removals(self) -> list[str]:
        """Paths whose removal failed and waits for ``retry_removals``."""
        raise NotImplementedError

    def retry_removals(self) -> list[str]:
        """Retry the queued removals; return the paths removed now."""
        raise NotImplementedError

    def list_mig_uuids(self) -> dict[str, Path]:
        """MIG UUID -> path of every spec file of this sidecar's kind in the directory (disabled: {})."""
        raise NotImplementedError
