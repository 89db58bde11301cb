"""Retention: what is deleted from the database and the SQL-table log once it is older than
the retention period (docs/privacy.md; docs/design.md §9.5: "retention and forgetting remove
records from everything the learner can read"). Forgetting one subject is ``core.forget``, which
deletes with the helpers here.

:func:`apply_retention` (``saoserve retention --days N``), a few SQL deletes around a pure
selection: every trajectory created before the cutoff, with its index row and what is keyed by
its id (a sample joined since, pending rows, claims); every feedback record, claim, pending join,
waiting learner sample and dead letter older than the cutoff; the episodes with no turn since.
Log rows go whether or not the learner has read them (those it had not are counted ``unread``):
the SQL log's readers take ``id >= offset``, so a gap below or above a committed offset changes
nothing, and ids never go back (``core.db.LogRecord``), so no later record lands below an
offset. Policy events, prompt evidence (per-prompt sums), learner steps and tombstones stay.

Times are tz-aware UTC; counts are rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Table, delete, exists, func, select
from sqlalchemy.engine import Connection, Engine

from core.claims import episode_key, trajectory_target
from core.db import (
    ConsumerOffset,
    DeadLetter,
    Episode,
    EpisodeTurn,
    FeedbackClaim,
    LearnerSample,
    LogRecord,
    PendingJoin,
    TrajectoryIndex,
)
from core.logbus import LogTransport, SqlLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES

RETAINED_TOPICS = (TOPIC_TRAJECTORIES, TOPIC_FEEDBACK)
"""The topics retention deletes from; policy events are kept for ever (a replica that starts
reads them all)."""

LEARNER = "learner"
"""The consumer whose offsets say which log rows were read (``learner.data.joiner.CONSUMER``)."""

BATCH_ROWS = 5000
"""Rows deleted per transaction: the SQL log's appends wait while a delete holds its lock."""

CHUNK = 500
"""Keys per ``IN (...)`` list (SQLite bounds a statement's parameters)."""


def retention_cutoff(now: datetime, days: int) -> datetime:
    """Records created before this time are deleted. Raises ValueError unless ``days`` >= 1."""
    if days < 1:
        raise ValueError(f"retention needs at least 1 day, not {days}")
    return now - timedelta(days=days)


def sql_log_engine(log: LogTransport) -> Engine | None:
    """The database of a SQL-table log, whose rows retention and forget delete; None for Kafka,
    which keeps records until its topics' ``retention.ms``."""
    return log.engine if isinstance(log, SqlLog) else None


def claim_targets(trajectory_ids: Iterable[str], episode_ids: Iterable[str]) -> set[str]:
    """Feedback claim targets (``t:<id>``, ``e:<episode id>``) of those trajectories and episodes."""
    return {trajectory_target(t) for t in trajectory_ids} | {episode_key(e) for e in episode_ids}


def chunks(items: Iterable, n: int = CHUNK) -> Iterator[list]:
    """``items`` in lists of at most ``n`` (sorted, so runs are reproducible)."""
    items = sorted(items)
    for i in range(0, len(items), n):
        yield items[i : i + n]


def delete_in(conn: Connection, table: Table, column: ColumnElement, keys: Iterable) -> int:
    n = 0
    for part in chunks(keys):
        n += conn.execute(delete(table).where(column.in_(part))).rowcount
    return n


def _delete_batches(engine: Engine, table: Table, key: ColumnElement, where: ColumnElement) -> int:
    """Delete the rows matching ``where``, BATCH_ROWS per transaction; returns how many."""
    total = 0
    while True:
        with engine.begin() as conn:
            keys = conn.execute(select(key).where(where).limit(BATCH_ROWS)).scalars().all()
            if not keys:
                return total
            total += conn.execute(delete(table).where(where, key.in_(keys))).rowcount


@dataclass(frozen=True)
class RetentionReport:
    """What :func:`apply_retention` deleted: rows per table (``log_records`` per topic, as
    ``log_records.<topic>``, absent for a Kafka log), and ``unread``: log rows among them the
    learner had not read yet."""

    cutoff: datetime
    deleted: dict[str, int] = field(default_factory=dict)
    unread: int = 0


