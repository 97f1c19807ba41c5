"""The table of ``hami-mig-sidecar serve``'s settings: each flag, its environment twin, default and meaning.

Why a table (``SERVE_FLAGS``) instead of plain argparse defaults: the same table drives ``--help`` (each
entry names its env variable and default), the README's configuration table and the validation
messages of ``sidecar.config``, which say whether a bad value came from a flag or from the environment.
Every flag ``--some-flag`` can also come from the environment variable ``HAMI_MIG_SIDECAR_SOME_FLAG``
(``env_name``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from sidecar.edge import descriptors
from sidecar.nvml import profiles
from sidecar.nvml.port import XID_APPLICATION_ERRORS
from sidecar.store import driver_cdi
from sidecar.store.cdi import DEFAULT_KIND

ENV_PREFIX = "HAMI_MIG_SIDECAR_"

DEFAULT_SOCKET = Path("/var/lib/hami/mig-sidecar/sidecar.sock")
DEFAULT_STATE_DIR = Path("/var/run/hami/dynamic-mig-state")
DEFAULT_CDI_DIR = Path("/var/run/cdi")
DEFAULT_RECONCILE_INTERVAL_S = 10.0
DEFAULT_SHUTDOWN_GRACE_S = 5.0
DEFAULT_RESERVE_WINDOW_S = 3600.0  # a profile nobody asked for in an hour is not kept ready
RESERVE_AUTO = "auto"
RESERVE_OFF = "off"
DEFAULT_STUCK_THRESHOLD_S = 300.0  # far above the slowest NVML call (a GI create takes seconds)
# About 21 MiB of following streams at most, at about 42 KiB each (``sidecar.edge.health_feed``): the
# sidecar stays far under half the shipped 256 Mi limit with every one open. Its clients follow with one
# stream each (the HAMi adapter) or one per kubelet health stream (the DRA plugin): a handful.
DEFAULT_MAX_FOLLOWERS = 512
# Twice the followers' bound, so that every follower may have a connection of its own; the clients
# themselves hold a handful (one channel of the HAMi adapter, a few of the DRA plugin, a CLI's).
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_XID_IGNORE = ",".join(str(x) for x in sorted(XID_APPLICATION_ERRORS))  # the device plugin's

# sun_path is 108 bytes including the terminating NUL; gRPC refuses longer paths with an opaque error.
MAX_SOCKET_PATH_BYTES = 107

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
BACKENDS = ("nvml", "simulated")


class FlagSpec(msgspec.Struct, frozen=True):
    """One ``serve`` setting: its flag, its destination, whether it is a switch, default and meaning."""

    flag: str
    dest: str
    help: str
    default: str | None = None  # as text, the way the environment would spell it; None = unset
    switch: bool = False  # a store_true flag; env accepts 1/0, true/false, yes/no, on/off
    metavar: str | None = None

    @property
    def env(self) -> str:
        return env_name(self.flag)


def env_name(flag: str) -> str:
    """``--cdi-kind`` -> ``HAMI_MIG_SIDECAR_CDI_KIND``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


