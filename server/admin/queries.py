"""The SQL the admin family's routes read (``server.admin``), as functions of a database engine,
out of the routers."""

from __future__ import annotations

import math

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from core.control import PAUSED
from core.db import ControlFlag, LearnerStep, PolicyVersion
from core.policies import GLOBAL
from core.records import as_utc


def policy_overview(db: Engine, policy: str, version: int) -> dict:
    """The row of ``GET /admin/policies`` (``server.admin.protocol.PolicyRow``) of ``policy``,
    serving ``version``, read from its namespace's database ``db`` in one connection. Raises the
    driver's error when the database does not answer (503)."""
    with db.connect() as conn:
        stage = conn.execute(
            select(PolicyVersion.lifecycle).where(PolicyVersion.version == version)
        ).scalar_one_or_none()
        paused = conn.execute(
            select(ControlFlag.value).where(ControlFlag.name == PAUSED)
        ).scalar_one_or_none()
        steps = conn.execute(select(func.count()).select_from(LearnerStep)).scalar_one()
        newest = conn.execute(
            select(LearnerStep.metrics, LearnerStep.created_at).order_by(LearnerStep.id.desc()).limit(1)
        ).one_or_none()
    figures = newest.metrics if newest is not None and isinstance(newest.metrics, dict) else {}

    def figure(name: str) -> float | None:
        v = figures.get(name)
        return (
            float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None
        )

    return {
        "policy": policy,
        "tenant": None if policy == GLOBAL else policy,
        "version": version,
        "unavailable": None,
        "lifecycle": stage,
        "paused": paused == "1",
        "steps": steps,
        "reward_mean": figure("reward_mean"),
        "staleness_mean": figure("staleness_mean"),
        "last_step_at": None if newest is None else as_utc(newest.created_at).isoformat(),
    }
