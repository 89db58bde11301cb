"""Operator control flags shared by server (writes) and learner (reads)."""

from __future__ import annotations

from sqlalchemy import delete, insert, select
from sqlalchemy.engine import Engine

from core.db import ControlFlag
from core.records import utcnow

PAUSED = "paused"
ROLLBACK_TO = "rollback_to"


def set_flag(db: Engine, name: str, value: str | None) -> None:
    """Set (or clear with None) an operator control flag."""
    with db.begin() as conn:
        conn.execute(delete(ControlFlag).where(ControlFlag.name == name))
        if value is not None:
            conn.execute(insert(ControlFlag).values(name=name, value=value, updated_at=utcnow()))


def get_flag(db: Engine, name: str) -> str | None:
    with db.connect() as conn:
        return conn.execute(select(ControlFlag.value).where(ControlFlag.name == name)).scalar_one_or_none()
