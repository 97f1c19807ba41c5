"""Logging as one JSON object per line on stderr.

Why JSON lines: the sidecar runs as a container beside HAMi's device plugin and its logs are read by
log collectors and by ``kubectl logs | jq``; a stable ``msg`` plus typed fields (``socket``, ``gpu``,
``reason``) is greppable where a formatted sentence is not. Tests also read the ``serving`` line.

Fields go through ``event(logger, level, msg, **fields)``; the standard ``logging`` API keeps working
for libraries (their records get the same envelope without extra fields).

Every change of the MIG layout the sidecar makes, and every instance it takes over, leaves one line at
the default level (``hardware_change``): ``"msg": "MIG instance created"`` (reused, reclaimed,
destroyed, adopted; ``ERROR`` at WARNING, from ``store.table``), with ``action``, ``gpu``,
``profile``, ``placement``, ``mig_uuid``, ``owner`` and ``record``. An operator who finds a MIG
instance in ``nvidia-smi`` that a pod lost finds here when and why the sidecar made or removed it.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import IO, Any

from sidecar.model.ownership import OwnershipRecord, hardware_fields

# store.table writes its ERROR line with this attribute too (the store sits below this module).
_FIELDS_ATTR = "sidecar_fields"


class JsonFormatter(logging.Formatter):
    """``{"ts": RFC 3339 UTC, "level", "logger", "msg", ...fields, "exc": traceback}``."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, tz=dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, _FIELDS_ATTR, None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                document.setdefault(key, value)
        if record.exc_info:
            document["exc"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str, separators=(",", ":"))


def configure(level: str = "INFO", stream: IO[str] | None = None) -> None:
    """Route the root logger to ``stream`` (stderr) as JSON lines at ``level``; idempotent."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def event(logger: logging.Logger, level: int, msg: str, *, exc_info: bool = False, **fields: object) -> None:
    """Log ``msg`` with structured ``fields`` (values that are not JSON become strings)."""
    logger.log(level, msg, exc_info=exc_info, extra={_FIELDS_ATTR: fields})


HARDWARE_ACTIONS = ("created", "reused", "reclaimed", "destroyed", "adopted")
"""The ``action`` of a ``hardware_change`` line; ``ERROR`` lines come from ``RecordTable.fail``."""

_hardware_log = logging.getLogger("sidecar.hardware")


def hardware_change(action: str, record: OwnershipRecord, **fields: object) -> None:
    """One INFO line for a change of the MIG layout (or an instance taken over): see the module."""
    assert action in HARDWARE_ACTIONS, action
    document: dict[str, object] = {"action": action, **hardware_fields(record), **fields}
    _hardware_log.info("MIG instance %s", action, extra={_FIELDS_ATTR: document})
