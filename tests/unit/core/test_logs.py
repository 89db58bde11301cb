"""core.logs: one line an event, as JSON or text, with the bound ids as fields; error cases."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from core import logs
from core.settings import LogFormat


@pytest.fixture
def capture():
    """A logger ``t.logs`` writing to a buffer through ``configure``'s handler and filter."""
    buf = io.StringIO()

    def make(fmt: LogFormat) -> logging.Logger:
        handler = logging.StreamHandler(buf)
        handler.setFormatter(logs.formatter(fmt))
        handler.addFilter(logs.BoundIds())
        logger = logging.getLogger("t.logs")
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
        return logger

    yield make, buf
    logging.getLogger("t.logs").handlers[:] = []


def test_json_lines_carry_the_bound_ids(capture):
    make, buf = capture
    log = make(LogFormat.JSON)
    with logs.bind(trajectory_id="chatcmpl-1", version=3):
        log.info("answered %d tokens", 2)
        with logs.bind(tenant="acme", version=4):  # the inner binding wins for its keys
            log.warning("slow")
    log.info("free", extra={"feedback_id": "f-9"})
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [(d["level"], d["logger"], d["message"]) for d in lines] == [
        ("INFO", "t.logs", "answered 2 tokens"),
        ("WARNING", "t.logs", "slow"),
        ("INFO", "t.logs", "free"),
    ]
    assert {k: lines[0][k] for k in ("trajectory_id", "version")} == {
        "trajectory_id": "chatcmpl-1",
        "version": 3,
    }
    assert (lines[1]["trajectory_id"], lines[1]["version"], lines[1]["tenant"]) == ("chatcmpl-1", 4, "acme")
    assert "trajectory_id" not in lines[2] and lines[2]["feedback_id"] == "f-9"
    assert set(lines[2]) == {"time", "level", "logger", "message", "feedback_id"}
    assert lines[0]["time"].endswith("+00:00")


def test_an_exception_is_one_json_line(capture):
    make, buf = capture
    log = make(LogFormat.JSON)
    try:
        raise ValueError("bad\nsecond line")
    except ValueError:
        log.exception("failed")
    (line,) = buf.getvalue().splitlines()  # the traceback stays inside the one line
    d = json.loads(line)
    assert d["message"] == "failed" and "ValueError: bad\nsecond line" in d["exception"]


def test_text_lines_put_the_ids_after_the_message(capture):
    make, buf = capture
    log = make(LogFormat.TEXT)
    with logs.bind(trajectory_id="chatcmpl-1", policy="global"):
        log.info("answered")
    log.info("plain")
    first, second = buf.getvalue().splitlines()
    assert first.endswith("INFO t.logs: answered [trajectory_id=chatcmpl-1 policy=global]")
    assert second.endswith("INFO t.logs: plain")


def test_a_binding_is_the_tasks_own():
    async def request(tid: str) -> dict:
        logs.bind_here(trajectory_id=tid)
        await asyncio.sleep(0)
        return logs.bound()

    async def both():
        return await asyncio.gather(request("a"), request("b"))

    assert asyncio.run(both()) == [{"trajectory_id": "a"}, {"trajectory_id": "b"}]
    assert logs.bound() == {}


def test_an_unknown_id_is_refused():
    with pytest.raises(ValueError, match="not a log id: trajectory"), logs.bind(trajectory="x"):
        pass
    with logs.bind(version=None):  # None values are left out
        assert logs.bound() == {}


def test_configure_replaces_its_own_handler_and_sets_levels(capsys):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, logging.getLogger("t.level").level)
    try:
        first = logs.configure(LogFormat.TEXT, {})
        handler = logs.configure(LogFormat.JSON, {"t.level": logging.DEBUG}, default=logging.ERROR)
        # The second call replaced the first's handler; the test runner's capture stays.
        assert first not in root.handlers and handler in root.handlers and root.level == logging.ERROR
        assert [h for h in saved[0] if h not in root.handlers] == []
        # The handler writes to stderr as it is when a line is written (a runner swaps it).
        logging.getLogger("t.level").error("to the stderr of now")
        assert '"message": "to the stderr of now"' in capsys.readouterr().err
        assert logging.getLogger("t.level").level == logging.DEBUG
        assert isinstance(handler.formatter, logs.JsonLines)
        assert logs.uvicorn_log_config(LogFormat.JSON) is None
        assert logs.uvicorn_log_config(LogFormat.TEXT)["loggers"]["uvicorn.access"]
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger("t.level").setLevel(saved[2])


def test_the_setting():
    from core.settings import Settings

    assert Settings().log_format is LogFormat.TEXT
    assert Settings(log_format="json").log_format is LogFormat.JSON
    with pytest.raises(ValueError, match="'text' or 'json'"):
        Settings(log_format="yaml")
