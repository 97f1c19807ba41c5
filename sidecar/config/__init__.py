"""Settings of ``hami-mig-sidecar serve``: from flags, then environment, then defaults; validated once.

Every flag ``--some-flag`` can also come from the environment variable ``HAMI_MIG_SIDECAR_SOME_FLAG``
(a DaemonSet sets env more easily than it rewrites ``args``). A flag given on the command line wins over
the environment. The result is one frozen ``ServeConfig``; nothing downstream re-reads flags or env.

The flags themselves, with their defaults and meaning, are the table of ``sidecar.config.flags``;
this module reads them (``load``) and checks every value, naming in each message whether a bad value
came from a flag or from the environment.

The simulator is never chosen silently: ``--backend`` defaults to ``nvml`` and the simulated hardware
is only used when asked for by name. ``--sim-*`` flags together with ``--backend nvml`` are refused
rather than ignored, because they betray a misconfiguration.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

from sidecar.config.flags import (
    BACKENDS,
    DEFAULT_CDI_DIR,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_FOLLOWERS,
    DEFAULT_RECONCILE_INTERVAL_S,
    DEFAULT_SHUTDOWN_GRACE_S,
    DEFAULT_SOCKET,
    DEFAULT_STATE_DIR,
    DEFAULT_STUCK_THRESHOLD_S,
    DEFAULT_XID_IGNORE,
    LOG_LEVELS,
    MAX_SOCKET_PATH_BYTES,
    METRICS_PORT,
    RESERVE_AUTO,
    RESERVE_OFF,
    SERVE_FLAGS,
    FlagSpec,
    add_serve_flags,
    env_name,
)
from sidecar.edge import unixsocket
from sidecar.model.domain import PROFILE_NAME_RE
from sidecar.model.idle_policy import IdleSettings
from sidecar.nvml import profiles
from sidecar.store import cdi_format, driver_cdi
from sidecar.store.cdi import DEFAULT_KIND

_SIM_GPU_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?::([0-9]+))?")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class ConfigError(ValueError):
    """A setting is missing, malformed or contradicts another; the message names flag and env variable."""


class SimGpu(msgspec.Struct, frozen=True):
    model: str
    count: int = 1


class MetricsAddress(msgspec.Struct, frozen=True):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``serve`` needs, validated. ``cdi_dir`` None = CDI disabled (``--no-cdi``)."""

    socket: Path = DEFAULT_SOCKET
    state_dir: Path = DEFAULT_STATE_DIR
    cdi_dir: Path | None = DEFAULT_CDI_DIR
    cdi_kind: str = DEFAULT_KIND
    driver: driver_cdi.DriverSettings = driver_cdi.DriverSettings()
    backend: Literal["nvml", "simulated"] = "nvml"
    sim_state: Path | None = None
    sim_gpus: tuple[SimGpu, ...] = ()
    adopt_existing: bool = False
    hami_takeover: bool = True  # take over HAMi's in-process records and specs at recovery
    metrics_address: MetricsAddress | None = None
    log_level: str = "INFO"
    reconcile_interval_s: float = DEFAULT_RECONCILE_INTERVAL_S
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    stuck_threshold_s: float = DEFAULT_STUCK_THRESHOLD_S
    max_followers: int = DEFAULT_MAX_FOLLOWERS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle: IdleSettings = IdleSettings()
    xid_ignore: tuple[int, ...] = tuple(int(x) for x in DEFAULT_XID_IGNORE.split(","))

    @property
    def sim_gpus_text(self) -> str:
        """The ``MODEL:COUNT,...`` spelling the simulated backend takes."""
        return ",".join(f"{g.model}:{g.count}" for g in self.sim_gpus)


