"""The version lifecycle's tests on any database (core/lifecycle_store.py): stages and their
transitions recorded, a version's rated rewards, quarantine. They take ``database_url``
(tests/unit: SQLite; tests/integration: PostgreSQL) and run in tests/unit/core/test_lifecycle.py
and tests/integration/test_lifecycle.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import insert, select

from core.db import (
    LearnerStep,
    PolicyVersion,
    VersionStatusEvent,
    make_engine,
    migrate,
)
from core.lifecycle import Stage, TransitionError, VersionStage
from core.lifecycle_store import (
    quarantine,
    quarantined,
    rated_rewards,
    set_step_metric,
    stages,
    step_metric,
    trained_sample_ids,
    transition,
)
from core.records import utcnow
from testing.guard import add_rated, add_version

__all__ = [
    "db",
    "test_a_version_row_without_a_stage_is_promoted_and_transitions_are_recorded",
    "test_rated_rewards_are_the_versions_rated_answers_in_receipt_order",
    "test_quarantine_keeps_the_first_row_of_an_id_and_lists_newest_first",
    "test_a_step_metric_written_later_sits_beside_the_step_s_own",
]


@pytest.fixture
def db(database_url):
    """The tier's database, migrated."""
    url = database_url
    migrate(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def test_a_version_row_without_a_stage_is_promoted_and_transitions_are_recorded(db):
    now = utcnow()
    with db.begin() as conn:
        conn.execute(
            insert(PolicyVersion).values(
                version=0, path="/p", sha256="0" * 64, status="published", metrics={}, created_at=now
            )
        )
        add_version(conn, 1)
    with db.begin() as conn:
        assert transition(conn, 1, "promoted", "alice", "looks right", now) == Stage.PROMOTED
    with db.connect() as conn:
        assert stages(conn) == [VersionStage(0, Stage.PROMOTED), VersionStage(1, Stage.PROMOTED)]
        ev = conn.execute(select(*VersionStatusEvent.__table__.columns)).one()
        assert (ev.version, ev.from_status, ev.to_status, ev.actor, ev.reason) == (
            1,
            "canary",
            "promoted",
            "alice",
            "looks right",
        )
    with db.begin() as conn, pytest.raises(TransitionError, match="cannot go from promoted to canary"):
        transition(conn, 1, "canary", "alice", "", now)
    with db.begin() as conn, pytest.raises(KeyError, match="no policy version 7"):
        transition(conn, 7, "promoted", "alice", "", now)


def test_rated_rewards_are_the_versions_rated_answers_in_receipt_order(db):
    t0 = utcnow()
    with db.begin() as conn:
        add_version(conn, 0, "promoted")
        add_version(conn, 1)
        add_rated(conn, "a", 0, 1.0, t0)
        add_rated(conn, "b", 1, 0.0, t0 + timedelta(seconds=1))
        add_rated(conn, "c", 0, 0.0, t0 + timedelta(seconds=2))
        add_rated(conn, "d", 1, 1.0, t0 + timedelta(seconds=3))
        add_rated(conn, "e", 1, None, t0 + timedelta(seconds=4), state="claimed")  # not yet received
    with db.connect() as conn:
        assert rated_rewards(conn, [1]) == [0.0, 1.0]  # b, d (e is not received)
        assert rated_rewards(conn, [0, 1]) == [1.0, 0.0, 0.0, 1.0]
        assert rated_rewards(conn, [0], limit=1) == [0.0]  # the newest one: c
        assert rated_rewards(conn, [0, 1], before=t0 + timedelta(seconds=2)) == [1.0, 0.0]
        assert rated_rewards(conn, []) == []


def test_quarantine_keeps_the_first_row_of_an_id_and_lists_newest_first(db):
    t0 = utcnow()
    with db.begin() as conn:
        conn.execute(
            insert(LearnerStep).values(
                run_id="r", step=1, version=3, metrics={"sample_ids": ["s1", "s2"]}, created_at=t0
            )
        )
        ids = trained_sample_ids(conn, [3, 4])
        assert ids == {3: ["s1", "s2"]}
        assert quarantine(conn, ids, "lineage rejected", t0) == 2
        assert quarantine(conn, {4: ["s2", "s3"]}, "again", t0 + timedelta(seconds=1)) == 1
    with db.connect() as conn:
        total, listed = quarantined(conn, 10)
    assert total == 3
    assert [(r["sample_id"], r["version"], r["reason"]) for r in listed] == [
        ("s3", 4, "again"),
        ("s1", 3, "lineage rejected"),
        ("s2", 3, "lineage rejected"),
    ]


def test_a_step_metric_written_later_sits_beside_the_step_s_own(db):
    """The drift veto's figure of a version measured before its promotion
    (``learner.guard.guard.KL_AFTER``) is written into the metrics of the step that trained it."""
    t0 = utcnow()
    with db.begin() as conn:
        conn.execute(
            insert(LearnerStep).values(
                run_id="r", step=1, version=3, metrics={"kl_ref": 0.5, "sample_ids": ["s1"]}, created_at=t0
            )
        )
        assert set_step_metric(conn, 3, "kl_ref_after", 1.14) == 1
        assert set_step_metric(conn, 4, "kl_ref_after", 0.2) == 0  # no step trained version 4
    with db.connect() as conn:
        assert step_metric(conn, [3, 4], "kl_ref_after") == {3: 1.14}
        assert step_metric(conn, [3], "kl_ref") == {3: 0.5}
        assert trained_sample_ids(conn, [3]) == {3: ["s1"]}
