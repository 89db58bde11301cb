"""From logged trajectories and a reward to learner samples and padded batches (pure).

A sample is one rollout (group size 1): the token sequence the policy saw and produced, which
positions are actions (tokens it generated) and which are observations (prompt, tool and user
turns), the logged rollout logprob of each action token, the policy version that produced each
action token, the sampling temperature and the reward. Multi-turn episodes become one sequence
of actions and observations (SAO §2.4, skip-observation GAE).

Only whole answers are trained (docs/design.md §8). A trajectory is a whole answer when its
``finish_reason`` is ``stop`` (the model ended it) or ``length`` (``max_tokens`` or the
context cut it). A ``length`` answer is trained under the same rule as a ``stop`` one: the
reward sits on its last token and that token is terminal (no bootstrap from the value at the
cut), so the critic learns the value of answers truncated at that budget. ``abort`` (the client
disconnected mid-stream), ``error`` (the engine failed) and any other reason are not whole
answers: neither the trajectory nor an episode containing such a turn is trained, and its
reward is not evidence (:class:`NotWholeAnswer`).

A trajectory whose request opted out of training (``TrajectoryRecord.train`` False,
docs/privacy.md) is never trained either, nor an episode holding such a turn, and its reward
is not evidence (:class:`OptedOut`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.claims import episode_key
from core.learnable import NOT_WHOLE_ANSWER, OPTED_OUT, episode_exclusion_reason, exclusion_reason
from core.records import TrajectoryRecord, answer_version
from learner.data.batch import Batch


class NotLearnable(ValueError):
    """A joined trajectory that is not trained on (the reason is the counter's name)."""


class NotWholeAnswer(NotLearnable):
    """A trajectory (or an episode turn) that is not a whole answer: aborted, errored, or
    finished for a reason outside ``core.records.WHOLE_ANSWER_FINISHES``. Its reward is neither
    trained nor added to the prompt's evidence. The reason is ``excluded_aborted``,
    ``excluded_error`` or ``excluded_unfinished``."""


class OptedOut(NotLearnable):
    """A trajectory (or an episode turn) whose request opted out of training: neither trained
    nor added to the prompt's evidence. The reason is ``excluded_opted_out``."""


@dataclass
class Sample:
    """One joined rollout, JSON-serialisable.

    ``actions``: spans ``[start, end)`` of action positions in ``input_ids``;
    ``rollout_logprobs`` and ``token_versions`` have one entry per action token in order.
    ``baseline_value``: the prompt value frozen at dispatch (SPO++), or None.
    ``result_version``: the policy version credited with the result in the prompt's evidence:
    the version that generated the answer's first token (:func:`answer_version`; for an
    episode, its first turn's answer). The baseline stays the one frozen at dispatch.
    ``identity``: who sent it (``TrajectoryRecord.identity``; an episode's first turn's), what
    the identity cap counts (``learner.data.identity_cap``); None when the record had none.
    """

    id: str
    prompt_id: str
    input_ids: list[int]
    actions: list[tuple[int, int]]
    rollout_logprobs: list[float]
    token_versions: list[int]
    temperature: float
    reward: float
    baseline_value: float | None
    result_version: int
    identity: str | None = None

    @property
    def n_actions(self) -> int:
        return sum(e - s for s, e in self.actions)

    def to_json(self) -> dict:
        return self.__dict__ | {"actions": [list(a) for a in self.actions]}

    @classmethod
    def from_json(cls, d: dict) -> Sample:
        return cls(**(d | {"actions": [tuple(a) for a in d["actions"]]}))


def expand_versions(token_versions: list[tuple[int, int]]) -> list[int]:
    """Run-length ``[(version, count)]`` → one version per token."""
    return [v for v, c in token_versions for _ in range(c)]


def _refuse(reason: str | None) -> None:
    """Raise the NotLearnable of a reason of ``core.learnable`` (None: nothing to raise):
    OptedOut for ``excluded_opted_out``, NotWholeAnswer for a finish that is no whole answer,
    else NotLearnable; the reason is the exception's text."""
    if reason == OPTED_OUT:
        raise OptedOut(reason)
    if reason in NOT_WHOLE_ANSWER:
        raise NotWholeAnswer(reason)
    if reason is not None:
        raise NotLearnable(reason)


def check_learnable(rec: TrajectoryRecord) -> None:
    """Raise NotLearnable (OptedOut, NotWholeAnswer first) when the learner cannot learn from
    ``rec``: the rule of ``core.learnable.exclusion_reason`` (opted out, not a whole answer,
    truncated or greedy sampling, empty response; docs/design.md §5.1)."""
    _refuse(exclusion_reason(rec))


def single_turn_sample(rec: TrajectoryRecord, reward: float) -> Sample:
    """The sample of a one-request trajectory: prompt as observation, response as actions.

    Raises NotLearnable (NotWholeAnswer first) for a trajectory that is not trained on.
    """
    check_learnable(rec)
    n_p, n_r = len(rec.prompt_token_ids), len(rec.response_token_ids)
    return Sample(
        id=rec.id,
        prompt_id=rec.prompt_id,
        input_ids=rec.prompt_token_ids + rec.response_token_ids,
        actions=[(n_p, n_p + n_r)],
        rollout_logprobs=list(rec.rollout_logprobs),
        token_versions=expand_versions(rec.token_versions),
        temperature=rec.sampling.temperature,
        reward=reward,
        baseline_value=rec.baseline.value if rec.baseline else None,
        result_version=answer_version(rec),
        identity=rec.identity,
    )


def episode_sample(
    episode_id: str, turns: list[TrajectoryRecord], reward: float, in_order: bool = False
) -> tuple[Sample, int]:
    """One sequence for a multi-turn episode; returns (sample, turns not aligned).

    ``in_order``: ``turns`` are in turn order already (the order the episode's feedback lists
    them, ``FeedbackRecord.turn_ids``: the server's numbering, which for turns logged before turn
    numbers the records do not carry); otherwise they are sorted by (turn, created_at).

    The last turn's prompt + response is the sequence. An earlier turn's response is an action
    span where its prompt + response tokens are a prefix of that sequence (the chat template
    re-rendered the same tokens) and it was sampled at the last turn's temperature without
    truncation; otherwise its tokens stay observations and it is counted as not aligned.
    Raises OptedOut if any turn opted out of training, then NotWholeAnswer if any turn, aligned
    or not, is not a whole answer (the first such turn in turn order names the reason), then
    NotLearnable if the last turn is not learnable (``core.learnable.episode_exclusion_reason``).
    ``result_version`` is the first turn's :func:`answer_version`; the baseline is the one
    frozen at the first turn's dispatch.
    """
    if not in_order:
        turns = sorted(turns, key=lambda r: (r.turn if r.turn is not None else 0, r.created_at))
    _refuse(episode_exclusion_reason(turns))
    last = turns[-1]
    seq = last.prompt_token_ids + last.response_token_ids
    actions: list[tuple[int, int]] = []
    lps: list[float] = []
    versions: list[int] = []
    misaligned = 0
    for rec in turns[:-1]:
        span = rec.prompt_token_ids + rec.response_token_ids
        aligned = (
            rec.response_token_ids
            and len(span) <= len(last.prompt_token_ids)
            and seq[: len(span)] == span
            and rec.sampling.temperature == last.sampling.temperature
            and not rec.sampling.truncated
            and (not actions or actions[-1][1] <= len(rec.prompt_token_ids))
        )
        if not aligned:
            misaligned += 1
            continue
        actions.append((len(rec.prompt_token_ids), len(span)))
        lps.extend(rec.rollout_logprobs)
        versions.extend(expand_versions(rec.token_versions))
    n_p = len(last.prompt_token_ids)
    actions.append((n_p, n_p + len(last.response_token_ids)))
    lps.extend(last.rollout_logprobs)
    versions.extend(expand_versions(last.token_versions))
    first = turns[0]
    sample = Sample(
        id=episode_key(episode_id),
        prompt_id=last.prompt_id,
        input_ids=seq,
        actions=actions,
        rollout_logprobs=lps,
        token_versions=versions,
        temperature=last.sampling.temperature,
        reward=reward,
        baseline_value=first.baseline.value if first.baseline else None,
        result_version=answer_version(first),
        identity=first.identity,
    )
    return sample, misaligned


def collate(samples: list[Sample], current_version: int, pad_id: int = 0) -> Batch:
    """Right-pad samples into a ``learner.data.batch.Batch`` ([B, T] tensors, T = longest sample).

    ``token_staleness[b, t]`` = ``current_version`` − the version that produced the token
    (0 outside actions). ``baseline_values``: each sample's value frozen at dispatch, 0.5 (the
    default prior) for records logged before evidence existed. Raises ValueError on an empty list.
    """
    if not samples:
        raise ValueError("no samples to collate")
    b, t = len(samples), max(len(s.input_ids) for s in samples)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention = torch.zeros((b, t), dtype=torch.long)
    action = torch.zeros((b, t), dtype=torch.float32)
    rollout = torch.zeros((b, t), dtype=torch.float32)
    stale = torch.zeros((b, t), dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[i, :n] = torch.tensor(s.input_ids)
        attention[i, :n] = 1
        k = 0
        for start, end in s.actions:
            action[i, start:end] = 1
            rollout[i, start:end] = torch.tensor(s.rollout_logprobs[k : k + end - start])
            stale[i, start:end] = current_version - torch.tensor(s.token_versions[k : k + end - start])
            k += end - start
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        action_mask=action,
        rollout_logprobs=rollout,
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        temperatures=torch.tensor([s.temperature for s in samples], dtype=torch.float32),
        token_staleness=stale,
        prompt_ids=[s.prompt_id for s in samples],
        baseline_values=torch.tensor(
            [s.baseline_value if s.baseline_value is not None else 0.5 for s in samples], dtype=torch.float32
        ),
    )
