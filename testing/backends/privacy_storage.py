"""Retention and forget on any database with the SQL log in it (docs/privacy.md), the joiner
reading before and after. The tests take ``database_url`` (tests/unit: SQLite; tests/integration:
PostgreSQL, its table lock in forget and its sequence for the log's ids) and run in
tests/unit/core/test_privacy_storage.py and tests/integration/test_privacy_storage.py."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from core.claims import claim_target
from core.db import (
    DeadLetter,
    Episode,
    EpisodeTurn,
    FeedbackClaim,
    ForgottenRecord,
    LearnerCounter,
    LearnerSample,
    LogRecord,
    PendingJoin,
    TrajectoryIndex,
)
from core.dead_letters import Letter, set_aside
from core.forget import ForgetKind, ForgetReceipt, ForgetTarget, all_forgotten, forget
from core.logbus import SqlLog
from core.records import TOPIC_FEEDBACK, FeedbackRecord, utcnow
from core.retention import apply_retention, retention_cutoff, sql_log_engine
from learner.algo.pretrain import logged_samples
from learner.data.joiner import Joiner
from server.store import ServerStore
from testing.builders import episode_turns, fb, traj
from testing.rows import backdate, count, keys_of, logged, migrated_with_log

__all__ = [
    "db",
    "test_retention_deletes_what_is_older_than_n_days_read_or_not_and_offsets_hold",
    "test_log_ids_never_go_back_after_the_newest_rows_are_deleted",
    "test_retention_keeps_an_episode_with_a_recent_turn",
    "test_forget_removes_a_users_records_from_the_database_and_the_sql_log",
    "test_forget_on_a_log_that_keeps_records_leaves_tombstones_the_learner_obeys",
    "test_a_forget_between_the_joiners_read_and_commit_leaves_nothing_behind",
    "test_pretraining_skips_opted_out_trajectories",
]


@pytest.fixture
def db(database_url):
    """The tier's database, migrated, and the SQL log in it."""
    with migrated_with_log(database_url) as log_and_engine:
        yield log_and_engine


def rated(store: ServerStore, log: SqlLog, f: FeedbackRecord, mark: bool = True) -> int:
    """Claim, log and (``mark``) confirm feedback as the server does; returns its offset."""
    f = f.model_copy(update={"feedback_id": str(uuid.uuid4()), "received_at": utcnow()})
    target = claim_target(f.trajectory_id, f.episode_id)
    assert store.claim(target, f.feedback_id)
    _, off = log.append(TOPIC_FEEDBACK, f.prompt_id, f.to_json())
    if mark:
        store.mark_received(target, f.reward, f.feedback_id)
    return off


SECRET = "the-server-secret-of-these-tests"


def forget_user(engine, log_engine, user: str, now) -> ForgetReceipt:
    """``saoserve admin forget USER`` in one namespace."""
    return forget(engine, log_engine, ForgetTarget(ForgetKind.USER, user), SECRET, now)


def test_retention_deletes_what_is_older_than_n_days_read_or_not_and_offsets_hold(db):
    log, engine = db
    store = ServerStore(engine)
    now = utcnow()
    old, recent = now - timedelta(days=40), now - timedelta(days=1)
    o1 = logged(store, log, traj("o1", created_at=old))  # log row 1
    f1 = rated(store, log, fb("o1", 1.0))  # 2
    joiner = Joiner(log, engine, expire_s=3600)
    assert joiner.poll_once().samples == 1  # o1 waits as a sample; offsets: trajectories 2, feedback 3
    o2 = logged(store, log, traj("o2", created_at=old))  # 3: old and not read yet
    n1 = logged(store, log, traj("n1", created_at=recent))  # 4
    n_f = rated(store, log, fb("n1", 0.5))  # 5
    assert (o1, f1, o2, n1, n_f) == (1, 2, 3, 4, 5)
    backdate(engine, LogRecord, LogRecord.offset, [o1, f1, o2], old)
    with engine.begin() as conn:
        conn.execute(update(FeedbackClaim).where(FeedbackClaim.target == "t:o1").values(claimed_at=old))
    report = apply_retention(engine, sql_log_engine(log), retention_cutoff(now, 30))
    assert report.cutoff == now - timedelta(days=30)
    assert report.deleted == {
        "log_records.trajectories": 2,  # o1, o2
        "log_records.feedback": 1,  # f1
        "trajectory_index": 2,
        "feedback_claims": 1,  # t:o1
        "pending_joins": 1,  # o1's joined tombstone
        "learner_samples": 1,  # o1, joined today from a 40-day-old trajectory
        "dead_letters": 0,
        "episode_turns": 0,
        "episodes": 0,
    }
    assert report.unread == 1  # o2: row 3 >= the learner's next trajectory offset 2
    assert keys_of(engine, LogRecord.offset) == [4, 5]
    assert keys_of(engine, TrajectoryIndex.id) == ["n1"] and keys_of(engine, LearnerSample.id) == []
    # The gap changes nothing for the learner: it reads n1 and its feedback, then a new record.
    assert joiner.poll_once().samples == 1 and keys_of(engine, LearnerSample.id) == ["n1"]
    assert logged(store, log, traj("n2")) == 6
    # A second run finds nothing left.
    again = apply_retention(engine, sql_log_engine(log), retention_cutoff(now, 30))
    assert sum(again.deleted.values()) == 0 and again.unread == 0


