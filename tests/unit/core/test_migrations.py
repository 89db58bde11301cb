"""Alembic migrations on SQLite (``testing.backends.migrations``; PostgreSQL:
tests/integration/test_migrations.py): up/down/up, and the models match them; data migrations
on a database populated before them."""

from __future__ import annotations

from sqlalchemy import select

from core.db import LearnerSample, make_engine, migrate
from core.logbus import SqlLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES
from learner.data.joiner import Joiner
from server.store import ServerStore
from testing.backends.migrations import (
    LOGGED_BEFORE_0006,
    at,
    check_0010,
    check_up_down_up,
    populated_before_0006,
)
from testing.builders import fb, traj


def test_migrations_sqlite(tmp_path):
    check_up_down_up(f"sqlite:///{tmp_path / 'm.db'}")


def test_revision_0010_numbers_the_turns_0006_left_unnumbered_and_keeps_the_answered_copy(tmp_path):
    """Finding 8: on a database populated before 0006, episodes of unnumbered turns listed no
    turn (feedback 202, never trained) and a turn sent twice kept an arbitrary copy (here the
    aborted one: the episode could never be rated)."""
    check_0010(f"sqlite:///{tmp_path / 'm.db'}")


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
