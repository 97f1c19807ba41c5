"""The shipped deployment files give the sidecar container what NVML's MIG calls need on a real node.

With the NVIDIA container runtime hook, ``/proc/driver/nvidia/capabilities`` (the GI/CI ``access`` files
the CDI specs are rendered from) is visible in a container, and NVML's mig/config capability with it,
only when ``NVIDIA_MIG_CONFIG_DEVICES`` and ``NVIDIA_MIG_MONITOR_DEVICES`` ask for them; both need a
privileged container. Without them every create fails on the node while all simulated tests pass, so
the files themselves are checked here (as text: the image and the manifest are not built in tests).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from sidecar import config
from sidecar.model.idle_policy import IdleSettings

ROOT = Path(__file__).resolve().parents[2]
MIG_DEVICE_VARIABLES = ("NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES")


def sidecar_container(manifest: str) -> str:
    """The lines of the ``mig-sidecar`` container in the DaemonSet, up to the next container or key of
    the pod spec (anything indented no deeper than its ``- name:`` line)."""
    lines = manifest.splitlines()
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"\s*- name: mig-sidecar\s*", line))
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if line.strip() and not line.lstrip().startswith("#") and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return "\n".join(block)


def env_value(container: str, name: str) -> str | None:
    match = re.search(rf"- name: {name}\s*\n\s*value: \"?([^\"\s#]*)", container)
    return match.group(1) if match else None


# The standalone example, the Helm post-renderer's patch of the chart's DaemonSet, and the DRA path's pod.
POD_FILES = ("daemonset.yaml", "helm/sidecar-patch.yaml", "dra/daemonset.yaml")


@pytest.mark.parametrize("pod_file", POD_FILES)
class TestDaemonSet:
    @pytest.mark.parametrize("variable", MIG_DEVICE_VARIABLES)
    def test_the_sidecar_container_asks_the_runtime_for_the_mig_capabilities(
        self, pod_file: str, variable: str
    ) -> None:
        container = sidecar_container((ROOT / "deploy" / pod_file).read_text())
        assert env_value(container, variable) == "all"

    def test_the_sidecar_container_is_privileged_which_the_mig_capabilities_require(
        self, pod_file: str
    ) -> None:
        container = sidecar_container((ROOT / "deploy" / pod_file).read_text())
        assert re.search(r"^\s*privileged: true\b", container, re.MULTILINE)

    def test_the_device_plugin_container_gets_no_mig_configuration_rights(self, pod_file: str) -> None:
        manifest = (ROOT / "deploy" / pod_file).read_text()
        sidecar = sidecar_container(manifest)
        for variable in MIG_DEVICE_VARIABLES:
            assert manifest.count(variable) == sidecar.count(variable)


def idle_policy(argv: list[str], environ: dict[str, str]) -> IdleSettings:
    parser = argparse.ArgumentParser()
    config.add_serve_flags(parser)
    return config.load(parser.parse_args(argv), environ).idle


def readme_defaults() -> dict[str, str]:
    """The README's configuration table: flag -> its default column, as written (backticks off)."""
    table = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-]+)[^|]*\| `HAMI_MIG_SIDECAR_\w+` \| ([^|]+) \|", table, re.MULTILINE)
    return {flag: default.strip().strip("`") for flag, default in rows}


IDLE_FLAGS = [s for s in config.SERVE_FLAGS if s.dest.startswith(("idle_", "max_idle"))]


class TestShippedDefaults:
    """What an operator installs is what the README says and what ``serve`` runs on its own: the idle
    policy (bench/README.md, "trace.py", measures it) comes from ``serve``'s defaults, and no
    manifest sets it otherwise, but for the DRA path's reserve, off (its plugin keeps each asked
    profile's next placement free itself: bench/README.md, "dra_claims.py")."""

    @pytest.mark.parametrize("spec", IDLE_FLAGS, ids=lambda s: s.flag)
    def test_the_readme_table_gives_serve_s_default(self, spec: config.FlagSpec) -> None:
        written = readme_defaults()[spec.flag]
        if spec.default is None or spec.switch:
            assert written == "off"
        elif written.replace(".", "").isdigit():
            assert float(written) == float(spec.default)
        else:
            assert written == spec.default

    @pytest.mark.parametrize("pod_file", POD_FILES)
    def test_the_manifest_runs_the_idle_policy_the_readme_gives(self, pod_file: str) -> None:
        container = sidecar_container((ROOT / "deploy" / pod_file).read_text())
        args = json.loads(re.search(r"^\s*args: (\[.*\])", container, re.MULTILINE).group(1))  # type: ignore[union-attr]
        environ = dict(re.findall(r"- name: (HAMI_MIG_SIDECAR_\w+)\s*\n\s*value: \"?([^\"\s#]*)", container))
        readme = [
            arg
            for spec in IDLE_FLAGS
            if (value := readme_defaults()[spec.flag]) != "off"
            for arg in (spec.flag, value)
        ]
        assert args[0] == "serve"
        shipped = idle_policy(args[1:], environ)
        if pod_file.startswith("dra/"):
            pairs = dict(zip(readme[::2], readme[1::2], strict=True))
            pairs.pop("--idle-reserve-window", None)
            pairs["--idle-reserve"] = "off"
            readme = [arg for pair in pairs.items() for arg in pair]
            assert shipped.reserve_asked_within_s is None
            assert not shipped.reserve
        else:
            assert shipped.reserve_asked_within_s is not None  # the measured best: the auto reserve
            assert shipped == idle_policy([], {})
        assert shipped == idle_policy(readme, {})


class TestContainerfile:
    @pytest.mark.parametrize("variable", MIG_DEVICE_VARIABLES)
    def test_the_image_asks_the_runtime_for_the_mig_capabilities(self, variable: str) -> None:
        text = (ROOT / "Containerfile").read_text()
        assert re.search(rf"^\s*(ENV\s+)?{variable}=all\b", text, re.MULTILINE)
