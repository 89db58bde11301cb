"""Forget reaches every copy (issue 40 item 7; docs/privacy.md) on a real database and the SQL-table
log, on SQLite and PostgreSQL: records sent with an API key and no ``user``, a record logged but
never indexed, client prompt ids in the evidence table, a forget interrupted by a crash and its
receipt; then the admin route and ``saoserve admin forget`` on the real app (no engine: the
records are written as the server writes them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError
from typer.testing import CliRunner

import core.forget
from core.claims import claim_target
from core.db import (
    ForgetRequest,
    ForgottenRecord,
    LogRecord,
    PendingJoin,
    PromptEvidence,
    TrajectoryIndex,
    make_engine,
    migrate,
)
from core.evidence_store import EvidenceStore, stored_prompt_id
from core.forget import (
    ForgetKind,
    ForgetReceipt,
    ForgetTarget,
    carry_out,
    forget,
    pending_requests,
    receipt_of,
    record_request,
)
from core.logbus import SqlLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, utcnow
from core.retention import sql_log_engine
from core.sealing import Shredded, SubjectKeys, envelope
from learner.data.joiner import Joiner
from saoserve.cli import app
from server.store import ServerStore
from testing import builders
from testing.dependencies import fresh_pg_database
from testing.fakes import FakeEngine
from testing.servers import ADMIN, make_settings, running_server

SECRET = "the-server-secret-of-these-tests"
K1, K2 = "k0123456789abcdef", "kfedcba9876543210"
P = "p-" + "0" * 32  # a prompt id of the server's own form: no evidence row is re-keyed
runner = CliRunner()


def traj(tid: str, prompt_id: str = P, **kw) -> TrajectoryRecord:
    """A trajectory at version 0, logged now (retention keeps it)."""
    return builders.traj(
        tid, prompt_id, created_at=utcnow(), token_versions=[(0, 2)], dispatch_version=0, **kw
    )


def by_key(key_id: str, **kw) -> dict:
    """The fields of a record an API key authenticated (``core.keys.identity_of``)."""
    return {"identity": f"key:{key_id}", "tenant": "acme", **kw}


def by_user(user: str) -> dict:
    return {"user": user, "identity": f"user:{user}"}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request, tmp_path):
    """A migrated database and the SQL log in it."""
    with contextlib.ExitStack() as stack:
        url = (
            f"sqlite:///{tmp_path / 'f.db'}"
            if request.param == "sqlite"
            else stack.enter_context(fresh_pg_database())
        )
        migrate(url)
        engine = make_engine(url)
        log = SqlLog(url)
        yield log, engine
        log.close()
        engine.dispose()


def logged(store: ServerStore, log: SqlLog, rec: TrajectoryRecord, index: bool = True) -> int:
    """Log ``rec`` as the server does and (``index``) index it; returns its offset."""
    part, off = log.append(TOPIC_TRAJECTORIES, rec.prompt_id, store.log_bytes(rec, log.keeps_records))
    if index:
        store.index_trajectory(rec, part, off)
    return off


def rated(store: ServerStore, log: SqlLog, tid: str, reward: float = 1.0, prompt_id: str = P) -> None:
    """Claim, log and confirm a rating of ``tid`` as the server does."""
    f = FeedbackRecord(
        trajectory_id=tid,
        prompt_id=prompt_id,
        reward=reward,
        received_at=utcnow(),
        feedback_id=str(uuid.uuid4()),
    )
    target = claim_target(tid, None)
    assert store.claim(target, f.feedback_id)
    log.append(TOPIC_FEEDBACK, f.prompt_id, f.to_json())
    store.mark_received(target, reward, f.feedback_id)


def forget_of(engine, log, kind: ForgetKind, subject: str) -> ForgetReceipt:
    return forget(engine, sql_log_engine(log), ForgetTarget(kind, subject), SECRET, utcnow())


def keys_of(engine, column) -> list:
    with engine.connect() as conn:
        return sorted(conn.execute(select(column)).scalars())


def log_payloads(engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(select(LogRecord.payload)).scalars())


ZERO = dict.fromkeys(
    (
        "trajectory_index",
        "feedback_claims",
        "pending_joins",
        "learner_samples",
        "dead_letters",
        "episode_turns",
        "episodes",
        "prompt_evidence",
        "subject_keys",
        "log_records.trajectories",
        "log_records.feedback",
    ),
    0,
)


def test_a_key_is_forgotten_with_the_records_it_sent_without_a_user(db):
    log, engine = db
    store = ServerStore(engine)
    logged(store, log, traj("x1", **by_key(K1)))  # sent with key K1, no user
    rated(store, log, "x1")
    logged(store, log, traj("x2", **by_key(K1, user="carol")))  # K1 on behalf of carol
    logged(store, log, traj("y1", **by_key(K2)))
    logged(store, log, traj("z1", **by_user("carol")))
    # x1's index row from before revision 0015 has no identity: forget finds it in the log.
    with engine.begin() as conn:
        conn.execute(update(TrajectoryIndex).where(TrajectoryIndex.id == "x1").values(identity=None))
    receipt = forget_of(engine, log, ForgetKind.KEY, K1)
    assert (receipt.trajectories, receipt.episodes, receipt.tombstones) == (2, 0, 2)  # x1, x2
    assert receipt.deleted == ZERO | {
        "log_records.trajectories": 2,
        "log_records.feedback": 1,  # x1's rating
        "trajectory_index": 2,
        "feedback_claims": 1,  # t:x1
    }
    assert keys_of(engine, TrajectoryIndex.id) == ["y1", "z1"]
    assert keys_of(engine, ForgottenRecord.key) == ["x1", "x2"]
    assert not any(K1 in p for p in log_payloads(engine))
    # carol's own record stays until carol is forgotten; x2 is gone already.
    again = forget_of(engine, log, ForgetKind.USER, "carol")
    assert (again.trajectories, again.deleted["trajectory_index"]) == (1, 1)
    assert keys_of(engine, TrajectoryIndex.id) == ["y1"]


def test_a_record_logged_but_never_indexed_is_found_in_the_log_and_in_the_learners_pending_joins(db):
    log, engine = db
    store = ServerStore(engine)
    logged(store, log, traj("u1", **by_user("dave")))
    logged(store, log, traj("u2", **by_user("dave")), index=False)  # the server died before its index row
    logged(store, log, traj("v1", **by_user("erin")))
    # The learner read all three: each waits for its feedback in pending_joins.
    Joiner(log, engine, expire_s=3600).poll_once()
    assert keys_of(engine, PendingJoin.key) == ["u1", "u2", "v1"]
    receipt = forget_of(engine, log, ForgetKind.USER, "dave")
    assert (receipt.trajectories, receipt.tombstones) == (2, 2)  # u1 through the index, u2 through the log
    assert receipt.deleted == ZERO | {
        "log_records.trajectories": 2,
        "trajectory_index": 1,  # u2 never had a row
        "pending_joins": 2,
    }
    assert keys_of(engine, PendingJoin.key) == ["v1"]
    assert keys_of(engine, ForgottenRecord.key) == ["u1", "u2"]
    assert not any("dave" in p for p in log_payloads(engine))


def test_a_record_the_learner_parked_but_the_kafka_log_keeps_is_found_in_pending_joins(db):
    # A log that keeps records (no log engine, as for Kafka) and an unindexed record: the learner's
    # pending row is how forget finds it, and its tombstone keeps the learner from it.
    log, engine = db
    store = ServerStore(engine)
    logged(store, log, traj("w1", **by_user("gail")), index=False)
    Joiner(log, engine, expire_s=3600).poll_once()
    receipt = forget(engine, None, ForgetTarget(ForgetKind.USER, "gail"), SECRET, utcnow())
    assert (receipt.trajectories, receipt.tombstones, receipt.deleted["pending_joins"]) == (1, 1, 1)
    assert "log_records.trajectories" not in receipt.deleted


def test_client_prompt_ids_held_in_clear_are_moved_to_their_keyed_hash_by_forget(db):
    log, engine = db
    store = ServerStore(engine)
    evidence = EvidenceStore(engine)
    clear, other = "erin@example.com", "fred@example.com"
    # Rows written before revision 0015, keyed by the clients' ids in clear.
    with engine.begin() as conn:
        evidence.add_results(conn, [(clear, 1.0, 0), (clear, 0.0, 0), (other, 1.0, 0)])
        # fred's prompt already has a row under its hash (a chat since the upgrade).
        evidence.add_results(conn, [(stored_prompt_id(SECRET, other), 1.0, 1)])
    logged(store, log, traj("e1", prompt_id=clear, **by_user("erin")))
    logged(store, log, traj("f1", prompt_id=other, **by_user("fred")))
    assert forget_of(engine, log, ForgetKind.USER, "erin").deleted["prompt_evidence"] == 1
    moved = evidence.get(stored_prompt_id(SECRET, clear))
    assert (moved.n_results, moved.reward_sum) == (2, 1.0)  # the row as it was, under the hash
    assert forget_of(engine, log, ForgetKind.USER, "fred").deleted["prompt_evidence"] == 1
    kept = evidence.get(stored_prompt_id(SECRET, other))
    assert (kept.n_results, kept.reward_sum) == (1, 1.0)  # the newer row stays, the clear one goes
    assert keys_of(engine, PromptEvidence.prompt_id) == sorted(
        stored_prompt_id(SECRET, p) for p in (clear, other)
    )
    # The operator looks a prompt up by the id the client sent.
    assert evidence.find(SECRET, clear) == (stored_prompt_id(SECRET, clear), moved)


def test_a_forget_interrupted_by_a_crash_is_finished_by_the_next_run_and_keeps_its_receipt(db, monkeypatch):
    log, engine = db
    store = ServerStore(engine)
    logged(store, log, traj("h1", **by_user("hana")))
    rated(store, log, "h1")
    logged(store, log, traj("i1", **by_user("ivan")))
    target = ForgetTarget(ForgetKind.USER, "hana")
    record_request(engine, "f-crash", target, utcnow())

    def crash(*args, **kwargs):
        raise RuntimeError("killed after the log's rows went")

    real = core.forget._forget_database
    monkeypatch.setattr(core.forget, "_forget_database", crash)
    with pytest.raises(RuntimeError):
        carry_out(engine, sql_log_engine(log), "f-crash", SECRET, utcnow())
    half = receipt_of(engine, "f-crash")
    assert half.completed_at is None and pending_requests(engine) == ["f-crash"]
    assert half.deleted == {"log_records.feedback": 1, "log_records.trajectories": 1}
    assert keys_of(engine, TrajectoryIndex.id) == ["h1", "i1"]  # the database's rows are still there
    monkeypatch.setattr(core.forget, "_forget_database", real)
    # The next forget (of someone else) finishes it first.
    ivan = forget_of(engine, log, ForgetKind.USER, "ivan")
    assert pending_requests(engine) == [] and ivan.trajectories == 1
    done = receipt_of(engine, "f-crash")
    assert done.completed_at is not None and (done.trajectories, done.tombstones) == (1, 1)
    # The first run's log rows and the second run's database rows, each counted once.
    assert done.deleted == ZERO | {
        "log_records.trajectories": 1,
        "log_records.feedback": 1,
        "trajectory_index": 1,
        "feedback_claims": 1,
    }
    assert keys_of(engine, TrajectoryIndex.id) == [] and keys_of(engine, ForgottenRecord.key) == ["h1", "i1"]
    # A completed request keeps whom it forgot only as a hash.
    with engine.connect() as conn:
        row = conn.execute(
            select(ForgetRequest.subject, ForgetRequest.subject_hash).where(ForgetRequest.id == "f-crash")
        ).one()
    assert tuple(row) == (None, hashlib.sha256(b"user\x00hana").hexdigest())
    # Carrying it out again changes nothing.
    assert carry_out(engine, sql_log_engine(log), "f-crash", SECRET, utcnow()) == done


def test_two_runs_of_one_request_at_once_count_it_once(db):
    log, engine = db
    store = ServerStore(engine)
    logged(store, log, traj("j1", **by_user("jane")))
    rated(store, log, "j1")
    record_request(engine, "f-twice", ForgetTarget(ForgetKind.USER, "jane"), utcnow())
    with ThreadPoolExecutor(2) as pool:
        runs = list(
            pool.map(lambda _: carry_out(engine, sql_log_engine(log), "f-twice", SECRET, utcnow()), range(2))
        )
    assert all(r.completed_at is not None for r in runs)
    # One trajectory, one tombstone, each row once, whichever run removed it.
    done = receipt_of(engine, "f-twice")
    assert (done.trajectories, done.tombstones) == (1, 1)
    assert done.deleted == ZERO | {
        "log_records.trajectories": 1,
        "log_records.feedback": 1,
        "trajectory_index": 1,
        "feedback_claims": 1,
    }


def test_an_unknown_request_is_named(db):
    _, engine = db
    with pytest.raises(LookupError, match="no forget request 'f-none'"):
        carry_out(engine, None, "f-none", SECRET, utcnow())


# ------------------------------------------------------------------ the admin route and the CLI
async def test_a_forget_a_crash_left_pending_is_finished_when_the_server_starts(tmp_path):
    # The server stopped between recording the forget and carrying it out (its 202 never came,
    # or the process died mid-way): the next start finishes it, with no other forget or
    # retention run; its receipt then counts olga's one trajectory, and pia's stays.
    settings = make_settings(tmp_path)
    migrate(settings.resolved_database_url)
    engine = make_engine(settings.resolved_database_url)
    log = SqlLog(settings.resolved_log_url)
    store = ServerStore(engine)
    logged(store, log, traj("o1", **by_user("olga")))
    logged(store, log, traj("p1", **by_user("pia")))
    record_request(engine, "f-restart", ForgetTarget(ForgetKind.USER, "olga"), utcnow())
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for _ in range(200):
                body = (await http.get("/admin/forget/f-restart", headers=ADMIN)).json()
                if body["completed"]:
                    break
                await asyncio.sleep(0.05)
    assert body["completed"] and body["trajectories"] == 1
    assert pending_requests(engine) == [] and keys_of(engine, TrajectoryIndex.id) == ["p1"]
    log.close()
    engine.dispose()


async def cli(*args: str):
    return await asyncio.to_thread(runner.invoke, app, ["admin", *args])


async def test_forget_by_key_through_the_admin_route_and_the_cli_with_its_receipt(tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        engine = make_engine(settings.resolved_database_url)
        log = SqlLog(settings.resolved_log_url)
        store = ServerStore(engine)
        logged(store, log, traj("x1", **by_key(K1)))
        rated(store, log, "x1")
        logged(store, log, traj("y1", **by_key(K2)))
        args = ("--url", url, "--key", ADMIN["Authorization"].removeprefix("Bearer "))
        result = await cli("forget", "--api-key", K1, "--json", *args)
        assert result.exit_code == 0, result.output
        body = json.loads(result.stdout)
        assert (body["kind"], body["key"], body["user"], body["completed"], body["log"]) == (
            "key",
            K1,
            None,
            True,
            "sql",
        )
        assert (body["trajectories"], body["tombstones"]) == (1, 1)
        assert body["deleted"] == ZERO | {
            "log_records.trajectories": 1,
            "log_records.feedback": 1,
            "trajectory_index": 1,
            "feedback_claims": 1,
        }
        # The receipt again, by its id: the same counts, the key only as a hash.
        async with httpx.AsyncClient(base_url=url, headers=ADMIN, timeout=30) as http:
            again = (await http.get(f"/admin/forget/{body['id']}")).json()
            missing = await http.get("/admin/forget/f-none")
        assert {k: again[k] for k in ("trajectories", "tombstones", "deleted", "completed")} == {
            k: body[k] for k in ("trajectories", "tombstones", "deleted", "completed")
        }
        assert (
            again["key"] is None
            and again["subject_hash"] == hashlib.sha256(f"key\0{K1}".encode()).hexdigest()
        )
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        text = await cli("forget", "--receipt", body["id"], *args)
        assert text.exit_code == 0, text.output
        assert text.stdout.splitlines()[0] == (
            f"forget {body['id']} of key sha256:{again['subject_hash'][:12]}…: 1 trajectories "
            "(0 episodes), 1 new tombstones"
        )
        assert "  removed trajectory_index: 1" in text.stdout and "  destroyed subject_keys: 0" in text.stdout
        both = await cli("forget", "carol", "--api-key", K1, *args)
        assert both.exit_code == 2 and "exactly one of USER, --api-key and --receipt" in both.output
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(TrajectoryIndex)).scalar_one() == 1
        log.close()
        engine.dispose()


def test_the_retention_command_finishes_a_forget_a_crash_left_pending(tmp_path, monkeypatch):
    from core.settings import get_settings

    for name in (
        "SAOSERVE_DATABASE_URL",
        "SAOSERVE_LOG_URL",
        "SAOSERVE_RETENTION_DAYS",
        "SAOSERVE_TENANT_POLICIES",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    get_settings.cache_clear()
    try:
        settings = get_settings()
        migrate(settings.resolved_database_url)
        engine = make_engine(settings.resolved_database_url)
        log = SqlLog(settings.resolved_log_url)
        store = ServerStore(engine)
        logged(store, log, traj("l1", **by_user("lena")))  # today's: retention keeps it
        record_request(engine, "f-left", ForgetTarget(ForgetKind.USER, "lena"), utcnow())
        result = runner.invoke(app, ["retention", "--days", "30"])
        assert result.exit_code == 0, result.output
        assert "finished forget f-left (1 trajectories)" in result.output
        done = receipt_of(engine, "f-left")
        assert done.completed_at is not None and done.deleted["trajectory_index"] == 1
        assert keys_of(engine, TrajectoryIndex.id) == [] and log_payloads(engine) == []
        log.close()
        engine.dispose()
    finally:
        get_settings.cache_clear()


def test_a_servers_cached_key_destroyed_by_a_forget_seals_records_nobody_can_read(db):
    # Another replica's forget: this server's cache still holds the key for KEY_CACHE_S.
    _, engine = db
    keys = SubjectKeys(engine, cache_s=3600)
    rec = traj("m1", **by_user("mia"))
    before = keys.encode(rec, utcnow())
    assert keys.open(before) == rec.to_json()
    forget(engine, None, ForgetTarget(ForgetKind.USER, "mia"), SECRET, utcnow())
    during = keys.encode(rec, utcnow())  # sealed under the destroyed key, still cached
    for value in (before, during):
        with pytest.raises(Shredded):
            keys.open(value)
    keys.drop_cached()  # what this server's own forget does
    after = keys.encode(rec, utcnow())
    assert envelope(after)[0] != envelope(during)[0] and keys.open(after) == rec.to_json()


def test_a_cached_key_seals_while_the_database_does_not_answer(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    migrate(url)
    engine = make_engine(url)
    keys = SubjectKeys(engine, cache_s=0)  # every record reads its key again
    known = traj("n1", **by_user("nina"))
    first = keys.encode(known, utcnow())
    with engine.begin() as conn:  # the database stops answering (SQLite: OperationalError)
        conn.exec_driver_sql("ALTER TABLE subject_keys RENAME TO gone")
    assert envelope(keys.encode(known, utcnow()))[0] == envelope(first)[0]  # the key it had
    with pytest.raises(OperationalError):
        keys.encode(traj("o1", **by_user("olga")), utcnow())  # no key known: the append fails
    engine.dispose()
