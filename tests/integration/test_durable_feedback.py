"""A 202 is durable (issue 40 item 9): feedback answered 202 is trained exactly once, the first,
even when the database refuses its claim's mark and the server restarts before it is done.

The real app (``running_server``, no engine needed for feedback) on PostgreSQL with the SQL-table
log in the same database, and the learner's real ``Joiner``. The database blip is PostgreSQL's
own: a trigger refuses every update of ``feedback_claims`` with SQLSTATE 08006 (connection
failure), which the server takes for an outage, as it would a dropped connection, while the
claim's insert and the log's append go through.

Before the fix (issue 40): the mark was retried in memory only, the restart dropped it ("3
deferred database writes not done"), a second rating of the same answer took the claim over
after the claim timeout and got 202, and the learner trained the second (0.0), not the first
(1.0).
"""

from __future__ import annotations

import json
from datetime import timedelta

import httpx
import pytest
from sqlalchemy import select, text, update

from core.claims import CLAIM_TIMEOUT
from core.db import FeedbackClaim, LearnerSample, make_engine, migrate
from core.logbus import open_log
from core.records import TOPIC_TRAJECTORIES, SamplingRecord, TrajectoryRecord, feedback_token, utcnow
from learner.data.joiner import Joiner
from server.store import ServerStore
from testing.fakes import FakeEngine
from testing.servers import make_settings, running_server

pytestmark = pytest.mark.integration

SECRET = "test-feedback-secret"  # make_settings' feedback_secret
COMPLETION = "chatcmpl-durable"

BLIP = """
CREATE FUNCTION refuse_claim_updates() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'the database is away (test blip)' USING ERRCODE = '08006';
END $$ LANGUAGE plpgsql;
CREATE TRIGGER blip BEFORE UPDATE ON feedback_claims FOR EACH ROW EXECUTE FUNCTION refuse_claim_updates();
"""
BLIP_OVER = "DROP TRIGGER blip ON feedback_claims; DROP FUNCTION refuse_claim_updates();"


def answer_logged(settings) -> None:
    """One whole answer, in the log and indexed, as a chat leaves it."""
    rec = TrajectoryRecord(
        id=COMPLETION,
        prompt_id="p-durable",
        created_at=utcnow(),
        model="m",
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        rollout_logprobs=[-0.5, -0.25],
        token_versions=[(0, 2)],
        dispatch_version=0,
        sampling=SamplingRecord(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8, seed=None),
        finish_reason="stop",
    )
    log = open_log(settings.resolved_log_url)
    part, off = log.append(TOPIC_TRAJECTORIES, rec.prompt_id, rec.to_json())
    log.close()
    db = make_engine(settings.resolved_database_url)
    ServerStore(db).index_trajectory(rec, part, off)
    db.dispose()


def sql(url: str, statement: str) -> None:
    db = make_engine(url)
    with db.begin() as conn:
        conn.execute(text(statement))
    db.dispose()


def claim(url: str):
    db = make_engine(url)
    with db.connect() as conn:
        row = conn.execute(select(*FeedbackClaim.__table__.columns)).one()
    db.dispose()
    return row


def age_claim(url: str) -> None:
    """The claim as a later request finds it: taken twice the claim timeout ago."""
    db = make_engine(url)
    with db.begin() as conn:
        conn.execute(update(FeedbackClaim).values(claimed_at=utcnow() - 2 * CLAIM_TIMEOUT))
    db.dispose()


async def rate(url: str, value: float) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        body = {"id": COMPLETION, "reward": value, "feedback_token": feedback_token(SECRET, COMPLETION)}
        return await http.post("/v1/feedback", json=body)


def train(url: str) -> tuple[list[float], dict[str, int]]:
    """What the learner's joiner makes of the log: the rewards of its samples, its counters."""
    db, log = make_engine(url), open_log(url)
    stats = Joiner(log, db, expire_s=3600).poll_once()
    with db.connect() as conn:
        rewards = [json.loads(p)["reward"] for p in conn.execute(select(LearnerSample.payload)).scalars()]
    log.close()
    db.dispose()
    return rewards, stats.counters


async def rated_during_a_blip(tmp_path, pg_url):
    """A server whose claim mark is refused: the first rating (1.0) is answered 202, its mark
    deferred; the server stops before the database is back. Returns the settings used."""
    migrate(pg_url)
    settings = make_settings(tmp_path / "first", database_url=pg_url)
    answer_logged(settings)
    sql(pg_url, BLIP)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        first = await rate(url, 1.0)
        assert first.status_code == 202, first.text
    assert claim(pg_url).state == "claimed"  # the mark never landed
    sql(pg_url, BLIP_OVER)
    return settings


async def test_a_restart_does_the_deferred_mark_and_first_wins(tmp_path, pg_url):
    """The same server restarts (its home, so its journal of deferred writes): the mark is done
    at start, the second rating (0.0) is 409, the learner trains 1.0 once."""
    settings = await rated_during_a_blip(tmp_path, pg_url)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        second = await rate(url, 0.0)
        assert second.status_code == 409, second.text
        assert second.json()["error"]["code"] == "conflict"
    row = claim(pg_url)
    assert (row.state, row.reward) == ("received", 1.0)
    rewards, counters = train(pg_url)
    assert rewards == [1.0]
    assert "void_feedback" not in counters


async def test_a_takeover_after_the_claim_timeout_still_trains_the_first(tmp_path, pg_url):
    """The first server never comes back (its journal is gone with it). After the claim timeout
    another server takes the claim over for a second rating (0.0), 202. The joiner reads the
    first record (1.0) before it: the takeover superseded it and it reached the log, so it is
    trained; the second is a duplicate (first wins). Samples: [1.0]; duplicate_feedback 1."""
    await rated_during_a_blip(tmp_path, pg_url)
    age_claim(pg_url)
    other = make_settings(tmp_path / "other", database_url=pg_url)
    async with running_server(other, FakeEngine(), watch_policy=False) as url:
        second = await rate(url, 0.0)
        assert second.status_code == 202, second.text
    row = claim(pg_url)
    assert (row.state, row.reward) == ("received", 0.0) and row.superseded_id is not None
    rewards, counters = train(pg_url)
    assert rewards == [1.0]
    assert counters.get("duplicate_feedback") == 1


async def test_an_unmarked_claim_past_the_timeout_confirms_its_record(tmp_path, pg_url):
    """No restart does the mark and no one rates again: once the claim is past the claim timeout
    its record is the answer's feedback (its request ended; the record is in the log), so the
    joiner trains it instead of waiting for a mark that will never come. Samples: [1.0]."""
    await rated_during_a_blip(tmp_path, pg_url)
    rewards, counters = train(pg_url)
    assert rewards == [] and "unconfirmed" not in counters  # within the timeout: it waits
    age_claim(pg_url)
    rewards, _ = train(pg_url)
    assert rewards == [1.0]


def test_the_claim_timeout_outlasts_every_append():
    """``CLAIM_TIMEOUT`` (120 s) > the longest append: the SQL log's 30 s wait, Kafka's 5 s send
    + 40 s delivery (core/logbus.py), so a live request never loses its claim."""
    assert CLAIM_TIMEOUT == timedelta(seconds=120) and CLAIM_TIMEOUT > timedelta(seconds=5 + 40)