def load(args: argparse.Namespace | Mapping[str, object], environ: Mapping[str, str]) -> ServeConfig:
    """Resolve flag > env > default for every setting, then validate; raises ``ConfigError``."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    raw: dict[str, str | None] = {}
    origin: dict[str, str] = {}
    for spec in SERVE_FLAGS:
        value = given.get(spec.dest)
        if value is not None and value is not False:
            raw[spec.dest] = "true" if value is True else str(value)
            origin[spec.dest] = spec.flag
        elif spec.env in environ:
            raw[spec.dest] = environ[spec.env]
            origin[spec.dest] = f"environment variable {spec.env}"
        else:
            raw[spec.dest] = spec.default
            origin[spec.dest] = f"default of {spec.flag}"
    return _validate(raw, origin)


def _switch(raw: str | None, where: str) -> bool:
    text = (raw or "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{where}: {raw!r} is not a boolean (use true or false)")


def _seconds(raw: str | None, where: str) -> float:
    try:
        value = float(raw or "")
    except ValueError:
        raise ConfigError(f"{where}: {raw!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{where}: {raw!r} must be a positive number of seconds")
    return value


def _count(raw: str | None, where: str) -> int:
    text = (raw or "").strip()
    if not text.isdigit():
        raise ConfigError(f"{where}: {raw!r} is not a count (a whole number, 0 or more)")
    return int(text)


def _at_least_one(raw: str | None, where: str) -> int:
    count = _count(raw, where)
    if count < 1:
        raise ConfigError(f"{where}: {raw!r} must be at least 1")
    return count


def parse_xids(text: str, where: str) -> tuple[int, ...]:
    """``13,31`` -> (13, 31), sorted, each once; ``none`` -> ()."""
    if text.strip().lower() == "none":
        return ()
    parts = [part.strip() for part in text.split(",") if part.strip()]
    bad = [p for p in parts if not p.isdigit()]
    if bad or not parts:
        raise ConfigError(f"{where}: {', '.join(bad) or repr(text)} is not an Xid list (e.g. 13,31, or none)")
    return tuple(sorted({int(p) for p in parts}))


def parse_profiles(text: str, where: str) -> tuple[str, ...]:
    """``1g.10gb,3g.40gb`` -> ("1g.10gb", "3g.40gb"): full GI profile names, each once."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if not PROFILE_NAME_RE.fullmatch(n)]
    if bad or not names:
        raise ConfigError(
            f"{where}: {', '.join(bad) or repr(text)} is not a MIG profile name list (e.g. 1g.10gb,3g.40gb)"
        )
    return tuple(dict.fromkeys(names))


def _idle_settings(raw: Mapping[str, str | None], origin: Mapping[str, str]) -> IdleSettings:
    reserve = (raw["idle_reserve"] or "").strip()
    if reserve == RESERVE_OFF:
        reserve = ""
    auto = reserve == RESERVE_AUTO
    named = bool(reserve) and not auto
    window = _seconds(raw["idle_reserve_window"], origin["idle_reserve_window"])
    if not auto and _rank(origin["idle_reserve_window"]) > 0:  # set, not the default
        raise ConfigError(
            f"{origin['idle_reserve_window']} applies only with --idle-reserve {RESERVE_AUTO}"
            f" (the reserve is {'off' if not reserve else repr(reserve)})"
        )
    return IdleSettings(
        ttl_s=_seconds(raw["idle_ttl"], origin["idle_ttl"]) if raw["idle_ttl"] else None,
        max_idle_per_gpu=(
            _count(raw["max_idle_per_gpu"], origin["max_idle_per_gpu"]) if raw["max_idle_per_gpu"] else None
        ),
        reserve=parse_profiles(reserve, origin["idle_reserve"]) if named else (),
        reserve_per_gpu=_switch(raw["idle_reserve_per_gpu"], origin["idle_reserve_per_gpu"]),
        reserve_asked_within_s=window if auto else None,
    )


def parse_sim_gpus(text: str, where: str = "--sim-gpus") -> tuple[SimGpu, ...]:
    """``h100-80gb:2,a100-40gb`` -> (SimGpu("h100-80gb", 2), SimGpu("a100-40gb", 1)).

    Each model must be in the simulator's model table (``profiles.MODELS``, which ``sim init`` also
    goes by): an unknown one is a bad flag, refused here with the known models listed, not a failed
    startup once the backend opens."""
    gpus: list[SimGpu] = []
    for part in text.split(","):
        match = _SIM_GPU_RE.fullmatch(part.strip())
        if match is None:
            raise ConfigError(f"{where}: {part.strip()!r} is not MODEL[:COUNT] (e.g. h100-80gb:2)")
        count = int(match.group(2) or "1")
        if count < 1:
            raise ConfigError(f"{where}: the count of {match.group(1)!r} must be at least 1")
        try:
            model = profiles.model(match.group(1))
        except KeyError as exc:
            raise ConfigError(f"{where}: {exc.args[0]}") from None
        gpus.append(SimGpu(model.key, count))
    return tuple(gpus)


def parse_metrics_address(text: str, where: str = "--metrics-address") -> MetricsAddress:
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text.isdigit():
        example = f"e.g. 0.0.0.0:{METRICS_PORT} or :{METRICS_PORT}"
        raise ConfigError(f"{where}: {text!r} is not HOST:PORT ({example})")
    port = int(port_text)
    if port > 65535:
        raise ConfigError(f"{where}: port {port} is outside 0..65535 (0 picks a free port)")
    host = host.strip("[]") or "0.0.0.0"  # noqa: S104 - an empty host means all interfaces, as for Prometheus
    return MetricsAddress(host, port)


def _path(raw: str | None, where: str) -> Path:
    if not raw:
        raise ConfigError(f"{where}: a path is required")
    return Path(raw).expanduser()


