"""The joiner's pure plan (learner/data/join_plan.py): hand-made records, no database, no engine."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.logbus import LogEntry
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord
from learner.data.join_plan import TOMBSTONE_TTL, JoinPlan, JoinState, PendingRow, Records
from testing.builders import EXPIRE_S, NOW, episode_turns, fb, plan, read, sent, tomb, traj


def test_trajectory_then_feedback_in_one_read():
    p = plan(read(traj(), fb(reward=1.0)))
    [s] = p.samples
    assert s.id == "t1" and s.prompt_id == "p"
    assert s.input_ids == [1, 2, 3, 4, 5] and s.actions == [(3, 5)]
    assert s.rollout_logprobs == [-0.5, -0.25] and s.token_versions == [2, 2]
    assert (s.temperature, s.reward, s.baseline_value, s.result_version) == (0.8, 1.0, 0.5, 2)
    assert p.results == [("p", 1.0, 2)]
    assert p.inserts == [tomb("t1")] and p.deletes == [] and p.expired == []
    assert p.counters == {}
    assert p.offsets == {(TOPIC_TRAJECTORIES, 0): 1, (TOPIC_FEEDBACK, 0): 1}
    assert p.forget_joined_before == NOW - timedelta(days=2) == NOW - TOMBSTONE_TTL


def test_feedback_before_trajectory_waits_then_joins_with_its_reward():
    first = fb(reward=0.25)
    p1 = plan(read(first))
    assert p1.samples == [] and p1.results == [] and p1.counters == {}
    assert p1.inserts == [PendingRow("t1", "feedback", "p", first.to_json().decode(), NOW)]
    p2 = plan(read(traj()), JoinState(feedback={"t1": first}))
    assert [(s.id, s.reward) for s in p2.samples] == [("t1", 0.25)]
    assert p2.deletes == [("t1", "feedback")] and p2.inserts == [tomb("t1")]
    assert p2.results == [("p", 0.25, 2)] and p2.offsets == {(TOPIC_TRAJECTORIES, 0): 1}


def test_trajectory_waits_then_joins_with_later_feedback():
    rec = traj(created_at=NOW - timedelta(minutes=5))
    p1 = plan(read(rec))
    assert p1.inserts == [
        PendingRow("t1", "trajectory", "p", rec.to_json().decode(), NOW - timedelta(minutes=5))
    ]
    p2 = plan(read(fb(reward=0.0)), JoinState(trajectories={"t1": rec}))
    assert [(s.id, s.reward) for s in p2.samples] == [("t1", 0.0)]
    assert p2.deletes == [("t1", "trajectory")] and p2.inserts == [tomb("t1")]
    assert p2.results == [("p", 0.0, 2)]


def test_duplicate_trajectories_are_ignored():
    # A copy of a joined trajectory (tombstone), of a pending one, and two copies in one read.
    p = plan(
        read(traj("t1"), traj("t2"), traj("t3"), traj("t3")),
        JoinState(joined=frozenset({"t1"}), trajectories={"t2": traj("t2")}),
    )
    assert p.counters == {"duplicate_trajectories": 3}
    assert [r.key for r in p.inserts] == ["t3"] and p.samples == []


def test_a_copy_after_joining_pending_feedback_is_a_duplicate():
    # The first copy joins the waiting feedback; the second must not make a second sample.
    p = plan(read(traj(), traj()), JoinState(feedback={"t1": fb()}))
    assert [s.id for s in p.samples] == ["t1"] and p.counters == {"duplicate_trajectories": 1}
    assert p.inserts == [tomb("t1")] and p.deletes == [("t1", "feedback")]


def test_second_feedback_loses_to_the_first():
    p = plan(read(traj(), fb(reward=1.0), fb(reward=0.0)))
    assert [s.reward for s in p.samples] == [1.0] and p.results == [("p", 1.0, 2)]
    assert p.counters == {"duplicate_feedback": 1}
    # After the join: the tombstone refuses it.
    p = plan(read(fb(reward=0.0)), JoinState(joined=frozenset({"t1"})))
    assert p.samples == [] and p.inserts == [] and p.counters == {"duplicate_feedback": 1}


def test_second_feedback_while_the_first_waits():
    first = fb(reward=1.0)
    p = plan(read(first, fb(reward=0.0)))
    assert p.inserts == [PendingRow("t1", "feedback", "p", first.to_json().decode(), NOW)]
    assert p.counters == {"duplicate_feedback": 1}
    p = plan(read(fb(reward=0.0)), JoinState(feedback={"t1": first}))
    assert p.inserts == [] and p.counters == {"duplicate_feedback": 1}


def unconfirmed(rec: FeedbackRecord) -> PendingRow:
    return PendingRow(rec.feedback_id, "unconfirmed", rec.prompt_id, rec.to_json().decode(), rec.received_at)


@pytest.mark.parametrize("a_first", [True, False])
def test_the_confirmed_feedback_is_trained_not_the_one_answered_503(a_first):
    # Issue 13 item 3: A (0.0) answered 503, its claim released, yet appended late; the retry
    # B (1.0) answered 202, its claim marked with B's id. Trained: 1.0; A void.
    a, b = sent("A", reward=0.0), sent("B", reward=1.0)
    claims = {"t:t1": "B"}
    p = plan(read(traj(), *((a, b) if a_first else (b, a))), JoinState(claims=claims))
    assert [s.reward for s in p.samples] == [1.0] and p.results == [("p", 1.0, 2)]
    assert p.counters == {"void_feedback": 1} and p.inserts == [tomb("t1")]
    # Across polls: A read while B's claim is still unmarked waits; B marked joins, A void.
    p1 = plan(read(traj(), a), JoinState(claims={"t:t1": None}))
    assert p1.samples == [] and p1.counters == {}
    assert p1.inserts == [unconfirmed(a), PendingRow("t1", "trajectory", "p", traj().to_json().decode(), NOW)]
    p2 = plan(read(b), JoinState(trajectories={"t1": traj()}, unconfirmed={"A": a}, claims=claims))
    assert [s.reward for s in p2.samples] == [1.0] and p2.counters == {"void_feedback": 1}
    assert p2.deletes == [("A", "unconfirmed"), ("t1", "trajectory")] and p2.inserts == [tomb("t1")]
    # B joined first: A, read later, is void (not a duplicate), and trains nothing.
    p3 = plan(read(a), JoinState(joined=frozenset({"t1"}), claims=claims))
    assert p3.samples == [] and p3.inserts == [] and p3.counters == {"void_feedback": 1}


def test_feedback_waits_until_its_claim_is_marked():
    b = sent("B", reward=0.5)
    p1 = plan(read(traj(), b, b), JoinState(claims={"t:t1": None}))
    # The re-sent copy of a waiting record is a duplicate, one row waits.
    assert p1.samples == [] and p1.counters == {"duplicate_feedback": 1}
    assert [(r.key, r.kind) for r in p1.inserts] == [("B", "unconfirmed"), ("t1", "trajectory")]
    # Nothing new read: still unmarked, it keeps waiting; marked, it joins.
    state = JoinState(trajectories={"t1": traj()}, unconfirmed={"B": b}, claims={"t:t1": None})
    p2 = plan(read(), state)
    assert p2.samples == [] and p2.inserts == [] and p2.deletes == [] and p2.counters == {}
    p3 = plan(read(), JoinState(trajectories={"t1": traj()}, unconfirmed={"B": b}, claims={"t:t1": "B"}))
    assert [s.reward for s in p3.samples] == [0.5] and p3.results == [("p", 0.5, 2)]
    assert p3.deletes == [("B", "unconfirmed"), ("t1", "trajectory")] and p3.counters == {}
    # A re-sent copy read while the record waits, or in the poll that confirms it: one sample.
    p4 = plan(read(b), state)
    assert p4.inserts == [] and p4.deletes == [] and p4.counters == {"duplicate_feedback": 1}
    p5 = plan(read(b), JoinState(trajectories={"t1": traj()}, unconfirmed={"B": b}, claims={"t:t1": "B"}))
    assert [s.reward for s in p5.samples] == [0.5] and p5.counters == {"duplicate_feedback": 1}


def test_feedback_without_a_claim_is_void_and_unmarked_feedback_expires():
    a = sent("A")
    p = plan(read(traj(), a))
    assert p.samples == [] and p.counters == {"void_feedback": 1}
    assert [(r.key, r.kind) for r in p.inserts] == [("t1", "trajectory")]
    # Received 2 h ago with expire_s = 1 h, its claim never marked (a server crash, no 202).
    old = a.model_copy(update={"received_at": NOW - timedelta(hours=2)})
    p = plan(read(), JoinState(unconfirmed={"A": old}, claims={"t:t1": None}))
    assert p.deletes == [("A", "unconfirmed")] and p.counters == {"expired_feedback": 1}
    p = plan(read(old), JoinState(claims={"t:t1": None}))
    assert p.inserts == [] and p.counters == {"expired_feedback": 1}
    # An id longer than a pending row's key (64) is not the server's: malformed.
    too_long = a.model_copy(update={"feedback_id": "x" * 65}).to_json()
    assert plan(read((TOPIC_FEEDBACK, too_long))).counters == {"malformed_feedback": 1}


@pytest.mark.parametrize("a_first", [True, False])
def test_episode_feedback_trains_the_confirmed_record(a_first):
    t0, t1 = episode_turns()
    a, b = (
        sent("A", episode="E", prompt_id="q", reward=0.0),
        sent("B", episode="E", prompt_id="q", reward=1.0),
    )
    p = plan(read(t0, t1, *((a, b) if a_first else (b, a))), JoinState(claims={"e:E": "B"}))
    assert [(s.id, s.reward) for s in p.samples] == [("e:E", 1.0)] and p.results == [("q", 1.0, 5)]
    assert p.counters == {"void_feedback": 1}
    # Unmarked: it waits with the turns, then joins them once marked.
    p1 = plan(read(t0, t1, b), JoinState(claims={"e:E": None}))
    assert sorted((r.key, r.kind) for r in p1.inserts) == [
        ("B", "unconfirmed"),
        ("E0", "trajectory"),
        ("E1", "trajectory"),
    ]
    p2 = plan(read(), JoinState(trajectories={"E0": t0, "E1": t1}, unconfirmed={"B": b}, claims={"e:E": "B"}))
    assert [(s.id, s.reward) for s in p2.samples] == [("e:E", 1.0)]
    assert sorted(p2.deletes) == [("B", "unconfirmed"), ("E0", "trajectory"), ("E1", "trajectory")]


@pytest.mark.parametrize(
    ("finish_reason", "reason"),
    [("abort", "excluded_aborted"), ("error", "excluded_error"), ("cancelled", "excluded_unfinished")],
)
@pytest.mark.parametrize("path", ["one_read", "pending_trajectory", "pending_feedback"])
def test_a_trajectory_that_is_not_a_whole_answer_is_neither_trained_nor_evidence(finish_reason, reason, path):
    # The input: a stream closed after three chunks, 3 tokens logged with "abort".
    rec = traj(
        response_token_ids=[4, 5, 6],
        rollout_logprobs=[-0.1, -0.2, -0.3],
        token_versions=[(2, 3)],
        finish_reason=finish_reason,
    )
    if path == "one_read":
        p = plan(read(rec, fb()))
    elif path == "pending_trajectory":
        p = plan(read(fb()), JoinState(trajectories={"t1": rec}))
    else:
        p = plan(read(rec), JoinState(feedback={"t1": fb()}))
    assert p.samples == [] and p.results == []
    assert p.counters == {reason: 1}
    assert tomb("t1") in p.inserts  # consumed: a re-sent feedback is a duplicate


def test_a_length_finish_is_a_whole_answer():
    p = plan(read(traj(finish_reason="length"), fb(reward=1.0)))
    assert [(s.id, s.reward, s.actions) for s in p.samples] == [("t1", 1.0, [(3, 5)])]
    assert p.counters == {}


def test_listed_turns_are_joined_in_the_order_the_feedback_lists_them():
    """Issue 23 finding 8: a turn logged before turn numbers carries none, or the client's own;
    the server's list (numbered by revision 0010 for such episodes) is the turn order."""
    t0, t1 = episode_turns()
    # Records that would sort the other way round: turn 1 unnumbered, turn 0 numbered 3.
    t0, t1 = t0.model_copy(update={"turn": 3}), t1.model_copy(update={"turn": None})
    rated = fb(episode="E", prompt_id="q").model_copy(update={"turn_ids": ["E0", "E1"]})
    [s] = plan(read(t1, t0, rated)).samples
    assert s.input_ids == [1, 2, 3, 4, 7, 8, 9] and s.actions == [(2, 4), (6, 7)]
    assert s.result_version == 5  # the first listed turn's first token


