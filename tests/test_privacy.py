"""Privacy controls (docs/privacy.md): the opt-out of training (``store: false``), retention
(``saoserve retention``) and forgetting a user (``saoserve admin forget``).

Pure tier: the record and request fields, the samples and the join plan (opted out: no sample,
no evidence; forgotten: dropped as read), the retention cutoff and the Kafka topics' retention
in deploy/. SQLite tier (no engine): retention and forget on a real database and SQL log, with
the joiner reading before and after. Engine tier: the same through the real server, its admin
route and the CLI, on SQLite and on PostgreSQL with a Kafka (tansu) log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update
from typer.testing import CliRunner

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
    make_engine,
    migrate,
)
from core.dead_letters import Letter, set_aside
from core.logbus import SqlLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, utcnow
from core.retention import (
    all_forgotten,
    apply_retention,
    concerns,
    forget_user,
    retention_cutoff,
    sql_log_engine,
)
from learner.join_plan import JoinState
from learner.joiner import Joiner
from learner.pretrain import logged_samples
from learner.samples import NotWholeAnswer, OptedOut, episode_sample, single_turn_sample
from saoserve.cli import app
from server.auth import ANONYMOUS, Caller
from server.chat import trains
from server.schemas import ChatCompletionRequest
from server.store import ServerStore
from tests.conftest import ADMIN, ROOT, fresh_pg_database, make_settings, running_server
from tests.test_deploy import COMPOSE, environment, interpolate, load, read_env_file
from tests.test_edges import chat_json, edge_app, post_raw
from tests.test_join_plan import NOW, episode_turns, fb, plan, read, tomb, traj

runner = CliRunner()
USER_MSG = [{"role": "user", "content": "hi"}]


# ------------------------------------------------------------------ records and requests
def test_records_logged_before_the_fields_are_trained_and_have_no_user():
    old = json.loads(traj().to_json())
    del old["train"], old["user"]
    rec = TrajectoryRecord.model_validate_json(json.dumps(old))
    assert (rec.train, rec.user) == (True, None)
    opted = traj(train=False, user="alice")
    assert TrajectoryRecord.model_validate_json(opted.to_json()) == opted


def test_store_false_or_an_opted_out_key_opts_out_and_nothing_else_does():
    def req(**kw) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=USER_MSG, **kw)

    stores = [{}, {"store": True}, {"store": None}, {"store": False}]
    assert [trains(req(**kw), ANONYMOUS) for kw in stores] == [True, True, True, False]
    keyed = Caller(key_id="k00000000000000aa", tenant="acme")
    assert [trains(req(**kw), keyed) for kw in stores] == [True, True, True, False]
    # A key opted out of training: no request field opts its answers back in.
    opted = Caller(key_id="k00000000000000bb", tenant="acme", train=False)
    assert [trains(req(**kw), opted) for kw in stores] == [False, False, False, False]
    assert req(user="alice").user == "alice"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"store": 0}, "store: Value error, must be true or false"),
        ({"store": "false"}, "store: Value error, must be true or false"),
        ({"user": "x" * 257}, "user: String should have at most 256 characters"),
        ({"user": "a\x00b"}, "user: contains a NUL character (U+0000), which cannot be stored"),
    ],
)
async def test_a_bad_store_or_user_is_400_naming_the_field(tmp_path, extra, message):
    r = await post_raw(edge_app(tmp_path), "/v1/chat/completions", chat_json(**extra))
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"], err["message"]) == (
        400,
        "invalid_value",
        next(iter(extra)),
        message,
    )


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({}, "user", "user: Field required"),
        ({"user": ""}, "user", "user: String should have at least 1 character"),
        ({"user": "u" * 257}, "user", "user: String should have at most 256 characters"),
        ({"user": 3}, "user", "user: Input should be a valid string"),
        ({"user": "alice", "all": True}, "all", "all: Extra inputs are not permitted"),
    ],
)
async def test_a_bad_forget_request_is_400_naming_the_field(tmp_path, body, param, message):
    r = await post_raw(edge_app(tmp_path), "/admin/forget", json.dumps(body).encode(), ADMIN)
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"], err["message"]) == (
        400,
        "invalid_value",
        param,
        message,
    )


async def test_forget_needs_the_admin_key(tmp_path):
    r = await post_raw(edge_app(tmp_path), "/admin/forget", b'{"user": "alice"}')
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# ------------------------------------------------------------------ samples and the join plan
def test_an_opted_out_trajectory_is_not_learnable_and_the_opt_out_is_the_reason():
    with pytest.raises(OptedOut, match="excluded_opted_out"):
        single_turn_sample(traj(train=False), 1.0)
    # Aborted and opted out: the opt-out names the reason.
    with pytest.raises(OptedOut):
        single_turn_sample(traj(train=False, finish_reason="abort"), 1.0)
    t0, t1 = episode_turns()
    with pytest.raises(OptedOut):
        episode_sample("E", [t0.model_copy(update={"train": False}), t1], 1.0)
    with pytest.raises(OptedOut):
        episode_sample(
            "E",
            [t0.model_copy(update={"finish_reason": "abort"}), t1.model_copy(update={"train": False})],
            1.0,
        )
    with pytest.raises(NotWholeAnswer):
        episode_sample("E", [t0.model_copy(update={"finish_reason": "abort"}), t1], 1.0)


def test_opted_out_feedback_is_joined_once_but_makes_no_sample_and_no_evidence():
    p = plan(read(traj("o", train=False), fb("o", 1.0), traj("t2"), fb("t2", 0.5)))
    assert [(s.id, s.reward) for s in p.samples] == [("t2", 0.5)]
    assert p.results == [("p", 0.5, 2)]  # t2 only: the opted-out reward is no evidence
    assert p.counters == {"excluded_opted_out": 1}
    # Joined like any other (a second feedback is a duplicate, not a new pending row).
    assert p.inserts == [tomb("o"), tomb("t2")]


def test_an_episode_with_an_opted_out_turn_makes_no_sample_and_no_evidence():
    t0, t1 = episode_turns()
    p = plan(read(t0, t1.model_copy(update={"train": False}), fb(episode="E", prompt_id="q")))
    assert p.samples == [] and p.results == []
    assert p.counters == {"excluded_opted_out": 1}


def test_forgotten_records_are_dropped_as_they_are_read():
    t0, t1 = episode_turns()
    unconfirmed = fb("u", 1.0).model_copy(update={"feedback_id": "f-u"})
    state = JoinState(
        forgotten=frozenset({"gone", "late", "e:E", "u"}),
        unconfirmed={"f-u": unconfirmed},
        claims={"t:u": None},
    )
    p = plan(
        read(traj("gone"), fb("gone"), fb("late"), t0, t1, fb(episode="E", prompt_id="q"), traj("kept")),
        state,
    )
    # gone + its feedback, late's feedback, two turns and the episode's feedback, u's feedback.
    assert p.counters == {"forgotten": 7}
    assert p.samples == [] and p.results == []
    # Nothing forgotten waits: only "kept" is pending; the held feedback of "u" is deleted.
    assert [(r.key, r.kind) for r in p.inserts] == [("kept", "trajectory")]
    assert p.deletes == [("f-u", "unconfirmed")]


@hyp_settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=8))
def test_no_sample_or_evidence_ever_comes_from_an_opted_out_or_forgotten_record(flags):
    """flags[i] = (opted out, forgotten, rated) of trajectory i, feedback right after it."""
    recs, forgotten = [], set()
    for i, (opted, gone, rated) in enumerate(flags):
        recs.append(traj(f"t{i}", train=not opted))
        if rated:
            recs.append(fb(f"t{i}", 1.0))
        if gone:
            forgotten.add(f"t{i}")
    p = plan(read(*recs), JoinState(forgotten=frozenset(forgotten)))
    trained = {f"t{i}" for i, (opted, gone, rated) in enumerate(flags) if rated and not opted and not gone}
    assert {s.id for s in p.samples} == trained and len(p.results) == len(trained)
    assert p.counters.get("excluded_opted_out", 0) == sum(o and r and not g for o, g, r in flags)
    assert p.counters.get("forgotten", 0) == sum(g * (1 + r) for _, g, r in flags)


# ------------------------------------------------------------------ retention and forget on SQLite
@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request, tmp_path):
    """A migrated database and the SQL log in it: SQLite, and PostgreSQL (its table lock in
    forget, its sequence for the log's ids)."""
    with contextlib.ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / 'p.db'}"
        else:
            url = stack.enter_context(fresh_pg_database())
        migrate(url)
        engine = make_engine(url)
        log = SqlLog(url)
        yield log, engine
        log.close()
        engine.dispose()


