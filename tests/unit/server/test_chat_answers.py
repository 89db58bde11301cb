"""The chat answers as the served OpenAPI document describes them: a whole answer is a
``ChatCompletion`` (the 200 ``application/json`` schema), a stream's events are chunks, an error
or ``[DONE]`` (the ``text/event-stream`` schema), with the keys OpenAI's clients expect (``logprobs``
null when not asked; ``usage`` in chunks only with ``include_usage``). A scripted engine stands
in for vLLM."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from core.claims import episode_token_subject
from core.logbus import LogUnavailable
from core.records import feedback_token
from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import ChatHandler
from server.engine import GenerationDelta
from server.fate import Fate
from testing.builders import rollout
from testing.fakes import FakeState
from testing.servers import make_settings

SECRET = "s" * 32
USER = [{"role": "user", "content": "hi"}]


class ScriptedEngine:
    """Two deltas at version 3: tokens 3, 4 ("Hi"), then 5 (" there", finish ``stop``); token
    ``i`` is the bytes ``<i>``."""

    async def generate(self, prompt_token_ids, sampling, request_id, top_logprobs, version):
        yield GenerationDelta([3, 4], [-0.5, -0.25], "Hi", 3, top_logprobs=[[], []])
        yield GenerationDelta(
            [5], [-1.0], " there", 3, finish_reason="stop", weight_versions=[(3, 0, 3)], top_logprobs=[[]]
        )

    def token_bytes(self, token_ids):
        return [f"<{t}>".encode() for t in token_ids]


def chat_state() -> FakeState:
    s = FakeState()
    s.engine, s.settings = ScriptedEngine(), SimpleNamespace(feedback_secret=SECRET)
    return s


def handler(s: FakeState) -> ChatHandler:
    """The handler of ``s``'s engine, settings and metrics; answering needs no store, dispatch
    or storage check (those are ``prepare``'s)."""
    return ChatHandler(
        s.settings, s.engine, None, s.metrics, open_fate=None, dispatch=None, require_storage=None
    )


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from server.app import create_app

    settings = make_settings(tmp_path_factory.mktemp("answers"))
    return create_app(settings, engine=SimpleNamespace(), watch_policy=False).openapi()


def documented_200(spec: dict, media_type: str) -> dict:
    return spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"][media_type]["schema"]


def entry(t: int, logprob: float) -> dict:
    text = f"<{t}>"
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}


# 2025-06-01T00:00:00Z, the rollout's creation, in Unix seconds.
CREATED = 1748736000
HEAD = {"id": "chatcmpl-1", "created": CREATED, "model": "m", "policy_version": 3, "prompt_id": "p"}
TOKENS = {
    "feedback_token": feedback_token(SECRET, "chatcmpl-1"),
    "episode_feedback_token": feedback_token(SECRET, episode_token_subject("ep")),
}


async def test_a_whole_answer_is_the_documented_body(spec):
    s = chat_state()
    req = ChatCompletionRequest(messages=USER)
    resp = await handler(s).complete(req, Fate(s, rollout(tokens=0), stream=False))
    body = json.loads(resp.body)
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": CREATED,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hi there"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        # 3 prompt tokens (1, 2, 3) + 3 sampled (3, 4, 5).
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        "policy_version": 3,
        "prompt_id": "p",
        **TOKENS,
    }
    schema = {"components": spec["components"], **documented_200(spec, "application/json")}
    jsonschema.Draft202012Validator(schema).validate(body)
    assert [r.finish_reason for r in s.persisted] == ["stop"]


async def test_an_answer_outside_an_episode_has_no_episode_token():
    s = chat_state()
    req = ChatCompletionRequest(messages=USER, logprobs=True)
    resp = await handler(s).complete(req, Fate(s, rollout(tokens=0, episode=None), stream=False))
    body = json.loads(resp.body)
    assert "episode_feedback_token" not in body
    assert body["choices"][0]["logprobs"] == {"content": [entry(3, -0.5), entry(4, -0.25), entry(5, -1.0)]}


