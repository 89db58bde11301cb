"""Dead letters: what the learner set aside instead of joining or training it, and why
(docs/design.md §8, §9.4; docs/reliability.md, "Dead letters").

The learner never stops on one record. A record it cannot join, validate or train after
:data:`MAX_TRIES` tries, and feedback that can never train, is written to ``dead_letters``
(``core.db.DeadLetter``) in the transaction that moves the consumer offsets past the record (or
deletes the samples), counted ``dead_letters`` in ``learner_counters``, and the learner goes on.
The server lists them (``GET /admin/dead_letters``; ``saoserve admin dead-letters``) and exports
the count on ``/metrics``.

Kinds (:data:`KINDS`):

* ``malformed``: a record that does not parse as its topic's schema, a field over its length
  (``core/limits.py``) included; set aside at once (parsing again cannot help);
* ``unjoinable``: a record whose join the database refused :data:`MAX_TRIES` times, alone;
* ``untrainable``: samples whose step failed :data:`MAX_TRIES` times, or that do not parse;
* ``trajectory_expired``: feedback (accepted, 202) whose trajectory the learner had already
  expired, or did not see within ``expire_s``: it can never make a sample;
* ``episode_incomplete``: episode feedback (accepted) that cannot join its turns: a listed turn
  expired, none listed, or (logged before turn lists) turns not numbered 0..n-1;
* ``unconfirmed``: feedback whose claim the server never marked received within ``expire_s``;
* ``unreadable_pending``: a pending-join row that no longer parses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, insert, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from core.breaker import Unavailable
from core.db import DeadLetter
from core.limits import KEY_CHARS, NAME_CHARS, PROMPT_ID_CHARS
from core.records import as_utc

MAX_TRIES = 3
"""Tries before a record (alone) or a batch of samples is set aside: an error the data causes
repeats every time; an outage (:func:`is_outage`) is never counted as one."""

KINDS = (
    "malformed",
    "unjoinable",
    "untrainable",
    "trajectory_expired",
    "episode_incomplete",
    "unconfirmed",
    "unreadable_pending",
)

COUNTER = "dead_letters"
"""The ``learner_counters`` row counting every dead letter written."""

REASON_CHARS = 1000
"""A reason is cut to this many characters (a database error quotes the whole statement)."""


@dataclass(frozen=True)
class Letter:
    """One thing set aside: ``kind`` (one of :data:`KINDS`), ``reason`` (for a person),
    ``key`` (trajectory id, ``e:<episode id>``, feedback id or sample id), ``prompt_id``, the
    log position (``topic``, ``log_partition``, ``log_offset``) when it is a record read,
    ``payload`` (the record or sample as read) and ``attempts`` (tries made)."""

    kind: str
    reason: str
    key: str | None = None
    prompt_id: str | None = None
    topic: str | None = None
    log_partition: int | None = None
    log_offset: int | None = None
    payload: str | bytes | None = None
    attempts: int = 1


def storable_text(value: str | bytes | None, limit: int | None = None) -> str | None:
    """``value`` as text any database column holds: bytes decoded (invalid UTF-8 as ``\\xNN``),
    lone surrogates as ``\\udXXX``, NUL as ``\\x00`` (PostgreSQL refuses it), cut to ``limit``
    characters. A dead letter must be writable whatever made its record fail."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    text = value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return text if limit is None else text[:limit]


def describe(exc: BaseException) -> str:
    """A one-line reason for ``exc``: a database error's driver message without the statement
    (``DataError: value too long for type character varying(64)``), cut to :data:`REASON_CHARS`."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    first = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {first}"[:REASON_CHARS]


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` means the database or the log is unavailable (retry later; never the
    record's fault), as ``server.health.is_storage_error`` decides for the server."""
    if isinstance(
        exc, Unavailable | OperationalError | InterfaceError | DisconnectionError | PoolTimeoutError
    ):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def set_aside(conn: Connection, letters: Iterable[Letter], now: datetime) -> int:
    """Insert ``letters`` in the caller's transaction (every text made storable, cut to its
    column); returns how many. The caller bumps :data:`COUNTER` by that in the same
    transaction."""
    rows = [
        dict(
            kind=storable_text(x.kind, NAME_CHARS),
            reason=storable_text(x.reason, REASON_CHARS),
            key=storable_text(x.key, KEY_CHARS),
            prompt_id=storable_text(x.prompt_id, PROMPT_ID_CHARS),
            topic=storable_text(x.topic, NAME_CHARS),
            log_partition=x.log_partition,
            log_offset=x.log_offset,
            attempts=x.attempts,
            payload=storable_text(x.payload),
            created_at=now,
        )
        for x in letters
    ]
    if rows:
        conn.execute(insert(DeadLetter), rows)
    return len(rows)


def recent(db: Engine, limit: int, kind: str | None = None, with_payload: bool = False) -> dict:
    """The newest ``limit`` dead letters (newest first; only ``kind`` if given), each a dict of
    the row (``created_at`` ISO-8601, ``payload`` only ``with_payload``), and ``total``: how many
    there are (of ``kind``)."""
    cols = [c for c in DeadLetter.__table__.columns if with_payload or c.name != "payload"]
    where = [] if kind is None else [DeadLetter.kind == kind]
    with db.connect() as conn:
        total = conn.execute(select(func.count()).select_from(DeadLetter).where(*where)).scalar_one()
        rows = conn.execute(select(*cols).where(*where).order_by(DeadLetter.id.desc()).limit(limit)).all()
    out = []
    for r in rows:
        d = dict(r._mapping)
        at = d["created_at"]
        # SQLite returns naive UTC times.
        d["created_at"] = as_utc(at).isoformat()
        out.append(d)
    return {"total": total, "dead_letters": out}
