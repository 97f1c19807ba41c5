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

Why a log thread: a reuse is three NVML reads and one record write, and its line cost about 180 us
inside the call (the fields, the JSON, the LogRecord with its caller lookup, a write and a flush):
HAMi's release -> reuse sequence went from 1.33x to 1.48x ALREADY_ALLOCATED's p50 with it
(``bench/HISTORY.md``). Now one thread writes every line, in the order they were logged: a
``hardware_change`` puts only a tuple (time, action, record, fields) on its queue, and the thread
makes the LogRecord, the fields' text and the JSON (msgspec); any other line comes as a LogRecord
(``logging.handlers.QueueHandler``), formatted there too. The thread writes a burst of lines
``BATCH_S`` after its first, so it wakes once per burst, not beside every request that logs. What
goes over is not copied: the queue stays in this process, and what is logged (strings, numbers,
frozen records) does not change after. ``configure`` also skips the caller lookup
(``logging._srcfile``, as the logging HOWTO's "Optimization" says: no line shows a file or line)
and, at exit, stops the thread once every queued line is written; a kill -9 loses the lines of its
last moment. Without ``configure`` (tests, the in-process sidecar) every line is logged in the call.
"""

from __future__ import annotations

import atexit
import datetime as dt
import logging
import logging.handlers
import queue
import sys
import time
from typing import IO, Any

import msgspec

from sidecar.model.ownership import OwnershipRecord, hardware_fields

# store.table writes its ERROR line with this attribute too (the store sits below this module).
_FIELDS_ATTR = "sidecar_fields"
_INSTANCE_ATTR = "sidecar_instance"  # the record a hardware_change line is about, made text here
_ENCODER = msgspec.json.Encoder(enc_hook=str)  # a value that is not JSON becomes its str


_SECOND: list[tuple[int, str]] = [(-1, "")]  # the second last formatted, as the log thread wrote it


def _rfc3339(created: float) -> str:
    """``2026-01-01T00:00:00.123+00:00``; the part up to the second is made once a second."""
    second = int(created)
    known, text = _SECOND[0]
    if known != second:
        text = dt.datetime.fromtimestamp(second, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _SECOND[0] = (second, text)
    return f"{text}.{int((created - second) * 1000):03d}+00:00"


class JsonFormatter(logging.Formatter):
    """``{"ts": RFC 3339 UTC, "level", "logger", "msg", ...fields, "exc": traceback}``."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "ts": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, _FIELDS_ATTR, None)
        if isinstance(fields, dict):
            instance = getattr(record, _INSTANCE_ATTR, None)
            if isinstance(instance, OwnershipRecord):  # after "action", before the caller's fields
                fields = {"action": fields.get("action"), **hardware_fields(instance), **fields}
            for key, value in fields.items():
                document.setdefault(key, value)
        if record.exc_info:
            document["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(document).decode()


class _AsIs(logging.handlers.QueueHandler):
    """Puts the record itself on the queue; the listener's handler formats it (module docstring)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


BATCH_S = 0.05  # how long the log thread lets lines gather after the first of a burst


class _Batching(logging.handlers.QueueListener):
    """Writes a burst of lines at once, ``BATCH_S`` after its first line: the thread wakes once per
    burst, not beside every request that logs (module docstring)."""

    def __init__(self, records: queue.SimpleQueue[Any], handler: logging.Handler) -> None:
        super().__init__(records, handler)
        self.records = records

    def dequeue(self, block: bool) -> Any:
        try:
            return self.records.get_nowait()
        except queue.Empty:
            if not block:
                raise
        record = self.records.get()
        if record is not None:  # QueueListener's sentinel: ``stop``
            time.sleep(BATCH_S)
        return record

    def prepare(self, record: Any) -> logging.LogRecord:
        """A ``hardware_change`` came as ``(created, action, instance, fields)``: its LogRecord is
        made here, stamped with the time it was logged."""
        if isinstance(record, logging.LogRecord):
            return record
        created, action, instance, fields = record
        made = logging.LogRecord(_hardware_log.name, logging.INFO, "", 0, _HARDWARE_MSG, (action,), None)
        made.created = created
        setattr(made, _FIELDS_ATTR, {"action": action, **fields})
        setattr(made, _INSTANCE_ATTR, instance)
        return made


_listener: _Batching | None = None


def configure(level: str = "INFO", stream: IO[str] | None = None) -> None:
    """Route the root logger to ``stream`` (stderr) as JSON lines at ``level``, written by the log
    thread (module docstring); idempotent: a second call ends the first's thread after its lines."""
    global _listener  # noqa: PLW0603 - one log thread per process, as there is one root logger
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter())
    records: queue.SimpleQueue[Any] = queue.SimpleQueue()
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    stop_logging()
    root.addHandler(_AsIs(records))
    root.setLevel(level)
    logging._srcfile = None  # no caller lookup: the JSON has no file or line
    _listener = _Batching(records, handler)
    _listener.start()


def stop_logging() -> None:
    """Write every queued line and end the log thread (at exit; nothing when none runs)."""
    global _listener
    listener, _listener = _listener, None
    if listener is not None:
        listener.stop()


atexit.register(stop_logging)


def event(logger: logging.Logger, level: int, msg: str, *, exc_info: bool = False, **fields: object) -> None:
    """Log ``msg`` with structured ``fields`` (values that are not JSON become strings)."""
    logger.log(level, msg, exc_info=exc_info, extra={_FIELDS_ATTR: fields})


HARDWARE_ACTIONS = ("created", "reused", "reclaimed", "destroyed", "adopted")
"""The ``action`` of a ``hardware_change`` line; ``ERROR`` lines come from ``RecordTable.fail``."""

_hardware_log = logging.getLogger("sidecar.hardware")
_HARDWARE_MSG = "MIG instance %s"


def hardware_change(action: str, record: OwnershipRecord, **fields: object) -> None:
    """One INFO line for a change of the MIG layout (or an instance taken over): see the module."""
    assert action in HARDWARE_ACTIONS, action
    listener = _listener
    if listener is not None and _hardware_log.isEnabledFor(logging.INFO):
        # The log thread makes the LogRecord too: the request pays a tuple on a queue.
        listener.records.put((time.time(), action, record, fields))
        return
    extra = {_FIELDS_ATTR: {"action": action, **fields}, _INSTANCE_ATTR: record}
    _hardware_log.info(_HARDWARE_MSG, action, extra=extra)