async def events_of(req: ChatCompletionRequest) -> list[str]:
    s = chat_state()
    fate = Fate(s, rollout(tokens=0), stream=True)
    out = [e async for e in handler(s).chunks(req, fate)]
    await s.drained()
    assert fate.outcome == "ok" and [r.finish_reason for r in s.persisted] == ["stop"]
    return [e.removeprefix("data: ").removesuffix("\n\n") for e in out]


def check_documented(spec: dict, data: list[str]) -> None:
    """Each event as schemathesis reads it (``{"data": ...}``) fits the event schema, and each
    JSON data fits its ``contentSchema`` (which jsonschema does not assert by itself)."""
    event = documented_200(spec, "text/event-stream")
    content = event["properties"]["data"]["anyOf"][1]["contentSchema"]
    for d in data:
        jsonschema.Draft202012Validator(event).validate({"data": d, "event": "message"})
        if d != "[DONE]":
            jsonschema.Draft202012Validator(content).validate(json.loads(d))


async def test_stream_events_with_usage_and_logprobs(spec):
    req = ChatCompletionRequest(
        messages=USER, stream=True, logprobs=True, stream_options={"include_usage": True}
    )
    data = await events_of(req)
    check_documented(spec, data)
    head = {**HEAD, "object": "chat.completion.chunk", **TOKENS, "usage": None}
    # The role chunk; "Hi" with its 2 tokens; the last delta (" there", its token, stop);
    # the usage chunk (3 + 3 = 6 tokens); [DONE].
    assert [json.loads(d) for d in data[:-1]] == [
        {
            **head,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hi"},
                    "finish_reason": None,
                    "logprobs": {"content": [entry(3, -0.5), entry(4, -0.25)]},
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " there"},
                    "finish_reason": "stop",
                    "logprobs": {"content": [entry(5, -1.0)]},
                }
            ],
        },
        {**head, "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}, "choices": []},
    ]
    assert data[-1] == "[DONE]"


async def test_stream_events_without_usage_or_logprobs_have_neither_key(spec):
    data = await events_of(ChatCompletionRequest(messages=USER, stream=True))
    check_documented(spec, data)
    chunks_ = [json.loads(d) for d in data[:-1]]
    # The role chunk, "Hi", the last delta: no usage chunk.
    assert len(chunks_) == 3 and data[-1] == "[DONE]"
    assert not any("usage" in c for c in chunks_)
    assert not any("logprobs" in c["choices"][0] for c in chunks_)
    assert [c["choices"][0]["delta"] for c in chunks_] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
        {"content": " there"},
    ]


async def test_a_stream_the_log_refuses_ends_with_a_documented_error(spec):
    s = chat_state()
    s.refuse = LogUnavailable("log down")
    fate = Fate(s, rollout(tokens=0), stream=True)
    req = ChatCompletionRequest(messages=USER, stream=True)
    data = [e.removeprefix("data: ").removesuffix("\n\n") async for e in handler(s).chunks(req, fate)]
    await s.drained()
    check_documented(spec, data)
    # The role chunk, "Hi", then the error instead of the last delta: no [DONE].
    assert len(data) == 3 and json.loads(data[-1])["error"]["code"] == "storage_unavailable"
    assert (fate.outcome, s.persisted, s.released) == ("log_unavailable", [], ["chatcmpl-1"])


def test_the_event_schema_refuses_what_is_no_event(spec):
    event = documented_200(spec, "text/event-stream")
    content = event["properties"]["data"]["anyOf"][1]["contentSchema"]
    v = jsonschema.Draft202012Validator(event)
    assert not v.is_valid({"event": "message"})  # no data
    assert not v.is_valid({"data": 1})
    # A chunk with a second choice index, or an error without its message, is no documented data.
    chunk = {**HEAD, "object": "chat.completion.chunk", "feedback_token": "t", "choices": []}
    assert jsonschema.Draft202012Validator(content).is_valid(chunk)
    bad_choice = {"index": 1, "delta": {}, "finish_reason": None}
    assert not jsonschema.Draft202012Validator(content).is_valid({**chunk, "choices": [bad_choice]})
    assert not jsonschema.Draft202012Validator(content).is_valid({"error": {"type": "server_error"}})
