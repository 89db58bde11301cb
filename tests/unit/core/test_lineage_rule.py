"""A version is judged as itself (core.sequential.decide_lineage; issue 40, item 2): each
version of a lineage on its own ratings, the error rate shared by α_j = α / (j (j + 1)), with
the bounds written out by hand (docs/guard.md's formulas, one rating at a time)."""

from __future__ import annotations

import math

import pytest

from core.sequential import Decision, RuleParams, decide, decide_lineage, member_alpha


def prpl_eb_lower(xs: list[float], alpha_side: float, cap: float = 0.5) -> float:
    """docs/guard.md's lower bound written out one rating at a time, with the running max."""
    log_inv = math.log(1 / alpha_side)
    s_x = s_sq = s_lam = s_lamx = s_pen = 0.0
    best = 0.0
    for i, x in enumerate(xs, start=1):
        mu_prev = (0.5 + s_x) / i
        var_prev = (0.25 + s_sq) / i
        lam = min(cap, math.sqrt(2 * log_inv / (var_prev * i * math.log(1 + i))))
        s_x += x
        s_sq += (x - (0.5 + s_x) / (i + 1)) ** 2
        s_lam += lam
        s_lamx += lam * x
        s_pen += (x - mu_prev) ** 2 * (-math.log(1 - lam) - lam)
        best = max(best, (s_lamx - log_inv - s_pen) / s_lam)
    return min(max(best, 0.0), 1.0)


def test_the_versions_share_alpha_and_the_shares_sum_to_it():
    # α/(j(j+1)): 0.05/2, 0.05/6, 0.05/12; the first J sum to α(1 − 1/(J+1)) (telescoping).
    assert [member_alpha(0.05, j) for j in (1, 2, 3)] == pytest.approx([0.025, 0.05 / 6, 0.05 / 12])
    assert sum(member_alpha(0.05, j) for j in range(1, 100)) == pytest.approx(0.05 * (1 - 1 / 100))
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="position"):
            member_alpha(0.05, bad)


def test_a_lineage_that_turned_bad_is_not_promoted_on_its_first_version_s_ratings():
    """The issue's case: 60 ratings at 0.8 (version 3), then 60 at 0.1 (version 4), against a
    control at 0.5. Pooled into one stream with a running intersection the lineage's lower bound
    stays where the first version put it (0.676), above its own upper bound (0.588), and the
    rule promoted both versions."""
    pooled = decide([0.8] * 60 + [0.1] * 60, [0.5] * 120)
    assert pooled.decision == Decision.PROMOTE
    assert pooled.candidate.lower == pytest.approx(0.676, abs=5e-4)
    assert pooled.candidate.upper == pytest.approx(0.588, abs=5e-4)
    # Judged as itself: version 4 (the second, α_2 = 0.05/6, each side 1/240) against the 60
    # control ratings of its own window. upper_C on sixty 0.1s is the mirror of the lower bound
    # on sixty 0.9s; lower_P on sixty 0.5s.
    j, verdict = decide_lineage([([0.8] * 60, [0.5] * 60), ([0.1] * 60, [0.5] * 60)])
    side = 0.05 / 6 / 2
    upper_c = 1 - prpl_eb_lower([0.9] * 60, side)
    lower_p = prpl_eb_lower([0.5] * 60, side)
    assert upper_c - lower_p == pytest.approx(-0.0329, abs=5e-4)  # < 0: shown worse
    assert j == 1 and verdict.decision == Decision.REJECT
    assert verdict.upper == pytest.approx(upper_c - lower_p)
    assert verdict.reason.startswith("version 2 of 2 (α_j = 0.00833): worse: upper bound < 0")


def test_a_version_without_ratings_of_its_own_is_never_promoted():
    """Versions [3, 4] were promoted with 0 ratings of version 4."""
    params = RuleParams(delta=0.5, min_samples=20)
    first = ([1.0] * 60, [1.0] * 60)
    assert decide_lineage([first], params)[1].decision == Decision.PROMOTE
    j, verdict = decide_lineage([first, ([], [1.0] * 10)], params)
    assert j == 1 and verdict.decision == Decision.CONTINUE and verdict.candidate.n == 0
    # Nor at a time-out that promotes: it waits for min_samples ratings of the newest.
    late = RuleParams(delta=0.5, min_samples=20, max_samples=60, on_timeout=Decision.PROMOTE)
    assert decide_lineage([first, ([1.0] * 19, [1.0] * 19)], late)[1].decision == Decision.CONTINUE
    # A time-out that rejects does not wait: 60 ratings of the lineage reach max_samples 60.
    strict = RuleParams(delta=0.01, min_samples=20, max_samples=60)
    _, out = decide_lineage([([0.5] * 30, [0.5] * 30), ([0.5] * 30, [0.5] * 30)], strict)
    assert out.decision == Decision.REJECT and out.timed_out


def test_an_older_version_shown_worse_rejects_the_lineage_and_a_veto_never_promotes():
    # Version 1: 30 losses against 30 wins at α_1 = 0.025: upper(Δ) = 1 − 2·lower(thirty 1s).
    low = prpl_eb_lower([1.0] * 30, 0.025 / 2)
    j, verdict = decide_lineage([([0.0] * 30, [1.0] * 30), ([1.0] * 5, [1.0] * 5)])
    assert j == 0 and verdict.decision == Decision.REJECT and verdict.upper == pytest.approx(1 - 2 * low)
    _, veto = decide_lineage([([1.0] * 60, [1.0] * 60)], RuleParams(delta=0.5), promotes=False)
    assert veto.decision == Decision.CONTINUE
    assert decide_lineage([])[0] is None
