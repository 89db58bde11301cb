"""Contracts of the HTTP edge found by an adversarial tester, one test per member of each class
(docs/design.md §4, §8; docs/reliability.md, "The edge's contracts"):

1. episode turns are numbered 0, 1, 2... in order, each once (409 otherwise), and the joiner
   joins only the turns the episode's feedback lists;
2. a turn of an episode is rated only with its episode (409 ``rate_the_episode``, both orders);
3. a field the server does not do is 400 ``unsupported_parameter``, not ignored;
4. a body that is not a JSON object is 400 ``invalid_json`` on every route;
5. feedback errors name what they are about (completion or episode);
6. headers or a body trickled in (slowloris): tests/integration/test_read_timeouts.py;
7. an episode turn answered 503 whose record the log appends late is never one of the
   episode's turns, and its number can be sent again.

Here, with no engine: schemas, the app's edge with a fake state, the store and the feedback path
on SQLite, the join plan. The same through the real server, and the late append (a log that
answers "refused" and appends anyway) to the joiner: tests/integration/test_edge_contracts.py.
"""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import jsonschema
import pytest
from pydantic import ValidationError
from sqlalchemy import create_engine, text, update

from core.db import EpisodeTurn, make_engine, migrate
from core.limits import MAX_EPISODE_TURNS
from core.records import FeedbackRecord, feedback_token, utcnow
from learner.data.join_plan import JoinState
from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import ChatHandler
from server.feedback.serving import accept_feedback
from server.state import ServerState
from server.store import ServerStore, Slot, plan_turn
from testing.builders import episode_turns, fb, plan, read, record, tomb
from testing.edges import (
    CHAT,
    NOT_JSON,
    SECRET,
    USER,
    edge_app,
    episode_token,
    error_of,
    feedback,
    feedback_state,
    post_raw,
    refused,
)
from testing.logs import read_topic
from testing.servers import ADMIN, make_settings


def chat_body(**extra) -> bytes:
    return json.dumps({"messages": USER, **extra}).encode()


# --- 3. fields the server does not do --------------------------------------------------------

UNKNOWN = "a field that may change the answer is refused rather than ignored (null, [] or {} is accepted)"
JSON_MODE = "the answer would be plain text, not JSON (no JSON mode or structured output here)"
TOOLS = "the model would answer in plain text and call no tool (no tool calling here)"
PENALTY = "it would change the distribution the learner reproduces (only its neutral value is accepted)"


@pytest.mark.parametrize(
    ("extra", "param", "why"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format", JSON_MODE),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
            JSON_MODE,
        ),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", TOOLS),
        ({"tool_choice": "required"}, "tool_choice", TOOLS),
        ({"functions": [{"name": "f"}]}, "functions", TOOLS),
        ({"function_call": "auto"}, "function_call", TOOLS),
        ({"parallel_tool_calls": True}, "parallel_tool_calls", TOOLS),
        ({"min_tokens": 5}, "min_tokens", UNKNOWN),
        ({"min_tokens": 0}, "min_tokens", UNKNOWN),
        ({"min_p": 0.1}, "min_p", UNKNOWN),
        ({"repetition_penalty": 1.2}, "repetition_penalty", UNKNOWN),
        ({"ignore_eos": True}, "ignore_eos", UNKNOWN),
        ({"use_beam_search": True}, "use_beam_search", UNKNOWN),
        ({"guided_json": {"type": "object"}}, "guided_json", UNKNOWN),
        ({"reasoning_effort": "high"}, "reasoning_effort", UNKNOWN),
        ({"stop_token_ids": [2]}, "stop_token_ids", UNKNOWN),
        ({"presence_penalty": 0.5}, "presence_penalty", PENALTY),
        ({"logit_bias": {"42": 5}}, "logit_bias", PENALTY),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
                    {"role": "tool", "content": "42", "tool_call_id": "c"},
                ]
            },
            "messages.1.tool_calls",
            TOOLS,
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]},
            "messages.0.audio",
            UNKNOWN,
        ),
    ],
)
async def test_a_field_the_server_does_not_do_is_400_naming_it(tmp_path, extra, param, why):
    r = await post_raw(edge_app(tmp_path), CHAT, chat_body(**extra))
    name = param.split(".")[-1]
    assert error_of(r) == (
        400,
        "unsupported_parameter",
        param,
        f"{name} is not supported by this server: {why}",
    )


