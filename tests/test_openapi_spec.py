"""The served OpenAPI document says what the server does: for each request below, the spec's
verdict (valid or not) is the server's (accepted or refused at the edge). Each case is a
schemathesis finding (issue 13, item 7) or a member of its class."""

from __future__ import annotations

from types import SimpleNamespace

import jsonschema
import pytest
from pydantic import ValidationError

from server.schemas import MAX_SEED, ChatCompletionRequest, FeedbackRequest, LoadPolicyRequest
from tests.conftest import make_settings

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    from server.app import create_app

    settings = make_settings(tmp_path_factory.mktemp("spec"), max_tokens_limit=8)
    return create_app(settings, engine=SimpleNamespace(), watch_policy=False).openapi()


def spec_accepts(spec: dict, model: str, body: dict) -> bool:
    schema = {"components": spec["components"], "$ref": f"#/components/schemas/{model}"}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


def server_accepts(cls, body: dict) -> bool:
    try:
        cls.model_validate(body)
    except ValidationError:
        return False
    return True


CASES = [
    # episode_token needs episode_id (a string; null is no episode)
    (ChatCompletionRequest, {"messages": USER, "episode_token": "t"}, False),
    (ChatCompletionRequest, {"messages": USER, "episode_token": "t", "episode_id": None}, False),
    (ChatCompletionRequest, {"messages": USER, "episode_token": None}, True),
    (ChatCompletionRequest, {"messages": USER, "episode_token": "t", "episode_id": "e"}, True),
    # top_logprobs > 0 needs logprobs: true
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2}, False),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2, "logprobs": False}, False),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 0}, True),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2, "logprobs": True}, True),
    # penalties and logit bias: only their neutral values
    (ChatCompletionRequest, {"messages": USER, "presence_penalty": 0.5}, False),
    (ChatCompletionRequest, {"messages": USER, "frequency_penalty": -1}, False),
    (ChatCompletionRequest, {"messages": USER, "presence_penalty": 0, "frequency_penalty": 0.0}, True),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": {"1": 1.0}}, False),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": {}}, True),
    (ChatCompletionRequest, {"messages": USER, "logit_bias": None}, True),
    # stop strings: non-empty, at most 1024 characters, at most 16
    (ChatCompletionRequest, {"messages": USER, "stop": ""}, False),
    (ChatCompletionRequest, {"messages": USER, "stop": ["a", ""]}, False),
    (ChatCompletionRequest, {"messages": USER, "stop": ["a" * 1025]}, False),
    (ChatCompletionRequest, {"messages": USER, "stop": ["s"] * 17}, False),
    (ChatCompletionRequest, {"messages": USER, "stop": ["s"] * 16}, True),
    # seed: 2^63 - 1024 is the largest (2^63 - 1 would be read as the float 2^63)
    (ChatCompletionRequest, {"messages": USER, "seed": MAX_SEED}, True),
    (ChatCompletionRequest, {"messages": USER, "seed": MAX_SEED + 1}, False),
    # NUL: refused in every stored string, allowed in text for the model
    (ChatCompletionRequest, {"messages": [{**USER[0], "name": "a\x00"}]}, False),
    (ChatCompletionRequest, {"messages": USER, "user": "\x00"}, False),
    (ChatCompletionRequest, {"messages": USER, "stream_options": {"a\x00": True}}, False),
    # stream_options: OpenAI's two booleans, with stream: true only
    (
        ChatCompletionRequest,
        {"messages": USER, "stream": True, "stream_options": {"include_usage": True}},
        True,
    ),
    (
        ChatCompletionRequest,
        {
            "messages": USER,
            "stream": True,
            "stream_options": {"include_usage": False, "include_obfuscation": True},
        },
        True,
    ),
    (
        ChatCompletionRequest,
        {"messages": USER, "stream": True, "stream_options": {"include_usage": "false"}},
        False,
    ),
    (ChatCompletionRequest, {"messages": USER, "stream": True, "stream_options": {"bogus": 1}}, False),
    (ChatCompletionRequest, {"messages": USER, "stream_options": {"include_usage": True}}, False),
    (ChatCompletionRequest, {"messages": USER, "stream": False, "stream_options": None}, True),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "h\x00i"}]}, True),
    (ChatCompletionRequest, {"messages": USER, "stop": ["\x00"]}, True),
    (LoadPolicyRequest, {"version": 1, "path": "/w\x00", "sha256": "0" * 64}, False),
    (FeedbackRequest, {"id": "c\x00", "feedback_token": "t", "reward": 1}, False),
    # feedback: exactly one of id and episode_id, exactly one of reward and thumbs
    (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": 2, "thumbs": "up"}, False),
    (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": 0.5, "thumbs": "up"}, False),
    (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": 0.5, "thumbs": None}, True),
    (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": None, "thumbs": "down"}, True),
    (FeedbackRequest, {"id": "c", "episode_id": "e", "feedback_token": "t", "reward": 1}, False),
    (FeedbackRequest, {"id": None, "episode_id": "e", "feedback_token": "t", "reward": 1}, True),
    (FeedbackRequest, {"feedback_token": "t", "reward": 1}, False),
]


@pytest.mark.parametrize(("cls", "body", "valid"), CASES)
def test_the_spec_and_the_server_agree(spec, cls, body, valid):
    assert (spec_accepts(spec, cls.__name__, body), server_accepts(cls, body)) == (valid, valid)


def test_the_spec_states_this_deployments_max_tokens(spec):
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        assert [c.get("maximum") for c in props[name]["anyOf"]] == [8, None]


def test_the_seed_bound_survives_a_float():
    # 2^63 - 1024 = 9223372036854774784 is a float64; 2^63 - 1 rounds up to 2^63 as one.
    assert int(float(MAX_SEED)) == MAX_SEED == 9223372036854774784
    assert int(float(2**63 - 1)) == 2**63


def test_load_policy_documents_its_refusals(spec):
    assert {"401", "403", "413", "422"} <= set(spec["paths"]["/admin/load_policy"]["post"]["responses"])
