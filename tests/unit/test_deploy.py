"""The shipped deployment files give the sidecar container what NVML's MIG calls need on a real node.

With the NVIDIA container runtime hook, ``/proc/driver/nvidia/capabilities`` (the GI/CI ``access`` files
the CDI specs are rendered from) is visible in a container, and NVML's mig/config capability with it,
only when ``NVIDIA_MIG_CONFIG_DEVICES`` and ``NVIDIA_MIG_MONITOR_DEVICES`` ask for them; both need a
privileged container. Without them every create fails on the node while all simulated tests pass, so
the files themselves are checked here (as text: the image and the manifest are not built in tests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


# The standalone example and the Helm post-renderer's patch of the chart's DaemonSet.
POD_FILES = ("daemonset.yaml", "helm/sidecar-patch.yaml")


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


class TestContainerfile:
    @pytest.mark.parametrize("variable", MIG_DEVICE_VARIABLES)
    def test_the_image_asks_the_runtime_for_the_mig_capabilities(self, variable: str) -> None:
        text = (ROOT / "Containerfile").read_text()
        assert re.search(rf"^\s*(ENV\s+)?{variable}=all\b", text, re.MULTILINE)
