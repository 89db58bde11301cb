"""The Joiner's read and commit around the pure plan, on a real SQLite database and SQL log
(no engine): what one poll leaves in the tables."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import select

from core.db import LearnerCounter, LearnerSample, PendingJoin
from core.evidence_store import EvidenceStore
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, utcnow
from learner.algo.pretrain import logged_samples
from learner.data.joiner import Joiner, JoinStats
from server.store import ServerStore
from testing.builders import episode_turns, fb, traj
from testing.rows import migrated_with_log


@pytest.fixture
def db(database_url):
    with migrated_with_log(database_url) as log_and_engine:
        yield log_and_engine


def append(log, *recs):
    for r in recs:
        topic = TOPIC_FEEDBACK if hasattr(r, "reward") else TOPIC_TRAJECTORIES
        log.append(topic, r.prompt_id, r.to_json())


def tables(engine):
    with engine.connect() as conn:
        return (
            dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all()),
            sorted(conn.execute(select(LearnerSample.id)).scalars()),
            sorted(conn.execute(select(PendingJoin.key, PendingJoin.kind)).all()),
        )


def test_aborted_answers_leave_no_sample_and_no_evidence_but_a_counted_reason(db):
    log, engine = db
    now = utcnow()
    t0, t1 = episode_turns()
    aborted = traj("a", created_at=now, finish_reason="abort")
    errored = traj("b", created_at=now, finish_reason="error")
    whole = traj("c", "w", created_at=now, token_versions=[(3, 2)])
    t0, t1 = (t.model_copy(update={"created_at": now}) for t in (t0, t1))
    t1 = t1.model_copy(update={"finish_reason": "abort"})
    append(log, aborted, errored, whole, t0, t1, fb("a"), fb("b"), fb("c", 1.0, "w"))
    append(log, fb(episode="E", prompt_id="q"))
    stats = Joiner(log, engine, 3600).poll_once()
    assert stats.samples == 1
    assert stats.counters == {"excluded_aborted": 2, "excluded_error": 1}
    counters, samples, pending = tables(engine)
    assert counters == {"excluded_aborted": 2, "excluded_error": 1} and samples == ["c"]
    assert pending == [(k, "joined") for k in ("E0", "E1", "a", "b", "c", "e:E")]
    ev = EvidenceStore(engine)
    assert ev.get("p") is None and ev.get("q") is None
    # The whole answer is credited to the version of its first token (3), not its dispatch (2).
    stored = ev.get("w")
    assert stored is not None and stored.n_results == 1
    assert (stored.online.ref_version, stored.prior.ref_version) == (3, 3)


def test_pending_rows_cross_polls_and_expire(db):
    log, engine = db
    now = utcnow()
    append(log, fb("late", 0.5), traj("old", created_at=now - timedelta(hours=2)))
    stats = Joiner(log, engine, 3 * 3600).poll_once()
    assert stats.samples == 0 and stats.counters == {}
    assert tables(engine)[2] == [("late", "feedback"), ("old", "trajectory")]
    # A shorter expiry: "old" (2 h) expires in the next poll, and leaves a tombstone of expiry.
    append(log, traj("late", created_at=now))
    stats = Joiner(log, engine, 3600).poll_once()
    assert stats.samples == 1 and stats.counters == {"expired": 1}
    counters, samples, pending = tables(engine)
    assert counters == {"expired": 1} and samples == ["late"]
    assert pending == [("late", "joined"), ("old", "expired")]
    with engine.connect() as conn:
        payload = json.loads(conn.execute(select(LearnerSample.payload)).scalar_one())
    assert payload["reward"] == 0.5 and payload["result_version"] == 2
    assert Joiner(log, engine, 3600).poll_once().samples == 0  # offsets moved


def test_critic_pretraining_reads_only_whole_answers(db):
    log, engine = db
    now = utcnow()
    append(
        log,
        traj("a", created_at=now, finish_reason="abort"),
        traj("b", created_at=now, finish_reason="error"),
        traj("c", created_at=now, finish_reason="length"),
        fb("a"),
        fb("b"),
        fb("c", 0.0),
    )
    assert [(s.id, s.reward) for s in logged_samples(log)] == [("c", 0.0)]


def test_feedback_waits_while_trajectories_are_behind(db):
    log, engine = db
    now = utcnow()
    t0, t1 = (t.model_copy(update={"created_at": now}) for t in episode_turns())
    t1 = t1.model_copy(update={"finish_reason": "abort"})
    append(log, traj("x", created_at=now), t0, t1, fb(episode="E", prompt_id="q"))
    joiner = Joiner(log, engine, 3600)
    # Two of three trajectories fill the batch (max_records = 2): more may be behind, so the
    # episode's rating is not read yet; joined now it would miss the aborted turn 1.
    stats = joiner.poll_once(max_records=2)
    assert stats.samples == 0 and stats.counters == {}
    assert tables(engine)[2] == [("E0", "trajectory"), ("x", "trajectory")]
    stats = joiner.poll_once(max_records=2)
    assert stats.samples == 0 and stats.counters == {"excluded_aborted": 1}
    assert tables(engine)[2] == [("E0", "joined"), ("E1", "joined"), ("e:E", "joined"), ("x", "trajectory")]
    assert joiner.poll_once(max_records=2).counters == {}


def test_feedback_answered_503_and_logged_late_is_void_the_confirmed_retry_is_trained(db):
    # Issue 13 item 3 through the server's claims: A (0.0) is released after its append timed
    # out (503) but the log appends it later; the retry B (1.0) gets the claim, is logged, and is
    # marked with B's id. Trained: 1.0, A counted void.
    log, engine = db
    store = ServerStore(engine)
    t1 = traj("t1", created_at=utcnow())
    a = fb("t1", 0.0).model_copy(update={"feedback_id": "A", "received_at": utcnow()})
    b = fb("t1", 1.0).model_copy(update={"feedback_id": "B", "received_at": utcnow()})
    append(log, t1)
    assert store.claim("t:t1", "A")
    store.release("t:t1", "A")
    assert store.claim("t:t1", "B")
    append(log, a, b)
    joiner = Joiner(log, engine, 3600)
    # B's claim is taken but not yet marked: both wait.
    assert joiner.poll_once() == JoinStats()
    assert tables(engine)[2] == [("A", "unconfirmed"), ("B", "unconfirmed"), ("t1", "trajectory")]
    store.mark_received("t:t1", 1.0, "B")
    # No new record: the waiting feedback is read again and resolved.
    assert joiner.poll_once() == JoinStats(samples=1, counters={"void_feedback": 1})
    counters, samples, pending = tables(engine)
    assert counters == {"void_feedback": 1} and samples == ["t1"] and pending == [("t1", "joined")]
    with engine.connect() as conn:
        assert json.loads(conn.execute(select(LearnerSample.payload)).scalar_one())["reward"] == 1.0
    assert joiner.poll_once() == JoinStats()
