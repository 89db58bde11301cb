"""Records, tokens and version run-lengths (no engine)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from core.records import (
    FeedbackRecord,
    TrajectoryRecord,
    check_feedback_token,
    feedback_token,
    prompt_id_for,
    utcnow,
)
from server.rollout import run_lengths


def test_run_lengths_merge_and_cover():
    # spans (0,[0,3)), (0,[3,5)), (1,[5,9)) → versions 0 for 5 tokens, 1 for 4 tokens
    assert run_lengths([(0, 0, 3), (0, 3, 5), (1, 5, 9)], 9) == [(0, 5), (1, 4)]
    assert run_lengths([], 0) == []


def test_run_lengths_refuses_gaps():
    with pytest.raises(ValueError, match="tile"):
        run_lengths([(0, 0, 3), (1, 4, 6)], 6)
    with pytest.raises(ValueError, match="cover 3"):
        run_lengths([(0, 0, 3)], 5)


def test_prompt_id_is_stable_under_whitespace_and_role_case():
    a = prompt_id_for([{"role": "user", "content": "Write  a poem\n"}])
    b = prompt_id_for([{"role": "USER", "content": "Write a poem"}])
    c = prompt_id_for([{"role": "user", "content": "Write a song"}])
    assert a == b != c and a.startswith("p-") and len(a) == 34


def test_feedback_token_is_hmac_sha256():
    import hashlib
    import hmac

    expect = hmac.new(b"k", b"chatcmpl-1", hashlib.sha256).hexdigest()
    assert feedback_token("k", "chatcmpl-1") == expect
    assert check_feedback_token("k", "chatcmpl-1", expect)
    assert not check_feedback_token("k", "chatcmpl-2", expect)
    assert not check_feedback_token("other", "chatcmpl-1", expect)


def _traj(**kw):
    base = dict(
        id="t1",
        prompt_id="p",
        created_at=utcnow(),
        model="m",
        prompt_token_ids=[1, 2],
        response_token_ids=[3, 4, 5],
        rollout_logprobs=[-0.1, -0.2, -0.3],
        token_versions=[(0, 2), (1, 1)],
        dispatch_version=0,
        sampling={"temperature": 0.7, "max_tokens": 8},
        finish_reason="stop",
    )
    base.update(kw)
    return TrajectoryRecord(**base)


def test_trajectory_record_round_trip_and_alignment():
    rec = _traj()
    again = TrajectoryRecord.model_validate_json(rec.to_json())
    assert again == rec and '"schema":"saoserve.trajectory/1"' in rec.to_json().decode()
    with pytest.raises(ValidationError, match="2 logprobs for 3 response tokens"):
        _traj(rollout_logprobs=[-0.1, -0.2])
    with pytest.raises(ValidationError, match="cover 2 tokens"):
        _traj(token_versions=[(0, 2)])


@pytest.mark.parametrize("reward", [math.nan, math.inf, -0.1, 1.5])
def test_feedback_record_refuses_bad_rewards(reward):
    with pytest.raises(ValidationError, match=r"finite number in \[0, 1\]"):
        FeedbackRecord(trajectory_id="t", prompt_id="p", reward=reward, received_at=utcnow())


def test_feedback_record_needs_one_target():
    with pytest.raises(ValidationError, match="exactly one"):
        FeedbackRecord(prompt_id="p", reward=1.0, received_at=utcnow())