def test_episode_joined_in_turn_order():
    t0, t1 = episode_turns()
    # Turn 1 in this read, turn 0 pending from an earlier one.
    p = plan(read(t1, fb(episode="E", prompt_id="q", reward=1.0)), JoinState(trajectories={"E0": t0}))
    [s] = p.samples
    assert s.id == "e:E" and s.prompt_id == "q"
    assert s.input_ids == [1, 2, 3, 4, 7, 8, 9] and s.actions == [(2, 4), (6, 7)]
    assert s.rollout_logprobs == [-0.1, -0.2, -0.3] and s.token_versions == [5, 5, 6]
    # Credited to the version of the first turn's first token (5), not its dispatch (4).
    assert s.result_version == 5 and p.results == [("q", 1.0, 5)]
    assert p.deletes == [("E0", "trajectory")]
    assert p.inserts == [tomb("E1", "q"), tomb("E0", "q"), tomb("e:E", "q")]
    assert p.counters == {}


@pytest.mark.parametrize("feedback_first", [False, True])
def test_feedback_naming_one_episode_turn_trains_nothing_whichever_comes_first(feedback_first):
    """A turn is rated with its episode only (the server answers 409 rate_the_episode): a turn's
    own feedback, logged before that rule, is dropped and the turn waits for its episode's."""
    t0, _ = episode_turns()
    rating = fb("E0", 0.5, "q")
    if feedback_first:
        p1 = plan(read(rating))
        assert [r.kind for r in p1.inserts] == ["feedback"]
        p = plan(read(t0), JoinState(feedback={"E0": rating}))
        assert p.deletes == [("E0", "feedback")]
        assert [(r.key, r.kind) for r in p.inserts] == [("E0", "trajectory")]
    else:
        p = plan(read(rating), JoinState(trajectories={"E0": t0}))
        assert p.deletes == [] and p.inserts == []
    assert p.samples == [] and p.results == [] and p.counters == {"episode_turn_feedback": 1}


