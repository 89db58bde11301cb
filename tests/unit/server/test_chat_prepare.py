"""server/chat/serving.py ``ChatHandler.prepare``: the request's one sampling record (what is logged and
what the engine samples with), and a sampling vLLM refuses answered 400 before anything is
stored or dispatched. A scripted engine renders every prompt as 3 tokens, vocabulary 100."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.auth import Caller
from server.chat.protocol import ChatCompletionRequest, ChatMessage
from server.chat.serving import ChatHandler
from server.errors import ApiError
from server.metrics import ServerMetrics
from testing.servers import make_settings

USER = [{"role": "user", "content": "hi"}]


def handler(tmp_path, calls: list[str]) -> ChatHandler:
    """A handler whose storage check and dispatch (version 3, no canary arm) are recorded in
    ``calls``; no episode store, no evidence."""

    async def require_storage() -> None:
        calls.append("storage")

    def dispatch(key=None):
        calls.append("dispatch")
        return 3, None

    engine = SimpleNamespace(render=lambda msgs: [1, 2, 3], tokenizer=tuple(range(100)))
    return ChatHandler(
        make_settings(tmp_path, default_max_tokens=64),
        engine,
        None,
        ServerMetrics(),
        open_fate=None,
        dispatch=dispatch,
        require_storage=require_storage,
    )


async def test_the_rollout_carries_the_requests_one_sampling_record(tmp_path):
    calls: list[str] = []
    h = handler(tmp_path, calls)
    req = ChatCompletionRequest(
        messages=USER, temperature=0.7, top_p=0.9, top_k=5, seed=11, stop="END", store=False, user="bob"
    )
    rollout = await h.prepare(req, Caller(key_id="k1", tenant="acme"))
    assert rollout.sampling.model_dump() == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "max_tokens": 64,  # the default budget: the context (2048 - 3 tokens) holds it
        "seed": 11,
        "stop": ["END"],  # one string is a list of one
    }
    assert (rollout.prompt_token_ids, rollout.dispatch_version, rollout.train) == ([1, 2, 3], 3, False)
    assert (rollout.identity, rollout.tenant, rollout.user) == ("key:k1", "acme", "bob")
    assert calls == ["storage", "dispatch"]


@pytest.mark.parametrize(("top_k", "recorded"), [(-1, 0), (0, 0), (99, 99), (100, 0), (5000, 0)])
async def test_top_k_off_or_past_the_vocabulary_is_recorded_as_off(tmp_path, top_k, recorded):
    req = ChatCompletionRequest(messages=USER, top_k=top_k, max_tokens=8, stop=["a", "b"])
    rollout = await handler(tmp_path, []).prepare(req, Caller())
    assert (rollout.sampling.top_k, rollout.sampling.max_tokens, rollout.sampling.stop) == (
        recorded,
        8,
        ["a", "b"],
    )


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "recorded"),
    [
        # vLLM raises a temperature in (0, 0.01) to 0.01 (its _MAX_TEMP): sampled, not greedy.
        (0.005, 1.0, 0, (0.01, 1.0, 0)),
        (1e-6, 0.9, 5, (0.01, 0.9, 5)),
        # Temperature 0 is greedy: vLLM turns top-p and top-k off, so the record says greedy.
        (0.0, 0.9, 5, (0.0, 1.0, 0)),
        (0.7, 0.9, 5, (0.7, 0.9, 5)),
    ],
)
async def test_the_record_holds_what_vllm_samples_with(tmp_path, temperature, top_p, top_k, recorded):
    h = handler(tmp_path, [])
    req = ChatCompletionRequest(messages=USER, temperature=temperature, top_p=top_p, top_k=top_k)
    s = (await h.prepare(req, Caller())).sampling
    assert (s.temperature, s.top_p, s.top_k) == recorded


async def test_sampling_vllm_refuses_is_400_before_storage_or_dispatch(tmp_path):
    # The request model bounds temperature to [0, 2]; a request built past its checks reaches vLLM's.
    req = ChatCompletionRequest.model_construct(
        messages=[ChatMessage(role="user", content="hi")], temperature=2.5
    )
    calls: list[str] = []
    h = handler(tmp_path, calls)
    with pytest.raises(ApiError) as exc:
        await h.prepare(req, Caller())
    e = exc.value
    assert (e.status, e.code, e.param) == (400, "invalid_value", None)
    assert e.message == (
        "invalid sampling parameters: temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)"
    )
    assert calls == []
    assert h.metrics.failed_before_generation.labels("invalid_value")._value.get() == 1
