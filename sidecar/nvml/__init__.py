"""The NVML layer: the port the domain uses, and the one factory that picks what implements it.

``open_backend("nvml")`` loads the real ``libnvidia-ml.so.1`` and never falls back to the simulator:
a node without a driver fails at startup, loudly. ``open_backend("simulated", sim_state=FILE)`` installs
the simulated library (``sidecar.nvml.sim``) under pynvml; the very same adapter runs over it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.nvml.port import NvmlError, NvmlPort, XidEvents

KINDS = ("nvml", "simulated")


class BackendUnavailableError(RuntimeError):
    """The requested NVML backend cannot be opened (no driver, bad simulator state …)."""


@dataclass(frozen=True)
class Backend:
    port: NvmlPort
    proc_root: Path  # /proc, or the simulated hardware's fake tree
    kind: str  # "nvml" or "simulated"
    xids: XidEvents | None = None  # critical Xid events of its GPUs (None: this backend has none)
    driver_root: Path | None = None  # the simulated node's fake driver root (None: the node's, configured)
    _closers: tuple[Callable[[], None], ...] = field(default=(), repr=False)

    def close(self) -> None:
        for closer in self._closers:
            closer()


def open_backend(
    kind: str,
    sim_state: Path | None = None,
    sim_gpus: str | None = None,
    retry_wait: bool = True,
) -> Backend:
    """Open the NVML backend ``kind``.

    ``simulated``: the hardware lives in ``sim_state`` (created from ``sim_gpus`` such as
    ``h100-80gb:2,a100-40gb:1`` when the file does not exist, with MIG enabled on every GPU). Without
    ``sim_state`` the hardware is in memory for this process only, and ``sim_gpus`` is required.
    """
    from sidecar.nvml.pynvml_backend import PynvmlBackend  # noqa: PLC0415 - keeps pynvml out of import time
    from sidecar.nvml.xid_events import PynvmlXidEvents  # noqa: PLC0415

    if kind == "nvml":
        try:
            port = PynvmlBackend(retry_wait=retry_wait)
        except NvmlError as exc:
            raise BackendUnavailableError(
                f"cannot initialise NVML ({exc.message}, code {exc.code}): is the NVIDIA driver installed "
                "and libnvidia-ml.so.1 visible? (--backend simulated is only used when asked for)"
            ) from exc
        return Backend(
            port=port, proc_root=Path("/proc"), kind="nvml", xids=PynvmlXidEvents(), _closers=(port.close,)
        )
    if kind != "simulated":
        raise BackendUnavailableError(f"unknown NVML backend {kind!r}; expected one of {', '.join(KINDS)}")

    import shutil  # noqa: PLC0415

    from sidecar.nvml import sim as simulated  # noqa: PLC0415
    from sidecar.nvml.profiles import parse_gpus  # noqa: PLC0415

    closers: list[Callable[[], None]] = []
    try:
        if sim_state is not None:
            hardware = simulated.open_or_init(sim_state, sim_gpus)
        else:
            if not sim_gpus:
                raise BackendUnavailableError(
                    "an in-memory simulated backend needs sim_gpus, e.g. h100-80gb:2"
                )
            import tempfile  # noqa: PLC0415 - the port's package stays free of file I/O at import time

            tmp = Path(tempfile.mkdtemp(prefix="sim-proc-"))
            closers.append(lambda: shutil.rmtree(tmp, ignore_errors=True))
            hardware = simulated.SimulatedHardware.create(parse_gpus(sim_gpus), proc_root=tmp)
    except (OSError, ValueError) as exc:
        raise BackendUnavailableError(f"cannot open the simulated hardware: {exc}") from exc
    proc_root = hardware.proc_root
    assert proc_root is not None  # both stores above have a /proc tree
    from sidecar.nvml.sim import driver_root  # noqa: PLC0415

    fake_driver = proc_root.with_suffix(".driver")  # <state>.driver beside <state>.proc
    if sim_state is None:
        closers.append(lambda: shutil.rmtree(fake_driver, ignore_errors=True))
    try:
        driver_root.build(fake_driver, [gpu.minor for gpu in hardware.state().gpus])
    except OSError as exc:
        raise BackendUnavailableError(f"cannot build the simulated driver root {fake_driver}: {exc}") from exc
    simulated.install(hardware)
    port = PynvmlBackend(retry_wait=retry_wait)
    return Backend(
        port=port,
        proc_root=proc_root,
        driver_root=fake_driver,
        kind="simulated",
        xids=PynvmlXidEvents(),
        _closers=(port.close, simulated.uninstall, *closers),
    )