def test_log_ids_never_go_back_after_the_newest_rows_are_deleted(db):
    # SQLite reuses the largest rowid left + 1 unless the table is AUTOINCREMENT (revision
    # 0007): without it this record would be row 1, below the learner's offset 4, never read.
    log, engine = db
    store = ServerStore(engine)
    old = utcnow() - timedelta(days=40)
    offsets = [
        logged(store, log, traj("a", created_at=old)),
        rated(store, log, fb("a")),
        logged(store, log, traj("b", created_at=old)),
    ]
    joiner = Joiner(log, engine, expire_s=10**9)
    joiner.poll_once()
    backdate(engine, LogRecord, LogRecord.offset, offsets, old)
    report = apply_retention(engine, sql_log_engine(log), retention_cutoff(utcnow(), 30))
    assert count(engine, LogRecord) == 0 and report.unread == 0
    assert logged(store, log, traj("c")) == 4
    rated(store, log, fb("c", 0.25))
    assert joiner.poll_once().samples == 1 and keys_of(engine, LearnerSample.id) == ["c"]


def test_retention_keeps_an_episode_with_a_recent_turn(db):
    log, engine = db
    store = ServerStore(engine)
    now = utcnow()
    for ep, when in (("old", now - timedelta(days=40)), ("live", now - timedelta(days=40))):
        assert store.start_episode_turn(ep, f"{ep}-0", token_ok=False, turn=0).outcome == "ok"
        with engine.begin() as conn:
            conn.execute(update(Episode).where(Episode.episode_id == ep).values(created_at=when))
            conn.execute(update(EpisodeTurn).where(EpisodeTurn.episode_id == ep).values(dispatched_at=when))
    # "live" got a turn yesterday: the episode and both its turns stay.
    with engine.begin() as conn:
        conn.execute(
            EpisodeTurn.__table__.insert().values(
                trajectory_id="live-1", episode_id="live", turn=1, dispatched_at=now - timedelta(days=1)
            )
        )
    report = apply_retention(engine, None, retention_cutoff(now, 30))
    assert (report.deleted["episodes"], report.deleted["episode_turns"]) == (1, 1)
    assert keys_of(engine, Episode.episode_id) == ["live"]
    assert keys_of(engine, EpisodeTurn.trajectory_id) == ["live-0", "live-1"]
    assert "log_records.trajectories" not in report.deleted  # a Kafka log: left to retention.ms


def alice_and_bob(log, engine):
    """Alice: a1 rated (joined, a sample waits), a2 unrated (pending), a3 rated but its claim not
    yet marked (unconfirmed), episode E (turn 0 hers, turn 1 sent without ``user``) rated after
    the poll, and a dead letter of a record of hers; Bob: b1 rated. Returns the store."""
    store = ServerStore(engine)
    now = utcnow()
    alice = {"user": "alice", "created_at": now}
    logged(store, log, traj("a1", **alice))
    rated(store, log, fb("a1", 1.0))
    logged(store, log, traj("a2", **alice))
    logged(store, log, traj("a3", **alice))
    rated(store, log, fb("a3", 0.0), mark=False)
    logged(store, log, traj("b1", user="bob", created_at=now))
    rated(store, log, fb("b1", 0.5))
    t0, t1 = (t.model_copy(update={"created_at": now}) for t in episode_turns())
    t0 = t0.model_copy(update={"user": "alice"})
    assert store.start_episode_turn("E", t0.id, token_ok=False, turn=0).outcome == "ok"
    logged(store, log, t0)
    assert store.start_episode_turn("E", t1.id, token_ok=True, turn=1).outcome == "ok"
    logged(store, log, t1)
    with engine.begin() as conn:
        set_aside(
            conn,
            [
                Letter("malformed", "bad", key="p", payload=json.dumps({"id": "a9", "user": "alice"})),
                Letter("malformed", "bad", key="p", payload=json.dumps({"id": "b9", "user": "bob"})),
            ],
            now,
        )
    return store


