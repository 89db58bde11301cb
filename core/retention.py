"""Retention and forgetting: what is deleted from the database and the SQL-table log
(docs/privacy.md; docs/design.md §9.5: "retention and forgetting remove records from everything
the learner can read").

Two operations, each a few SQL deletes around a pure selection:

- :func:`apply_retention` (``saoserve retention --days N``): every trajectory created before
  the cutoff, with its index row and what is keyed by its id (a sample joined since, pending
  rows, claims); every feedback record, claim, pending join, waiting learner sample and dead
  letter older than the cutoff; the episodes with no turn since. Log rows go whether or not the
  learner has read them (those it had not are counted ``unread``): the SQL log's readers take
  ``id >= offset``, so a gap below or above a committed offset changes nothing, and ids never
  go back (``core.db.LogRecord``), so no later record lands below an offset. Policy events,
  prompt evidence (per-prompt sums), learner steps and tombstones stay.
- :func:`forget_user` (``saoserve admin forget USER``): the trajectories a user's requests
  logged (``trajectory_index.user_id``) and every turn of their episodes, with their feedback,
  claims, pending joins, waiting samples and dead letters. The SQL log's rows of them are
  deleted first, so a failure half-way is repaired by running it again. Tombstones
  (``core.db.ForgottenRecord``) keep the learner from using what a Kafka log still holds: the
  joiner drops every record read under a tombstoned key (``learner.join_plan``), and deletes in
  its own commit whatever it wrote that a forget running beside it tombstoned.

Times are tz-aware UTC; counts are rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Table, delete, exists, func, insert, select, text
from sqlalchemy.engine import Connection, Engine

from core.claims import episode_key, trajectory_target
from core.db import (
    ConsumerOffset,
    DeadLetter,
    Episode,
    EpisodeTurn,
    FeedbackClaim,
    ForgottenRecord,
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
"""The consumer whose offsets say which log rows were read (``learner.joiner.CONSUMER``)."""

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


def forget_keys(trajectory_ids: Iterable[str], episode_ids: Iterable[str]) -> set[str]:
    """Tombstone keys of the trajectories and episodes forgotten."""
    return set(trajectory_ids) | {episode_key(e) for e in episode_ids}


def claim_targets(trajectory_ids: Iterable[str], episode_ids: Iterable[str]) -> set[str]:
    """Feedback claim targets (``t:<id>``, ``e:<episode id>``) of those trajectories and episodes."""
    return {trajectory_target(t) for t in trajectory_ids} | {episode_key(e) for e in episode_ids}


def concerns(payload: str | None, user: str, trajectory_ids: set[str], episode_ids: set[str]) -> bool:
    """Whether a record's JSON (a trajectory, a feedback record, or one that did not validate)
    is of ``user`` or of one of these trajectories or episodes; anything else that is not a JSON
    object is not."""
    try:
        rec = json.loads(payload or "")
    except ValueError:
        return False
    if not isinstance(rec, dict):
        return False
    return (
        rec.get("user") == user
        or rec.get("id") in trajectory_ids
        or rec.get("trajectory_id") in trajectory_ids
        or rec.get("episode_id") in episode_ids
    )


def chunks(items: Iterable, n: int = CHUNK) -> Iterator[list]:
    """``items`` in lists of at most ``n`` (sorted, so runs are reproducible)."""
    items = sorted(items)
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _delete_in(conn: Connection, table: Table, column: ColumnElement, keys: Iterable) -> int:
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
            n["learner_samples"] += _delete_in(conn, LearnerSample.__table__, LearnerSample.id, ids)
            n["pending_joins"] += _delete_in(conn, PendingJoin.__table__, PendingJoin.key, ids)
            n["feedback_claims"] += _delete_in(
                conn, FeedbackClaim.__table__, FeedbackClaim.target, claim_targets(ids, ())
            )
            n["trajectory_index"] += _delete_in(conn, TrajectoryIndex.__table__, TrajectoryIndex.id, ids)


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
        deleted["episode_turns"] = _delete_in(conn, EpisodeTurn.__table__, EpisodeTurn.episode_id, stale)
        deleted["episodes"] = _delete_in(conn, Episode.__table__, Episode.episode_id, stale)
    return RetentionReport(cutoff=cutoff, deleted=deleted, unread=unread)


@dataclass(frozen=True)
class ForgetReport:
    """What :func:`forget_user` removed: the user's trajectories (with every turn of their
    episodes) and episodes, the tombstones written, and rows deleted per table
    (``log_records.<topic>`` absent for a Kafka log, which keeps the records until its
    retention while the tombstones hide them from the learner)."""

    user: str
    trajectories: int
    episodes: int
    tombstones: int
    deleted: dict[str, int] = field(default_factory=dict)


def _users_records(conn: Connection, user: str) -> list[tuple[str, str | None, str, int, int]]:
    """(id, episode id, prompt id, log partition, log offset) of the user's indexed trajectories
    and of every indexed turn of their episodes."""
    cols = (
        TrajectoryIndex.id,
        TrajectoryIndex.episode_id,
        TrajectoryIndex.prompt_id,
        TrajectoryIndex.log_partition,
        TrajectoryIndex.log_offset,
    )
    own = conn.execute(select(*cols).where(TrajectoryIndex.user_id == user)).all()
    episodes = {r[1] for r in own if r[1] is not None}
    turns = []
    for part in chunks(episodes):
        turns += conn.execute(select(*cols).where(TrajectoryIndex.episode_id.in_(part))).all()
    return sorted({tuple(r) for r in [*own, *turns]})


def forget_user(db: Engine, log_engine: Engine | None, user: str, now: datetime) -> ForgetReport:
    """Remove ``user``'s records from everything the learner can read (module docstring).

    Idempotent: a user with nothing (left) indexed gets a report of zeros. Raises the driver's
    error when the database fails; running it again completes the work.
    """
    with db.connect() as conn:
        rows = _users_records(conn, user)
    ids = {r[0] for r in rows}
    episodes = {r[1] for r in rows if r[1] is not None}
    prompts = {r[2] for r in rows}
    keys = forget_keys(ids, episodes)
    deleted: dict[str, int] = {}
    if log_engine is not None:
        with log_engine.begin() as conn:
            deleted[f"log_records.{TOPIC_TRAJECTORIES}"] = _delete_in(
                conn,
                LogRecord.__table__,
                LogRecord.offset,
                # The SQL log has one partition per topic; the index holds each record's row id.
                [offset for *_, partition, offset in rows if partition == 0],
            )
            feedback = []
            for part in chunks(prompts):
                found = conn.execute(
                    select(LogRecord.offset, LogRecord.payload).where(
                        LogRecord.topic == TOPIC_FEEDBACK, LogRecord.key.in_(part)
                    )
                ).all()
                feedback += [offset for offset, payload in found if concerns(payload, user, ids, episodes)]
            deleted[f"log_records.{TOPIC_FEEDBACK}"] = _delete_in(
                conn, LogRecord.__table__, LogRecord.offset, feedback
            )
    with db.begin() as conn:
        if conn.dialect.name == "postgresql":
            # A joiner committing beside this waits, or is waited for, and then sees the
            # tombstones (its commit deletes what it wrote under them): learner.joiner.
            conn.execute(text("LOCK TABLE pending_joins, learner_samples IN SHARE ROW EXCLUSIVE MODE"))
        new = sorted(keys - forgotten_among(conn, keys))
        if new:
            conn.execute(insert(ForgottenRecord), [{"key": k, "forgotten_at": now} for k in new])
        unconfirmed = [
            k
            for k, payload in conn.execute(
                select(PendingJoin.key, PendingJoin.payload).where(PendingJoin.kind == "unconfirmed")
            )
            if concerns(payload, user, ids, episodes)
        ]
        deleted["trajectory_index"] = _delete_in(conn, TrajectoryIndex.__table__, TrajectoryIndex.id, ids)
        deleted["feedback_claims"] = _delete_in(
            conn, FeedbackClaim.__table__, FeedbackClaim.target, claim_targets(ids, episodes)
        )
        deleted["pending_joins"] = _delete_in(
            conn, PendingJoin.__table__, PendingJoin.key, keys | set(unconfirmed)
        )
        deleted["learner_samples"] = _delete_in(conn, LearnerSample.__table__, LearnerSample.id, keys)
        # Letters of the user's records: by key, or (a malformed record, keyed by its prompt)
        # by what its payload names.
        named = keys | claim_targets(ids, episodes)
        letters = {
            i
            for i, k, payload in conn.execute(select(DeadLetter.id, DeadLetter.key, DeadLetter.payload))
            if k in named or concerns(payload, user, ids, episodes)
        }
        deleted["dead_letters"] = _delete_in(conn, DeadLetter.__table__, DeadLetter.id, letters)
        deleted["episode_turns"] = _delete_in(
            conn, EpisodeTurn.__table__, EpisodeTurn.episode_id, episodes
        ) + _delete_in(conn, EpisodeTurn.__table__, EpisodeTurn.trajectory_id, ids)
        deleted["episodes"] = _delete_in(conn, Episode.__table__, Episode.episode_id, episodes)
    return ForgetReport(
        user=user, trajectories=len(ids), episodes=len(episodes), tombstones=len(new), deleted=deleted
    )


def forgotten_among(conn: Connection, keys: Sequence[str] | set[str]) -> frozenset[str]:
    """The keys among ``keys`` that a forget tombstoned."""
    found: set[str] = set()
    for part in chunks(keys):
        found |= set(conn.execute(select(ForgottenRecord.key).where(ForgottenRecord.key.in_(part))).scalars())
    return frozenset(found)


def all_forgotten(db: Engine) -> frozenset[str]:
    """Every tombstoned key (for readers of the whole log, such as critic pretraining)."""
    with db.connect() as conn:
        return frozenset(conn.execute(select(ForgottenRecord.key)).scalars())
