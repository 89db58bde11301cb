"""Backpressure through the real app under uvicorn (issue 42): a flood from one API key is answered
429 with Retry-After while another key is served; the openai SDK retries a 429 and succeeds; a
429 leaves no trajectory; the refusals are counted by tenant on /metrics.

The engine is ``HeldEngine`` below (no vLLM engine): its answers are two scripted tokens, and a
prompt that says ``hold`` waits until the test lets it finish, so a key's requests stay in flight.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx
import openai

from core.logbus import open_log
from server.engine import GenerationDelta
from testing.fakes import FakeEngine
from testing.servers import ADMIN, make_settings, running_server

# The first chat imports vLLM (its SamplingParams) inside the server's loop: tens of seconds here.
TIMEOUT_S = 120.0


def chat(content: str) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4}


@dataclass
class HeldEngine(FakeEngine):
    """Every prompt renders as 3 tokens (4 when its message says ``hold``); every answer is the
    tokens 7, 8 with ``stop``; a held prompt's answer waits for ``release``."""

    tokenizer: tuple = tuple(range(100))  # only its length is read (the top-k bound)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0

    def render(self, messages: list[dict]) -> list[int]:
        return [1, 2, 3, 4] if "hold" in messages[-1]["content"] else [1, 2, 3]

    async def generate(self, prompt_ids, sampling, request_id=None, top_logprobs=0, **_):
        if len(prompt_ids) == 4:
            self.held += 1
            await self.release.wait()
        yield GenerationDelta([7], [-0.5], "hi", self.version)
        yield GenerationDelta([8], [-0.25], "!", self.version, "stop", [(self.version, 0, 2)])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def create_key(http: httpx.AsyncClient, tenant: str) -> str:
    r = await http.post("/admin/keys", json={"tenant": tenant}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()["key"]


def logged_ids(settings) -> list[str]:
    """The completion ids of every trajectory record in the log (the SQL log: one partition)."""
    log = open_log(settings.resolved_log_url)
    try:
        return [json.loads(e.value)["id"] for e in log.read("trajectories", 0, 0, 1000, 0.0)]
    finally:
        log.close()


async def test_a_flood_from_one_key_is_refused_while_another_key_is_served(tmp_path):
    settings = make_settings(tmp_path, key_concurrency_limit=2, busy_retry_after_s=3)
    engine = HeldEngine()
    async with running_server(settings, engine, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            flooder, other = await create_key(http, "acme"), await create_key(http, "beta")
            # Two held requests take the flooder's two slots; they stay in flight.
            held = [
                asyncio.create_task(
                    http.post("/v1/chat/completions", json=chat("hold"), headers=bearer(flooder))
                )
                for _ in range(2)
            ]
            while engine.held < 2:
                await asyncio.sleep(0.01)
            flood = await asyncio.gather(
                *(
                    http.post("/v1/chat/completions", json=chat("more"), headers=bearer(flooder))
                    for _ in range(5)
                )
            )
            served = await http.post("/v1/chat/completions", json=chat("hello"), headers=bearer(other))
            engine.release.set()
            answered = await asyncio.gather(*held)
            page = (await http.get("/metrics")).text
            # The slots are given back with the answers: the flooder is served again.
            after = await http.post("/v1/chat/completions", json=chat("again"), headers=bearer(flooder))
    assert [r.status_code for r in flood] == [429] * 5
    for r in flood:
        assert r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "in flight" in err["message"]
    assert served.status_code == 200 and served.json()["choices"][0]["message"]["content"] == "hi!"
    assert [r.status_code for r in answered] == [200, 200]
    assert after.status_code == 200
    # 2 held + 1 of the other key + 1 after: 4 trajectories, none for the 5 refusals.
    ids = logged_ids(settings)
    assert sorted(ids) == sorted(r.json()["id"] for r in [*answered, served, after])
    assert 'saoserve_requests_throttled_total{limit="key_concurrency",tenant="acme"} 5.0' in page
    assert 'saoserve_requests_failed_before_generation_total{reason="throttled"} 5.0' in page
    assert 'tenant="beta"} ' not in page.split("saoserve_requests_throttled_total")[-1].split("# HELP")[0]


async def test_the_openai_sdk_retries_a_429_and_succeeds(tmp_path):
    # One request per 2 s: the second, sent at once, is refused with Retry-After: 2 (the first
    # leaves the window 2 s after it came, rounded up); the SDK sleeps that long and sends it
    # again, and the window then has room.
    settings = make_settings(tmp_path, key_rate_limit="1/2 seconds")
    async with running_server(settings, HeldEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            key = await create_key(http, "acme")
            sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2, timeout=TIMEOUT_S)
            first = await sdk.chat.completions.with_raw_response.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": "one"}], max_tokens=4
            )
            second = await sdk.chat.completions.with_raw_response.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": "two"}], max_tokens=4
            )
            no_retry = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            try:
                await no_retry.chat.completions.create(
                    model="smollm2-135m-instruct", messages=[{"role": "user", "content": "3"}], max_tokens=4
                )
                refused = None
            except openai.RateLimitError as exc:
                refused = exc
            page = (await http.get("/metrics")).text
    assert (first.retries_taken, second.retries_taken) == (0, 1)
    assert second.parse().choices[0].message.content == "hi!"
    assert refused is not None and refused.status_code == 429
    assert refused.code == "rate_limit_exceeded" and refused.response.headers["retry-after"] == "2"
    assert len(logged_ids(settings)) == 2  # the two answers; neither refusal
    assert 'saoserve_requests_throttled_total{limit="key_rate",tenant="acme"} 2.0' in page


async def test_the_engine_queue_refuses_anonymous_traffic_too(tmp_path):
    settings = make_settings(tmp_path, engine_queue_limit=1)
    engine = HeldEngine()
    async with running_server(settings, engine, watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            held = asyncio.create_task(http.post("/v1/chat/completions", json=chat("hold")))
            while engine.held < 1:
                await asyncio.sleep(0.01)
            full = await http.post("/v1/chat/completions", json=chat("next"))
            engine.release.set()
            assert (await held).status_code == 200
            page = (await http.get("/metrics")).text
    assert full.status_code == 429 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "engine_queue_full"
    assert 'saoserve_requests_throttled_total{limit="engine_queue",tenant="-"} 1.0' in page
    assert len(logged_ids(settings)) == 1
