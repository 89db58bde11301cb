"""What real clients (the openai SDK 3.57, unchanged) met on a real server (issue 23 findings 3,
5 and 10), each as the client does it.

- A final 409 is sent once: the SDK retries 409 unless the answer says ``x-should-retry: false``.
- The ``developer`` role is OpenAI's system role: accepted, rendered and identified as ``system``.
- ``client.models.retrieve(name)``: the model's card; another name is 404 ``model_not_found``.
- ``chat.completions.stream()`` + ``get_final_completion()``: the SDK builds the final
  completion's top-level fields from the first chunk, so every chunk carries
  ``feedback_token`` and ``policy_version``.
- A non-streamed request whose client has gone (the SDK's timeout, and its retry) is aborted in
  the engine and logged as an aborted trajectory, never generated to the end as a whole answer.
- The chat path's failures: a log that refuses the record is a 503 naming the class (no SQL,
  no parameters, no prompt id), an exception no handler knows a 500 in the OpenAI shape, and a
  prompt whose evidence lies far ahead of the served version is answered.

The developer role and the model's card without generating: tests/unit/server/test_real_clients.py.
The final 409 on ``testing.fakes.FakeEngine``, the rest on the engine.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import openai
import pytest

from core.db import make_engine
from core.evidence import RHO
from core.evidence_store import EvidenceStore, stored_prompt_id
from core.logbus import SqlLog
from core.records import TrajectoryRecord, feedback_token, prompt_id_for
from testing.logs import logged_trajectories
from testing.metrics import metric
from testing.servers import ADMIN, MODEL, make_settings, running_server, sdk

# ----------------------------------------------------------------- without generating


# ----------------------------------------------------------------- on the engine


@pytest.fixture(scope="module")
async def server(policy_engine, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("real-clients"))
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        yield url, settings


async def metrics_of(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return (await http.get("/metrics")).text


async def record_of(url: str, completion_id: str) -> TrajectoryRecord:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.get(f"/admin/trajectories/{completion_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return TrajectoryRecord.model_validate_json(r.content)


async def test_a_final_409_is_sent_once(server):
    url, _ = server
    client = sdk(url)  # the SDK's default: max_retries 2
    turn = {"episode_id": "ep-sdk-409", "turn": 0}
    msgs = [{"role": "user", "content": "Say hi."}]
    first = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body=turn)
    # Turn 0 again, with the episode's token: its number is taken (409 duplicate_turn).
    again = turn | {"episode_token": first.model_extra["episode_feedback_token"]}
    with pytest.raises(openai.ConflictError) as e:
        await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body=again)
    assert e.value.body["code"] == "duplicate_turn"
    m = await metrics_of(url)
    assert metric(m, "saoserve_requests_failed_before_generation_total", reason="duplicate_turn") == 1


async def test_the_developer_role_is_answered_as_system(server, policy_engine):
    url, _ = server
    client = sdk(url, max_retries=0)
    dev = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": "Sky colour?"},
    ]
    resp = await client.chat.completions.create(model=MODEL, messages=dev, max_tokens=4)
    rec = await record_of(url, resp.id)
    as_system = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Sky colour?"},
    ]
    assert rec.prompt_token_ids == policy_engine.render(as_system)
    assert rec.prompt_id == resp.model_extra["prompt_id"] == prompt_id_for(as_system)


async def test_stream_helper_final_completion_keeps_the_extension_fields(server):
    url, settings = server
    client = sdk(url, max_retries=0)
    async with client.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": "Name a river."}], max_tokens=256, stop=["."]
    ) as stream:
        chunks = [event.chunk async for event in stream if event.type == "chunk"]
        final = await stream.get_final_completion()
    extra = final.model_extra
    assert extra["feedback_token"] == feedback_token(settings.feedback_secret, final.id)
    assert extra["policy_version"] == 0 and extra["prompt_id"]
    assert all(c.model_extra["feedback_token"] == extra["feedback_token"] for c in chunks)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post(
            "/v1/feedback", json={"id": final.id, "feedback_token": extra["feedback_token"], "reward": 1}
        )
    assert r.status_code == 202, r.text


async def test_a_client_that_left_aborts_its_generation(server):
    """The SDK times out after 1.5 s and retries once: two requests, each aborted in the engine
    when its connection closed, each logged with finish reason ``abort`` (not rateable), after
    part of its 400 tokens rather than all of them."""
    url, settings = server
    client = sdk(url, timeout=1.5, max_retries=1)
    with pytest.raises(openai.APITimeoutError):
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell a long story about a lighthouse."}],
            max_tokens=400,
            temperature=1.0,
            seed=3,
            extra_body={"prompt_id": "client-left"},
        )
    deadline = time.monotonic() + 120
    while True:
        recs = [
            r
            for r in await asyncio.to_thread(logged_trajectories, settings)
            if r.prompt_id == stored_prompt_id(settings.feedback_secret, "client-left")
        ]
        if len(recs) == 2 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert [r.finish_reason for r in recs] == ["abort", "abort"]
    assert all(len(r.response_token_ids) < 400 for r in recs)
    m = await metrics_of(url)
    assert metric(m, "saoserve_requests_total", stream="false", outcome="aborted") == 2
    assert metric(m, "saoserve_requests_in_flight") == 0


async def test_evidence_far_ahead_of_the_served_version_is_answered(server):
    """The tester's row: a result at version 100000 while version 0 serves (now refused at
    /admin/load_policy; such a row may predate that). Before, the chat was a plain-text 500."""
    url, settings = server
    store = EvidenceStore(make_engine(settings.resolved_database_url))
    with store.engine.begin() as conn:
        # Stored under the hash of the client's id, as the server stores it (docs/privacy.md).
        store.add_results(conn, [(stored_prompt_id(settings.feedback_secret, "far-ahead"), 1.0, 100_000)])
    client = sdk(url, max_retries=0)
    resp = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        extra_body={"prompt_id": "far-ahead"},
    )
    base = (await record_of(url, resp.id)).baseline
    # α = 5 and β = 4 at version 100000, read 5230 versions earlier (tests/unit/server/test_version_chain.py).
    assert base.value == 5 / 9 and base.version == 0
    assert base.alpha == pytest.approx(5 * RHO**-5230, rel=1e-12) and math.isfinite(base.beta)


async def test_a_log_that_refuses_the_record_names_only_the_class(policy_engine, tmp_path):
    settings = make_settings(tmp_path)
    broken_log = SqlLog(f"sqlite:///{tmp_path / 'log-without-schema.db'}")
    async with running_server(settings, policy_engine, log_transport=broken_log, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            r = await http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "prompt_id": "victim-prompt",
                },
            )
            ready = await http.get("/readyz")
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["message"] == (
        "trajectory log unavailable, the answer was not recorded (LogUnavailable); retry later"
    )
    assert ready.json()["log"] == "the SQL log is unavailable (LogUnavailable)"
    for body in (r.text, ready.text):
        for internal in ("INSERT", "log_records", "parameters", "victim-prompt", "sqlite3"):
            assert internal not in body, (internal, body)


async def test_an_unknown_exception_on_the_chat_path_is_a_500_in_the_openai_shape(policy_engine, tmp_path):
    async def failing(prompt_id: str, version: int):
        raise RuntimeError(f"SELECT * FROM prompt_evidence WHERE prompt_id = '{prompt_id}'")

    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine, read_baseline=failing, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            r = await http.post("/v1/chat/completions", json=body)
            again = await http.get("/healthz")
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "internal error (RuntimeError); the details are in the server's log",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    assert again.status_code == 200
