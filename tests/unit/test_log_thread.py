"""Logging as ``serve`` configures it: every line written by the log thread, in the order logged,
the hardware lines with the same fields as when they were written in the call."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from helpers_records import GPU, MIG, make_record

from sidecar.lifecycle import logs


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logs.configure("INFO", out)
    try:
        yield out
    finally:
        logs.stop_logging()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def lines(out: io.StringIO) -> list[dict[str, object]]:
    logs.stop_logging()  # writes every queued line
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_lines_keep_their_order_and_a_hardware_line_its_fields(stream: io.StringIO) -> None:
    other = logging.getLogger("sidecar.test")
    logs.event(other, logging.INFO, "before", n=1)
    logs.hardware_change("reused", make_record(), was="IDLE")
    try:
        raise ValueError("boom")
    except ValueError:
        other.exception("after")
    other.debug("below the level")
    first, hardware, last = lines(stream)
    assert (first["msg"], first["n"]) == ("before", 1)
    assert hardware == {
        "ts": hardware["ts"],
        "level": "INFO",
        "logger": "sidecar.hardware",
        "msg": "MIG instance reused",
        "action": "reused",
        "gpu": GPU,
        "profile": "1g.10gb",
        "placement": "0:1",
        "mig_uuid": MIG,
        "owner": "default/trainer (pod-uid-1) container main",
        "record": f"mig-{GPU}-0-1",
        "was": "IDLE",
    }
    assert str(hardware["ts"]).endswith("+00:00")
    assert last["msg"] == "after"
    assert "ValueError: boom" in str(last["exc"])


def test_a_hardware_line_below_the_level_is_not_written(stream: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.WARNING)
    logs.hardware_change("reused", make_record())
    assert lines(stream) == []