def test_a_turn_logged_after_its_episode_was_joined_is_counted_not_kept():
    _, t1 = episode_turns()
    p = plan(read(t1), JoinState(joined=frozenset({"e:E"})))
    assert p.inserts == [] and p.samples == [] and p.counters == {"late_episode_turns": 1}


def test_episode_feedback_twice_and_without_turns():
    t0, t1 = episode_turns()
    p = plan(read(t0, t1, fb(episode="E", prompt_id="q"), fb(episode="E", prompt_id="q", reward=0.0)))
    assert [(s.id, s.reward) for s in p.samples] == [("e:E", 1.0)]
    assert p.counters == {"duplicate_feedback": 1}
    p = plan(read(fb(episode="E", prompt_id="q")), JoinState(joined=frozenset({"e:E"})))
    assert p.samples == [] and p.counters == {"duplicate_feedback": 1}
    p = plan(read(fb(episode="X", prompt_id="q")))
    assert p.samples == [] and p.inserts == [] and p.counters == {"episode_feedback_without_turns": 1}


@pytest.mark.parametrize(("aborted_turn", "pending"), [(1, False), (1, True), (0, False)])
def test_an_episode_with_an_aborted_turn_is_excluded(aborted_turn, pending):
    # The input: turn 0 whole, turn 1 streamed and dropped after 3 chunks.
    t0, t1 = episode_turns()
    if aborted_turn == 1:
        t1 = t1.model_copy(
            update=dict(
                response_token_ids=[9, 10, 11],
                rollout_logprobs=[-0.3, -0.3, -0.3],
                token_versions=[(6, 3)],
                finish_reason="abort",
            )
        )
    else:
        t0 = t0.model_copy(update=dict(finish_reason="abort"))
    rating = fb(episode="E", prompt_id="q", reward=1.0)
    if pending:
        p = plan(read(rating), JoinState(trajectories={"E0": t0, "E1": t1}))
        assert sorted(p.deletes) == [("E0", "trajectory"), ("E1", "trajectory")]
    else:
        p = plan(read(t0, t1, rating))
    assert p.samples == [] and p.results == []
    assert p.counters == {"excluded_aborted": 1}
    assert {r.key for r in p.inserts} == {"E0", "E1", "e:E"}


