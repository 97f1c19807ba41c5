"""``serve`` settings: flag beats environment beats default, and every bad value is refused with a
message that names where it came from."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sidecar import config
from sidecar.config import ConfigError, MetricsAddress, ServeConfig, SimGpu
from sidecar.model.idle_policy import IdleSettings
from sidecar.nvml import profiles
from sidecar.store.cdi import CdiSpecs


def parse(argv: list[str], environ: dict[str, str] | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser()
    config.add_serve_flags(parser)
    return config.load(parser.parse_args(argv), environ or {})


class TestDefaults:
    def test_without_flags_or_environment_the_architecture_defaults_apply(self) -> None:
        settings = parse([])
        assert settings.socket == Path("/var/lib/hami/mig-sidecar/sidecar.sock")
        assert settings.state_dir == Path("/var/run/hami/dynamic-mig-state")
        assert settings.cdi_dir == Path("/var/run/cdi")
        assert settings.cdi_kind == "k8s.hami.io/mig"
        assert settings.backend == "nvml"
        assert settings.adopt_existing is False
        assert settings.metrics_address is None
        assert settings.log_level == "INFO"
        assert settings.reconcile_interval_s == 10.0

    def test_the_simulator_is_never_the_default_backend(self) -> None:
        assert parse([]).backend == "nvml"


class TestEnvironment:
    def test_every_flag_has_an_environment_variable_named_after_it(self) -> None:
        names = {spec.flag: spec.env for spec in config.SERVE_FLAGS}
        assert names["--socket"] == "HAMI_MIG_SIDECAR_SOCKET"
        assert names["--adopt-existing-mig-instances"] == "HAMI_MIG_SIDECAR_ADOPT_EXISTING_MIG_INSTANCES"
        assert names["--reconcile-interval"] == "HAMI_MIG_SIDECAR_RECONCILE_INTERVAL"

    def test_environment_values_are_used_when_no_flag_is_given(self) -> None:
        settings = parse(
            [],
            {
                "HAMI_MIG_SIDECAR_SOCKET": "/run/x/s.sock",
                "HAMI_MIG_SIDECAR_BACKEND": "simulated",
                "HAMI_MIG_SIDECAR_SIM_STATE": "/tmp/hw.json",
                "HAMI_MIG_SIDECAR_SIM_GPUS": "h100-80gb:2,a100-40gb",
                "HAMI_MIG_SIDECAR_ADOPT_EXISTING_MIG_INSTANCES": "true",
                "HAMI_MIG_SIDECAR_METRICS_ADDRESS": ":9408",
                "HAMI_MIG_SIDECAR_LOG_LEVEL": "debug",
            },
        )
        assert settings.socket == Path("/run/x/s.sock")
        assert settings.backend == "simulated"
        assert settings.sim_state == Path("/tmp/hw.json")
        assert settings.sim_gpus == (SimGpu("h100-80gb", 2), SimGpu("a100-40gb", 1))
        assert settings.sim_gpus_text == "h100-80gb:2,a100-40gb:1"
        assert settings.adopt_existing is True
        assert settings.metrics_address == MetricsAddress("0.0.0.0", 9408)  # noqa: S104 - the default host
        assert settings.log_level == "DEBUG"

    def test_a_flag_wins_over_the_environment(self) -> None:
        settings = parse(["--state-dir", "/from/flag"], {"HAMI_MIG_SIDECAR_STATE_DIR": "/from/env"})
        assert settings.state_dir == Path("/from/flag")

    def test_no_cdi_from_the_environment_disables_cdi(self) -> None:
        assert parse([], {"HAMI_MIG_SIDECAR_NO_CDI": "1"}).cdi_dir is None

    def test_an_explicit_cdi_dir_flag_beats_no_cdi_from_the_environment(self) -> None:
        settings = parse(["--cdi-dir", "/x/cdi"], {"HAMI_MIG_SIDECAR_NO_CDI": "yes"})
        assert settings.cdi_dir == Path("/x/cdi")

    def test_an_unreadable_boolean_in_the_environment_is_refused_naming_the_variable(self) -> None:
        with pytest.raises(ConfigError, match="HAMI_MIG_SIDECAR_ADOPT_EXISTING_MIG_INSTANCES"):
            parse([], {"HAMI_MIG_SIDECAR_ADOPT_EXISTING_MIG_INSTANCES": "maybe"})


class TestValidation:
    def test_cdi_dir_and_no_cdi_together_contradict(self) -> None:
        with pytest.raises(ConfigError, match="contradict"):
            parse(["--cdi-dir", "/x", "--no-cdi"])

    def test_no_cdi_flag_disables_cdi(self) -> None:
        assert parse(["--no-cdi"]).cdi_dir is None

    def test_an_unknown_backend_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="not one of nvml, simulated"):
            parse(["--backend", "mock"])

    def test_the_simulated_backend_needs_a_state_file(self) -> None:
        with pytest.raises(ConfigError, match="--sim-state"):
            parse(["--backend", "simulated"])

    def test_simulator_flags_with_the_nvml_backend_are_refused_not_ignored(self) -> None:
        with pytest.raises(ConfigError, match="only meaningful with --backend simulated"):
            parse(["--sim-state", "/tmp/hw.json"])

    @pytest.mark.parametrize("text", ["h100-80gb:0", "h100-80gb:x", ":2", "h100 80gb"])
    def test_malformed_simulated_gpu_lists_are_refused(self, text: str) -> None:
        with pytest.raises(ConfigError, match="--sim-gpus"):
            parse(["--backend", "simulated", "--sim-state", "/tmp/hw.json", "--sim-gpus", text])

    def test_an_unknown_simulated_gpu_model_is_refused_listing_the_known_ones(self) -> None:
        with pytest.raises(ConfigError, match="--sim-gpus: unknown GPU model 'h999'") as refused:
            parse(["--backend", "simulated", "--sim-state", "/tmp/hw.json", "--sim-gpus", "h100-80gb,h999:1"])
        for known in profiles.MODELS:
            assert known in str(refused.value)

    def test_an_unknown_simulated_gpu_model_from_the_environment_names_the_variable(self) -> None:
        environ = {"HAMI_MIG_SIDECAR_SIM_GPUS": "a100-41gb"}
        with pytest.raises(ConfigError, match="HAMI_MIG_SIDECAR_SIM_GPUS: unknown GPU model"):
            parse(["--backend", "simulated", "--sim-state", "/tmp/hw.json"], environ)

    def test_simulated_gpu_models_are_read_in_any_case(self) -> None:
        settings = parse(
            ["--backend", "simulated", "--sim-state", "/tmp/hw.json", "--sim-gpus", "H200-141GB:2"]
        )
        assert settings.sim_gpus == (SimGpu("h200-141gb", 2),)

    def test_a_socket_path_longer_than_a_unix_address_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="longer than 107 bytes"):
            parse(["--socket", "/" + "s" * 120])

    @pytest.mark.parametrize(
        "kind",
        [
            "nvidia.com",
            "k8s.hami.io/",
            "/mig",
            "9hami.io/mig",  # a vendor starts with a letter
            "k8s.hami.io/mig-",  # a class ends with a letter or digit
            "k8s.hami.io/mig_",
            "k8s.hami.io/mig.",
            "k8s.hami.io/" + "m" * 64,  # a class has at most 63 characters
        ],
    )
    def test_a_cdi_kind_must_follow_the_cdi_name_rules(self, kind: str) -> None:
        with pytest.raises(ConfigError, match=r"--cdi-kind: .*not a CDI kind"):
            parse(["--cdi-kind", kind])

    def test_a_bad_cdi_kind_from_the_environment_names_the_variable(self) -> None:
        with pytest.raises(ConfigError, match="HAMI_MIG_SIDECAR_CDI_KIND"):
            parse([], {"HAMI_MIG_SIDECAR_CDI_KIND": "k8s.hami.io/mig-"})

    @pytest.mark.parametrize("kind", ["example.com/gpu", "Example_Vendor/mig.v2", "k8s.hami.io/" + "m" * 63])
    def test_every_kind_the_cdi_rules_allow_is_accepted_as_given(self, kind: str) -> None:
        settings = parse(["--cdi-kind", f" {kind} "])
        assert settings.cdi_kind == kind
        assert CdiSpecs(settings.cdi_dir, kind=settings.cdi_kind).kind == kind

    @pytest.mark.parametrize("address", ["9408", "host:", "host:99999", "host:-1"])
    def test_a_metrics_address_must_be_host_and_port(self, address: str) -> None:
        with pytest.raises(ConfigError, match="--metrics-address"):
            parse(["--metrics-address", address])

    def test_a_metrics_address_with_a_host_keeps_it(self) -> None:
        assert parse(["--metrics-address", "127.0.0.1:9408"]).metrics_address == MetricsAddress(
            "127.0.0.1", 9408
        )

    @pytest.mark.parametrize("seconds", ["0", "-1", "soon", "inf", "nan"])
    def test_the_reconcile_interval_must_be_a_positive_number(self, seconds: str) -> None:
        with pytest.raises(ConfigError, match="--reconcile-interval"):
            parse(["--reconcile-interval", seconds])

    def test_an_unknown_log_level_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="--log-level"):
            parse(["--log-level", "chatty"])


class TestIdlePolicy:
    def test_the_default_is_the_auto_reserve_and_off_turns_every_trim_off(self) -> None:
        assert parse([]).idle == IdleSettings(reserve_asked_within_s=3600.0)
        assert parse(["--idle-reserve-window", "600"]).idle == IdleSettings(reserve_asked_within_s=600.0)
        assert parse(["--idle-reserve", "off"]).idle == IdleSettings()
        assert not parse([], {"HAMI_MIG_SIDECAR_IDLE_RESERVE": "off"}).idle.enabled

    def test_flags_set_ttl_cap_and_reserve(self) -> None:
        settings = parse(
            ["--idle-ttl", "300", "--max-idle-per-gpu", "0", "--idle-reserve", "1g.10gb, 3g.40gb,1g.10gb"]
        ).idle
        assert settings == IdleSettings(ttl_s=300.0, max_idle_per_gpu=0, reserve=("1g.10gb", "3g.40gb"))
        assert settings.enabled

    def test_the_environment_sets_them_too(self) -> None:
        environ = {
            "HAMI_MIG_SIDECAR_IDLE_TTL": "60",
            "HAMI_MIG_SIDECAR_MAX_IDLE_PER_GPU": "2",
            "HAMI_MIG_SIDECAR_IDLE_RESERVE": "2g.20gb",
        }
        assert parse([], environ).idle == IdleSettings(ttl_s=60.0, max_idle_per_gpu=2, reserve=("2g.20gb",))

    def test_auto_reserves_the_profiles_asked_for_within_the_window(self) -> None:
        settings = parse(["--idle-reserve", "auto"]).idle
        assert settings == IdleSettings(reserve_asked_within_s=3600.0)
        assert settings.enabled
        assert settings.reserved({"3g.40gb": 100.0, "1g.10gb": 5000.0}, 3700.0) == ("1g.10gb", "3g.40gb")
        assert settings.reserved({"3g.40gb": 100.0, "1g.10gb": 5000.0}, 3701.0) == ("1g.10gb",)
        environ = {"HAMI_MIG_SIDECAR_IDLE_RESERVE": "auto", "HAMI_MIG_SIDECAR_IDLE_RESERVE_WINDOW": "600"}
        assert parse([], environ).idle == IdleSettings(reserve_asked_within_s=600.0)

    def test_a_named_reserve_ignores_what_was_asked(self) -> None:
        settings = parse(["--idle-reserve", "2g.20gb"]).idle
        assert settings.reserved({"3g.40gb": 100.0}, 100.0) == ("2g.20gb",)

    @pytest.mark.parametrize(
        ("argv", "named"),
        [
            (["--idle-reserve", "off", "--idle-reserve-window", "600"], "--idle-reserve-window"),
            (["--idle-reserve", "1g.10gb", "--idle-reserve-window", "600"], "--idle-reserve-window"),
            (["--idle-reserve", "auto", "--idle-reserve-window", "0"], "--idle-reserve-window"),
            (["--idle-ttl", "0"], "--idle-ttl"),
            (["--idle-ttl", "soon"], "--idle-ttl"),
            (["--max-idle-per-gpu", "-1"], "--max-idle-per-gpu"),
            (["--max-idle-per-gpu", "1.5"], "--max-idle-per-gpu"),
            (["--idle-reserve", "1g.10gb,large"], "--idle-reserve"),
            (["--idle-reserve", ","], "--idle-reserve"),
        ],
    )
    def test_bad_values_are_refused_naming_the_flag(self, argv: list[str], named: str) -> None:
        with pytest.raises(ConfigError, match=named):
            parse(argv)


class TestHelp:
    def test_help_names_the_environment_variable_and_default_of_every_flag(self) -> None:
        parser = argparse.ArgumentParser()
        config.add_serve_flags(parser)
        text = " ".join(parser.format_help().split())
        for spec in config.SERVE_FLAGS:
            assert spec.flag in text
            assert spec.env in text


class TestHamiTakeover:
    def test_taking_over_hamis_files_is_on_by_default(self) -> None:
        assert parse([]).hami_takeover is True

    def test_the_flag_or_its_environment_variable_turns_it_off(self) -> None:
        assert parse(["--no-hami-takeover"]).hami_takeover is False
        assert parse([], {"HAMI_MIG_SIDECAR_NO_HAMI_TAKEOVER": "true"}).hami_takeover is False
        assert parse([], {"HAMI_MIG_SIDECAR_NO_HAMI_TAKEOVER": "false"}).hami_takeover is True


def test_xids_ignored_by_default_are_the_device_plugins_application_errors() -> None:
    assert parse([]).xid_ignore == (13, 31, 43, 45, 68, 109)
    assert parse(["--xid-ignore", "13, 43,13"]).xid_ignore == (13, 43)
    assert parse([], {"HAMI_MIG_SIDECAR_XID_IGNORE": "none"}).xid_ignore == ()


@pytest.mark.parametrize("bad", ["79,x", "-1", ",", "13;31"])
def test_an_xid_list_that_is_not_one_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="--xid-ignore"):
        parse(["--xid-ignore", bad])


class TestConnections:
    def test_the_socket_holds_1024_connections_unless_told(self) -> None:
        assert parse([]).max_connections == 1024
        assert parse(["--max-connections", "64"]).max_connections == 64
        assert parse([], {"HAMI_MIG_SIDECAR_MAX_CONNECTIONS": "32"}).max_connections == 32

    @pytest.mark.parametrize("value", ["0", "-1", "many"])
    def test_a_bound_below_one_is_refused(self, value: str) -> None:
        with pytest.raises(ConfigError, match="--max-connections"):
            parse(["--max-connections", value])

    def test_a_socket_whose_health_listener_would_not_fit_an_address_is_refused(self) -> None:
        socket = "/" + "s" * 100  # 101 bytes fit; with ".health" beside it, 108 do not
        with pytest.raises(ConfigError, match=f"socket path {socket}.health is longer than 107 bytes"):
            parse(["--socket", socket])
        assert parse(["--socket", socket[:-1]]).socket == Path(socket[:-1])
