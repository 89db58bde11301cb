"""core/learnable.py: which logged trajectories the learner can learn from, one case per reason,
with every input written out; and how learner/data/samples.py raises them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from core.learnable import GREEDY_BELOW, episode_exclusion_reason, exclusion_reason
from core.records import TrajectoryRecord
from learner.data.samples import NotLearnable, NotWholeAnswer, OptedOut, check_learnable


def record(
    *,
    train: bool = True,
    finish_reason: str = "stop",
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 0,
    response: list[int] | None = None,
    turn: int | None = None,
) -> TrajectoryRecord:
    """A trajectory of prompt [1, 2, 3] and response ``response`` (default [4, 5]), each token
    at version 2 with logprob -0.5."""
    response = [4, 5] if response is None else response
    return TrajectoryRecord(
        id=f"t{turn}",
        prompt_id="p",
        episode_id=None if turn is None else "e",
        turn=turn,
        created_at=datetime(2025, 6, 1, tzinfo=UTC),
        model="m",
        prompt_token_ids=[1, 2, 3],
        response_token_ids=response,
        rollout_logprobs=[-0.5] * len(response),
        token_versions=[(2, len(response))] if response else [],
        dispatch_version=2,
        sampling={"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": 4},
        finish_reason=finish_reason,
        train=train,
    )


@pytest.mark.parametrize(
    ("inputs", "reason"),
    [
        ({}, None),
        ({"finish_reason": "length"}, None),
        ({"temperature": GREEDY_BELOW}, None),
        ({"train": False}, "excluded_opted_out"),
        ({"finish_reason": "abort"}, "excluded_aborted"),
        ({"finish_reason": "error"}, "excluded_error"),
        ({"finish_reason": "repetition"}, "excluded_unfinished"),
        ({"top_p": 0.9}, "excluded_truncated_sampling"),
        ({"top_k": 5}, "excluded_truncated_sampling"),
        ({"temperature": 0.0}, "excluded_greedy"),
        ({"temperature": 9e-6}, "excluded_greedy"),
        ({"response": []}, "excluded_empty_response"),
    ],
)
def test_each_reason(inputs, reason):
    assert exclusion_reason(record(**inputs)) == reason


@pytest.mark.parametrize(
    ("inputs", "reason"),
    [
        # Opted out comes first: it is never trained, whatever else is true of it.
        (
            {"train": False, "finish_reason": "abort", "temperature": 0.0, "response": []},
            "excluded_opted_out",
        ),
        # Then the finish: an aborted answer is no evidence even when its sampling is not learnable.
        ({"finish_reason": "abort", "top_p": 0.5, "temperature": 0.0}, "excluded_aborted"),
        # Truncation is named before greedy decoding and an empty response.
        ({"top_k": 5, "temperature": 0.0, "response": []}, "excluded_truncated_sampling"),
        ({"temperature": 0.0, "response": []}, "excluded_greedy"),
    ],
)
def test_the_first_reason_that_applies_is_named(inputs, reason):
    assert exclusion_reason(record(**inputs)) == reason


def test_an_episode_names_any_turn_opted_out_then_any_unfinished_then_its_last_turn():
    whole, last = record(turn=0), record(turn=1)
    assert episode_exclusion_reason([whole, last]) is None
    # Turn 0 aborted, turn 1 opted out: opting out is named first, for any turn.
    assert episode_exclusion_reason([record(turn=0, finish_reason="abort"), record(turn=1, train=False)]) == (
        "excluded_opted_out"
    )
    # The first unfinished turn in turn order names the reason.
    turns = [record(turn=0, finish_reason="error"), record(turn=1, finish_reason="abort")]
    assert episode_exclusion_reason(turns) == "excluded_error"
    # Sampling and emptiness are the last turn's only: an earlier greedy turn is not aligned, not refused.
    assert episode_exclusion_reason([record(turn=0, temperature=0.0), last]) is None
    assert episode_exclusion_reason([whole, record(turn=1, top_p=0.5)]) == "excluded_truncated_sampling"
    assert episode_exclusion_reason([whole, record(turn=1, response=[])]) == "excluded_empty_response"


@pytest.mark.parametrize(
    ("inputs", "kind", "reason"),
    [
        ({"train": False}, OptedOut, "excluded_opted_out"),
        ({"finish_reason": "abort"}, NotWholeAnswer, "excluded_aborted"),
        ({"finish_reason": "repetition"}, NotWholeAnswer, "excluded_unfinished"),
        ({"temperature": 0.0}, NotLearnable, "excluded_greedy"),
    ],
)
def test_the_learner_raises_the_reason_as_its_kind(inputs, kind, reason):
    with pytest.raises(NotLearnable, match=f"^{reason}$") as exc:
        check_learnable(record(**inputs))
    assert type(exc.value) is kind