def test_an_episode_with_an_errored_turn_names_the_first_bad_turn():
    t0, t1 = episode_turns()
    t0 = t0.model_copy(update=dict(finish_reason="error"))
    t1 = t1.model_copy(update=dict(finish_reason="abort"))
    p = plan(read(t1, t0, fb(episode="E", prompt_id="q")))
    assert p.samples == [] and p.counters == {"excluded_error": 1}


def test_expiry_of_old_pending_trajectories():
    old = traj("old", created_at=NOW - timedelta(hours=2))
    joined_late = traj("late", created_at=NOW - timedelta(hours=2))
    p = plan(
        read(old, traj("fresh", created_at=NOW - timedelta(seconds=3599)), fb("late")),
        JoinState(trajectories={"late": joined_late}, expired=frozenset({"late", "gone"})),
    )
    # "gone" (pending, older than 1 h) and "old" (read now, created 2 h ago) expire; "late" is
    # joined by its feedback first; "fresh" is 1 s short of the hour and waits.
    assert p.expired == ["gone"]
    assert p.counters == {"expired": 2}
    # Each expired id leaves a tombstone of expiry (feedback coming later is set aside).
    assert [(r.key, r.kind) for r in p.inserts] == [
        ("late", "joined"),
        ("old", "expired"),
        ("fresh", "trajectory"),
        ("gone", "expired"),
    ]
    assert [s.id for s in p.samples] == ["late"] and p.deletes == [("late", "trajectory")]


