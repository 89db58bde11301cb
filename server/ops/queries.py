"""The SQL the operators' pages read (``server.ops``), as functions of a database engine, out of
the routers."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import String, func, literal, select
from sqlalchemy.engine import Engine, Row

from core.claims import TRAJECTORY_PREFIX
from core.control import PAUSED, ROLLBACK_TO
from core.db import ControlFlag, FeedbackClaim, LearnerSample, LearnerStep, PolicyVersion, TrajectoryIndex
from server.db_figures import LifecycleState, read_lifecycle


@dataclass
class LearnerRows:
    """What ``learner_rows`` reads: the control ``flags`` (``PAUSED``, ``ROLLBACK_TO``: name →
    value), the newest ``versions`` (newest first: version, parent, status, lifecycle,
    rollback_to, created_at), the samples ``waiting`` and ``trained``, the completion
    ``rewards`` by dispatch version (version, mean, count; the versions read only) and the
    policy's ``lifecycle``."""

    flags: dict[str, str]
    versions: list[Row]
    waiting: int
    trained: int
    rewards: list[Row]
    lifecycle: LifecycleState


def learner_rows(db: Engine, n_versions: int, policy: str) -> LearnerRows:
    """The dashboard's figures of the learner and the lifecycle of ``policy`` (its namespace's
    database ``db``), read in one connection; ``n_versions``: how many of the newest versions."""
    with db.connect() as conn:
        flags = dict(
            conn.execute(
                select(ControlFlag.name, ControlFlag.value).where(ControlFlag.name.in_((PAUSED, ROLLBACK_TO)))
            ).all()
        )
        rows = conn.execute(
            select(
                PolicyVersion.version,
                PolicyVersion.parent_version,
                PolicyVersion.status,
                PolicyVersion.lifecycle,
                PolicyVersion.metrics["rollback_to"].as_integer(),
                PolicyVersion.created_at,
            )
            .order_by(PolicyVersion.version.desc())
            .limit(n_versions)
        ).all()
        waiting = conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one()
        trained = conn.execute(
            select(func.coalesce(func.sum(func.json_array_length(LearnerStep.metrics["sample_ids"])), 0))
        ).scalar_one()
        # Only the versions shown: joining every answer of a long run at each refresh is slow.
        oldest = rows[-1].version if rows else 0
        rewards = conn.execute(
            select(TrajectoryIndex.dispatch_version, func.avg(FeedbackClaim.reward), func.count())
            .join(
                FeedbackClaim, FeedbackClaim.target == literal(TRAJECTORY_PREFIX, String) + TrajectoryIndex.id
            )
            .where(FeedbackClaim.state == "received", TrajectoryIndex.dispatch_version >= oldest)
            .group_by(TrajectoryIndex.dispatch_version)
            .order_by(TrajectoryIndex.dispatch_version)
        ).all()
        lc = read_lifecycle(conn, policy)
    return LearnerRows(flags, rows, waiting, trained, rewards, lc)