# What the clients of tests/system/test_clients.py send by default (recorded from each against a stub
# server): nothing beyond the declared fields. Plus OpenAI fields that change nothing here, and
# undeclared ones that ask for nothing.
ACCEPTED = [
    {"model": "m", "stream": False, "messages": USER, "max_completion_tokens": 12},  # LangChain
    {"model": "m", "stream": True, "messages": USER, "stream_options": {"include_usage": True}},
    {"model": "m", "messages": USER, "max_tokens": 12, "stream": True},  # LiteLLM
    {"model": "m", "messages": USER},  # the openai SDK
    {"messages": USER, "store": True, "metadata": {"team": "a"}, "service_tier": "auto"},
    {"messages": USER, "tools": [], "tool_choice": None, "response_format": None, "min_tokens": None},
    {"messages": USER, "presence_penalty": 0, "logit_bias": {}},
    {
        "messages": [
            {"role": "user", "content": "hi"},
            # An assistant message as the openai SDK's model_dump() gives it back.
            {"role": "assistant", "content": "hello", "refusal": None, "audio": None, "tool_calls": []},
            {"role": "user", "content": "more"},
        ]
    },
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_what_clients_send_is_accepted(body):
    ChatCompletionRequest.model_validate(body)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return edge_app(tmp_path_factory.mktemp("spec")).openapi()


def spec_accepts(spec: dict, body: dict) -> bool:
    schema = {"components": spec["components"], "$ref": "#/components/schemas/ChatCompletionRequest"}
    return jsonschema.Draft202012Validator(schema).is_valid(body)


def server_accepts(body: dict) -> bool:
    try:
        ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return False
    return True


SPEC_CASES = [
    *((b, True) for b in ACCEPTED),
    ({"messages": USER, "response_format": {"type": "json_object"}}, False),
    ({"messages": USER, "tools": [{"type": "function"}]}, False),
    ({"messages": USER, "min_tokens": 0}, False),
    ({"messages": USER, "metadata": {"a\x00": "b"}}, False),
    ({"messages": USER, "metadata": {"a": "b\x00"}}, False),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c"}]}]}, False),
    ({"messages": USER, "turn": 0}, False),
    ({"messages": USER, "turn": None}, True),
    ({"messages": USER, "turn": 0, "episode_id": "e"}, True),
    ({"messages": USER, "turn": 1023, "episode_id": "e"}, True),
    ({"messages": USER, "turn": 1024, "episode_id": "e"}, False),
]


@pytest.mark.parametrize(("body", "valid"), SPEC_CASES)
def test_the_spec_says_which_fields_are_refused(spec, body, valid):
    assert (spec_accepts(spec, body), server_accepts(body)) == (valid, valid)


# --- 4. a body that is not a JSON object -------------------------------------------------------

NOT_OBJECT = "request body is not a JSON object"


def post_routes(app) -> list[str]:
    return sorted(r.path for r in app.routes if "POST" in getattr(r, "methods", ()))


def test_every_post_route_is_checked(tmp_path):
    # The routes the parametrised test below posts to: every POST route the app has.
    assert {CHAT, "/v1/feedback", "/admin/load_policy", "/admin/rollback", "/admin/pause"} <= set(
        post_routes(edge_app(tmp_path))
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"messages": [', NOT_JSON),
        (b"{'id': 'c'}", NOT_JSON),
        (b'{"id": "c"} trailing', NOT_JSON),
        (b"\xff\xfe{}", NOT_JSON),  # not UTF-8
        (b"[" * 100_000 + b"]" * 100_000, "request body is not valid JSON: nested too deeply"),
        (b"[]", NOT_OBJECT),
        (b'"x"', NOT_OBJECT),
        (b"null", NOT_OBJECT),
        (b"42", NOT_OBJECT),
    ],
)
async def test_a_body_that_is_not_a_json_object_is_400_on_every_post_route(tmp_path, body, message):
    """One rule, before any route runs (the fake state has no store: a route that ran, such as
    /admin/pause which takes no body, would fail with 500)."""
    app = edge_app(tmp_path)
    for path in post_routes(app):
        r = await post_raw(app, path, body, ADMIN)
        assert error_of(r) == (400, "invalid_json", None, message), path


@pytest.mark.parametrize("path", [CHAT, "/v1/feedback", "/admin/load_policy", "/admin/rollback"])
async def test_a_missing_or_mistyped_body_is_400_invalid_json(tmp_path, path):
    app = edge_app(tmp_path)
    r = await post_raw(app, path, b"", ADMIN)
    assert error_of(r) == (400, "invalid_json", None, NOT_OBJECT)
    r = await post_raw(app, path, b'{"version": 1}', {**ADMIN, "content-type": "text/plain"})
    assert error_of(r) == (
        400,
        "invalid_json",
        None,
        "request body is not a JSON object (sent as 'text/plain', not application/json)",
    )


async def test_a_bad_field_keeps_its_route_status(tmp_path):
    """Fields, not syntax: 400 for chat and admin (OpenAI's status), 422 for feedback (docs/design.md §4)."""
    app = edge_app(tmp_path)
    r = await post_raw(app, "/v1/feedback", b'{"id": "c", "feedback_token": "t", "reward": 2}')
    assert error_of(r) == (
        422,
        "invalid_value",
        None,
        "body: Value error, reward must be a finite number in [0, 1]",
    )
    r = await post_raw(app, CHAT, chat_body(max_tokens=0))
    assert error_of(r) == (
        400,
        "invalid_value",
        "max_tokens",
        "max_tokens: Input should be greater than or equal to 1",
    )
    r = await post_raw(app, "/admin/rollback", b'{"version": -1}', ADMIN)
    assert error_of(r) == (
        400,
        "invalid_value",
        "version",
        "version: Input should be greater than or equal to 0",
    )


# --- 1. turn numbers: the schema and the store -------------------------------------------------


async def test_a_turn_without_an_episode_is_400(tmp_path):
    r = await post_raw(edge_app(tmp_path), CHAT, chat_body(turn=0))
    assert error_of(r) == (
        400,
        "invalid_value",
        "turn",
        "turn: turn needs episode_id: a turn number belongs to an episode",
    )


def sqlite_store(tmp_path) -> ServerStore:
    url = f"sqlite:///{tmp_path / 's.db'}"
    migrate(url)
    return ServerStore(make_engine(url))


async def turn_of(s, ep: str, cid: str, turn: int | None, token: bool = True) -> int:
    """``server.chat.serving.ChatHandler.start_episode_turn`` (``s``'s settings and store) for a chat on
    ``ep`` (with its token unless ``token`` is False): the turn's number, or ApiError."""
    body = {"messages": USER, "episode_id": ep, "turn": turn}
    if token:
        body["episode_token"] = episode_token(ep)
    handler = ChatHandler(
        s.settings, None, s.store, None, open_fate=None, dispatch=None, require_storage=None
    )
    return await handler.start_episode_turn(ChatCompletionRequest.model_validate(body), cid)


async def test_turns_are_numbered_in_order_each_once(tmp_path):
    s = SimpleNamespace(settings=make_settings(tmp_path), store=sqlite_store(tmp_path))
    # A new episode starts at turn 0.
    assert await refused(turn_of(s, "e1", "c-x", 2, token=False)) == (
        409,
        "turn_out_of_order",
        "turn",
        "turn 2 of episode 'e1' is out of order: turns are numbered 0, 1, 2... in order, and the next turn is 0",
    )
    assert await turn_of(s, "e1", "c-0", 0, token=False) == 0
    # Turn 0 in flight: its number is taken, and turn 1 waits for its answer.
    assert await refused(turn_of(s, "e1", "c-y", 0)) == (
        409,
        "duplicate_turn",
        "turn",
        "turn 0 of episode 'e1' is already in progress: each turn number is used once (the next turn is 1)",
    )
    in_progress = (
        409,
        "episode_in_progress",
        "turn",
        "episode 'e1' has turn 0 in progress: send turn 1 once its answer is complete",
    )
    assert await refused(turn_of(s, "e1", "c-y", 1)) == in_progress
    assert await refused(turn_of(s, "e1", "c-y", None)) == in_progress
    s.store.index_trajectory(record("c-0", "e1", "stop"), 0, 0)
    assert await refused(turn_of(s, "e1", "c-y", 0)) == (
        409,
        "duplicate_turn",
        "turn",
        "turn 0 of episode 'e1' is already answered: each turn number is used once (the next turn is 1)",
    )
    assert await refused(turn_of(s, "e1", "c-y", 3)) == (
        409,
        "turn_out_of_order",
        "turn",
        "turn 3 of episode 'e1' is out of order: turns are numbered 0, 1, 2... in order, and the next turn is 1",
    )
    assert await turn_of(s, "e1", "c-1", 1) == 1
    # Turn 1 failed before its record (503): its number is free again.
    s.store.release_turn("c-1")
    assert await turn_of(s, "e1", "c-1b", 1) == 1
    s.store.index_trajectory(record("c-1b", "e1", "stop"), 0, 1)
    # Without a number, the next one.
    assert await turn_of(s, "e1", "c-2", None) == 2
    s.store.index_trajectory(record("c-2", "e1", "length"), 0, 2)
    assert s.store.episode_state("e1").turn_ids == ("c-0", "c-1b", "c-2")
    # Someone else's turn is 403 whatever its number (nothing said about the episode's turns).
    for turn in (0, 3, None):
        status, code, *_ = await refused(turn_of(s, "e1", "c-z", turn, token=False))
        assert (status, code) == (403, "episode_not_yours")


async def test_a_failed_first_turn_leaves_no_episode(tmp_path):
    """A first turn answered 503 gave the client no token: the episode is forgotten, so the same
    id can start it again."""
    s = SimpleNamespace(settings=make_settings(tmp_path), store=sqlite_store(tmp_path))
    assert await turn_of(s, "e2", "c-0", 0, token=False) == 0
    s.store.release_turn("c-0")
    assert await turn_of(s, "e2", "c-0b", None, token=False) == 0
    # A logged turn is never released.
    s.store.index_trajectory(record("c-0b", "e2", "stop"), 0, 0)
    s.store.release_turn("c-0b")
    assert s.store.episode_state("e2").turn_ids == ("c-0b",)


async def test_a_turn_stuck_in_flight_past_the_timeout_can_be_sent_again(tmp_path):
    s = SimpleNamespace(settings=make_settings(tmp_path), store=sqlite_store(tmp_path))
    assert await turn_of(s, "e3", "c-0", 0, token=False) == 0
    with s.store.engine.begin() as conn:  # the server died while answering it, 6 minutes ago
        conn.execute(update(EpisodeTurn).values(dispatched_at=utcnow() - timedelta(minutes=6)))
    assert s.store.episode_state("e3").turns_in_flight == 0
    assert await turn_of(s, "e3", "c-0b", 0) == 0
    # The old request's record, logged late, does not take the number back.
    s.store.index_trajectory(record("c-0", "e3", "stop"), 0, 0)
    s.store.index_trajectory(record("c-0b", "e3", "stop"), 0, 1)
    assert s.store.episode_state("e3").turn_ids == ("c-0b",)


def test_an_episode_has_at_most_1024_turns():
    now = utcnow()
    full = [Slot(t, f"c-{t}", now, now) for t in range(MAX_EPISODE_TURNS)]
    assert plan_turn(full, None, now).outcome == "full"
    assert plan_turn(full[:-1], None, now).turn == MAX_EPISODE_TURNS - 1


def test_the_migration_numbers_the_turns_already_logged(tmp_path):
    """Revision 0006 backfills one turn per (episode, number) from the trajectory index: the
    first id of a duplicated number, none for a turn logged without one (revision 0010 repairs
    both: tests/unit/core/test_migrations.py)."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    migrate(url, "0005")
    eng = create_engine(url)
    rows = [("a0", "ep", 0), ("a1", "ep", 1), ("b1", "ep", 1), ("n", "ep", None), ("x", None, None)]
    with eng.begin() as conn:
        for tid, ep, turn in rows:
            conn.execute(
                text(
                    "INSERT INTO trajectory_index (id, prompt_id, episode_id, turn, dispatch_version, last_version,"
                    " n_response_tokens, finish_reason, log_partition, log_offset, created_at)"
                    " VALUES (:id, 'p', :ep, :turn, 0, 0, 1, 'stop', 0, 0, '2026-11-30 12:00:00')"
                ),
                {"id": tid, "ep": ep, "turn": turn},
            )
    migrate(url, "0006")
    with eng.connect() as conn:
        got = conn.execute(
            text("SELECT episode_id, turn, trajectory_id FROM episode_turns ORDER BY turn")
        ).all()
    eng.dispose()
    assert [tuple(r) for r in got] == [("ep", 0, "a0"), ("ep", 1, "a1")]
    assert ServerStore(make_engine(url)).episode_state("ep").turn_ids == ("a0", "a1")


# --- 1, 7. the joiner joins the turns the feedback lists ----------------------------------------


def listed(ids: list[str] | None, reward: float = 1.0) -> FeedbackRecord:
    return fb(episode="E", prompt_id="q", reward=reward).model_copy(update={"turn_ids": ids})


def test_an_unlisted_turn_is_void_and_never_joined():
    """Turn 1 answered 503 and appended late (E1p), then sent again (E1): the feedback lists
    E0 and E1, the only turns in the sample."""
    t0, t1 = episode_turns()
    phantom = t1.model_copy(update={"id": "E1p", "response_token_ids": [5], "rollout_logprobs": [-9.0]})
    p = plan(read(t0, phantom, t1, listed(["E0", "E1"])))
    [s] = p.samples
    assert (s.id, s.input_ids, s.actions, s.rollout_logprobs) == (
        "e:E",
        [1, 2, 3, 4, 7, 8, 9],
        [(2, 4), (6, 7)],
        [-0.1, -0.2, -0.3],
    )
    assert p.counters == {"void_episode_turns": 1}
    assert p.inserts == [tomb("E0", "q"), tomb("E1", "q"), tomb("e:E", "q")]
    # The phantom pending from an earlier read is deleted with the turns it came with.
    p = plan(read(listed(["E0", "E1"])), JoinState(trajectories={"E0": t0, "E1p": phantom, "E1": t1}))
    assert [s.id for s in p.samples] == ["e:E"] and p.counters == {"void_episode_turns": 1}
    assert sorted(p.deletes) == [("E0", "trajectory"), ("E1", "trajectory"), ("E1p", "trajectory")]


def test_a_listed_turn_that_is_gone_leaves_the_episode_untrained():
    _, t1 = episode_turns()  # E0 expired while it waited
    p = plan(read(t1, listed(["E0", "E1"])))
    assert p.samples == [] and p.results == [] and p.counters == {"episode_turns_missing": 1}
    assert p.inserts == [tomb("E1", "q"), tomb("e:E", "q")]
    assert plan(read(t1, listed([]))).counters == {"episode_feedback_without_turns": 1}


@pytest.mark.parametrize(
    ("turns", "joined"),
    [
        ((0, 1), True),
        ((0, 0), False),
        ((1, 1), False),
        ((0, 2), False),
        ((1, 2), False),
        ((None, 1), False),
        ((None, None), False),
    ],
)
def test_feedback_logged_before_turn_ids_joins_only_turns_numbered_0_to_n(turns, joined):
    t0, t1 = episode_turns()
    t0, t1 = t0.model_copy(update={"turn": turns[0]}), t1.model_copy(update={"turn": turns[1]})
    p = plan(read(t1, t0, listed(None)))  # in the log's order, not the turns'
    assert [s.id for s in p.samples] == (["e:E"] if joined else [])
    assert p.counters == ({} if joined else {"episode_turns_misnumbered": 1})


def test_turn_ids_belong_to_episode_feedback():
    with pytest.raises(ValidationError, match="turn_ids belong to episode feedback"):
        FeedbackRecord.model_validate({**json.loads(fb().to_json()), "turn_ids": ["t1"]})


# --- 2, 5. feedback on an episode, and what its errors say ---------------------------------------


def logged_episode(s: ServerState, ep: str, ids: list[str]) -> None:
    s.store.start_episode_turn(ep, ids[0], token_ok=False)
    for i, tid in enumerate(ids):
        if i:
            s.store.start_episode_turn(ep, tid, token_ok=True)
        s.store.index_trajectory(record(tid, ep, "stop"), 0, i)


@pytest.mark.parametrize("episode_first", [True, False])
async def test_a_turn_is_rated_only_with_its_episode_in_both_orders(tmp_path, episode_first):
    s = feedback_state(tmp_path)
    logged_episode(s, "ep", ["c-0", "c-1"])
    by_turn = feedback(id="c-1", feedback_token=feedback_token(SECRET, "c-1"))
    by_episode = feedback(episode_id="ep", feedback_token=episode_token("ep"), reward=0.5)
    turn_refused = (
        409,
        "rate_the_episode",
        "id",
        "completion 'c-1' is turn 0 of episode 'ep': an episode is rated as a whole, with episode_id "
        "and its episode_feedback_token, never turn by turn",
    )
    if episode_first:
        assert (await accept_feedback(s, by_episode)).target == "e:ep"
        assert await refused(accept_feedback(s, by_turn)) == turn_refused
    else:
        assert await refused(accept_feedback(s, by_turn)) == turn_refused
        assert (await accept_feedback(s, by_episode)).target == "e:ep"
    # One feedback record, the episode's, listing its turns in order.
    [entry] = read_topic(s.log, "feedback")
    rec = FeedbackRecord.model_validate_json(entry.value)
    assert (rec.episode_id, rec.trajectory_id, rec.reward, rec.turn_ids) == ("ep", None, 0.5, ["c-0", "c-1"])
    assert s.metrics.registry.get_sample_value("saoserve_feedback_total", {"result": "episode_turn"}) == 1.0


async def test_feedback_errors_name_the_completion_or_the_episode(tmp_path):
    s = feedback_state(tmp_path)
    s.store.index_trajectory(record("c-9", None, "stop"), 0, 9)
    s.store.index_trajectory(record("c-ab", None, "abort"), 0, 10)
    logged_episode(s, "ep", ["c-0"])
    wrong = feedback_token(SECRET, "someone-else")
    assert await refused(accept_feedback(s, feedback(id="c-9", feedback_token=wrong))) == (
        403,
        None,
        "feedback_token",
        "feedback_token does not match completion 'c-9'",
    )
    assert await refused(accept_feedback(s, feedback(episode_id="ep", feedback_token=wrong))) == (
        403,
        None,
        "feedback_token",
        "feedback_token does not match episode 'ep' (an episode is rated with its episode_feedback_token)",
    )
    assert await refused(accept_feedback(s, feedback(id="c-nope", feedback_token=wrong))) == (
        404,
        "not_found",
        "id",
        "no completion with id 'c-nope'",
    )
    assert await refused(accept_feedback(s, feedback(episode_id="ep-nope", feedback_token=wrong))) == (
        404,
        "not_found",
        "episode_id",
        "no episode with id 'ep-nope'",
    )
    assert await refused(
        accept_feedback(s, feedback(id="c-ab", feedback_token=feedback_token(SECRET, "c-ab")))
    ) == (
        409,
        "not_a_whole_answer",
        None,
        "completion 'c-ab' ended with finish_reason 'abort': not a whole answer, feedback refused",
    )
    await accept_feedback(s, feedback(id="c-9", feedback_token=feedback_token(SECRET, "c-9")))
    assert await refused(
        accept_feedback(s, feedback(id="c-9", feedback_token=feedback_token(SECRET, "c-9")))
    ) == (
        409,
        "conflict",
        None,
        "feedback was already given for completion 'c-9' (first wins)",
    )
    # The episode: a turn in flight, then a turn that is not whole, then rated twice.
    s.store.start_episode_turn("ep", "c-1", token_ok=True)
    rate = feedback(episode_id="ep", feedback_token=episode_token("ep"))
    assert await refused(accept_feedback(s, rate)) == (
        409,
        "episode_in_progress",
        "episode_id",
        "episode 'ep' has a turn in progress; rate it once its last answer is whole",
    )
    # A failed turn (its client got no answer) frees its number; its retry answered, not whole.
    s.store.index_trajectory(record("c-1", "ep", "error"), 0, 1)
    assert s.store.start_episode_turn("ep", "c-1b", token_ok=True).turn == 1
    s.store.index_trajectory(record("c-1b", "ep", "repetition"), 0, 2)
    assert await refused(accept_feedback(s, rate)) == (
        409,
        "not_a_whole_answer",
        None,
        "episode 'ep' has 1 answered turn(s) that did not end whole: not a whole answer, feedback refused",
    )
    logged_episode(s, "ep2", ["d-0"])
    rate2 = feedback(episode_id="ep2", feedback_token=episode_token("ep2"))
    await accept_feedback(s, rate2)
    assert await refused(accept_feedback(s, rate2)) == (
        409,
        "conflict",
        None,
        "feedback was already given for episode 'ep2' (first wins)",
    )


# --- through the real server ----------------------------------------------------------------------
