"""The server's database edge: trajectory index and first-wins feedback claims (sync; callers
run these in a thread)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from core.db import (
    Episode,
    EpisodeTurn,
    FeedbackClaim,
    LearnerCounter,
    LearnerStep,
    PolicyVersion,
    TrajectoryIndex,
)
from core.records import TrajectoryRecord, utcnow

CLAIM_TIMEOUT = timedelta(seconds=30)
# A dispatched episode turn not indexed after this long never will be (its request failed
# before a record, or the server died): it no longer holds the episode's feedback back.
TURN_TIMEOUT = timedelta(minutes=5)
# Finish reasons of records that are not whole answers: never rated, never trained as answers.
NOT_WHOLE = ("abort", "error")


@dataclass(frozen=True)
class IndexedTrajectory:
    id: str
    prompt_id: str
    episode_id: str | None
    log_partition: int
    log_offset: int
    finish_reason: str


@dataclass(frozen=True)
class EpisodeState:
    """What episode feedback must know: its prompt id (None: unknown episode), its turns whose
    records are not whole answers, and its turns dispatched but not yet indexed."""

    prompt_id: str | None
    not_whole_turns: int
    turns_in_flight: int


def _held_by(feedback_id: str | None) -> list:
    """The condition that a claim belongs to ``feedback_id`` (none for a caller without ids)."""
    return [] if feedback_id is None else [FeedbackClaim.feedback_id == feedback_id]


class ServerStore:
    """Rows the server writes; the log holds the records themselves."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def index_trajectory(self, rec: TrajectoryRecord, partition: int, offset: int) -> None:
        """Index a logged record; an episode turn stops being in flight in the same transaction."""
        last_version = rec.token_versions[-1][0] if rec.token_versions else rec.dispatch_version
        with self.engine.begin() as conn:
            if rec.episode_id is not None:
                conn.execute(delete(EpisodeTurn).where(EpisodeTurn.trajectory_id == rec.id))
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
                    TrajectoryIndex.finish_reason,
                ).where(TrajectoryIndex.id == trajectory_id)
            ).first()
        return IndexedTrajectory(*row) if row else None

    def episode_prompt_id(self, episode_id: str) -> str | None:
        """The prompt id of an episode (all its turns share it), or None if unknown."""
        with self.engine.connect() as conn:
            return conn.execute(
                select(TrajectoryIndex.prompt_id).where(TrajectoryIndex.episode_id == episode_id).limit(1)
            ).scalar_one_or_none()

    def start_episode_turn(self, episode_id: str, trajectory_id: str, token_ok: bool) -> str:
        """Record a dispatched turn of ``episode_id``; returns ``ok``, ``not_yours`` or ``rated``.

        Without a valid episode token (``token_ok`` False) only a new episode may start: the
        primary key of ``episodes`` lets exactly one of two racing first turns win. A turn is
        refused once the episode's feedback is claimed. The turn row is committed before the
        claim is read, and feedback takes its claim before it reads the turn rows, so of a turn
        and a feedback racing, at least one sees the other (``episode_state``).
        """
        now = utcnow()
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(Episode).values(episode_id=episode_id, created_at=now))
        except IntegrityError:
            if not token_ok:
                return "not_yours"
        with self.engine.begin() as conn:
            conn.execute(
                insert(EpisodeTurn).values(
                    trajectory_id=trajectory_id, episode_id=episode_id, dispatched_at=now
                )
            )
        with self.engine.connect() as conn:
            claimed = conn.execute(
                select(FeedbackClaim.target).where(FeedbackClaim.target == f"e:{episode_id}")
            ).first()
        if claimed is None:
            return "ok"
        with self.engine.begin() as conn:
            conn.execute(delete(EpisodeTurn).where(EpisodeTurn.trajectory_id == trajectory_id))
        return "rated"

    def episode_state(self, episode_id: str) -> EpisodeState:
        """Read after taking the episode's feedback claim. Turns in flight are read before the
        index: a turn indexed in between is then seen in the index (both change in one
        transaction), so no turn escapes both reads."""
        since = utcnow() - TURN_TIMEOUT
        with self.engine.connect() as conn:
            in_flight = conn.execute(
                select(func.count())
                .select_from(EpisodeTurn)
                .where(EpisodeTurn.episode_id == episode_id, EpisodeTurn.dispatched_at > since)
            ).scalar_one()
            prompt_id = conn.execute(
                select(TrajectoryIndex.prompt_id).where(TrajectoryIndex.episode_id == episode_id).limit(1)
            ).scalar_one_or_none()
            not_whole = conn.execute(
                select(func.count())
                .select_from(TrajectoryIndex)
                .where(TrajectoryIndex.episode_id == episode_id, TrajectoryIndex.finish_reason.in_(NOT_WHOLE))
            ).scalar_one()
        return EpisodeState(prompt_id, not_whole, in_flight)

    def claim(self, target: str, feedback_id: str | None = None) -> bool:
        """Take the first-wins claim on ``target`` for the record ``feedback_id``; False if
        feedback was already given.

        A claim stuck in ``claimed`` longer than CLAIM_TIMEOUT belongs to a request that never
        answered 202 (crash mid-append) and is taken over with a compare-and-set; the claim then
        holds the new record's id, so the old request can neither release nor mark it.
        """
        now = utcnow()
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    insert(FeedbackClaim).values(
                        target=target, state="claimed", claimed_at=now, feedback_id=feedback_id
                    )
                )
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
                .values(claimed_at=now, feedback_id=feedback_id)
            )
            return res.rowcount == 1

    def release(self, target: str, feedback_id: str | None = None) -> None:
        """Drop a claim whose feedback could not be logged (the client got an error); with
        ``feedback_id``, only while the claim is still that record's."""
        with self.engine.begin() as conn:
            conn.execute(
                delete(FeedbackClaim).where(
                    FeedbackClaim.target == target, FeedbackClaim.state == "claimed", *_held_by(feedback_id)
                )
            )

    def mark_received(self, target: str, reward: float, feedback_id: str | None = None) -> None:
        """Confirm ``target``'s claim once its record is in the log: the joiner trains only the
        record whose ``feedback_id`` a ``received`` claim holds (``learner.join_plan``). With
        ``feedback_id``, a claim taken over by another record is left as it is."""
        with self.engine.begin() as conn:
            conn.execute(
                update(FeedbackClaim)
                .where(FeedbackClaim.target == target, *_held_by(feedback_id))
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
