"""Rows read and written straight in the database by a test: a record logged and indexed as the
server does (``logged``), rows backdated (``backdate``), counted (``count``) and listed
(``keys_of``); a database migrated with the SQL log in it (``migrated_with_log``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import func, select, update
from sqlalchemy.engine import Engine

from core.db import (
    DeadLetter,
    make_engine,
    migrate,
)
from core.logbus import SqlLog
from core.records import TOPIC_TRAJECTORIES, TrajectoryRecord
from server.store import ServerStore


def logged(store: ServerStore, log: SqlLog, rec: TrajectoryRecord) -> int:
    """Log and index ``rec`` as the server does; returns its offset."""
    part, off = log.append(TOPIC_TRAJECTORIES, rec.prompt_id, rec.to_json())
    store.index_trajectory(rec, part, off)
    return off


def backdate(engine, table, column, keys, when) -> None:
    with engine.begin() as conn:
        conn.execute(update(table).where(column.in_(keys)).values(created_at=when))


def count(engine, model, *where) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(model).where(*where)).scalar_one()


def keys_of(engine, column) -> list:
    with engine.connect() as conn:
        return sorted(conn.execute(select(column)).scalars())


def letters(engine) -> list[tuple]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                select(
                    DeadLetter.kind,
                    DeadLetter.key,
                    DeadLetter.prompt_id,
                    DeadLetter.topic,
                    DeadLetter.log_offset,
                    DeadLetter.attempts,
                    DeadLetter.reason,
                ).order_by(DeadLetter.id)
            )
        ]


@contextlib.contextmanager
def migrated_with_log(url: str) -> Iterator[tuple[SqlLog, Engine]]:
    """The database at ``url`` migrated, and the SQL log in it: ``(log, engine)``, both closed on
    exit."""
    migrate(url)
    engine = make_engine(url)
    log = SqlLog(url)
    try:
        yield log, engine
    finally:
        log.close()
        engine.dispose()
