"""Real clients nobody here wrote, pointed at the server unchanged: the ``openai`` SDK (sync,
async, streaming, logprobs, top_logprobs, include_usage), LangChain's ``ChatOpenAI`` and
LiteLLM's ``completion``. Each drives one plain and one streamed exchange and gives feedback
with the token it got back. Also OpenAI's logprob shape, worked out by hand on the tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import openai
import pytest

from core.records import TrajectoryRecord, feedback_token
from server.chat.serving import logprobs_body
from testing.servers import ADMIN, make_settings, running_server

pytestmark = pytest.mark.engine

# LiteLLM fetches its model price map from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
async def server(policy_engine, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("clients"))
    async with running_server(settings, policy_engine) as url:
        yield url, settings


async def give_feedback(url: str, completion_id: str, token: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post(
            "/v1/feedback", json={"id": completion_id, "feedback_token": token, "reward": 1}
        )


async def record_of(url: str, completion_id: str) -> TrajectoryRecord:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.get(f"/admin/trajectories/{completion_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return TrajectoryRecord.model_validate_json(r.content)


# ----------------------------------------------------------------- logprob shape, by hand


def test_token_text_and_bytes_by_hand(model_dir):
    """`` café 🎉 exactly`` in SmolLM2's byte-level BPE, and OpenAI's entries for it.

    The tokenizer stores bytes as printable stand-ins (Ġ = 0x20, Ã© = 0xc3 0xa9, ð = 0xf0,
    Ł = 0x9f, İ = 0x8e, ī = 0x89). 🎉 is U+1F389 = f0 9f 8e 89 in UTF-8, split over three
    tokens: " \\xf0\\x9f", "\\x8e", "\\x89"; none is text alone, so each is written
    ``bytes:\\xNN...`` and its bytes are the raw ones. café's é (c3 a9) stays in one token.
    """
    from transformers import AutoTokenizer

    from server.engine import PolicyEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = PolicyEngine(settings=make_settings(model_dir), model_dir=model_dir, tokenizer=tok)
    text = " café 🎉 exactly"
    ids = tok.encode(text)
    assert ids == [37366, 15107, 232, 227, 3869]
    assert tok.convert_ids_to_tokens(ids) == ["ĠcafÃ©", "ĠðŁ", "İ", "ī", "Ġexactly"]
    assert engine.token_bytes(ids) == [b" caf\xc3\xa9", b" \xf0\x9f", b"\x8e", b"\x89", b" exactly"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    logprobs = [-0.5, -1.0, -0.01, float("-inf"), -2.0, -0.25]
    alts = [[(ids[0], -0.5), (eos, -1.5)]] + [[] for _ in range(5)]
    body = logprobs_body(engine, [*ids, eos], logprobs, alts)
    content = body["content"]
    assert [e["token"] for e in content] == [
        " café",
        "bytes:\\x20\\xf0\\x9f",
        "bytes:\\x8e",
        "bytes:\\x89",
        " exactly",
        "",  # the end-of-sequence token adds nothing to the answer
    ]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    # -inf (a token outside top-p) is clamped as vLLM's server does: JSON has no infinity.
    assert [e["logprob"] for e in content] == [-0.5, -1.0, -0.01, -9999.0, -2.0, -0.25]
    assert content[0]["top_logprobs"] == [
        {"token": " café", "logprob": -0.5, "bytes": [32, 99, 97, 102, 195, 169]},
        {"token": "", "logprob": -1.5, "bytes": []},
    ]
    assert all(e["top_logprobs"] == [] for e in content[1:])
    json.dumps(body, allow_nan=False)


# ----------------------------------------------------------------- the openai SDK


def check_logprobs(content: str, entries: list, rec: TrajectoryRecord, top: int) -> None:
    """Entries are the record's tokens with its logprobs; their bytes spell the answer; each has
    ``top`` alternatives by rank, the sampled token's logprob among them when it ranks there."""
    assert len(entries) == len(rec.response_token_ids)
    assert [e.logprob for e in entries] == pytest.approx(rec.rollout_logprobs, abs=1e-6)
    spelled = b"".join(bytes(e.bytes) for e in entries)
    assert spelled == content.encode(), (spelled, content)
    for e in entries:
        alts = e.top_logprobs
        assert len(alts) == top
        lps = [a.logprob for a in alts]
        assert lps == sorted(lps, reverse=True)
        assert not lps or e.logprob <= lps[0] + 1e-6
        for a in alts:
            if a.token == e.token and a.bytes == e.bytes:
                assert a.logprob == pytest.approx(e.logprob, abs=1e-6)


async def test_openai_sync_client_plain_and_streamed(server):
    url, settings = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def plain():
        return client.chat.completions.create(
            model=settings.served_model_name, messages=PROMPT, max_tokens=12
        )

    def streamed():
        return list(
            client.chat.completions.create(
                model=settings.served_model_name, messages=PROMPT, max_tokens=12, stream=True
            )
        )

    # The server runs in this event loop: the blocking client runs in a thread.
    resp = await asyncio.to_thread(plain)
    assert resp.choices[0].message.content and resp.choices[0].logprobs is None
    token = resp.model_extra["feedback_token"]
    assert token == feedback_token(settings.feedback_secret, resp.id)
    assert (await give_feedback(url, resp.id, token)).status_code == 202

    chunks = await asyncio.to_thread(streamed)
    finish = chunks[-1]
    assert finish.choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in chunks)  # no include_usage, no usage
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (await give_feedback(url, finish.id, finish.model_extra["feedback_token"])).status_code == 202


