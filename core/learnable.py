"""Which logged trajectories the learner can learn from, and if not, why (docs/design.md §5.1, §8).

One rule, in one place: the learner applies it to every joined trajectory and episode
(``learner.data.samples``), and the reasons it returns are the learner's counters and dead-letter
names (``/admin/learner``). In order, a trajectory is not learned from when

1. its request opted out of training (``TrajectoryRecord.train`` False, docs/privacy.md):
   ``excluded_opted_out``;
2. it is not a whole answer (``core.records.is_whole_answer``): ``excluded_aborted``,
   ``excluded_error``, or ``excluded_unfinished`` for any other finish reason;
3. top-p < 1 or top-k truncated its distribution: ``excluded_truncated_sampling``;
4. it was decoded greedily (temperature below ``GREEDY_BELOW``): ``excluded_greedy``;
5. its response is empty: ``excluded_empty_response``.

Truncation and greedy decoding change the distribution the logged logprobs come from, and the
learner does not reproduce them (**project choice**, docs/design.md §5.1): such answers are
served and rated but not trained on.
"""

from __future__ import annotations

from core.records import SamplingRecord, TrajectoryRecord, is_whole_answer

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy decoding: vLLM's own threshold (``_SAMPLING_EPS``), under
which it takes the most likely token instead of sampling."""

OPTED_OUT = "excluded_opted_out"
UNFINISHED = {"abort": "excluded_aborted", "error": "excluded_error"}
"""The reason of a finish reason that is no whole answer; any other such finish reason is
``UNFINISHED_OTHER``."""
UNFINISHED_OTHER = "excluded_unfinished"
NOT_WHOLE_ANSWER = frozenset({*UNFINISHED.values(), UNFINISHED_OTHER})
"""The reasons of rule 2: the trajectory is not a whole answer."""
TRUNCATED = "excluded_truncated_sampling"
GREEDY = "excluded_greedy"
EMPTY_RESPONSE = "excluded_empty_response"


def unfinished_reason(finish_reason: str) -> str | None:
    """Rule 2 alone: None for a whole answer (``stop``, ``length``), else its reason
    (``excluded_aborted``, ``excluded_error``, ``excluded_unfinished``)."""
    if is_whole_answer(finish_reason):
        return None
    return UNFINISHED.get(finish_reason, UNFINISHED_OTHER)


def sampling_reason(sampling: SamplingRecord) -> str | None:
    """Rules 3 and 4 alone: None when the learner can evaluate the policy on the distribution
    ``sampling`` drew from, else ``excluded_truncated_sampling`` or ``excluded_greedy``."""
    if sampling.truncated:
        return TRUNCATED
    if sampling.temperature < GREEDY_BELOW:
        return GREEDY
    return None


def _empty_reason(rec: TrajectoryRecord) -> str | None:
    return None if rec.response_token_ids else EMPTY_RESPONSE


def exclusion_reason(rec: TrajectoryRecord) -> str | None:
    """Why the learner cannot learn from ``rec`` (the first of rules 1-5 that applies, module
    docstring), or None when it can."""
    if not rec.train:
        return OPTED_OUT
    return unfinished_reason(rec.finish_reason) or sampling_reason(rec.sampling) or _empty_reason(rec)


def episode_exclusion_reason(turns: list[TrajectoryRecord]) -> str | None:
    """Why the learner cannot learn from an episode of ``turns`` (in turn order), or None: rule 1
    for any turn, then rule 2 for any turn (the first such turn names the reason), then rules 3-5
    for the last turn, whose prompt and response are the sequence learned (``learner.data.samples``)."""
    for rec in turns:
        if not rec.train:
            return OPTED_OUT
    for rec in turns:
        why = unfinished_reason(rec.finish_reason)
        if why is not None:
            return why
    last = turns[-1]
    return sampling_reason(last.sampling) or _empty_reason(last)
