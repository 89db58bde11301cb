"""Dead letters (core/dead_letters.py, issue 23 findings 1 and 7): what the learner cannot join,
validate or train is set aside with its reason, in the commit that moves the offsets past it,
counted, listed (``GET /admin/dead_letters``, ``saoserve admin dead-letters``, ``/metrics``),
and the learner goes on; rollback and pause are carried out whatever the joins do.

Pure tier: the plan's rules, the Joiner on SQLite (a trigger makes the database refuse a record,
as PostgreSQL refused the 100-character episode id), the learner with a tiny model, the admin
route and the CLI on the real app with ``testing.fakes.FakeEngine``. On PostgreSQL (a record with a NUL, which it cannot store,
set aside): tests/integration/test_dead_letters.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.exc import IntegrityError
from typer.testing import CliRunner

from core.control import PAUSED, ROLLBACK_TO, get_flag, set_flag
from core.db import (
    ConsumerOffset,
    LearnerCounter,
    LearnerSample,
    PendingJoin,
    PolicyVersion,
    bump_counter,
    make_engine,
    migrate,
)
from core.dead_letters import Letter, describe, set_aside, storable_text
from core.logbus import SqlLog, open_log
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, utcnow
from learner.data.join_plan import JoinState, Unreadable
from learner.data.joiner import Joiner
from learner.publish import latest_version
from saoserve.cli import app as cli_app
from server.metrics import ServerMetrics
from server.state import ServerState
from server.store import ServerStore
from testing.builders import EXPIRE_S, NOW, episode_turns, fb, plan, read, sent, traj
from testing.fakes import FakeEngine
from testing.learner import feed, in_process, trained_ids, wait_for
from testing.logs import append
from testing.rows import letters, migrated_with_log
from testing.servers import ADMIN, make_settings, running_server

runner = CliRunner()
KEY = "test-admin-key"


def listed(ids: list[str] | None):
    return fb(episode="E", prompt_id="q").model_copy(update={"turn_ids": ids})


# ------------------------------------------------------------------------------ the plan
def test_a_malformed_record_is_a_dead_letter_with_its_position_and_why():
    long_id = json.dumps({**json.loads(traj().to_json()), "id": "x" * 65}).encode()
    p = plan(read((TOPIC_TRAJECTORIES, long_id), (TOPIC_FEEDBACK, b"{not json"), traj("ok")))
    assert p.counters == {"malformed_trajectories": 1, "malformed_feedback": 1}
    too_long, not_json = p.dead_letters
    assert too_long == Letter(
        "malformed",
        "not a trajectories record: id: String should have at most 64 characters",
        key="k",
        topic=TOPIC_TRAJECTORIES,
        log_partition=0,
        log_offset=0,
        payload=long_id,
    )
    assert (not_json.kind, not_json.topic, not_json.log_offset, not_json.payload) == (
        "malformed",
        TOPIC_FEEDBACK,
        0,
        b"{not json",
    )
    assert not_json.reason.startswith("not a feedback record: record: Invalid JSON")
    # The offsets move past both; the valid record waits as before.
    assert p.offsets == {(TOPIC_TRAJECTORIES, 0): 2, (TOPIC_FEEDBACK, 0): 1}
    assert [(r.key, r.kind) for r in p.inserts] == [("ok", "trajectory")]


def test_feedback_for_a_trajectory_already_expired_is_set_aside_not_left_pending():
    late = fb("old", 0.5)
    p = plan(read(late), JoinState(expired_before=frozenset({"old"})))
    assert p.samples == [] and p.inserts == [] and p.counters == {"late_feedback": 1}
    assert p.dead_letters == [
        Letter(
            "trajectory_expired",
            "its trajectory had expired (no feedback within expire_s = 3600 s) before this feedback was read",
            key="old",
            prompt_id="p",
            payload=late.to_json().decode(),
        )
    ]
    # A re-sent copy of the expired trajectory does not wait again.
    p = plan(read(traj("old")), JoinState(expired_before=frozenset({"old"})))
    assert p.inserts == [] and p.counters == {"duplicate_trajectories": 1}


def test_an_expired_trajectory_leaves_a_tombstone_of_expiry():
    old = traj("old", created_at=NOW - timedelta(seconds=EXPIRE_S + 1))
    p = plan(read(old), JoinState(expired=frozenset({"gone"})))
    assert [(r.key, r.kind) for r in p.inserts] == [("old", "expired"), ("gone", "expired")]
    assert p.counters == {"expired": 2} and p.expired == ["gone"]


def test_feedback_pending_longer_than_expire_s_is_set_aside_unless_its_trajectory_comes():
    stale = fb("gone")
    p = plan(read(), JoinState(stale_feedback={"gone": stale}))
    assert p.deletes == [("gone", "feedback")] and p.counters == {"late_feedback": 1}
    [letter] = p.dead_letters
    assert (letter.kind, letter.key, letter.reason) == (
        "trajectory_expired",
        "gone",
        "no trajectory joined it within expire_s (3600 s): its trajectory had expired before it came",
    )
    # Its trajectory in this very read: joined, nothing set aside.
    p = plan(read(traj("gone")), JoinState(feedback={"gone": stale}, stale_feedback={"gone": stale}))
    assert [s.id for s in p.samples] == ["gone"] and p.dead_letters == []
    assert p.deletes == [("gone", "feedback")]


def test_episode_feedback_that_cannot_join_its_turns_is_set_aside():
    _, t1 = episode_turns()
    p = plan(read(t1, listed(["E0", "E1"])), JoinState(expired_before=frozenset({"E0"})))
    assert p.samples == [] and p.counters == {"episode_turns_missing": 1}
    [letter] = p.dead_letters
    assert (letter.kind, letter.key, letter.prompt_id, letter.reason) == (
        "episode_incomplete",
        "e:E",
        "q",
        "1 of its 2 turns expired before the feedback came: E0",
    )
    [letter] = plan(read(t1, listed([]))).dead_letters
    assert letter.reason == "the feedback lists no turn of the episode"
    t0, t1 = episode_turns()
    misnumbered = t1.model_copy(update={"turn": 2})
    [letter] = plan(read(t0, misnumbered, listed(None))).dead_letters
    assert (
        letter.reason == "logged before turn lists, and its 2 turns are numbered [0, 2], not 0..n-1 each once"
    )


def test_feedback_whose_claim_was_never_marked_is_set_aside():
    old = sent("A").model_copy(update={"received_at": NOW - timedelta(hours=2)})
    p = plan(read(), JoinState(unconfirmed={"A": old}, claims={"t:t1": None}))
    assert p.counters == {"expired_feedback": 1}
    [letter] = p.dead_letters
    assert (letter.kind, letter.key) == ("unconfirmed", "t1")
    assert letter.reason.startswith("its claim was not marked received within expire_s (3600 s)")


def test_a_pending_row_that_does_not_parse_is_deleted_and_set_aside():
    bad = Unreadable("A", "unconfirmed", "p", "{broken", "Invalid JSON")
    p = plan(read(), JoinState(unreadable=(bad,)))
    assert p.deletes == [("A", "unconfirmed")]
    assert p.dead_letters == [
        Letter(
            "unreadable_pending",
            "a pending unconfirmed row that does not parse: Invalid JSON",
            key="A",
            prompt_id="p",
            payload="{broken",
        )
    ]


def test_dead_letter_text_is_storable_whatever_the_record_held():
    assert storable_text("p\x00q") == "p\\x00q"
    assert storable_text(b"\xff{") == "\\xff{"
    assert storable_text("\ud800x") == "\\ud800x"
    assert storable_text("k" * 200, 160) == "k" * 160
    assert describe(ValueError("first line\nsecond")) == "ValueError: first line"


# ------------------------------------------------------------------------ the Joiner
@pytest.fixture
def db(database_url):
    with migrated_with_log(database_url) as log_and_engine:
        yield log_and_engine


def counters(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())


def pending(engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return sorted(tuple(r) for r in conn.execute(select(PendingJoin.key, PendingJoin.kind)))


def test_expiry_runs_in_a_poll_that_reads_nothing_and_late_feedback_is_a_dead_letter(db):
    """Finding 7: feedback (202) on a trajectory the learner had expired made no sample and a
    pending row that never expired; expiry ran only in a poll that read new records."""
    log, engine = db
    append(log, traj("old", created_at=utcnow() - timedelta(minutes=50)))
    assert Joiner(log, engine, 3 * 3600).poll_once().counters == {}
    assert pending(engine) == [("old", "trajectory")]
    # expire_s = 30 min, and nothing new in the log: this poll expires it (50 min old).
    assert Joiner(log, engine, 1800).poll_once().counters == {"expired": 1}
    assert pending(engine) == [("old", "expired")]
    append(log, fb("old", 1.0))
    stats = Joiner(log, engine, 1800).poll_once()
    assert stats.samples == 0 and stats.counters == {"late_feedback": 1, "dead_letters": 1}
    assert pending(engine) == [("old", "expired")]
    assert letters(engine) == [
        (
            "trajectory_expired",
            "old",
            "p",
            None,
            None,
            1,
            "its trajectory had expired (no feedback within expire_s = 1800 s) before this feedback was read",
        )
    ]
    assert counters(engine) == {"expired": 1, "late_feedback": 1, "dead_letters": 1}


def test_feedback_left_pending_by_older_code_is_set_aside_after_expire_s(db):
    log, engine = db
    with engine.begin() as conn:
        conn.execute(
            insert(PendingJoin).values(
                key="gone",
                kind="feedback",
                prompt_id="p",
                payload=fb("gone").to_json().decode(),
                received_at=utcnow() - timedelta(hours=2),
            )
        )
    assert Joiner(log, engine, 3600).poll_once().counters == {"late_feedback": 1, "dead_letters": 1}
    assert pending(engine) == []
    assert [(k, key) for k, key, *_ in letters(engine)] == [("trajectory_expired", "gone")]


def test_a_pending_row_that_does_not_parse_stops_no_poll(db):
    log, engine = db
    with engine.begin() as conn:
        conn.execute(
            insert(PendingJoin).values(
                key="A", kind="unconfirmed", prompt_id="p", payload="{broken", received_at=utcnow()
            )
        )
    append(log, traj("t1", created_at=utcnow()), fb("t1"))
    stats = Joiner(log, engine, 3600).poll_once()
    assert stats.samples == 1
    assert pending(engine) == [("t1", "joined")]
    [(kind, key, prompt_id, *_)] = letters(engine)
    assert (kind, key, prompt_id) == ("unreadable_pending", "A", "p")


POISON_TRIGGER = (
    "CREATE TRIGGER poison BEFORE INSERT ON pending_joins WHEN NEW.prompt_id = 'poison' "
    "BEGIN SELECT RAISE(ABORT, 'poison record'); END"
)


def test_a_record_the_database_refuses_is_set_aside_after_three_tries_and_the_others_join(db):
    """The class of finding 1 on any database: one record whose join the database refuses
    (here a trigger; on PostgreSQL an over-long key or a NUL) no longer stops every join."""
    log, engine = db
    with engine.begin() as conn:
        conn.execute(text(POISON_TRIGGER))
    now = utcnow()
    append(log, traj("bad", "poison", created_at=now), traj("t1", created_at=now), fb("t1"))
    joiner = Joiner(log, engine, 3600)
    for _ in range(2):  # tries 1 and 2 of the read: raised, nothing committed
        with pytest.raises(IntegrityError, match="poison record"):
            joiner.poll_once()
        assert pending(engine) == [] and letters(engine) == []
    # Try 3: one record at a time; "bad" is refused 3 times alone and set aside.
    stats = joiner.poll_once()
    assert stats.samples == 1 and stats.counters == {"dead_letters": 1}
    bad_offset = log.read(TOPIC_TRAJECTORIES, 0, 0, 1, 0.0)[0].offset
    assert letters(engine) == [
        (
            "unjoinable",
            "bad",
            "poison",
            TOPIC_TRAJECTORIES,
            bad_offset,
            3,
            "the database refused its join 3 times: IntegrityError: poison record",
        )
    ]
    with engine.connect() as conn:
        assert conn.execute(select(LearnerSample.id)).scalars().all() == ["t1"]
        offsets = dict(conn.execute(select(ConsumerOffset.topic, ConsumerOffset.next_offset)).all())
    ends = {t: log.read(t, 0, 0, 10, 0.0)[-1].offset + 1 for t in (TOPIC_TRAJECTORIES, TOPIC_FEEDBACK)}
    assert offsets == ends
    assert counters(engine) == {"dead_letters": 1}
    assert joiner.poll_once().counters == {}  # nothing read again


# ------------------------------------------------------------------------- the learner
NO_JOINS_TRIGGER = (
    "CREATE TRIGGER no_joins BEFORE UPDATE ON consumer_offsets "
    "BEGIN SELECT RAISE(ABORT, 'joins refused'); END"
)


def test_rollback_is_carried_out_while_every_join_fails(tmp_path):
    """Finding 1: while the joins failed on the same records, a requested rollback was never
    carried out. Here no join can commit at all (a trigger refuses every offset update), and
    the rollback happens in the first iteration."""
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    log = open_log(learner.settings.resolved_database_url)
    feed(log, 4, 0)
    learner.poll_once()
    learner.train_step()
    learner.train_step()
    with learner.db.begin() as conn:
        conn.execute(text(NO_JOINS_TRIGGER))
    feed(log, 2, 4)
    set_flag(learner.db, ROLLBACK_TO, "1")
    stop = threading.Event()
    thread = threading.Thread(target=learner.run, args=(stop,))
    thread.start()
    try:
        assert wait_for(lambda: latest_version(learner.db).version == 3, 60)
    finally:
        stop.set()
        thread.join(60)
    with learner.db.connect() as conn:
        v3 = conn.execute(select(PolicyVersion.parent_version).where(PolicyVersion.version == 3)).scalar_one()
    assert v3 == 1 and get_flag(learner.db, ROLLBACK_TO) is None
    assert learner.waiting_samples() == 0  # the joins of t00004, t00005 never committed


def test_pause_is_honoured_while_every_join_fails(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    log = open_log(learner.settings.resolved_database_url)
    feed(log, 2, 0)
    learner.poll_once()
    with learner.db.begin() as conn:
        conn.execute(text(NO_JOINS_TRIGGER))
    feed(log, 2, 2)
    set_flag(learner.db, PAUSED, "1")
    joins, join = [], learner.poll_once
    learner.poll_once = lambda: (joins.append(1), join())[1]
    stop = threading.Event()
    thread = threading.Thread(target=learner.run, args=(stop,))
    thread.start()
    try:
        assert wait_for(lambda: len(joins) >= 5, 60)  # several iterations, each with a failing join
        assert latest_version(learner.db).version == 0 and learner.waiting_samples() == 2
        set_flag(learner.db, PAUSED, None)
        assert wait_for(lambda: latest_version(learner.db).version == 1, 60)
    finally:
        stop.set()
        thread.join(60)


def test_a_batch_whose_step_keeps_failing_is_set_aside_and_the_next_trains(tmp_path, monkeypatch):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    feed(open_log(learner.settings.resolved_database_url), 4, 0)
    learner.poll_once()
    step = learner._step

    def fails_on_t00000(batch):
        if learner.waiting_samples() == 4:  # the batch of t00000 and t00001
            raise ValueError("boom")
        return step(batch)

    monkeypatch.setattr(learner, "_step", fails_on_t00000)
    for _ in range(2):
        with pytest.raises(ValueError, match="boom"):
            learner.train_step()
        assert learner.algorithm is None
        learner.load()
    assert learner.train_step() is None  # the third failure: set aside
    assert learner.waiting_samples() == 2 and learner.algorithm is None
    learner.load()
    assert learner.train_step() is not None and learner.version == 1
    assert trained_ids(learner) == {"t00002": 1, "t00003": 1}
    assert [(k, key, a, r) for k, key, _, _, _, a, r in letters(learner.db)] == [
        ("untrainable", tid, 3, "its batch's step failed 3 times: ValueError: boom")
        for tid in ("t00000", "t00001")
    ]
    assert counters(learner.db)["dead_letters"] == 2


def test_a_sample_that_does_not_parse_is_set_aside_at_once(tmp_path):
    learner = in_process(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    feed(open_log(learner.settings.resolved_database_url), 2, 0)
    learner.poll_once()
    with learner.db.begin() as conn:
        conn.execute(
            insert(LearnerSample).values(
                id="broken", prompt_id="p", payload="{}", created_at=utcnow() - timedelta(hours=1)
            )
        )
    assert learner.train_step() is None
    [(kind, key, _, _, _, attempts, reason)] = letters(learner.db)
    assert (kind, key, attempts) == ("untrainable", "broken", 1)
    assert reason == "the sample does not parse: KeyError: 'actions'"
    assert learner.train_step() is not None and trained_ids(learner) == {"t00000": 1, "t00001": 1}


# --------------------------------------------------------------- the server and the CLI
def seed(url: str) -> None:
    """Two dead letters, as the learner writes them, and their counter."""
    engine = make_engine(url)
    with engine.begin() as conn:
        n = set_aside(
            conn,
            [
                Letter(
                    "malformed",
                    "not a feedback record: reward: too big",
                    key="k\x1b[2J",
                    topic="feedback",
                    log_partition=0,
                    log_offset=7,
                    payload="{}",
                ),
                Letter("trajectory_expired", "its trajectory had expired", key="old", prompt_id="p"),
            ],
            utcnow(),
        )
        bump_counter(conn, "dead_letters", n)
    engine.dispose()


def app_with_state(tmp_path):
    from server.app import create_app

    settings = make_settings(tmp_path)
    url = settings.resolved_database_url
    migrate(url)
    app = create_app(settings, engine=FakeEngine(), watch_policy=False)
    app.state.s = ServerState(
        settings, FakeEngine(), SqlLog(url), ServerStore(make_engine(url)), ServerMetrics(), None
    )
    return app, url


async def test_the_admin_route_lists_dead_letters_and_metrics_count_them(tmp_path):
    app, url = app_with_state(tmp_path)
    seed(url)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        body = (await http.get("/admin/dead_letters", headers=ADMIN)).json()
        only = (
            await http.get(
                "/admin/dead_letters", params={"kind": "malformed", "payload": "true"}, headers=ADMIN
            )
        ).json()
        bad = await http.get("/admin/dead_letters", params={"kind": "lost"}, headers=ADMIN)
        anonymous = await http.get("/admin/dead_letters")
        page = (await http.get("/metrics")).text
    assert body["total"] == 2
    assert [(d["id"], d["kind"], d["key"], d["topic"], d["log_offset"]) for d in body["dead_letters"]] == [
        (2, "trajectory_expired", "old", None, None),
        (1, "malformed", "k\x1b[2J", "feedback", 7),
    ]
    assert "payload" not in body["dead_letters"][0]
    assert only["total"] == 1 and only["dead_letters"][0]["payload"] == "{}"
    assert bad.status_code == 400 and anonymous.status_code == 401
    assert 'saoserve_learner_events_total{event="dead_letters"} 2.0' in page


async def test_saoserve_admin_dead_letters_prints_them(tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        seed(settings.resolved_database_url)
        args = ["admin", "dead-letters", "--url", url, "--key", KEY]
        table = await asyncio.to_thread(runner.invoke, cli_app, args, env={"COLUMNS": "200"})
        as_json = await asyncio.to_thread(runner.invoke, cli_app, [*args, "--json", "--kind", "malformed"])
        bad = await asyncio.to_thread(runner.invoke, cli_app, [*args, "--kind", "lost"])
    assert table.exit_code == 0, table.output
    flat = " ".join(table.stdout.split())
    assert "newest 2 of 2 dead letters" in flat
    assert "trajectory_expired old" in flat and "its trajectory had expired" in flat
    # The key came from a record: printed as escapes, it cannot clear the terminal.
    assert "k\\x1b[2J feedback 0:7" in flat and "\x1b[2J" not in table.stdout
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["total"] == 1
    assert bad.exit_code == 2 and "not a kind of dead letter: 'lost'" in bad.output
