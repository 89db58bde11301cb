"""Alembic migrations: up/down/up on SQLite and PostgreSQL, and the models match them; data
migrations on a database populated before them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, select, text

from core.db import Base, LearnerSample, downgrade, make_engine, migrate
from core.logbus import SqlLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES
from learner.joiner import Joiner
from server.store import ServerStore
from testing.builders import fb, traj


def _check(url: str) -> None:
    migrate(url)
    downgrade(url, "base")
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    migrate(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == [], f"models and migrations differ: {diff}"


def test_migrations_sqlite(tmp_path):
    _check(f"sqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_migrations_postgres(pg_url):
    _check(pg_url)


# ---------------------------------------------------------------- revision 0010 (issue 23, finding 8)
def index(conn, tid: str, episode: str, turn: int | None, at: datetime, finish: str = "stop") -> None:
    """A trajectory_index row as the server wrote it before 0006 (episode turns numbered by the
    client, or not at all)."""
    conn.execute(
        text(
            "INSERT INTO trajectory_index (id, prompt_id, episode_id, turn, dispatch_version, last_version,"
            " n_response_tokens, finish_reason, log_partition, log_offset, created_at)"
            " VALUES (:id, 'q', :ep, :turn, 0, 0, 1, :finish, 0, 0, :at)"
        ),
        {"id": tid, "ep": episode, "turn": turn, "finish": finish, "at": at},
    )


T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


# Episode → its trajectory_index rows (id, turn, minutes after T0, finish reason).
LOGGED_BEFORE_0006 = {
    "unnumbered": [("c-u0", None, 0, "stop"), ("c-u1", None, 1, "stop")],
    # Turn 1 sent twice: the first copy aborted (its id sorts first), the retry answered.
    "retried": [("c-r0", 0, 0, "stop"), ("c-r1a", 1, 1, "abort"), ("c-r1b", 1, 2, "stop")],
    "mixed": [("c-m0", 0, 0, "stop"), ("c-m1", 1, 1, "stop"), ("c-mx", None, 2, "stop")],
    "fine": [("c-f0", 0, 0, "stop"), ("c-f1", 1, 1, "stop")],
    "continued": [("c-c0", None, 0, "stop")],
}


def populated_before_0006(url: str) -> None:
    migrate(url, "0005")
    eng = create_engine(url)
    with eng.begin() as conn:
        for episode, rows in LOGGED_BEFORE_0006.items():
            for tid, turn, minutes, finish in rows:
                index(conn, tid, episode, turn, at(minutes), finish)
        # A turn of "unnumbered" in flight at the upgrade (a row without number, not logged).
        conn.execute(
            text(
                "INSERT INTO episode_turns (trajectory_id, episode_id, dispatched_at)"
                " VALUES ('c-u2', 'unnumbered', :at)"
            ),
            {"at": at(3)},
        )
    migrate(url, "0006")
    with eng.begin() as conn:
        # "continued" after 0006: the server found no numbered turn and numbered the next one 0.
        index(conn, "c-c1", "continued", 0, at(5))
        conn.execute(
            text(
                "INSERT INTO episode_turns (trajectory_id, episode_id, dispatched_at, turn, logged_at)"
                " VALUES ('c-c1', 'continued', :at, 0, :at)"
            ),
            {"at": at(5)},
        )
    eng.dispose()


def test_revision_0010_numbers_the_turns_0006_left_unnumbered_and_keeps_the_answered_copy(tmp_path):
    """Finding 8: on a database populated before 0006, episodes of unnumbered turns listed no
    turn (feedback 202, never trained) and a turn sent twice kept an arbitrary copy (here the
    aborted one: the episode could never be rated)."""
    check_0010(f"sqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_revision_0010_repairs_the_episodes_on_postgres(pg_url):
    check_0010(pg_url)


def check_0010(url: str) -> None:
    populated_before_0006(url)
    migrate(url)
    store = ServerStore(make_engine(url))
    states = {e: store.episode_state(e) for e in LOGGED_BEFORE_0006}
    assert {e: s.turn_ids for e, s in states.items()} == {
        "unnumbered": ("c-u0", "c-u1"),
        "retried": ("c-r0", "c-r1b"),  # the newest whole copy of turn 1
        "mixed": ("c-m0", "c-m1", "c-mx"),  # numbered in the order logged: 0, 1, then 2
        "fine": ("c-f0", "c-f1"),
        "continued": ("c-c0", "c-c1"),  # the old turn is 0, the one numbered 0 after 0006 is 1
    }
    assert {e: s.not_whole_turns for e, s in states.items()} == dict.fromkeys(LOGGED_BEFORE_0006, 0)
    with store.engine.connect() as conn:
        turns = dict(conn.execute(text("SELECT id, turn FROM trajectory_index")).all())
        flight = conn.execute(
            text("SELECT turn, logged_at FROM episode_turns WHERE trajectory_id = 'c-u2'")
        ).one()
    assert turns == {
        "c-u0": 0,
        "c-u1": 1,
        "c-r0": 0,
        "c-r1a": 1,  # the aborted copy is no turn of the episode; its own number stays
        "c-r1b": 1,
        "c-m0": 0,
        "c-m1": 1,
        "c-mx": 2,
        "c-f0": 0,
        "c-f1": 1,
        "c-c0": 0,
        "c-c1": 1,
    }
    assert tuple(flight) == (None, None)  # the turn in flight keeps its row
    store.engine.dispose()


def test_the_repaired_episodes_are_rated_and_trained(tmp_path):
    """The rest of finding 8's path: the feedback the server now makes lists the repaired turns,
    and the learner joins them (the aborted copy of the retried turn is unlisted: void)."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    populated_before_0006(url)
    migrate(url)
    store, log = ServerStore(make_engine(url)), SqlLog(url)
    for episode in ("unnumbered", "retried"):
        for tid, turn, minutes, finish in LOGGED_BEFORE_0006[episode]:
            rec = traj(tid, "q", episode_id=episode, turn=turn, created_at=at(minutes), finish_reason=finish)
            log.append(TOPIC_TRAJECTORIES, "q", rec.to_json())
        rated = fb(episode=episode, prompt_id="q").model_copy(
            update={"turn_ids": list(store.episode_state(episode).turn_ids)}
        )
        log.append(TOPIC_FEEDBACK, "q", rated.to_json())
    stats = Joiner(log, store.engine, 10 * 365 * 86400).poll_once()
    with store.engine.connect() as conn:
        samples = sorted(conn.execute(select(LearnerSample.id)).scalars())
    assert samples == ["e:retried", "e:unnumbered"]
    assert stats.counters == {"void_episode_turns": 1, "episode_turns_not_aligned": 2}
    log.close()
    store.engine.dispose()
