"""Operator control flags shared by server (writes) and learner (reads).

A flag is one row: its value and when it was set (``updated_at``). A request is carried out
by the learner, which then clears the flag only if it still holds the request it read
(``clear_if``: compare-and-clear on value and time), so a request made while an earlier one
was being carried out survives and is carried out next.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, insert, select
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
# ``learner.guard.Guard`` records it), which /metrics and the dashboard show.
GUARD_VERDICT = "guard_verdict"


@dataclass(frozen=True)
class Flag:
    """A flag as read: its ``value`` and ``updated_at`` (as the database returns it)."""

    value: str
    updated_at: datetime


def set_flag(db: Engine, name: str, value: str | None) -> None:
    """Set (or clear with None) an operator control flag."""
    with db.begin() as conn:
        conn.execute(delete(ControlFlag).where(ControlFlag.name == name))
        if value is not None:
            conn.execute(insert(ControlFlag).values(name=name, value=value, updated_at=utcnow()))


def get_flag(db: Engine, name: str) -> str | None:
    with db.connect() as conn:
        return conn.execute(select(ControlFlag.value).where(ControlFlag.name == name)).scalar_one_or_none()


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