def learner_offsets(db: Engine) -> dict[str, int]:
    """The learner's next offset per retained topic of the SQL log (partition 0; 0 if none)."""
    with db.connect() as conn:
        rows = conn.execute(
            select(ConsumerOffset.topic, ConsumerOffset.next_offset).where(
                ConsumerOffset.consumer == LEARNER, ConsumerOffset.partition == 0
            )
        ).all()
    found = dict(rows)
    return {t: int(found.get(t, 0)) for t in RETAINED_TOPICS}


def _delete_old_trajectories(db: Engine, cutoff: datetime) -> dict[str, int]:
    """Index rows of trajectories created before ``cutoff``, with what is keyed by their ids
    (a sample joined since, pending rows, claims), BATCH_ROWS trajectories per transaction."""
    n = dict.fromkeys(("trajectory_index", "feedback_claims", "pending_joins", "learner_samples"), 0)
    while True:
        with db.begin() as conn:
            ids = (
                conn.execute(
                    select(TrajectoryIndex.id).where(TrajectoryIndex.created_at < cutoff).limit(BATCH_ROWS)
                )
                .scalars()
                .all()
            )
            if not ids:
                return n
            n["learner_samples"] += delete_in(conn, LearnerSample.__table__, LearnerSample.id, ids)
            n["pending_joins"] += delete_in(conn, PendingJoin.__table__, PendingJoin.key, ids)
            n["feedback_claims"] += delete_in(
                conn, FeedbackClaim.__table__, FeedbackClaim.target, claim_targets(ids, ())
            )
            n["trajectory_index"] += delete_in(conn, TrajectoryIndex.__table__, TrajectoryIndex.id, ids)


def apply_retention(db: Engine, log_engine: Engine | None, cutoff: datetime) -> RetentionReport:
    """Delete what is older than ``cutoff`` (module docstring) from ``db`` and, when the log is
    a SQL-table log, from its rows in ``log_engine`` (None: a Kafka log, left to its topics'
    retention). Each batch commits on its own; a second run finishes what a failed one left.
    """
    deleted: dict[str, int] = {}
    unread = 0
    if log_engine is not None:
        offsets = learner_offsets(db)
        for topic in RETAINED_TOPICS:
            old = (LogRecord.topic == topic) & (LogRecord.created_at < cutoff)
            with log_engine.connect() as conn:
                unread += conn.execute(
                    select(func.count()).select_from(LogRecord).where(old, LogRecord.offset >= offsets[topic])
                ).scalar_one()
            deleted[f"log_records.{topic}"] = _delete_batches(
                log_engine, LogRecord.__table__, LogRecord.offset, old
            )
    deleted.update(_delete_old_trajectories(db, cutoff))
    for name, table, key, where in (
        ("feedback_claims", FeedbackClaim.__table__, FeedbackClaim.target, FeedbackClaim.claimed_at < cutoff),
        ("pending_joins", PendingJoin.__table__, PendingJoin.key, PendingJoin.received_at < cutoff),
        ("learner_samples", LearnerSample.__table__, LearnerSample.id, LearnerSample.created_at < cutoff),
        ("dead_letters", DeadLetter.__table__, DeadLetter.id, DeadLetter.created_at < cutoff),
    ):
        deleted[name] = deleted.get(name, 0) + _delete_batches(db, table, key, where)
    recent_turn = exists().where(
        EpisodeTurn.episode_id == Episode.episode_id, EpisodeTurn.dispatched_at >= cutoff
    )
    with db.connect() as conn:
        stale = (
            conn.execute(select(Episode.episode_id).where(Episode.created_at < cutoff, ~recent_turn))
            .scalars()
            .all()
        )
    with db.begin() as conn:
        deleted["episode_turns"] = delete_in(conn, EpisodeTurn.__table__, EpisodeTurn.episode_id, stale)
        deleted["episodes"] = delete_in(conn, Episode.__table__, Episode.episode_id, stale)
    return RetentionReport(cutoff=cutoff, deleted=deleted, unread=unread)
