"""Read-only probe of a real GPU node's MIG tables, diffed against this project's model of that GPU.

Prints, per GPU: the GI profile table (by profile index), each profile's possible placements, the CI
profile tables of the GIs that exist, and the existing GIs and CIs with the MIG UUID derived both
ways (``nvmlComputeInstanceGetInfo().device`` and the MIG device walk). Then the differences from
``profiles.model_by_name`` for that GPU name. It never creates, destroys or changes a mode: only
``Get*`` NVML calls are made.

``static_tables_agree`` checks what the adapter's caches assume: GPUs of one name and total memory
answer the same static tables (board part number and PCI IDs are printed to tell boards apart).

It also reports the driver root: the first of ``/`` (a host-installed driver) and
``/run/nvidia/driver`` (the GPU Operator's) under which the driver's ``libcuda.so.<version>`` is, the
version NVML reports; ``--driver-root`` of ``serve`` takes that directory (the simulated node's is its
fake root).

``python -m sidecar.nvml.probe --json`` runs it from the installed project, with the model diff.
Copied alone where only pynvml is installed, ``python probe.py --json`` reads the same tables and
skips the diff, with a note. CI profiles can only be read from a GI, so a GPU without GIs shows no
CI tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from ctypes import byref, c_uint
from pathlib import Path
from typing import Any

import pynvml

_SKIP = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _placements(fn: Any, owner: Any, profile_id: int, struct: Any) -> list[list[int]]:
    count = c_uint(0)
    fn(owner, profile_id, None, byref(count))
    array = (struct * max(1, count.value))()
    fn(owner, profile_id, array, byref(count))
    return [[int(array[i].start), int(array[i].size)] for i in range(count.value)]


def _gi_profiles(handle: Any) -> list[dict[str, Any]]:
    rows = []
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except pynvml.NVMLError as exc:
            if exc.value in _SKIP:
                continue
            raise
        rows.append(
            {
                "index": index,
                "id": int(info.id),
                "name": _text(info.name).removeprefix("MIG "),
                "slices": int(info.sliceCount),
                "instances": int(info.instanceCount),
                "memory_mb": int(info.memorySizeMB),
                "sms": int(info.multiprocessorCount),
                "engines": [
                    int(info.copyEngineCount),
                    int(info.decoderCount),
                    int(info.encoderCount),
                    int(info.jpegCount),
                    int(info.ofaCount),
                ],
                "placements": _placements(
                    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements,
                    handle,
                    int(info.id),
                    pynvml.c_nvmlGpuInstancePlacement_t,
                ),
            }
        )
    return rows


def _ci_profiles(gi: Any) -> list[dict[str, Any]]:
    rows = []
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except pynvml.NVMLError as exc:
            if exc.value in _SKIP:
                continue
            raise
        rows.append(
            {
                "index": index,
                "id": int(info.id),
                "slices": int(info.sliceCount),
                "instances": int(info.instanceCount),
                "sms": int(info.multiprocessorCount),
                "placements": [
                    p[0]
                    for p in _placements(
                        pynvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements,
                        gi,
                        int(info.id),
                        pynvml.c_nvmlComputeInstancePlacement_t,
                    )
                ],
            }
        )
    return rows


def _mig_walk(handle: Any) -> dict[tuple[int, int], str]:
    found = {}
    for index in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
        except pynvml.NVMLError as exc:
            if exc.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
        ids = int(pynvml.nvmlDeviceGetGpuInstanceId(mig)), int(pynvml.nvmlDeviceGetComputeInstanceId(mig))
        found[ids] = _text(pynvml.nvmlDeviceGetUUID(mig))
    return found


def _instances(handle: Any, gi_profiles: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    walked = _mig_walk(handle)
    instances: list[dict[str, Any]] = []
    ci_tables: dict[str, Any] = {}
    for p in gi_profiles:
        array = (pynvml.c_nvmlGpuInstance_t * max(1, p["instances"]))()
        count = c_uint(len(array))
        pynvml.nvmlDeviceGetGpuInstances(handle, p["id"], array, byref(count))
        for i in range(count.value):
            gi = array[i]
            info = pynvml.nvmlGpuInstanceGetInfo(gi)
            table = _ci_profiles(gi)
            ci_tables[str(p["id"])] = table
            cis = []
            for cp in table:
                ci_array = (pynvml.c_nvmlComputeInstance_t * max(1, cp["instances"]))()
                n = c_uint(len(ci_array))
                pynvml.nvmlGpuInstanceGetComputeInstances(gi, cp["id"], ci_array, byref(n))
                for j in range(n.value):
                    ci = pynvml.nvmlComputeInstanceGetInfo(ci_array[j])
                    cis.append(
                        {
                            "id": int(ci.id),
                            "profile_id": int(ci.profileId),
                            "placement": [int(ci.placement.start), int(ci.placement.size)],
                            "uuid_from_info_device": _text(pynvml.nvmlDeviceGetUUID(ci.device)),
                            "uuid_from_walk": walked.get((int(info.id), int(ci.id))),
                        }
                    )
            instances.append(
                {
                    "id": int(info.id),
                    "profile_id": int(info.profileId),
                    "placement": [int(info.placement.start), int(info.placement.size)],
                    "cis": sorted(cis, key=lambda c: c["id"]),
                }
            )
    return sorted(instances, key=lambda g: g["id"]), ci_tables


def _optional(read: Any) -> str | None:
    """A fact some drivers or boards do not report: None then, never a failed probe."""
    try:
        return _text(read())
    except (pynvml.NVMLError, AttributeError):
        return None


def _board(handle: Any) -> dict[str, str | None]:
    def pci_ids() -> str:
        pci = pynvml.nvmlDeviceGetPciInfo(handle)
        return f"{int(pci.pciDeviceId):#010x}/{int(pci.pciSubSystemId):#010x}"

    return {
        "part_number": _optional(lambda: pynvml.nvmlDeviceGetBoardPartNumber(handle)),
        "pci_device_subsystem": _optional(pci_ids),
    }


def static_tables_agree(gpus: list[dict[str, Any]]) -> dict[str, bool]:
    """Per model key (name and total memory, what the adapter caches its tables by): whether every GPU
    of that key answered the same GI profile table with the same placements, and the same CI
    profile table for each GI profile seen on more than one of them. GPUs that answered no table
    (MIG off on Ampere) are left out."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for g in gpus:
        if g["gi_profiles"]:
            by_key.setdefault(f"{g['name']} / {g['memory_mb']} MiB", []).append(g)
    out = {}
    for key, same in by_key.items():
        agree = all(g["gi_profiles"] == same[0]["gi_profiles"] for g in same)
        ci: dict[str, Any] = {}
        for g in same:
            for gi_profile_id, table in g["ci_profiles_by_gi_profile_id"].items():
                agree = agree and ci.setdefault(gi_profile_id, table) == table
        out[key] = agree
    return out


