"""Every request field checked at the edge, episode ownership, and feedback only on whole answers
(issue 12 items 1 and 4, issue 13 items 2, 4, 5 and 7; docs/design.md §8), through the real
server and engine, and on PostgreSQL: nothing logged for any refused input. Without an engine:
tests/unit/server/test_edges.py."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from sqlalchemy import func, select

from core.claims import episode_token_subject
from core.db import Episode, TrajectoryIndex, make_engine, migrate
from core.logbus import open_log
from core.records import FeedbackRecord, feedback_token
from server.store import ServerStore
from testing.edges import USER, chat_json
from testing.logs import logged_trajectories, read_topic
from testing.servers import ADMIN, make_settings, running_server


@pytest.mark.postgres
def test_two_racing_first_turns_one_wins_postgres(pg_url):
    migrate(pg_url)
    store = ServerStore(make_engine(pg_url))
    for round_ in range(5):
        barrier, results = threading.Barrier(8), []

        def first_turn(ep: str, cid: str, barrier: threading.Barrier, results: list) -> None:
            barrier.wait()
            results.append(store.start_episode_turn(ep, cid, token_ok=False).outcome)

        threads = [
            threading.Thread(target=first_turn, args=(f"race-{round_}", f"c-{round_}-{i}", barrier, results))
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["not_yours"] * 7 + ["ok"]
    store.engine.dispose()


engine_tier = pytest.mark.engine


@pytest.fixture
async def server(policy_engine, tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine) as url:
        yield url, settings


async def raw_chat(http: httpx.AsyncClient, **extra) -> httpx.Response:
    return await http.post(
        "/v1/chat/completions", content=chat_json(**extra), headers={"content-type": "application/json"}
    )


@engine_tier
async def test_unencodable_and_unbounded_inputs_are_400_and_nothing_is_logged(server):
    url, settings = server
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for extra, param in [
            ({"stop": ["\ud83d"]}, "stop"),
            ({"stop": ["\ud83d"], "stream": True}, "stop"),
            ({"messages": [{"role": "user", "content": "\ud83d"}]}, "messages.0.content"),
            ({"top_k": 10**30}, "top_k"),
            ({"turn": 2**63, "episode_id": "ep-big"}, "turn"),
        ]:
            r = await raw_chat(http, max_tokens=4, **extra)
            assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"]) == (
                400,
                param,
                "invalid_value",
            ), extra
        # Over the character bound (2048 × 128 = 262,144), under the body limit: refused by its
        # length, before tokenising (the message counts characters, not tokens).
        r = await raw_chat(http, messages=[{"role": "user", "content": "x" * 262_145}])
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "262145 characters" in r.json()["error"]["message"]
        r = await raw_chat(http, messages=[{"role": "user", "content": "x" * 10_000_000}])
        assert r.status_code == 413
        # A top_k over the vocabulary (49,152 tokens) leaves top-k off: served, recorded as 0.
        r = await raw_chat(http, max_tokens=2, top_k=100_000)
        assert r.status_code == 200, r.text
        r = await http.post(
            "/admin/load_policy", json={"version": 2**63, "path": "/v", "sha256": "0" * 64}, headers=ADMIN
        )
        assert (r.status_code, r.json()["error"]["param"]) == (400, "version")
        r = await raw_chat(http, max_tokens=2)
        assert r.status_code == 200 and r.json()["policy_version"] == 0
    recs = logged_trajectories(settings)
    assert [rec.sampling.top_k for rec in recs] == [0, 0]


@engine_tier
@pytest.mark.postgres
async def test_nul_in_ids_on_postgres_is_400_and_leaves_nothing(policy_engine, tmp_path, pg_url):
    settings = make_settings(tmp_path, database_url=pg_url)
    async with running_server(settings, policy_engine) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            for field in ("prompt_id", "episode_id"):
                r = await raw_chat(http, max_tokens=2, **{field: "a\x00b"})
                assert (r.status_code, r.json()["error"]["param"]) == (400, field)
            r = await http.post("/v1/feedback", json={"id": "c\x00", "feedback_token": "t", "reward": 1})
            assert (r.status_code, r.json()["error"]["param"]) == (422, "id")
    assert logged_trajectories(settings) == []
    eng = make_engine(pg_url)
    with eng.connect() as conn:
        counts = [
            conn.execute(select(func.count()).select_from(t)).scalar_one() for t in (TrajectoryIndex, Episode)
        ]
    eng.dispose()
    assert counts == [0, 0]


@engine_tier
async def test_an_episode_is_extended_and_rated_only_by_who_started_it(server):
    url, settings = server
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        r0 = await raw_chat(http, max_tokens=3, episode_id="ep-h", turn=0)
        assert r0.status_code == 200
        owner = r0.json()["episode_feedback_token"]
        assert owner == feedback_token(settings.feedback_secret, episode_token_subject("ep-h"))
        # Someone else's chat on that episode: 403 before anything is generated, no token leaked.
        r = await raw_chat(http, max_tokens=3, episode_id="ep-h", turn=1)
        assert r.status_code == 403 and r.json()["error"]["code"] == "episode_not_yours"
        other = await raw_chat(http, max_tokens=3, episode_id="ep-mine", turn=0)
        wrong = other.json()["episode_feedback_token"]
        r = await raw_chat(http, max_tokens=3, episode_id="ep-h", turn=1, episode_token=wrong)
        assert (r.status_code, r.json()["error"]["param"]) == (403, "episode_token")
        # ... nor rate it with any token of theirs.
        for tok in (wrong, other.json()["feedback_token"]):
            r = await http.post(
                "/v1/feedback", json={"episode_id": "ep-h", "feedback_token": tok, "reward": 1}
            )
            assert r.status_code == 403
        # The owner extends it with its token, and rates it; a rated episode takes no more turns.
        r = await raw_chat(http, max_tokens=3, episode_id="ep-h", turn=1, episode_token=owner)
        assert r.status_code == 200
        r = await http.post("/v1/feedback", json={"episode_id": "ep-h", "feedback_token": owner, "reward": 1})
        assert r.status_code == 202
        r = await raw_chat(http, max_tokens=3, episode_id="ep-h", turn=2, episode_token=owner)
        assert (r.status_code, r.json()["error"]["code"]) == (409, "episode_rated")
    # Logged: ep-h turns 0 and 1, ep-mine turn 0; nothing of the refused requests.
    assert sorted((rec.episode_id, rec.turn) for rec in logged_trajectories(settings)) == [
        ("ep-h", 0),
        ("ep-h", 1),
        ("ep-mine", 0),
    ]


async def stream_and_drop(http: httpx.AsyncClient, **extra) -> str:
    """Stream a long answer and close the connection after three content chunks; its id."""
    body = {"messages": USER, "max_tokens": 200, "stream": True, **extra}
    n, cid = 0, None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                cid = chunk["id"]
                n += bool(chunk["choices"] and chunk["choices"][0]["delta"].get("content"))
                if n >= 3:
                    break
    return cid


async def until_not_404(post) -> httpx.Response:
    """The aborted record is indexed by a background task: until then, feedback is 404."""
    for _ in range(300):
        r = await post()
        if r.status_code != 404:
            return r
        await asyncio.sleep(0.1)
    raise AssertionError("the aborted record was never indexed")


@engine_tier
async def test_feedback_on_an_aborted_answer_is_409(server):
    url, settings = server
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        cid = await stream_and_drop(http)
        tok = feedback_token(settings.feedback_secret, cid)
        r = await until_not_404(
            lambda: http.post("/v1/feedback", json={"id": cid, "feedback_token": tok, "reward": 1})
        )
        assert (r.status_code, r.json()["error"]["code"]) == (409, "not_a_whole_answer")
        text = (await http.get("/metrics")).text
    assert 'saoserve_feedback_total{result="not_whole"} 1.0' in text
    [rec] = logged_trajectories(settings)
    assert rec.id == cid and rec.finish_reason == "abort"
    # Nothing reached the feedback topic.
    log = open_log(settings.resolved_log_url)
    assert read_topic(log, "feedback") == []
    log.close()


@engine_tier
async def test_an_aborted_turn_is_sent_again_and_the_episode_rates_the_retry(server):
    """The client of turn 1 left mid-answer: its number is free (server.fate), the retry is
    answered (a 409 episode_in_progress at most while the abort is being recorded), and the
    episode's feedback lists turn 0 and the retry, never the aborted record, logged once."""
    url, settings = server
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        r0 = await raw_chat(http, max_tokens=3, episode_id="ep-a", turn=0)
        tok = r0.json()["episode_feedback_token"]
        turn1 = {"episode_id": "ep-a", "turn": 1, "episode_token": tok}
        aborted = await stream_and_drop(http, **turn1)
        for _ in range(300):
            retry = await raw_chat(http, max_tokens=3, **turn1)
            if retry.status_code != 409:
                break
            assert retry.json()["error"]["code"] == "episode_in_progress", retry.text
            await asyncio.sleep(0.1)
        assert retry.status_code == 200, retry.text
        fb = {"episode_id": "ep-a", "feedback_token": tok, "reward": 1}
        rated = await http.post("/v1/feedback", json=fb)
        assert rated.status_code == 202, rated.text
        await until_not_404(lambda: http.get(f"/admin/trajectories/{aborted}", headers=ADMIN))
    recs = {rec.id: rec for rec in logged_trajectories(settings)}
    assert len(recs) == 3 and (recs[aborted].finish_reason, recs[aborted].turn) == ("abort", 1)
    log = open_log(settings.resolved_log_url)
    [rating] = [FeedbackRecord.model_validate_json(e.value) for e in read_topic(log, "feedback")]
    log.close()
    assert rating.turn_ids == [r0.json()["id"], retry.json()["id"]]
