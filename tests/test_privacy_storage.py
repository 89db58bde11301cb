"""Privacy controls on a real database (docs/privacy.md), the SQLite tier of tests/test_privacy.py
(no engine): retention and forget on SQLite and PostgreSQL with the SQL log, the joiner reading
before and after; the ``saoserve retention`` command; the Kafka topics' retention in deploy/.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
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
    ForgetKind,
    ForgetReceipt,
    ForgetTarget,
    all_forgotten,
    apply_retention,
    concerns,
    forget,
    retention_cutoff,
    sql_log_engine,
)
from learner.joiner import Joiner
from learner.pretrain import logged_samples
from saoserve.cli import app
from server.store import ServerStore
from tests.conftest import ROOT, fresh_pg_database
from tests.test_deploy import COMPOSE, environment, interpolate, load, read_env_file
from tests.test_join_plan import NOW, episode_turns, fb, traj

runner = CliRunner()


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


SECRET = "the-server-secret-of-these-tests"


def forget_user(engine, log_engine, user: str, now) -> ForgetReceipt:
    """``saoserve admin forget USER`` in one namespace."""
    return forget(engine, log_engine, ForgetTarget(ForgetKind.USER, user), SECRET, now)


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


def test_concerns_reads_only_json_objects():
    ids, eps = {"a1"}, {"E"}
    alice = ForgetTarget(ForgetKind.USER, "alice")
    assert concerns('{"id": "a1"}', alice, ids, eps)
    assert concerns('{"trajectory_id": "a1"}', alice, ids, eps)
    assert concerns('{"episode_id": "E"}', alice, ids, eps)
    assert concerns('{"id": "zz", "user": "alice"}', alice, ids, eps)
    assert not concerns('{"id": "zz", "user": "bob"}', alice, ids, eps)
    assert not concerns("[1, 2]", alice, ids, eps)
    assert not concerns("not json", alice, ids, eps)
    assert not concerns(None, alice, ids, eps)
    # A key's forget names the records the key sent, with or without a user.
    key = ForgetTarget(ForgetKind.KEY, "k0123456789abcdef")
    assert concerns('{"id": "zz", "identity": "key:k0123456789abcdef", "user": "bob"}', key, ids, eps)
    assert not concerns('{"id": "zz", "identity": "user:k0123456789abcdef"}', key, ids, eps)


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
