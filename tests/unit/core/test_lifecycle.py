"""The version lifecycle (core/lifecycle.py, core/lifecycle_store.py): transitions, lineage, the
guard's verdict on hand-made reward streams, and the database side on a migrated SQLite."""

from __future__ import annotations

import pytest

from core.lifecycle import (
    Stage,
    TransitionError,
    VersionStage,
    check_transition,
    drifted,
    judge_lineage,
    lineage,
    promoted,
)
from core.sequential import Decision, RuleParams
from testing.backends.lifecycle import *  # noqa: F403 (its tests run here on SQLite)
from testing.guard import prpl_eb_lower

C, P, R, X = Stage.CANDIDATE, Stage.CANARY, Stage.PROMOTED, Stage.REJECTED


def rows(*stages_):
    return [VersionStage(v, s) for v, s in enumerate(stages_)]


# ------------------------------------------------------------------ transitions
@pytest.mark.parametrize(
    ("current", "target"),
    [(C, P), (C, R), (C, X), (P, R), (P, X), (R, X)],
)
def test_allowed_moves(current, target):
    assert check_transition(3, current, target) == target


@pytest.mark.parametrize(
    ("current", "target", "message"),
    [
        (X, P, "cannot go from rejected to canary"),
        (X, R, "cannot go from rejected to promoted"),
        (R, P, "cannot go from promoted to canary"),
        (P, C, "cannot go from canary to candidate"),
        (P, P, "already canary"),
        ("live", P, "unknown stage"),
    ],
)
def test_refused_moves_name_the_version_and_stages(current, target, message):
    with pytest.raises(TransitionError, match=message):
        check_transition(3, current, target)


def test_the_base_version_cannot_be_rejected():
    with pytest.raises(TransitionError, match="version 0"):
        check_transition(0, R, X)


def test_lineage_is_what_follows_the_newest_promoted_version_minus_the_rejected():
    # 0 promoted, 1 canary, 2 rejected by the gate, 3 canary: the lineage is [1, 3].
    assert promoted(rows(R, P, X, P)) == 0 and lineage(rows(R, P, X, P)) == [1, 3]
    # 0..2 promoted (a promotion), 3 rejected, 4 the rollback's version (promoted): empty.
    assert promoted(rows(R, R, R, X, R)) == 4 and lineage(rows(R, R, R, X, R)) == []
    with pytest.raises(ValueError, match="no promoted version"):
        promoted(rows(P, P))


def test_a_lineage_that_loses_every_rating_is_rejected_with_the_bounds_written_out():
    # 30 ratings each: the lineage scored 0 every time, the promoted record 1 every time.
    params = RuleParams(delta=0.05, alpha=0.05, min_samples=20)
    verdict = judge_lineage([0.0] * 30, [1.0] * 30, params)
    # Each one-sided bound at α/2 = 0.025. lower_P on thirty 1s; upper_C on thirty 0s is its
    # mirror (1 − lower on 1 − x = thirty 1s), so upper(Δ) = upper_C − lower_P = (1 − l) − l.
    low = prpl_eb_lower([1.0] * 30, 0.025)
    assert 0.5 < low < 1.0
    assert verdict.upper == pytest.approx((1 - low) - low)
    assert verdict.upper < 0 and verdict.decision == Decision.REJECT
    assert verdict.candidate.mean == 0.0 and verdict.promoted.mean == 1.0


def test_a_lineage_as_good_as_a_perfect_record_is_promoted():
    # Both arms 1 every time: lower(Δ) = lower_C − upper_P = l − 1 (upper_P = 1 for all 1s).
    params = RuleParams(delta=0.5, alpha=0.05, min_samples=20)
    verdict = judge_lineage([1.0] * 60, [1.0] * 60, params)
    low = prpl_eb_lower([1.0] * 60, 0.025)
    assert verdict.lower == pytest.approx(low - 1.0)
    assert low - 1.0 > -0.5 and verdict.decision == Decision.PROMOTE


def test_too_few_ratings_continue_and_a_time_out_takes_the_configured_action():
    params = RuleParams(min_samples=20, max_samples=40, on_timeout=Decision.REJECT)
    # 19 losing ratings: below min_samples on the lineage's arm, so no bound decides.
    assert judge_lineage([0.0] * 19, [1.0] * 30, params).decision == Decision.CONTINUE
    # Alternating 0/1 on both arms (means 0.5 and 0.5): undecided at 30 ratings …
    even = [0.0, 1.0] * 15
    assert judge_lineage(even, even, params).decision == Decision.CONTINUE
    # … and at 40 = max_samples the time-out rejects (on_timeout = reject).
    out = judge_lineage([0.0, 1.0] * 20, even, params)
    assert out.decision == Decision.REJECT and out.timed_out
    # On time: max_seconds 3600, 3600 s since the lineage started.
    timed = RuleParams(min_samples=20, max_seconds=3600.0, on_timeout=Decision.PROMOTE)
    assert judge_lineage(even, even, timed, elapsed_s=3599.0).decision == Decision.CONTINUE
    assert judge_lineage(even, even, timed, elapsed_s=3600.0).decision == Decision.PROMOTE


def test_drifted_is_the_first_measured_kl_over_the_bound():
    # nats/token; None: a step that measured none (the KL anchor off).
    assert drifted([0.01, None, 0.37], 0.6) is None
    assert drifted([0.2, 0.64, 3.0], 0.6) == 0.64
    assert drifted([0.6], 0.6) is None  # at the bound is not over it
    assert drifted([], 0.6) is None
