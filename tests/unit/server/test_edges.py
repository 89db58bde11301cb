"""Every request field checked at the edge, episode ownership, and feedback only on whole answers
(issue 12 items 1 and 4, issue 13 items 2, 4, 5 and 7; docs/design.md §8).

Here, with no engine: the schemas, the app's validation and body-size edge with a small fake
state (a request refused there never reaches the engine), the store on SQLite. The same inputs
through the real server (nothing logged for any of them) and the store on PostgreSQL:
tests/integration/test_edges.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from core.db import make_engine, migrate
from server.admin.protocol import LoadPolicyRequest, RollbackRequest
from server.chat.protocol import ChatCompletionRequest
from server.feedback.protocol import FeedbackRequest
from server.limits import BodySizeLimit, max_body_bytes, max_message_chars
from server.store import ServerStore
from testing.builders import record
from testing.edges import USER, chat_json, edge_app, post_raw
from testing.servers import ADMIN


def refusal(cls, body: dict) -> tuple[tuple, str]:
    """(location, error type) of the first error ``cls`` raises for ``body``."""
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    err = info.value.errors()[0]
    return err["loc"], err["type"]


# --- the schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"messages": USER, "stop": ["\ud83d"]}, ("stop",)),
        ({"messages": USER, "stop": "\ud83d"}, ("stop",)),
        ({"messages": [{"role": "user", "content": "hi \ud83d"}]}, ("messages", 0, "content")),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            ("messages", 0, "content"),
        ),
        ({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, ("messages", 0, "name")),
        ({"messages": USER, "user": "\ud800"}, ("user",)),
        ({"messages": USER, "model": "\ud800"}, ("model",)),
        ({"messages": USER, "stream_options": {"\ud800": True}}, ("stream_options",)),
        ({"messages": USER, "stream_options": {"x": ["\ud800"]}}, ("stream_options",)),
    ],
)
def test_lone_surrogates_are_refused_in_every_chat_string(body, loc):
    assert refusal(ChatCompletionRequest, body) == (loc, "invalid_value")


@pytest.mark.parametrize("field", ["prompt_id", "episode_id", "user", "model", "episode_token"])
def test_nul_is_refused_where_a_string_is_stored_or_an_id(field):
    body = {"messages": USER, "episode_id": "ep", field: "a\x00b"}  # episode_token needs an episode
    assert refusal(ChatCompletionRequest, body) == ((field,), "invalid_value")


def test_nul_in_message_content_and_stop_is_text_for_the_model():
    """Content is tokenised, never stored as text (the log holds token ids); stop strings are
    kept in the record's sampling, JSON-escaped (tests/unit/server/test_engine_sampling.py); NUL is a
    character either may hold: accepted."""
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "a\x00b"}], "stop": ["\x00"]}
    )
    assert req.messages[0].text() == "a\x00b" and req.stop == ["\x00"]


@pytest.mark.parametrize(
    ("cls", "body", "loc"),
    [
        (FeedbackRequest, {"id": "c\x00", "feedback_token": "t", "reward": 1}, ("id",)),
        (FeedbackRequest, {"episode_id": "e\x00", "feedback_token": "t", "reward": 1}, ("episode_id",)),
        (FeedbackRequest, {"id": "c", "feedback_token": "t\x00", "reward": 1}, ("feedback_token",)),
        (LoadPolicyRequest, {"version": 1, "path": "/v\x00", "sha256": "0" * 64}, ("path",)),
    ],
)
def test_nul_in_feedback_and_admin_bodies(cls, body, loc):
    assert refusal(cls, body) == (loc, "invalid_value")


@pytest.mark.parametrize(
    ("cls", "body", "loc"),
    [
        (ChatCompletionRequest, {"messages": USER, "top_k": 10**30}, ("top_k",)),
        (ChatCompletionRequest, {"messages": USER, "turn": 2**63}, ("turn",)),
        (ChatCompletionRequest, {"messages": USER, "turn": 2**31}, ("turn",)),  # INTEGER column: < 2^31
        (ChatCompletionRequest, {"messages": USER, "max_tokens": 2**31}, ("max_tokens",)),
        (
            ChatCompletionRequest,
            {"messages": USER, "max_completion_tokens": 2**31},
            ("max_completion_tokens",),
        ),
        (ChatCompletionRequest, {"messages": USER, "top_logprobs": 21}, ("top_logprobs",)),
        (ChatCompletionRequest, {"messages": USER, "seed": 2**63}, ("seed",)),
        # 2^63 - 1024 is the largest seed (the largest int64 a float64 holds): 2^63 - 1023 is over.
        (ChatCompletionRequest, {"messages": USER, "seed": 2**63 - 1023}, ("seed",)),
        (ChatCompletionRequest, {"messages": USER, "stop": ["s"] * 17}, ("stop",)),
        (LoadPolicyRequest, {"version": 2**63, "path": "/v", "sha256": "0" * 64}, ("version",)),
        (RollbackRequest, {"version": 2**31}, ("version",)),
    ],
)
def test_integers_and_lists_are_bounded(cls, body, loc):
    assert refusal(cls, body)[0] == loc


@pytest.mark.parametrize(
    ("cls", "body", "loc"),
    [
        (ChatCompletionRequest, {"messages": USER, "max_tokens": True}, ("max_tokens",)),
        (ChatCompletionRequest, {"messages": USER, "temperature": True}, ("temperature",)),
        (ChatCompletionRequest, {"messages": USER, "top_p": True}, ("top_p",)),
        (ChatCompletionRequest, {"messages": USER, "top_k": True}, ("top_k",)),
        (ChatCompletionRequest, {"messages": USER, "n": True}, ("n",)),
        (ChatCompletionRequest, {"messages": USER, "seed": True}, ("seed",)),
        (ChatCompletionRequest, {"messages": USER, "seed": "5"}, ("seed",)),
        (ChatCompletionRequest, {"messages": USER, "turn": True}, ("turn",)),
        (ChatCompletionRequest, {"messages": USER, "stream": 0}, ("stream",)),
        (ChatCompletionRequest, {"messages": USER, "logprobs": 1}, ("logprobs",)),
        (LoadPolicyRequest, {"version": "1", "path": "/p", "sha256": "0" * 64}, ("version",)),
        (RollbackRequest, {"version": True}, ("version",)),
        (FeedbackRequest, {"id": "c", "feedback_token": "t", "reward": True}, ("reward",)),
    ],
)
def test_scalars_keep_their_json_type(cls, body, loc):
    """``true`` is not 1, ``"1"`` is not a version, ``0`` is not ``false`` (found by a tester:
    each of these was answered 200 or got past validation)."""
    assert refusal(cls, body) == (loc, "value_error")


def test_integral_numbers_still_fill_integer_and_number_fields():
    # JSON Schema's integer admits 1.0; an integer fills a number field.
    req = ChatCompletionRequest.model_validate({"messages": USER, "max_tokens": 16.0, "temperature": 1})
    assert (req.max_tokens, req.temperature) == (16, 1.0)


def test_the_largest_values_in_bounds_are_accepted():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": USER,
            "top_k": 2**31 - 1,
            "episode_id": "ep",
            "turn": 1023,  # an episode has at most 1024 turns
            "seed": 2**63 - 1024,
            "logprobs": True,
            "top_logprobs": 20,
        }
    )
    assert (req.top_k, req.turn, req.seed) == (2**31 - 1, 1023, 2**63 - 1024)


def test_episode_token_needs_an_episode():
    assert refusal(ChatCompletionRequest, {"messages": USER, "episode_token": "t"}) == ((), "value_error")


# --- the app's edge, without an engine -------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat_json(stop=["\ud83d"]), "stop"),
        (chat_json(messages=[{"role": "user", "content": "\ud83d"}]), "messages.0.content"),
        (chat_json(prompt_id="p\x00"), "prompt_id"),
        (chat_json(episode_id="e\x00"), "episode_id"),
        (chat_json(top_k=10**30), "top_k"),
        (chat_json(turn=2**63), "turn"),
        (chat_json(**{"stream_options": {"\ud800": 1}}), "stream_options"),
        (chat_json(logit_bias={"\ud800": 1}), "logit_bias"),
    ],
)
async def test_chat_edge_answers_400_invalid_value_naming_the_field(tmp_path, body, param):
    app = edge_app(tmp_path)
    r = await post_raw(app, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, "invalid_value", "invalid_request_error")
    assert (
        app.state.s.metrics.registry.get_sample_value(
            "saoserve_requests_failed_before_generation_total", {"reason": "invalid_request"}
        )
        == 1.0
    )


async def test_a_field_name_with_a_surrogate_is_a_clear_422(tmp_path):
    """A field name that is not UTF-8 is refused as such (pydantic checks the keys), not a 500."""
    r = await post_raw(
        edge_app(tmp_path),
        "/v1/feedback",
        json.dumps({"id": "c", "feedback_token": "t", "reward": 1, "\ud800": 1}).encode(),
    )
    err = r.json()["error"]
    assert (r.status_code, err["code"]) == (422, "invalid_value") and "unicode" in err["message"]


async def test_admin_bodies_and_parameters_are_bounded(tmp_path):
    app = edge_app(tmp_path)
    r = await post_raw(
        app,
        "/admin/load_policy",
        json.dumps({"version": 2**63, "path": "/v", "sha256": "0" * 64}).encode(),
        ADMIN,
    )
    assert (r.status_code, r.json()["error"]["param"]) == (400, "version")
    r = await post_raw(
        app,
        "/admin/load_policy",
        json.dumps({"version": 1, "path": "/v\x00", "sha256": "0" * 64}).encode(),
        ADMIN,
    )
    assert (r.status_code, r.json()["error"]["param"]) == (400, "path")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        r = await http.get("/admin/learner", params={"limit": 10**30}, headers=ADMIN)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "query.limit")
        r = await http.get("/admin/evidence", params={"top": 0}, headers=ADMIN)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "query.top")
        r = await http.get("/admin/trajectories/a%00b", headers=ADMIN)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "path.trajectory_id")


def test_body_limit_is_the_context_bound():
    # 2048 tokens × 128 bytes a token × 6 JSON bytes a byte + 64 KiB = 1,572,864 + 65,536.
    assert max_body_bytes(2048) == 1_638_400
    assert max_message_chars(2048) == 262_144


async def test_a_10_mb_message_is_413_before_the_route(tmp_path):
    app = edge_app(tmp_path)
    body = chat_json(messages=[{"role": "user", "content": "x" * 10_000_000}])
    r = await post_raw(app, "/v1/chat/completions", body)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    # The route never ran: not even the validation counter moved.
    assert (
        app.state.s.metrics.registry.get_sample_value(
            "saoserve_requests_failed_before_generation_total", {"reason": "invalid_request"}
        )
        is None
    )


async def test_a_chunked_body_over_the_limit_never_reaches_the_app():
    """Without Content-Length: the body is read (and dropped past the limit) to its end, then
    413; the app is never called."""
    reached, sent = [], []
    chunks = [b"x" * 400] * 5

    async def inner(scope, receive, send):
        reached.append(await receive())

    async def receive():
        body = chunks.pop()
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "headers": []}
    await BodySizeLimit(inner, max_bytes=1000)(scope, receive, send)
    # 5 × 400 = 2000 bytes > 1000: all five chunks read, then 413.
    assert (chunks, reached, sent[0]["status"]) == ([], [], 413)
    small = []

    async def one_chunk():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def keep(scope, receive, send):
        small.append(await receive())

    await BodySizeLimit(keep, max_bytes=1000)(scope, one_chunk, send)
    assert small == [{"type": "http.request", "body": b"{}", "more_body": False}]


def test_openapi_says_what_the_server_answers(tmp_path):
    spec = edge_app(tmp_path).openapi()
    err_ref = {"$ref": "#/components/schemas/ErrorResponse"}

    def schema(path, method, status):
        return spec["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]

    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and {"400", "403", "404", "409", "413", "503"} <= set(chat)
    assert schema("/v1/chat/completions", "post", "400") == err_ref
    assert schema("/v1/feedback", "post", "422") == err_ref
    assert {"403", "404", "409"} <= set(spec["paths"]["/v1/feedback"]["post"]["responses"])
    assert schema("/admin/load_policy", "post", "401") == err_ref
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    fb = spec["components"]["schemas"]["FeedbackRequest"]
    assert [[b["required"] for b in rule["oneOf"]] for rule in fb["allOf"]] == [
        [["id"], ["episode_id"]],
        [["reward"], ["thumbs"]],
    ]
    chat_schema = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat_schema["properties"]["messages"]["contains"]["properties"]["role"] == {"const": "user"}
    assert "episode_token" in chat_schema["properties"]


# --- the store: episode starts and turns in flight ------------------------------------------


def sqlite_store(tmp_path) -> ServerStore:
    url = f"sqlite:///{tmp_path / 's.db'}"
    migrate(url)
    return ServerStore(make_engine(url))


def test_episode_starts_once_and_later_turns_need_its_token(tmp_path):
    store = sqlite_store(tmp_path)
    assert store.start_episode_turn("ep", "c-0", token_ok=False).outcome == "ok"
    assert store.start_episode_turn("ep", "c-x", token_ok=False).outcome == "not_yours"
    # Turn 0 in flight: its number is taken, and no other turn starts before it is answered.
    assert store.start_episode_turn("ep", "c-1", token_ok=True).outcome == "in_progress"
    assert store.episode_state("ep").turns_in_flight == 1
    store.index_trajectory(record("c-0", "ep", "stop"), 0, 0)
    assert store.start_episode_turn("ep", "c-1", token_ok=True).turn == 1
    # An aborted turn's record is indexed, but holds no turn (its client got no answer): its
    # number is free for the retry, also where Fate's release did not come first.
    store.index_trajectory(record("c-1", "ep", "abort"), 0, 1)
    st = store.episode_state("ep")
    assert (st.prompt_id, st.not_whole_turns, st.turns_in_flight, st.turn_ids) == ("p-1", 0, 0, ("c-0",))
    assert store.find_trajectory("c-1").finish_reason == "abort"
    assert store.start_episode_turn("ep", "c-1b", token_ok=True).turn == 1
    store.index_trajectory(record("c-1b", "ep", "repetition"), 0, 2)
    # An answered turn that is not whole keeps its number: the episode cannot be rated.
    st = store.episode_state("ep")
    assert (st.not_whole_turns, st.turn_ids) == (1, ("c-0", "c-1b"))
    # Once the episode's feedback is claimed, it takes no more turns.
    assert store.claim("e:ep")
    assert store.start_episode_turn("ep", "c-2", token_ok=True).outcome == "rated"
    assert store.episode_state("ep").turns_in_flight == 0


# --- through the real server ----------------------------------------------------------------
