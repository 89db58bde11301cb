"""learner/data/samples.py: which trajectories are whole answers, and the version a result is credited to."""

from __future__ import annotations

import pytest

from learner.data.samples import (
    NotLearnable,
    NotWholeAnswer,
    answer_version,
    episode_sample,
    single_turn_sample,
)
from testing.builders import episode_turns, traj


@pytest.mark.parametrize(
    ("finish_reason", "reason"),
    [("abort", "excluded_aborted"), ("error", "excluded_error"), ("content_filter", "excluded_unfinished")],
)
def test_not_a_whole_answer_is_named_before_any_sampling_reason(finish_reason, reason):
    # Greedy and truncated too: the finish reason is what decides that it is not evidence.
    rec = traj(finish_reason=finish_reason, sampling={"temperature": 0.0, "top_p": 0.5, "max_tokens": 4})
    with pytest.raises(NotWholeAnswer, match=f"^{reason}$"):
        single_turn_sample(rec, 1.0)


def test_stop_and_length_are_whole_answers_trained_alike():
    stop, length = (single_turn_sample(traj(finish_reason=f), 1.0) for f in ("stop", "length"))
    assert stop == length  # reward on the last token, terminal, for both
    with pytest.raises(NotLearnable, match="^excluded_greedy$") as exc:
        single_turn_sample(traj(finish_reason="length", sampling={"temperature": 0.0, "max_tokens": 2}), 1.0)
    assert not isinstance(exc.value, NotWholeAnswer)


def test_answer_version_is_the_first_tokens():
    assert answer_version(traj(token_versions=[(2, 2)])) == 2
    assert answer_version(traj(token_versions=[(4, 1), (5, 1)])) == 4
    # A zero-length run generated nothing: the first token came from version 5.
    assert answer_version(traj(token_versions=[(3, 0), (5, 2)])) == 5
    assert answer_version(traj(response_token_ids=[], rollout_logprobs=[], token_versions=[])) == 2


def test_episode_credits_its_first_turns_first_token_and_refuses_any_unfinished_turn():
    t0, t1 = episode_turns()
    s, misaligned = episode_sample("E", [t1, t0], 1.0)
    assert misaligned == 0 and s.result_version == 5  # turn 0: dispatched at 4, first token from 5
    # An unaligned aborted turn still excludes the episode.
    bad = t0.model_copy(update={"prompt_token_ids": [9, 9], "finish_reason": "abort"})
    with pytest.raises(NotWholeAnswer, match="^excluded_aborted$"):
        episode_sample("E", [t1, bad], 1.0)
