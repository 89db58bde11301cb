"""Opt-out enforced where training happens (learner.data.join_plan.as_keyed; issue 40, item 6): a
record whose API key has opted out by the time it joins is excluded, whatever its own ``train``
flag says (logged before the opt-out, or without the field). Pure: the plan on hand-made
records, the key's setting given as ``JoinState.opted_out``."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from core.logbus import LogEntry
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord
from learner.data.join_plan import JoinState, Records, plan_join

NOW = datetime(2026, 12, 6, tzinfo=UTC)
KEY = "key:k0123456789abcdef"


def trajectory(tid: str, identity: str | None, **kw) -> dict:
    return {
        "schema": "saoserve.trajectory/1",
        "id": tid,
        "prompt_id": "p",
        "created_at": NOW.isoformat(),
        "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "response_token_ids": [4, 5],
        "rollout_logprobs": [-0.5, -0.25],
        "token_versions": [[2, 2]],
        "dispatch_version": 2,
        "sampling": {"temperature": 0.8, "max_tokens": 4},
        "finish_reason": "stop",
        "identity": identity,
        **kw,
    }


def feedback(tid: str) -> bytes:
    return FeedbackRecord(trajectory_id=tid, prompt_id="p", reward=1.0, received_at=NOW).to_json()


def read(*entries: tuple[str, bytes]) -> Records:
    counts = {TOPIC_TRAJECTORIES: 0, TOPIC_FEEDBACK: 0}
    out = []
    for topic, value in entries:
        out.append(LogEntry(topic, 0, counts[topic], "k", value))
        counts[topic] += 1
    return Records.parse(out)


def test_a_key_that_opted_out_after_logging_is_not_trained_nor_evidence():
    flagged = json.dumps(trajectory("a", KEY, train=True)).encode()
    unflagged = json.dumps(trajectory("b", KEY)).encode()  # logged before the field: no flag
    other = json.dumps(trajectory("c", "key:kfedcba9876543210", train=True)).encode()
    records = read(
        (TOPIC_TRAJECTORIES, flagged),
        (TOPIC_TRAJECTORIES, unflagged),
        (TOPIC_TRAJECTORIES, other),
        (TOPIC_FEEDBACK, feedback("a")),
        (TOPIC_FEEDBACK, feedback("b")),
        (TOPIC_FEEDBACK, feedback("c")),
    )
    assert [r.train for r in records.trajectories] == [True, True, True]  # a missing flag reads True
    # The key's setting now (off) decides for a and b: two exclusions, no evidence from them;
    # c, another key, trains: one sample, one evidence result.
    p = plan_join(records, JoinState(opted_out=frozenset({KEY})), NOW, 900.0)
    assert [s.id for s in p.samples] == ["c"]
    assert p.results == [("p", 1.0, 2)]
    assert p.counters == {"excluded_opted_out": 2}
    # The same read with the key on: all three train.
    assert len(plan_join(records, JoinState(), NOW, 900.0).samples) == 3


def test_a_pending_record_keeps_its_flag_as_logged():
    """Only the join sees the key's setting: a record that waits for its feedback is filed as
    logged, so an opt-out undone before the feedback comes trains it again."""
    rec = json.dumps(trajectory("a", KEY, train=True)).encode()
    p = plan_join(read((TOPIC_TRAJECTORIES, rec)), JoinState(opted_out=frozenset({KEY})), NOW, 900.0)
    (row,) = [r for r in p.inserts if r.kind == "trajectory"]
    assert TrajectoryRecord.model_validate_json(row.payload).train is True
    pending = JoinState(trajectories={"a": TrajectoryRecord.model_validate_json(row.payload)})
    again = plan_join(read((TOPIC_FEEDBACK, feedback("a"))), pending, NOW, 900.0)
    assert [s.id for s in again.samples] == ["a"]
