"""The log of every saoserve process (issue 42): one line an event, as text for a person or as
JSON for a log pipeline (``Settings.log_format``), with the ids of what the event is about.

An event's ids are fields: ``trajectory_id``, ``feedback_id``, ``version``, ``policy``,
``prompt_id``, ``tenant``, ``trace_id``. They come from the ``extra=`` of the call, or from
``bind``, which sets them for the rest of the current task (a chat request binds its trajectory
id once, and each line the request logs afterwards, in this module or in a library, carries it;
``contextvars``, so tasks started afterwards inherit it and other requests never see it).

JSON lines are python-json-logger's ``JsonFormatter`` (already installed with vLLM, which uses
it for its own JSON logs): ``{"time", "level", "logger", "message", <ids>, "exception"}``, one
object a line, the time in ISO 8601 UTC. Text lines are ``time level logger: message`` followed
by the bound ids as ``key=value``, so that a person can grep for a trajectory id either way.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

from pythonjsonlogger.json import JsonFormatter

from core.settings import LogFormat

ID_FIELDS = ("trajectory_id", "feedback_id", "version", "policy", "prompt_id", "tenant", "trace_id")
"""The ids an event may carry as fields (``bind``, ``extra=``)."""

# A new dict each time ids are bound (never changed in place), so a task's ids are its own.
_bound: contextvars.ContextVar[dict[str, object] | None] = contextvars.ContextVar(
    "saoserve_log_ids", default=None
)


@contextlib.contextmanager
def bind(**ids: object) -> Iterator[None]:
    """Within the ``with``, every line logged in this task (and in the tasks it starts) carries
    ``ids`` (keys of ``ID_FIELDS``; None values left out) besides those bound around it.

    Raises:
        ValueError: a key that is not one of ``ID_FIELDS``.
    """
    token = _bound.set(_merged(ids))
    try:
        yield
    finally:
        _bound.reset(token)


def bind_here(**ids: object) -> None:
    """``bind`` for the rest of the current task (no ``with``): a request handler's binding,
    which ends with its task."""
    _bound.set(_merged(ids))


def _merged(ids: dict[str, object]) -> dict[str, object]:
    unknown = set(ids) - set(ID_FIELDS)
    if unknown:
        raise ValueError(f"not a log id: {', '.join(sorted(unknown))} (ids: {', '.join(ID_FIELDS)})")
    return (_bound.get() or {}) | {k: v for k, v in ids.items() if v is not None}


def bound() -> dict[str, object]:
    """The ids bound now (a copy)."""
    return dict(_bound.get() or {})


class BoundIds(logging.Filter):
    """Sets each bound id (``bind``) on the record, unless the call's ``extra=`` set it."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_bound.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonLines(JsonFormatter):
    """One JSON object a line: ``time`` (ISO 8601 UTC), ``level``, ``logger``, ``message``, the
    ids the record carries (``ID_FIELDS``), and ``exception`` (the traceback) when there is one.
    Other ``extra=`` fields of a call are left out: the fields of a line are the ones above."""

    def __init__(self) -> None:
        super().__init__(json_ensure_ascii=False)

    def add_fields(self, log_record: dict, record: logging.LogRecord, message_dict: dict) -> None:
        log_record["time"] = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        log_record["level"] = record.levelname
        log_record["logger"] = record.name
        log_record["message"] = record.getMessage()
        for key in ID_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                log_record[key] = value
        if record.exc_info:
            log_record["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            log_record["exception"] = record.exc_text

    def format(self, record: logging.LogRecord) -> str:
        log_record: dict = {}
        self.add_fields(log_record, record, {})
        return self.serialize_log_record(log_record)


class TextLines(logging.Formatter):
    """``time level logger: message`` and the record's ids as ``key=value`` after it."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={getattr(record, k)}" for k in ID_FIELDS if getattr(record, k, None) is not None]
        if not ids:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the line
        return f"{head} [{' '.join(ids)}]{sep}{tail}"


def formatter(fmt: LogFormat) -> logging.Formatter:
    """The formatter of ``fmt``."""
    return JsonLines() if fmt is LogFormat.JSON else TextLines()


class _StderrHandler(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a line is written, not when the
    handler was made: a CLI runner or a test harness swaps stderr between commands, and a
    handler bound to a swapped-out (closed) stream fails every line after it."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(fmt: LogFormat, levels: dict[str, int], default: int = logging.WARNING) -> logging.Handler:
    """Send every logger's lines to stderr in ``fmt``: the root logger at ``default``, each
    logger of ``levels`` at its own level (``{"server": logging.INFO}``). A second call replaces
    the handler the first one installed (other handlers on the root, such as a test runner's
    log capture, stay). Returns the handler."""
    handler = _StderrHandler()
    handler.setFormatter(formatter(fmt))
    handler.addFilter(BoundIds())
    root = logging.getLogger()
    for old in list(root.handlers):
        if isinstance(old, _StderrHandler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(default)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    return handler


def uvicorn_log_config(fmt: LogFormat) -> dict | None:
    """uvicorn's ``log_config``: None in JSON mode, so that its loggers (``uvicorn.error``,
    ``uvicorn.access``) propagate to ``configure``'s handler and write JSON too; uvicorn's own
    coloured text otherwise."""
    if fmt is LogFormat.JSON:
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
