"""The server–learner contract spelled once in core/: claim keys and token subjects
(core/claims.py), and the whole-answer rule (core.records.is_whole_answer) both sides apply."""

from __future__ import annotations

import pytest

from core import limits
from core.claims import (
    EPISODE_PREFIX,
    TRAJECTORY_PREFIX,
    claim_target,
    episode_key,
    episode_token_subject,
    record_key,
    trajectory_target,
)
from core.records import feedback_token, is_whole_answer
from learner.data.join_plan import JoinState
from learner.data.samples import NotWholeAnswer, single_turn_sample
from server.feedback.serving import accept_feedback
from testing.builders import fb, plan, read, record, traj
from testing.edges import SECRET, episode_token, feedback, feedback_state, refused


def test_claim_keys_and_token_subjects():
    assert (trajectory_target("c-1"), episode_key("ep")) == ("t:c-1", "e:ep")
    assert claim_target("c-1", None) == "t:c-1" and claim_target(None, "ep") == "e:ep"
    # The learner files a trajectory's feedback under its bare id, an episode's under e:<id>.
    assert record_key("c-1", None) == "c-1" and record_key(None, "ep") == "e:ep"
    assert episode_token_subject("ep") == "episode:ep"
    # An episode and a trajectory with the same id have distinct claim targets.
    assert claim_target("x", None) != claim_target(None, "x")
    assert len(TRAJECTORY_PREFIX) == len(EPISODE_PREFIX) == limits.KEY_PREFIX_CHARS == 2


@pytest.mark.parametrize(
    ("finish_reason", "whole"),
    [("stop", True), ("length", True), ("abort", False), ("error", False), ("repetition", False)],
)
def test_whole_answer_rule(finish_reason, whole):
    assert is_whole_answer(finish_reason) is whole


# Where the two rules disagreed: the server refused feedback only on ``abort``/``error`` (a
# list of what is not whole), the learner trained only ``stop``/``length`` (a list of what is).
# vLLM 0.32 also ends a request with ``repetition``: the server answered such feedback 202 and
# the learner then dropped it (``excluded_unfinished``: no sample, no evidence), so an accepted
# reward was lost. One rule now: the server refuses it, the learner still excludes it.


async def test_feedback_on_a_repetition_answer_is_refused(tmp_path):
    s = feedback_state(tmp_path)
    s.store.index_trajectory(record("c-rep", None, "repetition"), 0, 0)
    assert await refused(
        accept_feedback(s, feedback(id="c-rep", feedback_token=feedback_token(SECRET, "c-rep")))
    ) == (
        409,
        "not_a_whole_answer",
        None,
        "completion 'c-rep' ended with finish_reason 'repetition': not a whole answer, feedback refused",
    )


async def test_an_episode_with_a_repetition_turn_is_refused(tmp_path):
    s = feedback_state(tmp_path)
    s.store.start_episode_turn("ep", "c-0", token_ok=False)
    s.store.index_trajectory(record("c-0", "ep", "repetition"), 0, 0)
    # One logged turn, not whole: 1 (the old rule counted 0 and accepted the feedback).
    assert s.store.episode_state("ep").not_whole_turns == 1
    rate = feedback(episode_id="ep", feedback_token=episode_token("ep"))
    assert (await refused(accept_feedback(s, rate)))[:2] == (409, "not_a_whole_answer")


def test_the_learner_excludes_a_repetition_answer():
    rec = traj(finish_reason="repetition")
    with pytest.raises(NotWholeAnswer, match="excluded_unfinished"):
        single_turn_sample(rec, 1.0)
    # Joined with its (pre-rule) feedback: a tombstone, no sample, no evidence, one counter.
    p = plan(read(rec, fb(reward=1.0)), JoinState())
    assert (p.samples, p.results, p.counters) == ([], [], {"excluded_unfinished": 1})
