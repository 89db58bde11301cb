"""Contracts of the HTTP edge (tests/unit/server/test_edge_contracts.py lists them) through the
real server and engine, racing turns on PostgreSQL, and an episode turn answered 503 whose record
the log appends late (a log that answers "refused" and appends anyway, and a paused broker):
never one of the episode's turns."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from sqlalchemy import select

from core.db import EpisodeTurn, LearnerSample, make_engine, migrate
from core.logbus import LogTransport, LogUnavailable, SqlLog, open_log
from core.records import TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord
from server.store import ServerStore
from testing.builders import record
from testing.edges import (
    CHAT,
    NOT_JSON,
    USER,
    error_of,
)
from testing.logs import logged_trajectories, read_topic
from testing.servers import make_settings, running_server


@pytest.mark.postgres
def test_racing_requests_for_one_turn_number_one_wins_postgres(pg_url):
    migrate(pg_url)
    store = ServerStore(make_engine(pg_url))
    assert store.start_episode_turn("race", "c-0", token_ok=False).outcome == "ok"
    store.index_trajectory(record("c-0", "race", "stop"), 0, 0)
    for round_ in range(3):
        barrier, results = threading.Barrier(8), []

        def next_turn(cid: str, turn: int | None, barrier: threading.Barrier, results: list) -> None:
            barrier.wait()
            results.append(store.start_episode_turn("race", cid, token_ok=True, turn=turn).outcome)

        threads = [
            threading.Thread(
                target=next_turn, args=(f"c-{round_}-{i}", round_ + 1 if i % 2 else None, barrier, results)
            )
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # One holds the number; the others see it taken or in progress.
        assert results.count("ok") == 1 and set(results) <= {"ok", "taken", "in_progress"}, results
        with store.engine.connect() as conn:
            winner = conn.execute(
                select(EpisodeTurn.trajectory_id).where(EpisodeTurn.logged_at.is_(None))
            ).scalar_one()
        store.index_trajectory(record(winner, "race", "stop"), 0, round_ + 1)
    assert len(store.episode_state("race").turn_ids) == 4
    store.engine.dispose()


engine_tier = pytest.mark.engine


@engine_tier
async def test_the_edge_contracts_through_the_real_server(policy_engine, tmp_path):
    settings = make_settings(tmp_path)
    async with (
        running_server(settings, policy_engine) as url,
        httpx.AsyncClient(base_url=url, timeout=120) as http,
    ):

        async def chat(**extra) -> httpx.Response:
            return await http.post(CHAT, json={"messages": USER, "max_tokens": 2, **extra})

        r = await chat(response_format={"type": "json_object"})
        assert error_of(r)[:3] == (400, "unsupported_parameter", "response_format")
        r = await chat(turn=0)
        assert error_of(r)[:3] == (400, "invalid_value", "turn")
        r0 = await chat(episode_id="ep", turn=0)
        assert r0.status_code == 200, r0.text
        tok = r0.json()["episode_feedback_token"]
        r = await chat(episode_id="ep", turn=0, episode_token=tok)
        assert error_of(r)[:3] == (409, "duplicate_turn", "turn")
        r = await chat(episode_id="ep", turn=2, episode_token=tok)
        assert error_of(r)[:3] == (409, "turn_out_of_order", "turn")
        r1 = await chat(episode_id="ep", episode_token=tok)  # no number: the next one
        assert r1.status_code == 200
        r = await http.post(
            "/v1/feedback",
            json={"id": r1.json()["id"], "feedback_token": r1.json()["feedback_token"], "reward": 1},
        )
        assert error_of(r)[:2] == (409, "rate_the_episode")
        r = await http.post("/v1/feedback", json={"episode_id": "ep", "feedback_token": tok, "reward": 1})
        assert r.status_code == 202
        r = await http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
        assert error_of(r) == (400, "invalid_json", None, NOT_JSON)
    assert [(rec.episode_id, rec.turn) for rec in logged_trajectories(settings)] == [("ep", 0), ("ep", 1)]


class LateLog(LogTransport):
    """The real SQL log, except that ``late`` trajectory appends answer "refused" and land
    0.3 s later anyway: what a broker paused with the produce request already in its socket
    does past the wait (core/logbus.KafkaLog; docs/reliability.md, Limits)."""

    def __init__(self, url: str):
        self.inner, self.url, self.late, self.landed = SqlLog(url), url, 0, threading.Semaphore(0)

    def append(self, topic: str, key: str, value: bytes) -> tuple[int, int]:
        if topic == TOPIC_TRAJECTORIES and self.late:
            self.late -= 1

            def land() -> None:
                self.inner.append(topic, key, value)
                self.landed.release()

            threading.Timer(0.3, land).start()
            raise LogUnavailable("no acknowledgement within the wait")
        return self.inner.append(topic, key, value)

    def check(self) -> None:
        self.inner.check()

    def partitions(self, topic: str) -> list[int]:
        return self.inner.partitions(topic)

    def read(self, *args, **kwargs):
        return self.inner.read(*args, **kwargs)


@engine_tier
async def test_a_turn_answered_503_and_appended_late_is_never_an_episode_turn(policy_engine, tmp_path):
    """The tester's input: turn 1 of an episode answered 503 while its append lands in the log
    later. The client may send turn 1 again (200); the episode's feedback lists turns 0 and the
    resent 1, and the joiner trains exactly those (the late record: void_episode_turns). Same
    for a streamed turn (503 as the stream's error event) and for a first turn (the episode id
    can be started again, without a token)."""
    from learner.data.joiner import Joiner

    settings = make_settings(tmp_path)
    migrate(settings.resolved_database_url)
    late = LateLog(settings.resolved_database_url)

    async def landed() -> None:
        assert await asyncio.to_thread(late.landed.acquire, True, 10)

    async with running_server(settings, policy_engine, log_transport=late, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:

            async def chat(**extra) -> httpx.Response:
                return await http.post(CHAT, json={"messages": USER, "max_tokens": 3, **extra})

            r0 = await chat(episode_id="ep", turn=0)
            tok = r0.json()["episode_feedback_token"]
            late.late = 1
            r = await chat(episode_id="ep", turn=1, episode_token=tok)
            assert r.status_code == 503 and "not recorded" in r.json()["error"]["message"]
            await landed()
            r1 = await chat(episode_id="ep", turn=1, episode_token=tok)
            assert r1.status_code == 200, r1.text
            late.late = 1
            body = {
                "messages": USER,
                "max_tokens": 3,
                "stream": True,
                "episode_id": "ep",
                "turn": 2,
                "episode_token": tok,
            }
            async with http.stream("POST", CHAT, json=body) as r:
                events = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
            assert r.status_code == 200 and '"error"' in events[-1] and "not recorded" in events[-1]
            await landed()
            r2 = await chat(episode_id="ep", turn=2, episode_token=tok)
            assert r2.status_code == 200, r2.text
            r = await http.post("/v1/feedback", json={"episode_id": "ep", "feedback_token": tok, "reward": 1})
            assert r.status_code == 202
            # A first turn answered 503 leaves no episode behind.
            late.late = 1
            r = await chat(episode_id="ep-first", turn=0)
            assert r.status_code == 503
            await landed()
            assert (await chat(episode_id="ep-first", turn=0)).status_code == 200
    # The log holds the three late records, but the feedback lists the turns the client was given.
    turns = [rec for rec in logged_trajectories(settings) if rec.episode_id == "ep"]
    assert [rec.turn for rec in turns] == [0, 1, 1, 2, 2]
    [fb_entry] = read_topic(late.inner, "feedback")
    ids = [r0.json()["id"], r1.json()["id"], r2.json()["id"]]
    assert FeedbackRecord.model_validate_json(fb_entry.value).turn_ids == ids
    db = make_engine(settings.resolved_database_url)
    stats = Joiner(late.inner, db, expire_s=3600).poll_once()
    with db.connect() as conn:
        [(sample_id, payload)] = conn.execute(select(LearnerSample.id, LearnerSample.payload)).all()
    db.dispose()
    last = next(rec for rec in turns if rec.id == ids[2])
    assert stats.counters.get("void_episode_turns") == 2 and sample_id == "e:ep"
    assert json.loads(payload)["input_ids"] == last.prompt_token_ids + last.response_token_ids
    late.inner.close()


@engine_tier
@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
async def test_a_turn_appended_late_by_a_paused_broker_is_never_an_episode_turn(policy_engine, tmp_path):
    """The same on a real broker (tansu): paused while turn 1 is being generated, so its record
    is written to the broker's socket and not acknowledged within the wait (2 s here): the
    stream ends with a 503 error event; on resume the broker appends it anyway. The client's
    second turn 1 is the one the episode's feedback lists and the joiner trains."""
    from core.logbus import KafkaLog
    from learner.data.joiner import Joiner
    from testing.dependencies import TansuBroker, fresh_pg_database

    broker = TansuBroker()
    broker.start()
    try:
        with fresh_pg_database() as pg:
            settings = make_settings(tmp_path, database_url=pg, log_url=broker.url)
            log = KafkaLog(broker.url, ack_timeout_s=2.0)
            async with running_server(settings, policy_engine, log_transport=log, watch_policy=False) as url:
                async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                    base = {"messages": USER, "episode_id": "ep"}
                    r0 = await http.post(CHAT, json={**base, "turn": 0, "max_tokens": 3})
                    tok = r0.json()["episode_feedback_token"]
                    body = {**base, "turn": 1, "episode_token": tok, "max_tokens": 48, "stream": True}
                    async with http.stream("POST", CHAT, json=body) as r:
                        events = []
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                events.append(line)
                                if len(events) == 2:  # generating: the dispatch checks are behind it
                                    broker.pause()
                    assert '"error"' in events[-1] and "not recorded" in events[-1], events[-1]
                    broker.resume()
                    for _ in range(100):  # until the probe sees the broker back
                        r1 = await http.post(
                            CHAT, json={**base, "turn": 1, "episode_token": tok, "max_tokens": 3}
                        )
                        if r1.status_code != 503:
                            break
                        await asyncio.sleep(0.2)
                    assert r1.status_code == 200, r1.text
                    r = await http.post(
                        "/v1/feedback", json={"episode_id": "ep", "feedback_token": tok, "reward": 1}
                    )
                    assert r.status_code == 202
            reader = open_log(broker.url)
            turns = [
                TrajectoryRecord.model_validate_json(e.value) for e in read_topic(reader, "trajectories")
            ]
            assert sorted(t.turn for t in turns) == [0, 1, 1]  # the late record is in the log
            db = make_engine(pg)
            stats = Joiner(reader, db, expire_s=3600).poll_once()
            with db.connect() as conn:
                [payload] = conn.execute(select(LearnerSample.payload)).scalars().all()
            db.dispose()
            reader.close()
            log.close()
        last = next(t for t in turns if t.id == r1.json()["id"])
        assert stats.counters.get("void_episode_turns") == 1
        assert json.loads(payload)["input_ids"] == last.prompt_token_ids + last.response_token_ids
    finally:
        broker.kill()
