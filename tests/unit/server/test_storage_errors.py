"""Storage failures without the engine: which errors mean "storage down", the health report,
and the spool's re-send after an index row was refused (SQLite, no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from sqlalchemy import event, select
from sqlalchemy.exc import IntegrityError, OperationalError

from core.breaker import Unavailable
from core.db import LogRecord, make_engine, migrate
from core.logbus import LogUnavailable, SqlLog
from core.records import TrajectoryRecord
from server.health import DatabaseUnavailable, Health, is_storage_error
from server.spool import Spool
from server.store import ServerStore
from testing.builders import record


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (LogUnavailable("broker down"), True),
        (DatabaseUnavailable("no answer"), True),
        (OperationalError("SELECT 1", {}, ConnectionRefusedError()), True),
        (IntegrityError("INSERT", {}, ValueError()), False),  # a conflict, not an outage
        (ValueError("bad"), False),
    ],
)
def test_is_storage_error(exc, expected):
    assert is_storage_error(exc) is expected


async def test_health_report_names_what_is_down(tmp_path):
    url = f"sqlite:///{tmp_path / 'ok.db'}"
    migrate(url)
    db = make_engine(url)
    healthy = Health(db, SqlLog(url), log_required=True)
    report = await healthy.report()
    assert report["database"] == "ok" and report["log"] == "ok"
    healthy.require()
    broken_log = SqlLog(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(LogUnavailable):
        broken_log.append("trajectories", "k", b"{}")  # no schema: fails and opens its breaker
    health = Health(db, broken_log, log_required=True)
    report = await health.report()
    assert report["database"] == "ok" and report["log"].startswith("the SQL log is unavailable")
    with pytest.raises(Unavailable):
        health.require()
    # With the spool on (log_required off) the log may be down: only the database counts.
    Health(db, broken_log, log_required=False).require()


def _record(i: int) -> TrajectoryRecord:
    return record(f"chatcmpl-spool{i}", prompt_id="p", turn=None, max_tokens=4)


def test_spool_appends_once_when_the_index_row_was_refused(tmp_path):
    """A spooled record whose append succeeded but whose index row the database refused is
    not appended again on the next flush: 1 record in the log, 1 index row."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    log = SqlLog(url)
    read_only = make_engine(url)  # reads answer, writes are refused, as by a failing database
    event.listen(read_only, "connect", lambda conn, _: conn.execute("PRAGMA query_only = ON"))
    spool = Spool(tmp_path / "spool", log, ServerStore(read_only))
    spool.put(_record(1))
    with pytest.raises(OperationalError, match="readonly"):
        spool.flush_once()
    assert len(spool.pending()) == 1 and len(list((tmp_path / "spool").glob("*.placed"))) == 1

    def logged() -> list:
        with log.engine.connect() as conn:
            return conn.execute(select(LogRecord.offset).where(LogRecord.topic == "trajectories")).all()

    assert len(logged()) == 1  # appended before the index row was refused
    spool.store = ServerStore(log.engine)
    assert spool.flush_once() == 1
    rows = logged()
    assert len(rows) == 1
    assert spool.store.find_trajectory("chatcmpl-spool1").log_offset == rows[0][0]
    assert spool.pending() == [] and list((tmp_path / "spool").iterdir()) == []


def test_a_spools_log_lines_name_its_policy(tmp_path, caplog):
    """A tenant policy's spool (``policy="acme"``) starts its lines with the policy: the flush
    refused by a read-only database is logged as ``acme: spool flush failed, will retry: ...``."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    read_only = make_engine(url)
    event.listen(read_only, "connect", lambda conn, _: conn.execute("PRAGMA query_only = ON"))
    spool = Spool(tmp_path / "spool", SqlLog(url), ServerStore(read_only), retry_s=0.01, policy="acme")
    spool.put(_record(1))

    async def one_flush() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(spool.run(), 0.2)

    with caplog.at_level(logging.WARNING, logger="server.spool"):
        asyncio.run(one_flush())
    lines = [r.getMessage() for r in caplog.records if r.name == "server.spool"]
    assert lines and all(line.startswith("acme: spool flush failed, will retry: ") for line in lines)
    assert {r.policy for r in caplog.records if r.name == "server.spool"} == {"acme"}
