"""Migration checks on a database URL (SQLite in tests/unit/core/test_migrations.py, PostgreSQL in
tests/integration/test_migrations.py): up, down and up again with the models matching
(``check_up_down_up``), and revision 0010's repair of episodes logged before 0006
(``check_0010`` over ``populated_before_0006``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from core.db import Base, downgrade, make_engine, migrate
from server.store import ServerStore


def check_up_down_up(url: str) -> None:
    migrate(url)
    downgrade(url, "base")
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    migrate(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == [], f"models and migrations differ: {diff}"


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