def test_malformed_records_are_counted_and_passed():
    p = plan(
        read(
            (TOPIC_TRAJECTORIES, b"{not json"),
            (TOPIC_FEEDBACK, b"{}"),
            (TOPIC_FEEDBACK, json.dumps(json.loads(fb().to_json()) | {"reward": 2.0}).encode()),
            (TOPIC_FEEDBACK, json.dumps(json.loads(fb().to_json()) | {"episode_id": "E"}).encode()),
            traj(),
        )
    )
    assert p.counters == {"malformed_trajectories": 1, "malformed_feedback": 3}
    # Offsets move past them: 2 trajectory entries (0, 1), 3 feedback entries (0..2).
    assert p.offsets == {(TOPIC_TRAJECTORIES, 0): 2, (TOPIC_FEEDBACK, 0): 3}
    assert [r.key for r in p.inserts] == ["t1"] and p.samples == []


def test_records_of_another_topic_are_refused():
    with pytest.raises(ValueError, match="not 'policy'"):
        Records.parse([LogEntry("policy", 0, 0, "policy", b"{}")])


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"sampling": {"temperature": 0.0, "max_tokens": 4}}, "excluded_greedy"),
        ({"sampling": {"temperature": 1.0, "top_p": 0.9, "max_tokens": 4}}, "excluded_truncated_sampling"),
        ({"sampling": {"temperature": 1.0, "top_k": 5, "max_tokens": 4}}, "excluded_truncated_sampling"),
    ],
)
def test_greedy_or_truncated_sampling_is_not_trained_but_is_evidence(kw, reason):
    p = plan(read(traj(**kw), fb(reward=1.0)))
    assert p.samples == [] and p.counters == {reason: 1}
    assert p.results == [("p", 1.0, 2)]  # the answer was whole: its reward is prompt evidence