async def test_openai_async_client_logprobs_top_logprobs(server):
    url, settings = server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    resp = await client.chat.completions.create(
        model=settings.served_model_name,
        messages=[{"role": "user", "content": "Say something in French about a café."}],
        max_tokens=24,
        temperature=0.8,
        seed=11,
        logprobs=True,
        top_logprobs=3,
    )
    choice = resp.choices[0]
    rec = await record_of(url, resp.id)
    check_logprobs(choice.message.content, choice.logprobs.content, rec, 3)
    assert (await give_feedback(url, resp.id, resp.model_extra["feedback_token"])).status_code == 202

    # logprobs without top_logprobs: the sampled token only, no alternatives.
    resp = await client.chat.completions.create(
        model=settings.served_model_name, messages=PROMPT, max_tokens=8, logprobs=True
    )
    rec = await record_of(url, resp.id)
    check_logprobs(resp.choices[0].message.content, resp.choices[0].logprobs.content, rec, 0)


async def test_openai_async_streaming_logprobs_and_usage_chunk(server):
    url, settings = server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model=settings.served_model_name,
        messages=[{"role": "user", "content": "Name two fruits with an emoji each."}],
        max_tokens=24,
        temperature=0.8,
        seed=5,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    finish, usage = chunks[-2], chunks[-1]
    # The usage chunk is separate, last, with empty choices; every chunk before has usage null.
    assert usage.choices == [] and all(c.usage is None for c in chunks[:-1])
    assert finish.choices[0].finish_reason in ("stop", "length")
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    entries = [e for c in chunks[:-1] if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    rec = await record_of(url, finish.id)
    check_logprobs(content, entries, rec, 2)
    n_prompt, n_completion = len(rec.prompt_token_ids), len(rec.response_token_ids)
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (n_prompt, n_completion)
    assert usage.usage.total_tokens == n_prompt + n_completion
    assert (await give_feedback(url, finish.id, finish.model_extra["feedback_token"])).status_code == 202


async def test_top_logprobs_bounds_are_4xx(server):
    url, _ = server
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for body, needle in (
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
            ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ):
            r = await http.post("/v1/chat/completions", json={"messages": PROMPT, **body})
            assert r.status_code == 400, r.text
            assert needle in r.json()["error"]["message"] + str(r.json()["error"]["param"])


async def test_raw_stream_has_no_usage_key_without_include_usage(server):
    url, _ = server
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async with http.stream(
            "POST", "/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 6, "stream": True}
        ) as r:
            assert r.headers["x-feedback-token"]
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert r.headers["x-feedback-token"] == chunks[-1]["feedback_token"]
    assert r.headers["x-completion-id"] == chunks[-1]["id"]


# ----------------------------------------------------------------- LangChain


async def test_langchain_chat_openai_plain_and_streamed(server):
    from langchain_openai import ChatOpenAI

    url, settings = server
    llm = ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        model=settings.served_model_name,
        max_tokens=12,
        max_retries=0,
        include_response_headers=True,  # the extension fields also travel as headers
    )
    msg = await llm.ainvoke("Write one sentence about the sea.")
    assert isinstance(msg.content, str) and msg.content
    headers = msg.response_metadata["headers"]
    completion_id = headers["x-completion-id"]
    assert msg.response_metadata["id"] == completion_id
    assert (await give_feedback(url, completion_id, headers["x-feedback-token"])).status_code == 202

    chunks = [c async for c in llm.astream("Write one sentence about the sea.")]
    text = "".join(c.content for c in chunks if isinstance(c.content, str))
    assert text
    headers = next(c.response_metadata["headers"] for c in chunks if "headers" in c.response_metadata)
    rec = await record_of(url, headers["x-completion-id"])
    assert rec.finish_reason in ("stop", "length")
    r = await give_feedback(url, headers["x-completion-id"], headers["x-feedback-token"])
    assert r.status_code == 202


# ----------------------------------------------------------------- LiteLLM


async def test_litellm_completion_plain_and_streamed(server):
    import litellm

    url, settings = server
    kwargs = dict(
        model=f"openai/{settings.served_model_name}",
        api_base=f"{url}/v1",
        api_key="unused",
        messages=PROMPT,
        max_tokens=12,
        num_retries=0,
    )
    resp = await asyncio.to_thread(litellm.completion, **kwargs)
    assert resp.choices[0].message.content
    token = resp._hidden_params["additional_headers"]["llm_provider-x-feedback-token"]
    assert (await give_feedback(url, resp.id, token)).status_code == 202

    def streamed():
        stream = litellm.completion(stream=True, **kwargs)
        return list(stream), stream._hidden_params

    chunks, hidden = await asyncio.to_thread(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    headers = hidden["additional_headers"]
    completion_id = headers["llm_provider-x-completion-id"]
    assert {c.id for c in chunks} == {completion_id}
    r = await give_feedback(url, completion_id, headers["llm_provider-x-feedback-token"])
    assert r.status_code == 202