DRIVER_ROOTS = ("/", "/run/nvidia/driver")
LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib/x86_64-linux-gnu",
    "lib64",
    "usr/lib",
)


def find_driver_root(version: str, roots: tuple[str, ...] = DRIVER_ROOTS) -> dict[str, str | None]:
    """The first root holding ``libcuda.so.<version>`` in a library directory, and that file's path."""
    for root in roots:
        for directory in LIBRARY_DIRS:
            path = Path(root) / directory / f"libcuda.so.{version}"
            if path.is_file():
                return {"root": root, "libcuda": str(path)}
    return {"root": None, "libcuda": None}


def collect(driver_roots: tuple[str, ...] = DRIVER_ROOTS) -> dict[str, Any]:
    """Everything the probe reads, as plain JSON-able data. Call with NVML initialised."""
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
        gi_profiles = _gi_profiles(handle)
        instances, ci_tables = _instances(handle, gi_profiles) if current else ([], {})
        gpus.append(
            {
                "index": index,
                "name": _text(pynvml.nvmlDeviceGetName(handle)),
                "uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
                "memory_mb": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024),
                "board": _board(handle),
                "mig_mode": [int(current), int(pending)],
                "gi_profiles": gi_profiles,
                "ci_profiles_by_gi_profile_id": ci_tables,
                "instances": instances,
            }
        )
    version = _text(pynvml.nvmlSystemGetDriverVersion())
    return {
        "driver": version,
        "driver_root": find_driver_root(version, driver_roots),
        "gpus": gpus,
        "static_tables_agree": static_tables_agree(gpus),
    }


