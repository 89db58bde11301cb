"""Privacy controls through the real server (docs/privacy.md), the engine tier of
tests/unit/server/test_privacy.py: the opt-out of training (``store: false``, a key opted out) and
``saoserve admin forget`` through the server, its admin route, the CLI and the learner's join, on
SQLite and on PostgreSQL with a Kafka (tansu) log, whose records are sealed and shredded by forget.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from core.db import (
    LearnerSample,
    LogRecord,
    TrajectoryIndex,
    make_engine,
)
from core.logbus import SqlLog
from core.records import TOPIC_TRAJECTORIES, TrajectoryRecord
from core.sealing import Shredded, SubjectKeys
from learner.data.joiner import Joiner
from saoserve.cli import app
from testing.rows import keys_of
from testing.servers import ADMIN, make_settings, running_server

runner = CliRunner()


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
                secret = settings.feedback_secret  # client prompt ids are stored hashed
                opted_evidence = [
                    evidence.find(secret, p)[1] for p in ("p-key-off", "p-key-off-store", "p-store-off")
                ]
                trained_evidence = evidence.find(secret, "p-trained")[1]

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
    from testing.dependencies import TansuBroker
    from testing.logs import read_topic

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
                assert body["deleted"]["subject_keys"] == 1  # alice's data key, destroyed
        db = make_engine(pg_url)
        keys = SubjectKeys(db)
        # Kafka keeps both records until retention.ms, sealed: Alice's no longer opens.
        opened = []
        for e in read_topic(log, TOPIC_TRAJECTORIES):
            try:
                opened.append(json.loads(keys.open(e.value))["id"])
            except Shredded:
                opened.append("shredded")
        assert sorted(opened) == sorted([b1["id"], "shredded"])
        stats = Joiner(log, db, expire_s=3600).poll_once()
        # a1 skipped unread, its feedback dropped under its tombstone.
        assert stats.samples == 1 and stats.counters == {"shredded": 1, "forgotten": 1}
        assert keys_of(db, LearnerSample.id) == [b1["id"]]
        db.dispose()
    finally:
        log.close()
        broker.kill()