def logged(store: ServerStore, log: SqlLog, rec: TrajectoryRecord) -> int:
    """Log and index ``rec`` as the server does; returns its offset."""
    part, off = log.append(TOPIC_TRAJECTORIES, rec.prompt_id, rec.to_json())
    store.index_trajectory(rec, part, off)
    return off


def rated(store: ServerStore, log: SqlLog, f: FeedbackRecord, mark: bool = True) -> int:
    """Claim, log and (``mark``) confirm feedback as the server does; returns its offset."""
    f = f.model_copy(update={"feedback_id": str(uuid.uuid4()), "received_at": utcnow()})
    target = claim_target(f.trajectory_id, f.episode_id)
    assert store.claim(target, f.feedback_id)
    _, off = log.append(TOPIC_FEEDBACK, f.prompt_id, f.to_json())
    if mark:
        store.mark_received(target, f.reward, f.feedback_id)
    return off


def backdate(engine, table, column, keys, when) -> None:
    with engine.begin() as conn:
        conn.execute(update(table).where(column.in_(keys)).values(created_at=when))


def count(engine, model, *where) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(model).where(*where)).scalar_one()


def keys_of(engine, column) -> list:
    with engine.connect() as conn:
        return sorted(conn.execute(select(column)).scalars())


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


def test_retention_needs_a_day_at_least():
    with pytest.raises(ValueError, match="at least 1 day, not 0"):
        retention_cutoff(NOW, 0)
    assert retention_cutoff(NOW, 7) == NOW - timedelta(days=7)


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


