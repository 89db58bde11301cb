"""Event-time evidence arithmetic (core/evidence.py): hand-computed cases and properties."""

from __future__ import annotations

import math
from functools import reduce

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.evidence import (
    RHO,
    EvidenceState,
    event_coordinate,
    evidence_at,
    jeffreys_prior,
    uncertainty_weight,
    value,
)

# ρ = 0.875: ρ² = 0.765625, ρ³ = 0.669921875, ρ⁵ = 0.512908935546875.
RHO2, RHO3, RHO5 = 0.765625, 0.669921875, 0.512908935546875


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    # The absolute floor only matters for terms thousands of versions old (≈ 0 anyway).
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-280)


def test_powers_of_rho_written_out():
    assert (RHO**2, RHO**3, RHO**5) == (RHO2, RHO3, RHO5)


def test_hand_computed_prior_and_two_results():
    # Prior (4, 4) at version 0; R = 1 at version 2; R = 0 at version 3; read at version 5.
    # α = 4ρ⁵ + 1·ρ³ = 2.0516357421875 + 0.669921875 = 2.7215576171875
    # β = 4ρ⁵ + 1·ρ² = 2.0516357421875 + 0.765625    = 2.8172607421875
    alpha, beta = evidence_at(4.0, 4.0, 0, [(1, 2), (0, 3)], 5)
    assert alpha == pytest.approx(2.7215576171875, rel=1e-12)
    assert beta == pytest.approx(2.8172607421875, rel=1e-12)
    # v̂ = 2.7215576171875 / 5.538818359375 = 0.491360691144708...
    assert value(alpha, beta) == pytest.approx(0.4913606911447084, rel=1e-12)

    state = EvidenceState(4.0, 4.0, 0).add(1, 2).add(0, 3)
    # Stored at the newest version, 3: α = 4ρ³ + ρ, β = 4ρ³ + 1.
    assert state.ref_version == 3
    assert state.alpha == pytest.approx(4 * RHO3 + 0.875, rel=1e-12)
    assert state.beta == pytest.approx(4 * RHO3 + 1.0, rel=1e-12)
    a5, b5 = state.at(5)
    assert a5 == pytest.approx(2.7215576171875, rel=1e-12)
    assert b5 == pytest.approx(2.8172607421875, rel=1e-12)
    assert state.value == pytest.approx(0.4913606911447084, rel=1e-12)


def test_jeffreys_prior_hand_computed():
    # 3 successes in 8: α0 = 8·3.5/9 = 28/9 = 3.111..., β0 = 8 − 28/9 = 44/9 = 4.888...
    alpha0, beta0 = jeffreys_prior(3, 8)
    assert alpha0 == pytest.approx(3.1111111111111111, rel=1e-12)
    assert beta0 == pytest.approx(4.8888888888888889, rel=1e-12)
    # 0 of 0: 8·0.5/1 = 4 each.
    assert jeffreys_prior(0, 0) == (4.0, 4.0)


@pytest.mark.parametrize(
    "args",
    [(4, 3), (-1, 3), (1.0, 3), (True, 3), (1, 3.0), (1, 3, 0.0), (1, 3, -8.0), (1, 3, math.inf)],
)
def test_jeffreys_prior_rejects(args):
    with pytest.raises(ValueError):
        jeffreys_prior(*args)


def test_value_and_uncertainty_weight():
    assert value(3.0, 1.0) == 0.75
    # sqrt(0.5·0.5 + 0.05) = sqrt(0.3) = 0.5477225575051661
    assert uncertainty_weight(0.5) == pytest.approx(0.5477225575051661, rel=1e-12)
    # sqrt(0 + 0.05)
    assert uncertainty_weight(1.0) == pytest.approx(math.sqrt(0.05), rel=1e-12)
    for bad in [(0.0, 0.0), (-1.0, 1.0), (math.nan, 1.0), (math.inf, 1.0)]:
        with pytest.raises(ValueError):
            value(*bad)
    for bad in (-0.1, 1.1, math.nan):
        with pytest.raises(ValueError):
            uncertainty_weight(bad)


def test_event_coordinate():
    # z(v) = −v·log ρ = 3 · 0.13353139262452263
    assert event_coordinate(3) == pytest.approx(3 * 0.13353139262452263, rel=1e-12)
    assert event_coordinate(0) == 0.0
    with pytest.raises(ValueError):
        event_coordinate(-1)


