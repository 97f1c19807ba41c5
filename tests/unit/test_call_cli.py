"""``hami-mig-sidecar call`` and ``health`` without a sidecar: usage errors and the --field path."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from sidecar import cli
from sidecar.edge import call


def test_field_walks_keys_and_list_indexes() -> None:
    document = {"gpus": [{"uuid": "GPU-a", "mig_mode": {"current": True}}]}
    assert call._field(document, "gpus.0.uuid") == "GPU-a"
    assert call._field(document, "gpus.0.mig_mode") == {"current": True}
    for missing in ("gpus.1.uuid", "gpus.x", "nope", "gpus.0.uuid.more"):
        with pytest.raises(KeyError):
            call._field(document, missing)


def test_an_unknown_method_exits_2_naming_the_methods(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["call", "Allocat", "--socket", str(tmp_path / "s.sock")]) == call.EXIT_USAGE
    err = capsys.readouterr().err
    assert "no method 'Allocat'" in err
    assert "Allocate" in err
    assert call.HEALTH_CHECK in err


@pytest.mark.parametrize("request_text", ['{"pod_uid":', '{"no_such_field": 1}', "[]"])
def test_a_request_that_does_not_parse_exits_2_before_dialling(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, request_text: str
) -> None:
    socket = tmp_path / "missing.sock"
    assert cli.main(["call", "Release", request_text, "--socket", str(socket)]) == call.EXIT_USAGE
    assert "the request does not parse" in capsys.readouterr().err


def test_a_request_with_an_unknown_field_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    socket = tmp_path / "missing.sock"
    assert cli.main(["call", "GetState", '{"zzz":1}', "--socket", str(socket)]) == call.EXIT_USAGE
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("hami-mig-sidecar call GetState: the request does not parse: ")
    assert "zzz" in line


@pytest.mark.parametrize("timeout", ["nan", "0", "-1", "inf"])
def test_a_timeout_that_is_not_a_finite_number_above_0_is_bad_usage(tmp_path: Path, timeout: str) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["call", "GetInfo", "--timeout", timeout, "--socket", str(tmp_path / "s.sock")])
    assert exited.value.code == call.EXIT_USAGE


@pytest.mark.parametrize(
    "request_text",
    ['{"pod_uid":' * 100_000 + "1" + "}" * 100_000, "[" * 100_000 + "]" * 100_000],
    ids=["objects", "arrays"],
)
def test_a_deeply_nested_request_exits_2_with_a_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, request_text: str
) -> None:
    socket = tmp_path / "missing.sock"
    assert cli.main(["call", "Release", request_text, "--socket", str(socket)]) == call.EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == [
        "hami-mig-sidecar call Release: the request does not parse: nested too deeply"
    ]


def test_an_oversized_request_on_stdin_exits_2_without_reading_it_all(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = '{"pod_uid":"' + "u" * (call.MAX_REQUEST_TEXT + 10) + '"}'
    stream = io.StringIO(body)
    monkeypatch.setattr("sys.stdin", stream)
    assert cli.main(["call", "Release", "-", "--socket", str(tmp_path / "s.sock")]) == call.EXIT_USAGE
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("hami-mig-sidecar call Release: the request does not parse: it is over")
    assert stream.tell() == call.MAX_REQUEST_TEXT + 1  # the rest was never read


def test_no_socket_exits_1_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    socket = tmp_path / "missing.sock"
    assert cli.main(["call", "GetInfo", "--socket", str(socket)]) == call.EXIT_FAILED
    assert cli.main(["health", "--socket", str(socket)]) == call.EXIT_FAILED
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"hami-mig-sidecar call: no sidecar socket at {socket} (is the sidecar running?)",
        # health asks on the health listener beside the socket
        f"hami-mig-sidecar health: no sidecar socket at {socket}.health (is the sidecar running?)",
    ]


def test_every_method_of_the_contract_and_the_health_check_can_be_called() -> None:
    from hami.migsidecar.v1 import migsidecar_pb2 as pb  # noqa: PLC0415

    methods = call._methods()
    for method in pb.DESCRIPTOR.services_by_name["MigSidecar"].methods:
        assert methods[method.name][0] == f"/hami.migsidecar.v1.MigSidecar/{method.name}"
    assert methods[call.HEALTH_CHECK][0] == "/grpc.health.v1.Health/Check"
