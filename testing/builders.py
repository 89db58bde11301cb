"""Records built by hand: trajectories and feedback as the joiner reads them (``traj``, ``fb``,
``sent``, ``episode_turns``, ``read`` → ``Records``, ``plan`` → the pure join plan at ``NOW``), a
logged answer's record (``record``) and a chat's rollout (``rollout``)."""

from __future__ import annotations

from datetime import UTC, datetime

from core.logbus import LogEntry
from core.records import (
    TOPIC_FEEDBACK,
    TOPIC_TRAJECTORIES,
    FeedbackRecord,
    SamplingRecord,
    TrajectoryRecord,
    utcnow,
)
from learner.data.join_plan import JoinPlan, JoinState, PendingRow, Records, plan_join
from server.rollout import Rollout


def rollout(tokens: int = 2, episode: str | None = "ep") -> Rollout:
    """A rollout with ``tokens`` sampled tokens (ids 5, 6, ...; logprob -0.5 each) at version 3,
    finished ``stop``; a turn of episode ``episode`` (None: no episode)."""
    r = Rollout(
        id="chatcmpl-1",
        prompt_id="p",
        model="m",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingRecord(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8, seed=None),
        dispatch_version=3,
        created_at=datetime(2025, 6, 1, tzinfo=UTC),
        episode_id=episode,
        turn=0 if episode else None,
    )
    r.token_ids = [5 + i for i in range(tokens)]
    r.logprobs = [-0.5] * tokens
    r.delta_versions = [(3, tokens)] if tokens else []
    r.finish_reason = "stop" if tokens else None
    return r


NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


EXPIRE_S = 3600.0


def traj(id: str = "t1", prompt_id: str = "p", **kw) -> TrajectoryRecord:
    base = dict(
        id=id,
        prompt_id=prompt_id,
        created_at=NOW,
        model="m",
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        rollout_logprobs=[-0.5, -0.25],
        token_versions=[(2, 2)],
        dispatch_version=2,
        sampling={"temperature": 0.8, "max_tokens": 4},
        finish_reason="stop",
        baseline={"alpha": 4, "beta": 4, "value": 0.5, "version": 2, "z": 0.27},
    )
    base.update(kw)
    return TrajectoryRecord(**base)


def fb(tid: str | None = "t1", reward: float = 1.0, prompt_id: str = "p", episode: str | None = None):
    return FeedbackRecord(
        trajectory_id=None if episode else tid,
        episode_id=episode,
        prompt_id=prompt_id,
        reward=reward,
        received_at=NOW,
    )


def read(*recs: TrajectoryRecord | FeedbackRecord | tuple[str, bytes]) -> Records:
    """Records parsed from log entries numbered 0, 1, ... per topic, one partition each."""
    entries = []
    counts = {TOPIC_TRAJECTORIES: 0, TOPIC_FEEDBACK: 0}
    for r in recs:
        if isinstance(r, tuple):
            topic, value = r
        else:
            topic = TOPIC_TRAJECTORIES if isinstance(r, TrajectoryRecord) else TOPIC_FEEDBACK
            value = r.to_json()
        entries.append(LogEntry(topic, 0, counts[topic], "k", value))
        counts[topic] += 1
    return Records.parse(entries)


def plan(records: Records, state: JoinState | None = None) -> JoinPlan:
    return plan_join(records, state or JoinState(), NOW, EXPIRE_S)


def tomb(key: str, prompt_id: str = "p") -> PendingRow:
    return PendingRow(key, "joined", prompt_id, "", NOW)


def sent(
    fid: str, tid: str | None = "t1", reward: float = 1.0, prompt_id: str = "p", episode: str | None = None
):
    """A feedback record as the server logs it: with its id ``fid``."""
    return fb(tid, reward, prompt_id, episode).model_copy(update={"feedback_id": fid})


def episode_turns(e: str = "E", prompt_id: str = "q"):
    """Turn 0: prompt [1, 2], answer [3, 4]; turn 1 re-renders it, adds an observation [7, 8]."""
    t0 = traj(
        f"{e}0",
        prompt_id,
        episode_id=e,
        turn=0,
        prompt_token_ids=[1, 2],
        response_token_ids=[3, 4],
        rollout_logprobs=[-0.1, -0.2],
        token_versions=[(5, 2)],
        dispatch_version=4,
    )
    t1 = traj(
        f"{e}1",
        prompt_id,
        episode_id=e,
        turn=1,
        prompt_token_ids=[1, 2, 3, 4, 7, 8],
        response_token_ids=[9],
        rollout_logprobs=[-0.3],
        token_versions=[(6, 1)],
        dispatch_version=6,
    )
    return t0, t1


def record(
    rid: str,
    episode_id: str | None = None,
    finish: str = "stop",
    *,
    prompt_id: str = "p-1",
    turn: int | None = 0,
    max_tokens: int = 8,
) -> TrajectoryRecord:
    """A logged one-token answer ``rid`` at version 0 (prompt [1, 2], token 3 at logprob -0.5),
    finished ``finish``; turn ``turn`` of ``episode_id``."""
    return TrajectoryRecord(
        id=rid,
        prompt_id=prompt_id,
        episode_id=episode_id,
        turn=turn,
        created_at=utcnow(),
        model="m",
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        rollout_logprobs=[-0.5],
        token_versions=[(0, 1)],
        dispatch_version=0,
        sampling=SamplingRecord(temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens, seed=None),
        finish_reason=finish,
    )
