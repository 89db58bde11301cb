"""The server's database edge: trajectory index and first-wins feedback claims (sync; callers
run these in a thread)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from core.db import FeedbackClaim, LearnerCounter, LearnerStep, PolicyVersion, TrajectoryIndex
from core.records import TrajectoryRecord, utcnow

CLAIM_TIMEOUT = timedelta(seconds=30)


@dataclass(frozen=True)
class IndexedTrajectory:
    id: str
    prompt_id: str
    episode_id: str | None
    log_partition: int
    log_offset: int


class ServerStore:
    """Rows the server writes; the log holds the records themselves."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def index_trajectory(self, rec: TrajectoryRecord, partition: int, offset: int) -> None:
        last_version = rec.token_versions[-1][0] if rec.token_versions else rec.dispatch_version
        with self.engine.begin() as conn:
            conn.execute(
                insert(TrajectoryIndex).values(
                    id=rec.id,
                    prompt_id=rec.prompt_id,
                    episode_id=rec.episode_id,
                    turn=rec.turn,
                    dispatch_version=rec.dispatch_version,
                    last_version=last_version,
                    n_response_tokens=len(rec.response_token_ids),
                    finish_reason=rec.finish_reason,
                    log_partition=partition,
                    log_offset=offset,
                    created_at=rec.created_at,
                )
            )

    def find_trajectory(self, trajectory_id: str) -> IndexedTrajectory | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(
                    TrajectoryIndex.id,
                    TrajectoryIndex.prompt_id,
                    TrajectoryIndex.episode_id,
                    TrajectoryIndex.log_partition,
                    TrajectoryIndex.log_offset,
                ).where(TrajectoryIndex.id == trajectory_id)
            ).first()
        return IndexedTrajectory(*row) if row else None

    def episode_prompt_id(self, episode_id: str) -> str | None:
        """The prompt id of an episode (all its turns share it), or None if unknown."""
        with self.engine.connect() as conn:
            return conn.execute(
                select(TrajectoryIndex.prompt_id).where(TrajectoryIndex.episode_id == episode_id).limit(1)
            ).scalar_one_or_none()

    def claim(self, target: str) -> bool:
        """Take the first-wins claim on ``target``; False if feedback was already given.

        A claim stuck in ``claimed`` longer than CLAIM_TIMEOUT belongs to a request that never
        answered 202 (crash mid-append) and is taken over with a compare-and-set.
        """
        now = utcnow()
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(FeedbackClaim).values(target=target, state="claimed", claimed_at=now))
            return True
        except IntegrityError:
            pass
        with self.engine.begin() as conn:
            res = conn.execute(
                update(FeedbackClaim)
                .where(
                    FeedbackClaim.target == target,
                    FeedbackClaim.state == "claimed",
                    FeedbackClaim.claimed_at < now - CLAIM_TIMEOUT,
                )
                .values(claimed_at=now)
            )
            return res.rowcount == 1

    def release(self, target: str) -> None:
        """Drop a claim whose feedback could not be logged (the client got an error)."""
        with self.engine.begin() as conn:
            conn.execute(
                delete(FeedbackClaim).where(FeedbackClaim.target == target, FeedbackClaim.state == "claimed")
            )

    def mark_received(self, target: str, reward: float) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(FeedbackClaim)
                .where(FeedbackClaim.target == target)
                .values(state="received", reward=reward, received_at=utcnow())
            )

    def policy_versions(self) -> list[dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(*PolicyVersion.__table__.columns).order_by(PolicyVersion.version)
            ).all()
        return [
            {
                "version": r.version,
                "path": r.path,
                "sha256": r.sha256,
                "status": r.status,
                "parent_version": r.parent_version,
                "created_at": r.created_at.isoformat(),
            }
            for r in rows
        ]

    def learner_status(self, limit: int) -> dict:
        """The last ``limit`` learner steps (oldest first) and the learner's counters."""
        with self.engine.connect() as conn:
            steps = conn.execute(
                select(LearnerStep.step, LearnerStep.version, LearnerStep.metrics, LearnerStep.created_at)
                .order_by(LearnerStep.id.desc())
                .limit(limit)
            ).all()
            counters = dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())
        return {
            "steps": [
                {"step": s, "version": v, "created_at": c.isoformat(), **m} for s, v, m, c in reversed(steps)
            ],
            "counters": counters,
        }

    def request_rate(self, bucket_s: int, buckets: int) -> list[float]:
        """Requests/s in the last ``buckets`` buckets of ``bucket_s`` seconds (oldest first),
        counted from the trajectory index."""
        now = utcnow()
        since = now - timedelta(seconds=bucket_s * buckets)
        with self.engine.connect() as conn:
            times = conn.execute(
                select(TrajectoryIndex.created_at).where(TrajectoryIndex.created_at >= since)
            ).scalars()
            counts = [0] * buckets
            for t in times:
                if t.tzinfo is None:  # SQLite returns naive UTC datetimes
                    t = t.replace(tzinfo=now.tzinfo)
                i = int((t - since).total_seconds() // bucket_s)
                counts[min(max(i, 0), buckets - 1)] += 1
        return [c / bucket_s for c in counts]
