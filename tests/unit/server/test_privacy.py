"""Privacy controls (docs/privacy.md): the opt-out of training (``store: false``), retention
(``saoserve retention``) and forgetting a user (``saoserve admin forget``).

Pure tier (this file): the record and request fields, the samples and the join plan (opted out:
no sample, no evidence; forgotten: dropped as read). SQLite tier (no engine), in
tests/unit/core/test_privacy_storage.py: retention and forget on a real database and SQL log, with the
joiner reading before and after, the retention cutoff, the ``retention`` command and the Kafka
topics' retention in deploy/. Engine tier, in tests/integration/test_privacy_server.py: the same through the
real server, its admin route and the CLI, on SQLite and on PostgreSQL with a Kafka (tansu) log.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from core.records import TrajectoryRecord
from learner.data.join_plan import JoinState
from learner.data.samples import NotWholeAnswer, OptedOut, episode_sample, single_turn_sample
from server.auth import ANONYMOUS, Caller
from server.chat.protocol import ChatCompletionRequest
from server.chat.serving import trains
from testing.builders import episode_turns, fb, plan, read, tomb, traj
from testing.edges import chat_json, edge_app, post_raw
from testing.servers import ADMIN

USER_MSG = [{"role": "user", "content": "hi"}]


# ------------------------------------------------------------------ records and requests
def test_records_logged_before_the_fields_are_trained_and_have_no_user():
    old = json.loads(traj().to_json())
    del old["train"], old["user"]
    rec = TrajectoryRecord.model_validate_json(json.dumps(old))
    assert (rec.train, rec.user) == (True, None)
    opted = traj(train=False, user="alice")
    assert TrajectoryRecord.model_validate_json(opted.to_json()) == opted


def test_store_false_or_an_opted_out_key_opts_out_and_nothing_else_does():
    def req(**kw) -> ChatCompletionRequest:
        return ChatCompletionRequest(messages=USER_MSG, **kw)

    stores = [{}, {"store": True}, {"store": None}, {"store": False}]
    assert [trains(req(**kw), ANONYMOUS) for kw in stores] == [True, True, True, False]
    keyed = Caller(key_id="k00000000000000aa", tenant="acme")
    assert [trains(req(**kw), keyed) for kw in stores] == [True, True, True, False]
    # A key opted out of training: no request field opts its answers back in.
    opted = Caller(key_id="k00000000000000bb", tenant="acme", train=False)
    assert [trains(req(**kw), opted) for kw in stores] == [False, False, False, False]
    assert req(user="alice").user == "alice"


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"store": 0}, "store: Value error, must be true or false"),
        ({"store": "false"}, "store: Value error, must be true or false"),
        ({"user": "x" * 257}, "user: String should have at most 256 characters"),
        ({"user": "a\x00b"}, "user: contains a NUL character (U+0000), which cannot be stored"),
    ],
)
async def test_a_bad_store_or_user_is_400_naming_the_field(tmp_path, extra, message):
    r = await post_raw(edge_app(tmp_path), "/v1/chat/completions", chat_json(**extra))
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"], err["message"]) == (
        400,
        "invalid_value",
        next(iter(extra)),
        message,
    )


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({}, None, "body: Value error, give exactly one of user and key"),
        (
            {"user": "alice", "key": "k0123456789abcdef"},
            None,
            "body: Value error, give exactly one of user and key",
        ),
        ({"key": "sao-k0123456789abcdef.00"}, "key", "key: String should match pattern '^k[0-9a-f]{16}$'"),
        ({"user": ""}, "user", "user: String should have at least 1 character"),
        ({"user": "u" * 257}, "user", "user: String should have at most 256 characters"),
        ({"user": 3}, "user", "user: Input should be a valid string"),
        ({"user": "alice", "all": True}, "all", "all: Extra inputs are not permitted"),
    ],
)
async def test_a_bad_forget_request_is_400_naming_the_field(tmp_path, body, param, message):
    r = await post_raw(edge_app(tmp_path), "/admin/forget", json.dumps(body).encode(), ADMIN)
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"], err["message"]) == (
        400,
        "invalid_value",
        param,
        message,
    )


async def test_forget_needs_the_admin_key(tmp_path):
    r = await post_raw(edge_app(tmp_path), "/admin/forget", b'{"user": "alice"}')
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# ------------------------------------------------------------------ samples and the join plan
def test_an_opted_out_trajectory_is_not_learnable_and_the_opt_out_is_the_reason():
    with pytest.raises(OptedOut, match="excluded_opted_out"):
        single_turn_sample(traj(train=False), 1.0)
    # Aborted and opted out: the opt-out names the reason.
    with pytest.raises(OptedOut):
        single_turn_sample(traj(train=False, finish_reason="abort"), 1.0)
    t0, t1 = episode_turns()
    with pytest.raises(OptedOut):
        episode_sample("E", [t0.model_copy(update={"train": False}), t1], 1.0)
    with pytest.raises(OptedOut):
        episode_sample(
            "E",
            [t0.model_copy(update={"finish_reason": "abort"}), t1.model_copy(update={"train": False})],
            1.0,
        )
    with pytest.raises(NotWholeAnswer):
        episode_sample("E", [t0.model_copy(update={"finish_reason": "abort"}), t1], 1.0)


def test_opted_out_feedback_is_joined_once_but_makes_no_sample_and_no_evidence():
    p = plan(read(traj("o", train=False), fb("o", 1.0), traj("t2"), fb("t2", 0.5)))
    assert [(s.id, s.reward) for s in p.samples] == [("t2", 0.5)]
    assert p.results == [("p", 0.5, 2)]  # t2 only: the opted-out reward is no evidence
    assert p.counters == {"excluded_opted_out": 1}
    # Joined like any other (a second feedback is a duplicate, not a new pending row).
    assert p.inserts == [tomb("o"), tomb("t2")]


def test_an_episode_with_an_opted_out_turn_makes_no_sample_and_no_evidence():
    t0, t1 = episode_turns()
    p = plan(read(t0, t1.model_copy(update={"train": False}), fb(episode="E", prompt_id="q")))
    assert p.samples == [] and p.results == []
    assert p.counters == {"excluded_opted_out": 1}


def test_forgotten_records_are_dropped_as_they_are_read():
    t0, t1 = episode_turns()
    unconfirmed = fb("u", 1.0).model_copy(update={"feedback_id": "f-u"})
    state = JoinState(
        forgotten=frozenset({"gone", "late", "e:E", "u"}),
        unconfirmed={"f-u": unconfirmed},
        claims={"t:u": None},
    )
    p = plan(
        read(traj("gone"), fb("gone"), fb("late"), t0, t1, fb(episode="E", prompt_id="q"), traj("kept")),
        state,
    )
    # gone + its feedback, late's feedback, two turns and the episode's feedback, u's feedback.
    assert p.counters == {"forgotten": 7}
    assert p.samples == [] and p.results == []
    # Nothing forgotten waits: only "kept" is pending; the held feedback of "u" is deleted.
    assert [(r.key, r.kind) for r in p.inserts] == [("kept", "trajectory")]
    assert p.deletes == [("f-u", "unconfirmed")]


@hyp_settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=8))
def test_no_sample_or_evidence_ever_comes_from_an_opted_out_or_forgotten_record(flags):
    """flags[i] = (opted out, forgotten, rated) of trajectory i, feedback right after it."""
    recs, forgotten = [], set()
    for i, (opted, gone, rated) in enumerate(flags):
        recs.append(traj(f"t{i}", train=not opted))
        if rated:
            recs.append(fb(f"t{i}", 1.0))
        if gone:
            forgotten.add(f"t{i}")
    p = plan(read(*recs), JoinState(forgotten=frozenset(forgotten)))
    trained = {f"t{i}" for i, (opted, gone, rated) in enumerate(flags) if rated and not opted and not gone}
    assert {s.id for s in p.samples} == trained and len(p.results) == len(trained)
    assert p.counters.get("excluded_opted_out", 0) == sum(o and r and not g for o, g, r in flags)
    assert p.counters.get("forgotten", 0) == sum(g * (1 + r) for _, g, r in flags)
