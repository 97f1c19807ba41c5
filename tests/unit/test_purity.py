"""The planners are pure: imported in a fresh interpreter, they load no I/O module."""

from __future__ import annotations

import json
import subprocess
import sys

PLANNERS = (
    "sidecar.ownership",
    "sidecar.states",
    "sidecar.decision",
    "sidecar.placement",
    "sidecar.recovery.plan",
)
IO_MODULES = frozenset(
    {"fcntl", "threading", "secrets", "socket", "shutil", "tempfile", "grpc", "pynvml", "subprocess"}
)
IO_MODULES |= {"sidecar.records", "sidecar.cdi", "sidecar.lifecycle", "sidecar.recovery.apply"}


def loaded_by(*modules: str) -> set[str]:
    """The modules in sys.modules after importing ``modules`` in a fresh interpreter."""
    code = "import importlib, json, sys\n"
    code += "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout))


def test_the_planners_load_no_io_module() -> None:
    loaded = loaded_by(*PLANNERS)
    assert set(PLANNERS) <= loaded  # the imports happened
    assert not loaded & IO_MODULES


def test_the_probe_sees_an_io_module_when_one_is_loaded() -> None:
    assert "fcntl" in loaded_by("sidecar.records") & IO_MODULES


def test_the_nvml_port_types_load_no_io_module() -> None:
    assert not loaded_by("sidecar.nvml.port") & IO_MODULES
