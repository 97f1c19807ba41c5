"""The read-only probe, run against the simulated node: it reads what the model says, and changes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar import cli
from sidecar.nvml import probe, profiles
from sidecar.nvml.port import Placement
from sidecar.nvml.pynvml_backend import PynvmlBackend
from sidecar.nvml.sim import SimulatedHardware, install, uninstall

KEYS = list(profiles.MODELS)


@pytest.fixture
def node() -> Iterator[SimulatedHardware]:
    hw = SimulatedHardware.create([(k, 1) for k in KEYS])
    install(hw)
    port = PynvmlBackend(retry_wait=False)
    try:
        made = {
            "h100-80gb": ("1g.20gb", "2g.20gb"),
            "a100-40gb": ("3g.20gb",),
            "rtx-pro-6000": ("1g.24gb", "2g.48gb"),
        }
        for key, names in made.items():
            gpu = hw.gpu_uuid(KEYS.index(key))
            for p in port.gpu_instance_profiles(gpu):
                if p.name in names:
                    where = p.placements[0] if p.name.startswith("2g") else p.placements[-1]
                    gi = port.create_gpu_instance(gpu, p.id, where)
                    port.create_compute_instance(gpu, gi.id, p.ci_profile_id)
        yield hw
    finally:
        port.close()
        uninstall()


def test_the_simulated_node_matches_its_model_exactly(node: SimulatedHardware) -> None:
    doc = probe.collect()
    assert probe.diff(doc) == []
    assert [g["name"] for g in doc["gpus"]] == [profiles.model(k).name for k in KEYS]
    h100 = doc["gpus"][KEYS.index("h100-80gb")]
    assert h100["ci_profiles_by_gi_profile_id"]["15"][-1] | {"placements": None} == {
        "index": 7, "id": 7, "slices": 1, "instances": 1, "sms": 26, "placements": None,
    }  # fmt: skip
    live = {(g.id, c.mig_uuid) for g in node.layout(KEYS.index("h100-80gb")).gis for c in g.cis}
    seen = {(g["id"], c["uuid_from_walk"]) for g in h100["instances"] for c in g["cis"]}
    assert seen == live
    assert all(c["uuid_from_info_device"] == c["uuid_from_walk"] for g in h100["instances"] for c in g["cis"])


def test_a_driver_answering_the_parent_shows_in_the_diff(node: SimulatedHardware) -> None:
    node.set_ci_info_device(parent=True)
    doc = probe.collect()
    h100 = doc["gpus"][KEYS.index("h100-80gb")]
    assert {c["uuid_from_info_device"] for g in h100["instances"] for c in g["cis"]} == {h100["uuid"]}
    assert any("info.device UUID" in line for line in probe.diff(doc))


def test_a_table_that_differs_from_the_model_is_reported(node: SimulatedHardware) -> None:
    doc = probe.collect()
    doc["gpus"][0]["gi_profiles"][0]["memory_mb"] += 1
    (line,) = probe.diff(doc)
    assert "memory_mb" in line


def test_the_probe_only_reads(node: SimulatedHardware) -> None:
    before = node.layouts()
    node.reset_call_counts()
    probe.collect()
    called = set(node.call_counts())
    assert called
    reads = ("nvmlDeviceGet", "nvmlGpuInstanceGet", "nvmlComputeInstanceGet", "nvmlSystemGet")
    assert all(n.startswith(reads) for n in called), called
    assert node.layouts() == before


def test_the_probe_command_prints_json_with_an_empty_diff(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "hw.json"
    SimulatedHardware.init_file(state, [("h200-141gb", 1), ("b200", 1)])
    hw = SimulatedHardware.open(state)
    hw.create_instance(0, "1g.35gb", 2, 2)
    try:
        assert cli.main(["probe", "--json", "--sim-state", str(state)]) == 0
    finally:
        uninstall()
    doc = json.loads(capsys.readouterr().out)
    assert doc["diff_against_model"] == []
    assert doc["gpus"][0]["instances"][0]["cis"][0]["profile_id"] == 7
    assert doc["gpus"][0]["instances"][0]["placement"] == [2, 2]
    # The driver root it found: the simulated node's fake one, holding the version NVML reports.
    root = state.with_name(state.name + ".driver")
    assert doc["driver_root"] == {
        "root": str(root),
        "libcuda": f"{root}/usr/lib/x86_64-linux-gnu/libcuda.so.{doc['driver']}",
    }


def test_a_node_without_the_driver_s_libcuda_reports_no_driver_root(tmp_path: Path) -> None:
    found = probe.find_driver_root("580.65.06", (str(tmp_path),))
    assert found == {"root": None, "libcuda": None}
    lib = tmp_path / "run" / "nvidia" / "driver" / "usr" / "lib64"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.580.65.06").write_bytes(b"")
    operator = str(tmp_path / "run" / "nvidia" / "driver")
    assert probe.find_driver_root("580.65.06", (str(tmp_path), operator)) == {
        "root": operator,
        "libcuda": f"{lib}/libcuda.so.580.65.06",
    }


def test_the_text_table_lists_every_profile(node: SimulatedHardware) -> None:
    text = probe.render(probe.collect())
    for key in KEYS:
        for p in profiles.model(key).profiles:
            assert f" {p.name} " in text, p.name


def test_placements_in_the_model_are_what_the_simulated_driver_lists(node: SimulatedHardware) -> None:
    doc = probe.collect()
    rtx = doc["gpus"][KEYS.index("rtx-pro-6000")]
    assert {p["name"]: p["placements"] for p in rtx["gi_profiles"]}["2g.48gb"] == [[0, 2], [2, 2]]
    assert Placement(0, 2)  # the probe's [start, size] pairs are the domain's placements


class TestTheStaticTablesTheAdapterCachesPerModel:
    def test_gpus_of_one_model_agree(self) -> None:
        install(SimulatedHardware.create([("h100-80gb", 2), ("a100-40gb", 1)]))
        try:
            doc = probe.collect()
        finally:
            uninstall()
        assert doc["static_tables_agree"] == {
            f"{profiles.model('h100-80gb').name} / {doc['gpus'][0]['memory_mb']} MiB": True,
            f"{profiles.model('a100-40gb').name} / {doc['gpus'][2]['memory_mb']} MiB": True,
        }
        assert "static tables of every GPU that is" in probe.render(doc)

    def test_two_gpus_of_one_key_with_different_placements_are_reported(
        self, node: SimulatedHardware
    ) -> None:
        doc = probe.collect()
        h100 = doc["gpus"][KEYS.index("h100-80gb")]
        other = json.loads(json.dumps(h100))
        other["gi_profiles"][0]["placements"] = other["gi_profiles"][0]["placements"][:1]
        key = f"{h100['name']} / {h100['memory_mb']} MiB"
        assert probe.static_tables_agree([h100, other])[key] is False
        assert probe.static_tables_agree([h100, json.loads(json.dumps(h100))])[key] is True