def test_concerns_reads_only_json_objects():
    ids, eps = {"a1"}, {"E"}
    assert concerns('{"id": "a1"}', "alice", ids, eps)
    assert concerns('{"trajectory_id": "a1"}', "alice", ids, eps)
    assert concerns('{"episode_id": "E"}', "alice", ids, eps)
    assert concerns('{"id": "zz", "user": "alice"}', "alice", ids, eps)
    assert not concerns('{"id": "zz", "user": "bob"}', "alice", ids, eps)
    assert not concerns("[1, 2]", "alice", ids, eps)
    assert not concerns("not json", "alice", ids, eps)
    assert not concerns(None, "alice", ids, eps)


# ------------------------------------------------------------------ the CLI and deploy/
@pytest.fixture
def home(tmp_path, monkeypatch):
    from core.settings import get_settings

    for name in ("SAOSERVE_DATABASE_URL", "SAOSERVE_LOG_URL", "SAOSERVE_RETENTION_DAYS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    get_settings.cache_clear()
    yield tmp_path, monkeypatch
    get_settings.cache_clear()


def test_retention_command_needs_a_period(home):
    r = runner.invoke(app, ["retention"])
    assert (
        r.exit_code == 2 and "no retention period: pass --days N or set SAOSERVE_RETENTION_DAYS" in r.output
    )
    r = runner.invoke(app, ["retention", "--days", "0"])
    assert r.exit_code == 2 and "--days" in r.output


def test_retention_command_deletes_and_warns_of_unread_records(home):
    tmp, env = home
    url = f"sqlite:///{(tmp / 'saoserve.db').resolve()}"
    migrate(url)
    engine, log = make_engine(url), SqlLog(url)
    old = utcnow() - timedelta(days=10)
    off = logged(ServerStore(engine), log, traj("o", created_at=old))
    backdate(engine, LogRecord, LogRecord.offset, [off], old)
    log.close()
    env.setenv("SAOSERVE_RETENTION_DAYS", "30")
    from core.settings import get_settings

    get_settings.cache_clear()
    r = runner.invoke(app, ["retention"])  # 30 days from the setting: nothing that old
    assert r.exit_code == 0 and "(30 days)" in r.output and "log_records.trajectories: 0" in r.output
    r = runner.invoke(app, ["retention", "--days", "7"])
    assert r.exit_code == 0, r.output
    assert "log_records.trajectories: 1" in r.output and "trajectory_index: 1" in r.output
    assert "warning: 1 of the deleted log records had not been read by the learner yet" in r.output
    assert count(engine, LogRecord) == 0
    engine.dispose()


def run_topics_script(tmp_path: Path, env: dict[str, str]) -> list[list[str]]:
    """The kafka-topics service's script as compose runs it, with the Kafka tools replaced by
    stubs that record their arguments; returns each call's arguments."""
    script = interpolate(load(COMPOSE), env)["services"]["kafka-topics"]["command"][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool in ("kafka-topics.sh", "kafka-configs.sh"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/bash\nprintf "%s\\0" {tool} "$@" >> {calls}\nprintf "\\n\\0" >> {calls}\n')
        stub.chmod(0o755)
    subprocess.run(["bash", "-c", script.replace("/opt/kafka/bin/", f"{bin_dir}/")], check=True, timeout=30)
    args = calls.read_text().split("\0")
    out, cur = [], []
    for a in args:
        if a == "\n":
            out.append(cur)
            cur = []
        elif a:
            cur.append(a)
    return out


@pytest.mark.parametrize(
    "hours, retention_ms, segment_ms",
    [
        ("168", 168 * 3_600_000, 86_400_000),  # 7 days; segments roll daily
        ("12", 12 * 3_600_000, 12 * 3_600_000),  # below a day: a segment rolls at the retention
    ],
)
def test_kafka_topics_keep_trajectories_and_feedback_for_the_retention(
    tmp_path, hours, retention_ms, segment_ms
):
    env = read_env_file(ROOT / "deploy" / ".env.example") | {"KAFKA_RETENTION_HOURS": hours}
    calls = run_topics_script(tmp_path, env)
    configs = {
        c[c.index("--entity-name") + 1]: c[c.index("--add-config") + 1]
        for c in calls
        if c[0] == "kafka-configs.sh"
    }
    want = f"retention.ms={retention_ms},segment.ms={segment_ms}"
    assert configs == {"trajectories": want, "feedback": want}
    kafka = environment(interpolate(load(COMPOSE), env)["services"]["kafka"])
    assert (kafka["KAFKA_LOG_RETENTION_HOURS"], kafka["KAFKA_LOG_ROLL_HOURS"]) == (hours, "24")


# ------------------------------------------------------------------ the real server
async def chat(http: httpx.AsyncClient, content: str, **extra) -> dict:
    r = await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()


async def rate(http: httpx.AsyncClient, answer: dict, reward: float) -> httpx.Response:
    return await http.post(
        "/v1/feedback",
        json={"id": answer["id"], "feedback_token": answer["feedback_token"], "reward": reward},
    )


async def test_opt_out_and_forget_through_the_server_and_the_learners_join(
    policy_engine, tmp_path, monkeypatch
):
    from core.settings import get_settings

    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            a1 = await chat(http, "One", user="alice", store=False)
            a2 = await chat(http, "Two", user="alice")
            b1 = await chat(http, "Three", user="bob")
            o1 = await chat(http, "Four", store=False)
            # Feedback on an opted-out answer is accepted (202), and never trained.
            assert [
                (await rate(http, a, r)).status_code for a, r in ((a1, 1), (a2, 0), (b1, 1), (o1, 1))
            ] == [202] * 4
            rec = TrajectoryRecord.model_validate_json(
                (await http.get(f"/admin/trajectories/{a1['id']}", headers=ADMIN)).content
            )
            assert (rec.train, rec.user) == (False, "alice")
            db = make_engine(settings.resolved_database_url)
            log = SqlLog(settings.resolved_log_url)
            joiner = Joiner(log, db, expire_s=3600)
            stats = await asyncio.to_thread(joiner.poll_once)
            assert stats.samples == 2 and stats.counters == {"excluded_opted_out": 2}
            assert keys_of(db, LearnerSample.id) == sorted([a2["id"], b1["id"]])

            monkeypatch.setenv("SAOSERVE_SERVER_URL", url)
            monkeypatch.setenv("SAOSERVE_ADMIN_KEY", "test-admin-key")
            get_settings.cache_clear()
            try:
                r = await asyncio.to_thread(runner.invoke, app, ["admin", "forget", "alice", "--json"])
            finally:
                get_settings.cache_clear()
            assert r.exit_code == 0, r.output
            body = json.loads(r.output)
            assert (body["user"], body["trajectories"], body["tombstones"], body["log"]) == (
                "alice",
                2,
                2,
                "sql",
            )
            assert (
                body["deleted"]["log_records.trajectories"] == 2
                and body["deleted"]["log_records.feedback"] == 2
            )
            assert body["deleted"]["learner_samples"] == 1  # a2's sample, waiting for a batch

            assert (await http.get(f"/admin/trajectories/{a1['id']}", headers=ADMIN)).status_code == 404
            assert (await rate(http, a2, 1)).status_code == 404
            assert keys_of(db, LearnerSample.id) == [b1["id"]]
            assert keys_of(db, TrajectoryIndex.id) == sorted([b1["id"], o1["id"]])
            # Read again from the start: the log holds nothing of Alice's, so nothing of hers joins.
            with db.begin() as conn:
                for table in ("consumer_offsets", "pending_joins", "learner_samples"):
                    conn.exec_driver_sql(f"DELETE FROM {table}")
            stats = await asyncio.to_thread(Joiner(log, db, expire_s=3600).poll_once)
            assert stats.samples == 1 and stats.counters == {"excluded_opted_out": 1}  # b1; o1 opted out
            assert keys_of(db, LearnerSample.id) == [b1["id"]]
            log.close()
            db.dispose()


async def test_a_key_opted_out_of_training_through_the_server_and_the_learners_join(policy_engine, tmp_path):
    """Issue 23: every answer sent with a key whose ``train`` setting is off is logged once,
    marked ``train: false``, and its feedback goes where ``store: false``'s goes: accepted
    (202), joined once, set aside as ``excluded_opted_out``, no sample, no prompt evidence. The
    key opted back in (``PATCH /admin/keys/{id}``): its next answer trains."""
    from core.evidence_store import EvidenceStore

    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            made = await http.post("/admin/keys", json={"tenant": "acme", "train": False}, headers=ADMIN)
            key = made.json()
            assert (made.status_code, key["train"]) == (201, False)
            as_key = httpx.AsyncClient(
                base_url=url, timeout=120, headers={"Authorization": f"Bearer {key['key']}"}
            )
            async with as_key:
                k1 = await chat(as_key, "One", prompt_id="p-key-off")
                # The request asks to be stored: the key's opt-out still decides.
                k2 = await chat(as_key, "Two", prompt_id="p-key-off-store", store=True)
                s1 = await chat(http, "Three", prompt_id="p-store-off", store=False)
                t1 = await chat(http, "Four", prompt_id="p-trained")
                assert [
                    (await rate(as_key if a in (k1, k2) else http, a, 1)).status_code
                    for a in (k1, k2, s1, t1)
                ] == [202] * 4
                recs = {}
                for name, a in (("k1", k1), ("k2", k2), ("s1", s1), ("t1", t1)):
                    got = await http.get(f"/admin/trajectories/{a['id']}", headers=ADMIN)
                    recs[name] = TrajectoryRecord.model_validate_json(got.content)
                db = make_engine(settings.resolved_database_url)
                log = SqlLog(settings.resolved_log_url)
                joiner = Joiner(log, db, expire_s=3600)
                stats = await asyncio.to_thread(joiner.poll_once)
                evidence = EvidenceStore(db)
                opted_evidence = [evidence.get(p) for p in ("p-key-off", "p-key-off-store", "p-store-off")]
                trained_evidence = evidence.get("p-trained")

                back = await http.patch(f"/admin/keys/{key['id']}", json={"train": True}, headers=ADMIN)
                assert (back.status_code, back.json()["train"]) == (200, True)
                k3 = await chat(as_key, "Five", prompt_id="p-key-on")
                assert (await rate(as_key, k3, 0)).status_code == 202
                after = await asyncio.to_thread(joiner.poll_once)
                with db.connect() as conn:
                    logged = conn.execute(
                        select(func.count())
                        .select_from(LogRecord)
                        .where(LogRecord.topic == TOPIC_TRAJECTORIES)
                    ).scalar_one()
                samples = keys_of(db, LearnerSample.id)
                log.close()
                db.dispose()
    identity = f"key:{key['id']}"
    assert [(r.train, r.identity, r.tenant) for r in (recs["k1"], recs["k2"])] == [
        (False, identity, "acme")
    ] * 2
    assert (recs["s1"].train, recs["t1"].train) == (False, True)
    # Exactly one trajectory per answer (5 answers, 5 records): the opt-out is a mark, not a copy.
    assert logged == 5
    # k1, k2 (the key) and s1 (store: false) set aside alike; t1 the one sample of the first join.
    assert stats.samples == 1 and stats.counters == {"excluded_opted_out": 3}
    assert opted_evidence == [None, None, None]
    assert (trained_evidence.n_results, trained_evidence.reward_sum) == (1, 1.0)
    assert after.samples == 1 and after.counters == {}
    assert samples == sorted([t1["id"], k3["id"]])


@pytest.mark.kafka
async def test_forget_on_kafka_keeps_the_records_in_the_log_and_out_of_the_learner(
    policy_engine, tmp_path, pg_url
):
    from core.logbus import KafkaLog
    from tests.dependencies import TansuBroker
    from tests.logutil import read_topic

    broker = TansuBroker()  # a broker of its own: the learner below reads every record in it
    broker.start()
    log = KafkaLog(broker.url)
    try:
        settings = make_settings(tmp_path, database_url=pg_url, log_url=broker.url)
        async with running_server(settings, policy_engine, log_transport=log, watch_policy=False) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                a1 = await chat(http, "Kafka", user="alice")
                b1 = await chat(http, "Kafka", user="bob")
                assert (await rate(http, a1, 1)).status_code == 202 and (
                    await rate(http, b1, 0)
                ).status_code == 202
                r = await http.post("/admin/forget", json={"user": "alice"}, headers=ADMIN)
                assert r.status_code == 200, r.text
                body = r.json()
                assert (body["trajectories"], body["tombstones"], body["log"]) == (1, 1, "kafka")
                assert not any(k.startswith("log_records") for k in body["deleted"])
                assert body["deleted"]["trajectory_index"] == 1 and body["deleted"]["feedback_claims"] == 1
        ids = {json.loads(e.value)["id"] for e in read_topic(log, TOPIC_TRAJECTORIES)}
        assert ids == {a1["id"], b1["id"]}  # Kafka keeps Alice's record until retention.ms
        db = make_engine(pg_url)
        stats = Joiner(log, db, expire_s=3600).poll_once()
        assert stats.samples == 1 and stats.counters == {"forgotten": 2}  # a1 and its feedback
        assert keys_of(db, LearnerSample.id) == [b1["id"]]
        db.dispose()
    finally:
        log.close()
        broker.kill()
