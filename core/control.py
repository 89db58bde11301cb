"""Operator control flags shared by server (writes) and learner (reads).

A flag is one row: its value and when it was set (``updated_at``). A request is carried out
by the learner, which then clears the flag only if it still holds the request it read
(``clear_if``: compare-and-clear on value and time), so a request made while an earlier one
was being carried out survives and is carried out next.

Writes are atomic under concurrency (issue 40 item 8): setting a flag is one upsert
(``INSERT … ON CONFLICT (name) DO UPDATE``), never delete-then-insert, so two operators (or an
operator and the learner) setting the same flag at once both succeed and the row holds the last
writer's value; PostgreSQL's row lock orders them, SQLite's write lock does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from core.db import ControlFlag
from core.lifecycle import check_canary_share
from core.records import utcnow

PAUSED = "paused"
ROLLBACK_TO = "rollback_to"
# The guard's operator switches (docs/guard.md, "The lifecycle"): "1" turns the lifecycle off
# (no gate, every version promoted); a version number pins the promoted version (no automatic
# decision); a share (``core.lifecycle.check_canary_share``'s bounds) is kept for canary
# deployments (a single engine has none).
GUARD_OFF = "guard_off"
GUARD_PIN = "guard_pin"
CANARY_SHARE = "canary_share"
# Written by the learner, not an operator: its last verdict on the lineage (JSON, as
# ``learner.guard.guard.Guard`` records it), which /metrics and the dashboard show.
GUARD_VERDICT = "guard_verdict"


@dataclass(frozen=True)
class Flag:
    """A flag as read: its ``value`` and ``updated_at`` (as the database returns it)."""

    value: str
    updated_at: datetime


_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
"""The dialects' ``INSERT … ON CONFLICT`` constructs (the two databases saoserve runs on)."""


def write_flag(conn: Connection, name: str, value: str | None) -> None:
    """In the caller's transaction, set ``name`` to ``value`` with the time now (one upsert), or
    clear it (``value`` None: a delete, which a flag already clear survives).

    Raises:
        ValueError: a database other than PostgreSQL or SQLite.
    """
    if value is None:
        conn.execute(delete(ControlFlag).where(ControlFlag.name == name))
        return
    make = _INSERTS.get(conn.dialect.name)
    if make is None:
        raise ValueError(f"control flags need PostgreSQL or SQLite, not {conn.dialect.name}")
    stmt = make(ControlFlag).values(name=name, value=value, updated_at=utcnow())
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[ControlFlag.name],
            set_={"value": stmt.excluded.value, "updated_at": stmt.excluded.updated_at},
        )
    )


def set_flag(db: Engine, name: str, value: str | None) -> None:
    """Set (or clear with None) an operator control flag, in a transaction of its own
    (``write_flag``)."""
    with db.begin() as conn:
        write_flag(conn, name, value)


def flag_value(conn: Connection, name: str) -> str | None:
    """The value of ``name`` in the caller's connection or transaction, None when not set."""
    return conn.execute(select(ControlFlag.value).where(ControlFlag.name == name)).scalar_one_or_none()


def get_flag(db: Engine, name: str) -> str | None:
    """The value of ``name``, None when not set."""
    with db.connect() as conn:
        return flag_value(conn, name)


def read_flag(db: Engine, name: str) -> Flag | None:
    """The flag ``name`` with the time it was set, or None when it is not set."""
    with db.connect() as conn:
        row = conn.execute(
            select(ControlFlag.value, ControlFlag.updated_at).where(ControlFlag.name == name)
        ).first()
    return None if row is None else Flag(row.value, row.updated_at)


def clear_if(conn: Connection, name: str, seen: Flag) -> bool:
    """In the caller's transaction, clear ``name`` only if it still holds ``seen`` (the same
    value set at the same time); True if it did. A flag set again since (even to the same value)
    is a later request, and stays."""
    res = conn.execute(
        delete(ControlFlag).where(
            ControlFlag.name == name,
            ControlFlag.value == seen.value,
            ControlFlag.updated_at == seen.updated_at,
        )
    )
    return res.rowcount == 1


def canary_share_flag(value: str | None) -> float | None:
    """The share a ``canary_share`` flag's ``value`` holds, or None: unset, or not a share that
    ``core.lifecycle.check_canary_share`` accepts (a value written around the admin route, or
    before the bounds; the readers then use ``Settings.canary_share``)."""
    if value is None:
        return None
    try:
        return check_canary_share(float(value), CANARY_SHARE)
    except ValueError:
        return None