def test_result_credited_to_the_version_of_the_first_token():
    # Dispatched at 2; a swap before the first token: tokens from versions 3 and 4.
    rec = traj(token_versions=[(3, 1), (4, 1)])
    p = plan(read(rec, fb(reward=1.0)))
    [s] = p.samples
    assert p.results == [("p", 1.0, 3)] and s.result_version == 3
    assert s.token_versions == [3, 4] and s.baseline_value == 0.5  # baseline frozen at dispatch
    # An empty answer has no first token: dispatch version, and it is not trained.
    empty = traj(response_token_ids=[], rollout_logprobs=[], token_versions=[])
    p = plan(read(empty, fb(reward=0.0)))
    assert p.results == [("p", 0.0, 2)] and p.counters == {"excluded_empty_response": 1}


# Receipt-order invariance: within one read, the joined set (samples, evidence results, rows
# written, counters) does not depend on the order of trajectories or of feedback, as long as
# every target has at most one feedback (with two, the first wins by contract).

FINISH = st.sampled_from(["stop", "stop", "length", "abort", "error"])


@st.composite
def scenarios(draw):
    n_single = draw(st.integers(0, 5))
    n_episodes = draw(st.integers(0, 2))
    trajs, pending_t, pending_f, feedback = [], {}, {}, []
    for i in range(n_single):
        rec = traj(
            f"s{i}",
            prompt_id=draw(st.sampled_from(["p", "q", "r"])),
            finish_reason=draw(FINISH),
            sampling={"temperature": draw(st.sampled_from([0.0, 0.8, 1.0])), "max_tokens": 4},
            token_versions=draw(st.sampled_from([[(2, 2)], [(3, 1), (4, 1)]])),
            created_at=NOW - timedelta(hours=draw(st.sampled_from([0, 0, 2]))),
        )
        where = draw(st.sampled_from(["read", "read", "pending", "both"]))
        if where in ("read", "both"):
            trajs.append(rec)
        if where in ("pending", "both"):
            pending_t[rec.id] = rec
        reward = draw(st.sampled_from([0.0, 0.5, 1.0]))
        fb_where = draw(st.sampled_from(["none", "read", "pending"]))
        if fb_where == "read":
            feedback.append(fb(rec.id, reward, rec.prompt_id))
        elif fb_where == "pending":
            pending_f[rec.id] = fb(rec.id, reward, rec.prompt_id)
        if draw(st.booleans()):
            trajs.append(rec)  # a re-sent copy
    for e in range(n_episodes):
        turns = episode_turns(f"E{e}", prompt_id=f"q{e}")
        for rec in turns:
            rec = rec.model_copy(update={"finish_reason": draw(FINISH)})
            if draw(st.booleans()):
                trajs.append(rec)
            else:
                pending_t[rec.id] = rec
        if draw(st.booleans()):
            feedback.append(fb(episode=f"E{e}", prompt_id=f"q{e}", reward=draw(st.sampled_from([0.0, 1.0]))))
    expired = frozenset(k for k, r in pending_t.items() if r.created_at < NOW - timedelta(seconds=EXPIRE_S))
    state = JoinState(trajectories=pending_t, feedback=pending_f, expired=expired)
    return trajs, feedback, state


def outcome(p: JoinPlan):
    return (
        sorted(json.dumps(s.to_json(), sort_keys=True) for s in p.samples),
        sorted(p.results),
        p.counters,
        sorted(p.inserts, key=lambda r: (r.key, r.kind)),
        sorted(p.deletes),
        p.expired,
        p.offsets,
        sorted((d.kind, d.key, d.reason) for d in p.dead_letters),
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data(), scenario=scenarios())
def test_joined_set_does_not_depend_on_receipt_order_within_a_read(data, scenario):
    trajs, feedback, state = scenario
    base = plan(read(*trajs, *feedback), state)
    shuffled = plan(read(*data.draw(st.permutations(trajs)), *data.draw(st.permutations(feedback))), state)
    assert outcome(shuffled) == outcome(base)