SERVE_FLAGS: tuple[FlagSpec, ...] = (
    FlagSpec(
        "--socket",
        "socket",
        "Unix socket to serve the gRPC API on (mode 0660, directory created 0750). Put it in a directory "
        "shared with the device plugin container, never under /var/lib/kubelet/device-plugins.",
        default=str(DEFAULT_SOCKET),
        metavar="PATH",
    ),
    FlagSpec(
        "--state-dir",
        "state_dir",
        "Directory of the durable ownership records; its lock keeps a second sidecar out.",
        default=str(DEFAULT_STATE_DIR),
        metavar="DIR",
    ),
    FlagSpec(
        "--cdi-dir",
        "cdi_dir",
        "Directory to write one CDI spec file per MIG instance into.",
        default=str(DEFAULT_CDI_DIR),
        metavar="DIR",
    ),
    FlagSpec(
        "--no-cdi",
        "no_cdi",
        "Legacy mode: write no CDI spec files (cdi_device is empty in responses).",
        switch=True,
    ),
    FlagSpec(
        "--cdi-kind",
        "cdi_kind",
        "CDI kind (vendor/class) of the spec files; a kind of its own so no other tool writes its names.",
        default=DEFAULT_KIND,
        metavar="VENDOR/CLASS",
    ),
    FlagSpec(
        "--backend",
        "backend",
        "Hardware backend: nvml (the real driver) or simulated (a simulated GPU node for demos and "
        "tests). Never chosen silently: without a driver, nvml fails at startup.",
        default="nvml",
        metavar="{nvml,simulated}",
    ),
    FlagSpec(
        "--sim-state",
        "sim_state",
        "With --backend simulated: the file holding the simulated hardware (created if missing).",
        metavar="FILE",
    ),
    FlagSpec(
        "--sim-gpus",
        "sim_gpus",
        "With --backend simulated: GPUs of a new --sim-state file, MODEL[:COUNT],... e.g. "
        "h100-80gb:2,a100-40gb:1 (ignored when the file exists); models: " + ", ".join(profiles.MODELS) + ".",
        metavar="MODEL[:COUNT],...",
    ),
    FlagSpec(
        "--adopt-existing-mig-instances",
        "adopt_existing",
        "At recovery, claim MIG instances without an ownership record (only when this sidecar "
        "exclusively owns the node's MIG layout).",
        switch=True,
    ),
    FlagSpec(
        "--no-hami-takeover",
        "no_hami_takeover",
        "At recovery, leave the ownership records and CDI specs of HAMi's in-process MIG lifecycle alone "
        "(their instances stay foreign) instead of taking them over.",
        switch=True,
    ),
    FlagSpec(
        "--metrics-address",
        "metrics_address",
        "Serve Prometheus metrics over HTTP on HOST:PORT (off when unset; port 0 picks a free one and "
        "the 'serving' log line names it).",
        metavar="HOST:PORT",
    ),
    FlagSpec(
        "--log-level",
        "log_level",
        "Lowest level logged (JSON lines on stderr): " + ", ".join(LOG_LEVELS) + ".",
        default="INFO",
        metavar="LEVEL",
    ),
    FlagSpec(
        "--reconcile-interval",
        "reconcile_interval",
        "Seconds between background retries of failed destroys and CDI removals.",
        default=str(DEFAULT_RECONCILE_INTERVAL_S),
        metavar="SECONDS",
    ),
    FlagSpec(
        "--idle-ttl",
        "idle_ttl",
        "Idle policy: the reconciler destroys an IDLE instance once it has been idle longer than this "
        "(off when unset).",
        metavar="SECONDS",
    ),
    FlagSpec(
        "--max-idle-per-gpu",
        "max_idle_per_gpu",
        "Idle policy: keep at most N IDLE instances per GPU; the reconciler destroys the least recently "
        "used beyond that (off when unset; 0 destroys every IDLE instance in the background).",
        metavar="N",
    ),
    FlagSpec(
        "--idle-reserve",
        "idle_reserve",
        "Idle policy: the profiles the scheduler allows, for which a free placement is kept ready on "
        "the node: when no GPU has one left, the reconciler destroys the least recently used IDLE "
        "instances that block one, so the next request finds it free instead of waiting for a destroy "
        "(profiles a GPU lacks are ignored on it). 'auto' (the default): the profiles Allocates asked "
        "for within --idle-reserve-window, as demand moves (none right after a start). 'off': no "
        "reserve, IDLE instances are destroyed only inside an Allocate that needs their slices.",
        default=RESERVE_AUTO,
        metavar="PROFILE[,PROFILE...]|auto|off",
    ),
    FlagSpec(
        "--idle-reserve-window",
        "idle_reserve_window",
        "With --idle-reserve auto: how long a profile stays reserved after the last Allocate that "
        "asked for it.",
        default=str(DEFAULT_RESERVE_WINDOW_S),
        metavar="SECONDS",
    ),
    FlagSpec(
        "--idle-reserve-per-gpu",
        "idle_reserve_per_gpu",
        "With --idle-reserve: keep the free placement ready on every GPU, not once on the node (for a "
        "scheduler that picks the GPU blind to the sidecar's advice; destroys much more idle cache).",
        switch=True,
    ),
    FlagSpec(
        "--shutdown-grace",
        "shutdown_grace",
        "Seconds in-flight RPCs get to answer after SIGTERM; a call still running then is cancelled"
        " towards its client, and the sidecar exits once its handler has returned.",
        default=str(DEFAULT_SHUTDOWN_GRACE_S),
        metavar="SECONDS",
    ),
    FlagSpec(
        "--stuck-threshold",
        "stuck_threshold",
        "Seconds an NVML call or a reconciler round may run before the health service answers "
        "NOT_SERVING (the liveness probe then restarts the container; a restart is crash-safe).",
        default=str(DEFAULT_STUCK_THRESHOLD_S),
        metavar="SECONDS",
    ),
    FlagSpec(
        "--max-followers",
        "max_followers",
        "WatchHealth streams that may follow at once; the next is refused RESOURCE_EXHAUSTED (reason "
        "OVERLOADED) and the Go clients retry it with backoff. Each costs about 42 KiB of memory.",
        default=str(DEFAULT_MAX_FOLLOWERS),
        metavar="N",
    ),
    FlagSpec(
        "--max-connections",
        "max_connections",
        "Connections the socket holds at once; a further one is closed as soon as it is accepted (the "
        "client sees UNAVAILABLE and retries). Fewer where the file descriptor limit leaves less: "
        f"{descriptors.RESERVED} descriptors stay for the sidecar's own files and "
        f"{descriptors.HEALTH_CONNECTIONS} for the health listener the probes ask on, beside the socket.",
        default=str(DEFAULT_MAX_CONNECTIONS),
        metavar="N",
    ),
    FlagSpec(
        "--xid-ignore",
        "xid_ignore",
        "Critical Xids that do not fault an instance (application errors; the NVIDIA device plugin's "
        "default); every other Xid NVML reports on an instance, or on its whole GPU, keeps it from "
        "ever being reused. 'none' counts every Xid.",
        default=DEFAULT_XID_IGNORE,
        metavar="XID,...",
    ),
    *(FlagSpec(*row) for row in driver_cdi.FLAGS),
)


METRICS_PORT = 9408
"""The metrics port the manifests and ``make run-sim`` use (the flag itself is off by default). The
sidecar runs in HAMi's device-plugin pod, which the chart puts on the host's network with
``devicePlugin.hostNetwork=true``, so its port must be none that a GPU node's usual exporters take:
9400 is dcgm-exporter's, 9100 node-exporter's, 9394 and 9395 HAMi's vGPU monitor and scheduler (the
Prometheus project's list of default exporter ports has the first two). Change it here and in
deploy/ and the Makefile together."""


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Declare the ``serve`` flags. Defaults stay None so ``load`` can tell "not given" from "given"."""
    for spec in SERVE_FLAGS:
        default = "unset" if spec.default is None else spec.default
        if spec.switch:
            default = "off"
        text = f"{spec.help} [env {spec.env}; default: {default}]"
        if spec.switch:
            parser.add_argument(spec.flag, dest=spec.dest, action="store_true", default=None, help=text)
        else:
            parser.add_argument(spec.flag, dest=spec.dest, default=None, metavar=spec.metavar, help=text)