def diff(doc: dict[str, Any]) -> list[str]:
    """Each way the real tables differ from the model of their GPU name; empty when they agree."""
    from sidecar.nvml import profiles  # noqa: PLC0415 - needs msgspec; the reading above does not

    out = []
    for g in doc["gpus"]:
        model = profiles.model_by_name(g["name"])
        where = f"GPU {g['index']} ({g['name']})"
        if model is None:
            out.append(f"{where}: no model of this GPU name")
            continue
        if not g["gi_profiles"]:
            out.append(f"{where}: no GI profile answered (MIG mode {g['mig_mode']}): nothing to compare")
            continue
        real = {p["index"]: p for p in g["gi_profiles"]}
        for index in sorted(set(real) | {p.index for p in model.profiles}):
            m, r = model.profile_by_index(index), real.get(index)
            if m is None or r is None:
                out.append(
                    f"{where} profile index {index}: only in the {'real GPU' if m is None else 'model'}"
                )
                continue
            want = {
                "id": m.id,
                "name": m.name,
                "slices": m.slice_count,
                "instances": m.instance_count,
                "memory_mb": m.memory_mb,
                "sms": m.multiprocessor_count,
                "engines": [m.copy_engines, m.decoders, m.encoders, m.jpegs, m.ofas],
                "placements": [[s, m.size] for s in m.starts],
            }
            out.extend(
                f"{where} {m.name} {k}: model {v!r}, real {r[k]!r}" for k, v in want.items() if r[k] != v
            )
            table = g["ci_profiles_by_gi_profile_id"].get(str(m.id))
            if table is not None:
                got = sorted((c["id"], c["slices"], c["instances"], c["sms"], c["placements"]) for c in table)
                exp = sorted(
                    (c.id, c.slice_count, c.instance_count, c.multiprocessor_count, list(c.starts))
                    for c in m.ci_profiles
                )
                if got != exp:
                    out.append(f"{where} {m.name} CI profiles: model {exp}, real {got}")
        for gi in g["instances"]:
            for ci in gi["cis"]:
                if ci["uuid_from_info_device"] != ci["uuid_from_walk"]:
                    out.append(
                        f"{where} GI {gi['id']} CI {ci['id']}: "
                        f"info.device UUID {ci['uuid_from_info_device']}, "
                        f"MIG device walk {ci['uuid_from_walk']}"
                    )
    return out


def render(doc: dict[str, Any]) -> str:
    """The tables as text, one line per profile, placement list and instance."""
    lines = [f"driver {doc['driver']}"]
    found = doc.get("driver_root", {})
    if found.get("root"):
        lines.append(f"driver root {found['root']} ({found['libcuda']})")
    else:
        lines.append(f"driver root: no libcuda.so.{doc['driver']} under {' or '.join(DRIVER_ROOTS)}")
    for g in doc["gpus"]:
        lines.append(f"GPU {g['index']} {g['uuid']} {g['name']} {g['memory_mb']} MiB MIG {g['mig_mode']}")
        board = g.get("board", {})
        lines.append(
            f"  board part number {board.get('part_number') or 'not reported'},"
            f" PCI device/subsystem {board.get('pci_device_subsystem') or 'not reported'}"
        )
        lines.append("  idx  id  name              slices inst  MiB     SM  CE/DEC/ENC/JPG/OFA  placements")
        for p in g["gi_profiles"]:
            starts = ",".join(f"{s}:{n}" for s, n in p["placements"])
            engines = "/".join(str(e) for e in p["engines"])
            lines.append(
                f"  {p['index']:>3} {p['id']:>3}  {p['name']:<17} {p['slices']:>6} {p['instances']:>4} "
                f"{p['memory_mb']:>6} {p['sms']:>4}  {engines:<18}  {starts}"
            )
        for gi_profile_id, table in sorted(g["ci_profiles_by_gi_profile_id"].items()):
            for c in table:
                lines.append(
                    f"  CI profile {c['id']} in GI profile {gi_profile_id}: {c['slices']} slice(s), "
                    f"{c['instances']} instance(s), {c['sms']} SM, starts {c['placements']}"
                )
        for gi in g["instances"]:
            lines.append(
                f"  GI {gi['id']:>2} profile {gi['profile_id']} {gi['placement'][0]}:{gi['placement'][1]}"
            )
            for ci in gi["cis"]:
                lines.append(
                    f"    CI {ci['id']} profile {ci['profile_id']} info.device {ci['uuid_from_info_device']} "
                    f"walk {ci['uuid_from_walk']}"
                )
    for key, agree in sorted(doc.get("static_tables_agree", {}).items()):
        lines.append(
            f"static tables of every GPU that is {key}: {'the same' if agree else 'DIFFER (caches unsafe)'}"
        )
    return "\n".join(lines) + "\n"


def run(as_json: bool, out: Any = None, driver_roots: tuple[str, ...] = DRIVER_ROOTS) -> int:
    """Read (NVML already initialised), print, and diff; exit 0 whatever the diff says."""
    out = out if out is not None else sys.stdout
    doc = collect(driver_roots)
    try:
        doc["diff_against_model"] = diff(doc)
    except ImportError as exc:  # run alone, without the project: the reading is still worth having
        doc["diff_against_model"] = [f"not compared: {exc}"]
    if as_json:
        out.write(json.dumps(doc, indent=2) + "\n")
    else:
        out.write(render(doc))
        out.write("diff against the model: " + ("none" if not doc["diff_against_model"] else "") + "\n")
        out.writelines(f"  {line}\n" for line in doc["diff_against_model"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sidecar.nvml.probe", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    pynvml.nvmlInit()
    try:
        return run(args.json)
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    sys.exit(main())