def test_forget_removes_a_users_records_from_the_database_and_the_sql_log(db):
    log, engine = db
    store = alice_and_bob(log, engine)
    joiner = Joiner(log, engine, expire_s=3600)
    assert joiner.poll_once().samples == 2  # a1, b1
    rated(store, log, fb(episode="E", prompt_id="q").model_copy(update={"turn_ids": ["E0", "E1"]}))
    report = forget_user(engine, sql_log_engine(log), "alice", utcnow())
    # Her trajectories: a1, a2, a3 and both turns of her episode (turn 1 carried no user).
    assert (report.trajectories, report.episodes, report.tombstones) == (5, 1, 6)
    assert report.deleted == {
        "log_records.trajectories": 5,
        "log_records.feedback": 3,  # a1's, a3's, the episode's
        "trajectory_index": 5,
        "feedback_claims": 3,  # t:a1, t:a3, e:E
        # a1's joined tombstone, a2/E0/E1/a3 pending, a3's unconfirmed feedback
        "pending_joins": 6,
        "learner_samples": 1,  # a1
        "dead_letters": 1,
        "episode_turns": 2,
        "episodes": 1,
        # The joined a1 and b1 made evidence of prompt "p", a client's id in clear (a row
        # written before revision 0015): moved to its keyed hash. No data key (a SQL log).
        "prompt_evidence": 1,
        "subject_keys": 0,
    }
    assert keys_of(engine, TrajectoryIndex.id) == ["b1"] and keys_of(engine, LearnerSample.id) == ["b1"]
    assert keys_of(engine, ForgottenRecord.key) == sorted(["a1", "a2", "a3", "E0", "E1", "e:E"])
    assert keys_of(engine, PendingJoin.key) == ["b1"] and count(engine, DeadLetter) == 1
    with engine.connect() as conn:
        payloads = conn.execute(select(LogRecord.payload)).scalars().all()
    assert len(payloads) == 2 and all("alice" not in p and '"a1"' not in p for p in payloads)
    assert joiner.poll_once().samples == 0
    # Read again from the start (a learner that lost its offsets): only Bob's record joins.
    with engine.begin() as conn:
        for table in ("consumer_offsets", "pending_joins", "learner_samples"):
            conn.exec_driver_sql(f"DELETE FROM {table}")
    assert Joiner(log, engine, expire_s=3600).poll_once().samples == 1
    assert keys_of(engine, LearnerSample.id) == ["b1"]
    # Idempotent: nothing is left to find.
    again = forget_user(engine, sql_log_engine(log), "alice", utcnow())
    assert (again.trajectories, again.tombstones, sum(again.deleted.values())) == (0, 0, 0)
    assert forget_user(engine, sql_log_engine(log), "nobody", utcnow()).trajectories == 0


def test_forget_on_a_log_that_keeps_records_leaves_tombstones_the_learner_obeys(db):
    # A Kafka log cannot delete: forget is given no log engine, as for Kafka, and the records
    # stay in the log; the joiner reads them and drops every one under a tombstone.
    log, engine = db
    store = alice_and_bob(log, engine)
    rated(store, log, fb(episode="E", prompt_id="q").model_copy(update={"turn_ids": ["E0", "E1"]}))
    report = forget_user(engine, None, "alice", utcnow())
    assert "log_records.trajectories" not in report.deleted and report.tombstones == 6
    stats = Joiner(log, engine, expire_s=3600).poll_once()
    # a1, its feedback, a2, a3, its feedback, E0, E1, the episode's feedback.
    assert stats.samples == 1 and stats.counters == {"forgotten": 8}
    assert keys_of(engine, LearnerSample.id) == ["b1"] and keys_of(engine, PendingJoin.key) == ["b1"]
    with engine.connect() as conn:
        assert (
            conn.execute(select(LearnerCounter.value).where(LearnerCounter.name == "forgotten")).scalar_one()
            == 8
        )
    # Critic pretraining reads the whole log: the tombstones keep a1 out of it too.
    assert [s.id for s in logged_samples(log, all_forgotten(engine))] == ["b1"]
    # Without them it would read a1 (and a3, whose feedback pretraining takes unconfirmed).
    assert sorted(s.id for s in logged_samples(log)) == ["a1", "a3", "b1"]


def test_a_forget_between_the_joiners_read_and_commit_leaves_nothing_behind(db):
    log, engine = db
    store = ServerStore(engine)
    logged(store, log, traj("a1", user="alice", created_at=utcnow()))
    rated(store, log, fb("a1"))
    logged(store, log, traj("a2", user="alice", created_at=utcnow()))

    class Racing(Joiner):
        def _state(self, records, now):
            state = super()._state(records, now)
            forget_user(engine, None, "alice", utcnow())
            return state

    stats = Racing(log, engine, expire_s=3600).poll_once()
    assert stats.samples == 1  # planned before the tombstones existed...
    assert count(engine, LearnerSample) == 0 and count(engine, PendingJoin) == 0  # ...and purged


def test_pretraining_skips_opted_out_trajectories(db):
    log, engine = db
    store = ServerStore(engine)
    logged(store, log, traj("o", train=False, created_at=utcnow()))
    rated(store, log, fb("o"))
    logged(store, log, traj("t", created_at=utcnow()))
    rated(store, log, fb("t"))
    assert [s.id for s in logged_samples(log)] == ["t"]