@pytest.mark.parametrize(
    "results", [[(1.5, 0)], [(-0.1, 0)], [(math.nan, 0)], [(True, 0)], [(1, -1)], [(1, 1.0)]]
)
def test_evidence_at_rejects_bad_results(results):
    with pytest.raises(ValueError):
        evidence_at(4.0, 4.0, 0, results, 5)


def test_evidence_at_rejects_bad_rho_and_prior():
    with pytest.raises(ValueError):
        evidence_at(4.0, 4.0, 0, [], 5, rho=1.0)
    with pytest.raises(ValueError):
        evidence_at(-1.0, 4.0, 0, [], 5)


def test_result_newer_than_reader_weighs_more_than_one():
    # A result generated at version 4 read from version 3: weight ρ^(3−4) = 1/0.875.
    alpha, beta = evidence_at(0.0, 0.0, 0, [(1, 4)], 3)
    assert alpha == pytest.approx(1 / 0.875, rel=1e-12)
    assert beta == 0.0
    assert EvidenceState(0.0, 0.0, 0).add(1, 4).at(3) == (pytest.approx(1 / 0.875, rel=1e-12), 0.0)


def test_thousands_of_versions_do_not_overflow():
    # Results spread over 20 000 versions, read at the last one and at version 0.
    results = [(float(i % 3 == 0), 4 * i) for i in range(5000)]
    alpha, beta = evidence_at(4.0, 4.0, 0, results, 20_000)
    state = reduce(lambda s, rv: s.add(*rv), results, EvidenceState(4.0, 4.0, 0))
    a2, b2 = state.at(20_000)
    assert all(math.isfinite(x) for x in (alpha, beta, a2, b2))
    assert close(alpha, a2) and close(beta, b2)
    # Result at version 19 996 (i = 4999, R = 0): β ≥ ρ⁴, the geometric tail bounds the rest.
    assert beta == pytest.approx(sum(RHO ** (20_000 - 4 * i) for i in range(5000) if i % 3), rel=1e-9)
    # A prior 20 000 versions old underflows harmlessly to 0 rather than overflowing.
    assert evidence_at(4.0, 4.0, 0, [], 20_000) == (0.0, 0.0)
    # Reading long after the evidence: the stored value is still exact.
    assert EvidenceState(4.0, 4.0, 0).value == 0.5
    # Reading 20 000 versions *before* the evidence would overflow: a clear error.
    with pytest.raises(ValueError, match="overflow"):
        evidence_at(0.0, 0.0, 0, [(1, 20_000)], 0)
    with pytest.raises(ValueError, match="overflow"):
        EvidenceState(1.0, 0.0, 20_000).at(0)


def test_merge_refuses_different_rho():
    with pytest.raises(ValueError):
        EvidenceState(1.0, 1.0, 0).merge(EvidenceState(1.0, 1.0, 0, rho=0.9))


rewards = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.01, 0.99))
results_st = st.lists(st.tuples(rewards, st.integers(0, 4000)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(results=results_st, data=st.data())
def test_any_receipt_order_gives_the_same_state(results, data):
    perm = data.draw(st.permutations(results))
    prior = EvidenceState(3.0, 5.0, 0)
    a = reduce(lambda s, rv: s.add(*rv), results, prior)
    b = reduce(lambda s, rv: s.add(*rv), perm, prior)
    assert a.ref_version == b.ref_version
    assert close(a.alpha, b.alpha) and close(a.beta, b.beta)


@settings(max_examples=200, deadline=None)
@given(results=results_st, v_q=st.integers(0, 4000), split=st.integers(0, 40))
def test_incremental_state_matches_the_formula(results, v_q, split):
    # Two batches merged (two learners' partial sums) equal the direct sum of the formula.
    left = reduce(lambda s, rv: s.add(*rv), results[:split], EvidenceState(3.0, 5.0, 7))
    right = reduce(lambda s, rv: s.add(*rv), results[split:], EvidenceState(0.0, 0.0, 0))
    merged = right.merge(left)
    expected = evidence_at(3.0, 5.0, 7, results, v_q)
    got = merged.at(v_q)
    assert close(got[0], expected[0]) and close(got[1], expected[1])
    # The value does not depend on the reading version.
    if sum(expected) > 1e-250:
        assert merged.value == pytest.approx(value(*expected), rel=1e-9)