def _rank(where: str) -> int:
    """How explicit a setting's origin is: a flag (2) beats the environment (1) beats a default (0)."""
    if where.startswith("--"):
        return 2
    return 1 if where.startswith("environment") else 0


def _validate(raw: Mapping[str, str | None], origin: Mapping[str, str]) -> ServeConfig:
    backend = (raw["backend"] or "").strip().lower()
    if backend not in BACKENDS:
        raise ConfigError(
            f"{origin['backend']}: backend {raw['backend']!r} is not one of {', '.join(BACKENDS)}"
        )

    # gRPC needs unix:///absolute/path; a relative --socket is taken relative to the working directory.
    socket = _path(raw["socket"], origin["socket"]).absolute()
    for path in (socket, unixsocket.health_socket(socket)):  # the health listener's beside it
        if len(str(path).encode()) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError(
                f"{origin['socket']}: socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes, "
                "the limit of a Unix socket address"
            )

    no_cdi = _switch(raw["no_cdi"], origin["no_cdi"])
    if no_cdi and _rank(origin["cdi_dir"]) == _rank(origin["no_cdi"]):
        raise ConfigError(f"{origin['cdi_dir']} and {origin['no_cdi']} contradict each other: choose one")
    if no_cdi and _rank(origin["cdi_dir"]) > _rank(origin["no_cdi"]):
        no_cdi = False  # an explicit --cdi-dir flag beats HAMI_MIG_SIDECAR_NO_CDI from the environment
    cdi_dir = None if no_cdi else _path(raw["cdi_dir"], origin["cdi_dir"])

    cdi_kind = (raw["cdi_kind"] or "").strip()
    try:
        cdi_format.parse_kind(cdi_kind)  # the rules CdiSpecs applies, so nothing that passes here fails there
    except ValueError as exc:
        raise ConfigError(
            f"{origin['cdi_kind']}: {exc}; want VENDOR/CLASS, each starting with a letter and ending with a "
            f"letter or digit, letters, digits, '_', '.', '-' between, the class at most 63 characters "
            f"(e.g. {DEFAULT_KIND})"
        ) from None

    sim_state = Path(raw["sim_state"]).expanduser() if raw["sim_state"] else None
    sim_gpus = parse_sim_gpus(raw["sim_gpus"], origin["sim_gpus"]) if raw["sim_gpus"] else ()
    if backend == "simulated" and sim_state is None:
        raise ConfigError("--backend simulated needs --sim-state FILE (the simulated hardware)")
    if backend == "nvml" and (sim_state is not None or sim_gpus):
        raise ConfigError(
            "--sim-state/--sim-gpus are only meaningful with --backend simulated; "
            "the simulator is never chosen implicitly"
        )

    metrics = (
        parse_metrics_address(raw["metrics_address"], origin["metrics_address"])
        if raw["metrics_address"]
        else None
    )

    log_level = (raw["log_level"] or "").strip().upper()
    if log_level not in LOG_LEVELS:
        raise ConfigError(
            f"{origin['log_level']}: {raw['log_level']!r} is not one of {', '.join(LOG_LEVELS)}"
        )

    return ServeConfig(
        socket=socket,
        state_dir=_path(raw["state_dir"], origin["state_dir"]),
        cdi_dir=cdi_dir,
        cdi_kind=cdi_kind,
        driver=driver_cdi.settings(raw, origin, ConfigError),
        backend="simulated" if backend == "simulated" else "nvml",
        sim_state=sim_state,
        sim_gpus=sim_gpus,
        adopt_existing=_switch(raw["adopt_existing"], origin["adopt_existing"]),
        hami_takeover=not _switch(raw["no_hami_takeover"], origin["no_hami_takeover"]),
        metrics_address=metrics,
        log_level=log_level,
        reconcile_interval_s=_seconds(raw["reconcile_interval"], origin["reconcile_interval"]),
        shutdown_grace_s=_seconds(raw["shutdown_grace"], origin["shutdown_grace"]),
        stuck_threshold_s=_seconds(raw["stuck_threshold"], origin["stuck_threshold"]),
        idle=_idle_settings(raw, origin),
        max_followers=_at_least_one(raw["max_followers"], origin["max_followers"]),
        max_connections=_at_least_one(raw["max_connections"], origin["max_connections"]),
        xid_ignore=parse_xids(raw["xid_ignore"] or DEFAULT_XID_IGNORE, origin["xid_ignore"]),
    )


__all__ = [
    "DEFAULT_SOCKET",
    "DEFAULT_STATE_DIR",
    "SERVE_FLAGS",
    "ConfigError",
    "FlagSpec",
    "MetricsAddress",
    "ServeConfig",
    "SimGpu",
    "add_serve_flags",
    "env_name",
    "load",
    "parse_metrics_address",
    "parse_profiles",
    "parse_sim_gpus",
    "parse_xids",
]
