"""Forget on a Kafka log (tansu) with PostgreSQL (issue 40 item 7; docs/privacy.md, "The Kafka log"):
the trajectory records are sealed per (API key, user) subject, a forget destroys the subject's
data key, and every copy the broker keeps can no longer be read: the learner skips them
(``shredded``), critic pretraining and the admin read too; the rest joins as before.
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import delete, func, select

from core.claims import claim_target
from core.db import ConsumerOffset, LearnerSample, PendingJoin, SubjectKey, make_engine, migrate
from core.forget import ForgetKind, ForgetTarget, all_forgotten, forget
from core.logbus import KafkaLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, utcnow
from core.sealing import Shredded, is_sealed
from learner.algo.pretrain import logged_samples
from learner.data.joiner import Joiner
from server.store import ServerStore
from testing import builders
from testing.logs import read_topic

SECRET = "the-server-secret-of-these-tests"
K1 = "k0123456789abcdef"
P = "p-" + "0" * 32

pytestmark = pytest.mark.kafka


def traj(tid: str, **kw) -> TrajectoryRecord:
    """A trajectory of prompt ``P`` at version 0, logged now."""
    return builders.traj(tid, P, created_at=utcnow(), token_versions=[(0, 2)], dispatch_version=0, **kw)


@pytest.fixture
def kafka(tansu, pg_url):
    """The shared broker under topics of this test's own (a prefix), and a migrated database."""
    log = KafkaLog(f"{tansu}?topic_prefix=forget-{uuid.uuid4().hex[:8]}-")
    migrate(pg_url)
    db = make_engine(pg_url)
    yield log, db
    log.close()
    db.dispose()


def served(store: ServerStore, log: KafkaLog, rec: TrajectoryRecord, reward: float) -> None:
    """Log and index ``rec`` as the server does (sealed: a Kafka log keeps records), then a
    rating of it, claimed, logged and confirmed."""
    part, off = log.append(TOPIC_TRAJECTORIES, rec.prompt_id, store.log_bytes(rec, log.keeps_records))
    store.index_trajectory(rec, part, off)
    fb = FeedbackRecord(
        trajectory_id=rec.id, prompt_id=P, reward=reward, received_at=utcnow(), feedback_id=str(uuid.uuid4())
    )
    assert store.claim(claim_target(rec.id, None), fb.feedback_id)
    log.append(TOPIC_FEEDBACK, P, fb.to_json())
    store.mark_received(claim_target(rec.id, None), reward, fb.feedback_id)


def test_forget_destroys_the_keys_and_every_copy_in_the_broker_becomes_unreadable(kafka):
    log, db = kafka
    store = ServerStore(db)
    assert log.keeps_records
    served(store, log, traj("a1", user="alice", identity="user:alice"), 1.0)
    served(store, log, traj("k1", identity=f"key:{K1}", tenant="acme"), 0.0)  # a key, no user
    served(store, log, traj("b1", user="bob", identity="user:bob"), 0.5)
    raw = {e.offset: e.value for e in read_topic(log, TOPIC_TRAJECTORIES)}
    assert len(raw) == 3 and all(is_sealed(v) for v in raw.values())
    assert not any(b"alice" in v or K1.encode() in v or b"bob" in v for v in raw.values())
    # The learner opens them and joins all three.
    assert Joiner(log, db, expire_s=3600).poll_once().samples == 3

    alice = forget(db, None, ForgetTarget(ForgetKind.USER, "alice"), SECRET, utcnow())
    key = forget(db, None, ForgetTarget(ForgetKind.KEY, K1), SECRET, utcnow())
    for receipt in (alice, key):
        assert (receipt.trajectories, receipt.tombstones) == (1, 1)
        # One data key each; the joined sample, its "joined" pending row, its claim, its index row.
        assert {k: n for k, n in receipt.deleted.items() if n} == {
            "subject_keys": 1,
            "learner_samples": 1,
            "pending_joins": 1,
            "feedback_claims": 1,
            "trajectory_index": 1,
        }
    with db.connect() as conn:
        live = conn.execute(
            select(func.count()).select_from(SubjectKey).where(SubjectKey.secret.is_not(None))
        )
        assert live.scalar_one() == 1  # bob's
    # The broker still holds all three records, and two of them can no longer be read by anyone.
    copies = read_topic(log, TOPIC_TRAJECTORIES)
    assert [e.value for e in copies] == list(raw.values())
    opened = []
    for e in copies:
        try:
            opened.append(TrajectoryRecord.model_validate_json(store.open_logged(e.value)).id)
        except Shredded:
            opened.append(None)
    assert sorted(opened, key=str) == sorted([None, None, "b1"], key=str)

    # A learner reading the whole log again: the two trajectories are skipped unread (shredded),
    # their ratings dropped under the tombstones (forgotten), bob's record joins.
    with db.begin() as conn:
        for table in (ConsumerOffset, PendingJoin, LearnerSample):
            conn.execute(delete(table))
    stats = Joiner(log, db, expire_s=3600).poll_once()
    assert stats.samples == 1 and stats.counters == {"shredded": 2, "forgotten": 2}
    with db.connect() as conn:
        assert list(conn.execute(select(LearnerSample.id)).scalars()) == ["b1"]
    # Critic pretraining reads the log too.
    assert [s.id for s in logged_samples(log, all_forgotten(db), store.subject_keys)] == ["b1"]

    # Alice comes back: her new record gets a new key, and is read and trained as any other
    # (once the server's cached key is dropped: the admin route does it at once; another replica
    # reads the key again after core.sealing.KEY_CACHE_S).
    store.subject_keys.drop_cached()
    served(store, log, traj("a2", user="alice", identity="user:alice"), 1.0)
    assert Joiner(log, db, expire_s=3600).poll_once().samples == 1
