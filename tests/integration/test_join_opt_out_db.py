"""The Joiner reads the key's training setting at join time (issue 40, item 6), on SQLite and
PostgreSQL with the SQL-table log: a key that opts out after its answers were logged gets none
of them trained, nor their rewards into the prompt evidence; a single answer and an episode."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from core.db import LearnerCounter, LearnerSample, PromptEvidence, make_engine, migrate
from core.keys import KeyStore, opted_out_keys
from core.logbus import SqlLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, utcnow
from learner.algo.pretrain import logged_samples
from learner.data.joiner import Joiner
from learner.data.sample_queue import next_batch
from testing import builders


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path / 'db.sqlite'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    migrate(url)
    engine, log = make_engine(url), SqlLog(url)
    yield log, engine
    log.close()
    engine.dispose()


def trajectory(tid: str, prompt_id: str, identity: str, **kw) -> TrajectoryRecord:
    """A trajectory of ``identity`` at version 0, logged now."""
    return builders.traj(
        tid,
        prompt_id,
        created_at=utcnow(),
        token_versions=[(0, 2)],
        dispatch_version=0,
        identity=identity,
        **kw,
    )


def test_a_key_that_opts_out_after_logging_is_never_trained(db):
    log, engine = db
    keys = KeyStore(engine)
    out, _ = keys.create("acme", utcnow())
    stays, _ = keys.create("acme", utcnow())
    recs = [
        trajectory("a", "pa", f"key:{out.id}"),  # logged train: true, key opted out before the join
        trajectory("b", "pb", f"key:{stays.id}"),
        trajectory("e0", "pe", f"key:{out.id}", episode_id="E", turn=0),
        trajectory("e1", "pe", f"key:{out.id}", episode_id="E", turn=1),
    ]
    for r in recs:
        log.append(TOPIC_TRAJECTORIES, r.prompt_id, r.to_json())
    keys.set_train(out.id, False)
    for fb in (
        FeedbackRecord(trajectory_id="a", prompt_id="pa", reward=1.0, received_at=utcnow()),
        FeedbackRecord(trajectory_id="b", prompt_id="pb", reward=1.0, received_at=utcnow()),
        FeedbackRecord(
            episode_id="E", prompt_id="pe", reward=1.0, received_at=utcnow(), turn_ids=["e0", "e1"]
        ),
    ):
        log.append(TOPIC_FEEDBACK, fb.prompt_id, fb.to_json())
    joiner = Joiner(log, engine, 3600)
    for _ in range(3):  # trajectories first, then the feedback (the Joiner's read order)
        joiner.poll_once()
    with engine.connect() as conn:
        counters = dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())
        samples = sorted(conn.execute(select(LearnerSample.id)).scalars())
        evidence = sorted(conn.execute(select(PromptEvidence.prompt_id)).scalars())
        n_evidence = conn.execute(select(func.count()).select_from(PromptEvidence)).scalar_one()
    # a and the episode E: excluded (2); b trains. Only b's prompt gets evidence.
    assert counters.get("excluded_opted_out") == 2
    assert samples == ["b"]
    assert evidence == ["pb"] and n_evidence == 1
    # Critic pretraining reads the log itself: a (logged train: true) is read unless the keys
    # whose training is off now are left out (saoserve pretrain-critic passes them).
    with engine.connect() as conn:
        opted = opted_out_keys(conn)
    assert sorted(s.id for s in logged_samples(log)) == ["a", "b"]
    assert [s.id for s in logged_samples(log, opted_out=opted)] == ["b"]
    # b joined while its key trained; the key opts out before b's batch: b is deleted at the
    # next batch's selection, counted like the joiner's exclusions (2 + 1), never trained.
    keys.set_train(stays.id, False)
    assert next_batch(engine, 1, None) == (None, 0)
    with engine.connect() as conn:
        counters = dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())
        assert conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one() == 0
    assert counters["excluded_opted_out"] == 3


def test_a_tenant_learner_reads_the_keys_of_the_global_database(tmp_path):
    """A tenant policy's learner joins from its namespace's database, while the API keys live in
    the global one (``Settings.keys_database_url``): the key's setting is read there."""
    from core.settings import Settings

    settings = Settings(home=tmp_path, tenant_policies=["acme"], adapter_serving="adapter", max_cpu_loras=6)
    tenant = settings.for_tenant("acme")
    assert tenant.keys_database_url == settings.resolved_database_url != tenant.resolved_database_url
    for url in (settings.resolved_database_url, tenant.resolved_database_url):
        migrate(url)
    keys_db, db, log = (
        make_engine(tenant.keys_database_url),
        make_engine(tenant.resolved_database_url),
        SqlLog(tenant.resolved_database_url),
    )
    try:
        keys = KeyStore(keys_db)
        out, _ = keys.create("acme", utcnow())
        rec = trajectory("a", "pa", f"key:{out.id}")
        log.append(TOPIC_TRAJECTORIES, rec.prompt_id, rec.to_json())
        keys.set_train(out.id, False)
        fb = FeedbackRecord(trajectory_id="a", prompt_id="pa", reward=1.0, received_at=utcnow())
        log.append(TOPIC_FEEDBACK, fb.prompt_id, fb.to_json())
        joiner = Joiner(log, db, 3600, keys_db)
        for _ in range(3):
            joiner.poll_once()
        with db.connect() as conn:
            counters = dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())
            assert conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one() == 0
        assert counters.get("excluded_opted_out") == 1
    finally:
        log.close()
        db.dispose()
        keys_db.dispose()
