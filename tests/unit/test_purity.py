"""The model is pure: each module of ``sidecar.model``, imported afresh, loads no I/O module."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import sidecar.model

MODEL = tuple(info.name for info in pkgutil.walk_packages(sidecar.model.__path__, prefix="sidecar.model."))
IO_MODULES = frozenset(
    {"fcntl", "threading", "secrets", "socket", "shutil", "tempfile", "grpc", "pynvml", "subprocess"}
)
IO_MODULES |= {"sidecar.store", "sidecar.lifecycle", "sidecar.edge", "sidecar.nvml.pynvml_backend"}


def loaded_by(*modules: str) -> set[str]:
    """The modules in sys.modules after importing ``modules`` in a fresh interpreter."""
    code = "import importlib, json, sys\n"
    code += "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout))


def test_the_model_is_every_module_of_its_package() -> None:
    assert "sidecar.model.decision" in MODEL
    assert "sidecar.model.recovery_plan.plan" in MODEL
    assert len(MODEL) >= 20


def test_no_module_of_the_model_loads_an_io_module() -> None:
    loaded = loaded_by(*MODEL)
    assert set(MODEL) <= loaded  # the imports happened
    assert not loaded & IO_MODULES


def test_the_probe_sees_an_io_module_when_one_is_loaded() -> None:
    assert {"fcntl", "sidecar.store"} <= loaded_by("sidecar.store.records") & IO_MODULES


def test_the_nvml_port_types_load_no_io_module() -> None:
    assert not loaded_by("sidecar.nvml.port") & IO_MODULES
