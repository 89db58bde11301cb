"""The off-policy correction family (papers/004): the MIS mask, PPO-EWMA, snapshots."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.algo.dis import dis_loss
from learner.algo.offpolicy import SnapshotStore, ewma_beta, ewma_proxy_step, mis_token_mask

LN2 = math.log(2.0)


def _row(*xs):
    return torch.tensor([list(xs)], dtype=torch.float64)


def test_every_branch_on_hand_made_ratios():
    # eps_low = 0.2, eps_high = 0.28, c = 2 → r_d must lie in [0.5, 2].
    # token: r_d, r_s, A → kept?
    #   0: r_d 1,   r_s 1,    A +1 → yes (both constraints hold)
    #   1: r_d 4,   r_s 1,    A +1 → no  (r_d > c = 2)
    #   2: r_d 1/4, r_s 1,    A −1 → no  (r_d < 1/c = 0.5)
    #   3: r_d 1,   r_s 2,    A +1 → no  (A ≥ 0 and r_s = 2 > 1.28)
    #   4: r_d 1,   r_s 2,    A −1 → yes (A < 0 only bounds r_s from below)
    #   5: r_d 1,   r_s 1/2,  A −1 → no  (A < 0 and r_s = 0.5 < 0.8)
    #   6: r_d 1,   r_s 1/2,  A +1 → yes (A ≥ 0 only bounds r_s from above)
    #   7: r_d 1,   r_s 2,    A 0  → no  (A = 0 counts as A ≥ 0: 2 > 1.28)
    old = _row(0.0, 2 * LN2, -2 * LN2, 0.0, 0.0, 0.0, 0.0, 0.0)
    beh = torch.zeros(1, 8, dtype=torch.float64)
    new = old + _row(0.0, 0.0, 0.0, LN2, LN2, -LN2, -LN2, LN2)
    adv = _row(1, 1, -1, 1, -1, -1, 1, 0)
    mask = mis_token_mask(new, old, beh, adv, eps_low=0.2, eps_high=0.28, c=2.0)
    assert mask.tolist() == [[True, False, False, False, True, False, True, False]]


def test_bounds_are_closed():
    # r_d exactly 1/c and c (c = 2, in float64 exp(±ln 2) = 0.5, 2 to the last bit), r_s exactly 1 + eps_high = 2.
    old = _row(LN2, -LN2, 0.0)
    beh = torch.zeros(1, 3, dtype=torch.float64)
    new = old + _row(0.0, 0.0, LN2)
    adv = _row(1, 1, 1)
    assert mis_token_mask(new, old, beh, adv, eps_low=0.2, eps_high=1.0, c=2.0).tolist() == [
        [True, True, True]
    ]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -9999.0])
@pytest.mark.parametrize("where", ["new", "old", "behaviour"])
def test_non_finite_or_sentinel_logprob_is_never_kept(bad, where):
    t = {k: _row(-0.5, -0.5) for k in ("new", "old", "behaviour")}
    t[where][0, 1] = bad
    mask = mis_token_mask(t["new"], t["old"], t["behaviour"], _row(1, 1), eps_low=1.0, eps_high=1e9, c=1e9)
    assert mask.tolist() == [[True, False]]


def test_non_finite_advantage_and_action_mask():
    lp = torch.zeros(1, 3, dtype=torch.float64)
    mask = mis_token_mask(
        lp, lp, lp, _row(float("nan"), 1, 1), eps_low=0.2, eps_high=0.2, c=2.0, action_mask=_row(1, 1, 0)
    )
    assert mask.tolist() == [[False, True, False]]


def test_argument_errors():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="c must be >= 1"):
        mis_token_mask(lp, lp, lp, lp, eps_low=0.2, eps_high=0.2, c=0.5)
    with pytest.raises(ValueError, match="interval"):
        mis_token_mask(lp, lp, lp, lp, eps_low=0.2, eps_high=0.2, c=(1.2, 3.0))
    with pytest.raises(ValueError, match="eps_low"):
        mis_token_mask(lp, lp, lp, lp, eps_low=1.5, eps_high=0.2, c=2.0)
    with pytest.raises(ValueError, match="advantages has shape"):
        mis_token_mask(lp, lp, lp, torch.zeros(1, 3), eps_low=0.2, eps_high=0.2, c=2.0)


# Table 1: the variants are settings of the one mask. Ratios are drawn away from the bounds so
# that open (DIS) and closed (MIS) intervals agree.
_LOGR = st.floats(-2.0, 2.0).filter(
    lambda x: min(abs(x - b) for b in (math.log(0.7), math.log(1.2), math.log(0.8), math.log(6.0))) > 1e-3
)


@settings(deadline=None, max_examples=60)
@given(st.lists(st.tuples(_LOGR, _LOGR, st.sampled_from([-1.0, 1.0])), min_size=1, max_size=12))
def test_ppo_clip_is_mis_with_old_equal_to_behaviour(rows):
    """PPO clip (π_old = μ): the tokens with a gradient are exactly the MIS mask with r_d = 1."""
    beh = torch.tensor([[r[0] for r in rows]], dtype=torch.float64)
    new = (beh + torch.tensor([[r[1] for r in rows]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[r[2] for r in rows]], dtype=torch.float64)
    eps = 0.2
    ratio = torch.exp(new - beh)
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv).sum()
    loss.backward()
    has_grad = new.grad != 0
    mask = mis_token_mask(new, beh, beh, adv, eps_low=eps, eps_high=eps, c=1.0)
    assert torch.equal(mask, has_grad)


@settings(deadline=None, max_examples=60)
@given(st.lists(st.tuples(_LOGR, st.sampled_from([-1.0, 1.0])), min_size=1, max_size=12))
def test_sao_dis_is_mis_without_old_policy(rows):
    """DIS (SAO §2.2): π_old := πθ (r_s = 1) and the interval (1 − ε_l, 1 + ε_h) on πθ/μ."""
    lr = torch.tensor([[r[0] for r in rows]], dtype=torch.float32)
    adv = torch.tensor([[r[1] for r in rows]], dtype=torch.float32)
    beh = torch.full_like(lr, -1.0)
    new = (beh + lr).requires_grad_()
    loss, _ = dis_loss(new, beh, adv, torch.ones_like(lr), eps_low=0.3, eps_high=5.0)
    loss.backward()
    mask = mis_token_mask(new, new, beh, adv, eps_low=0.0, eps_high=0.0, c=(0.7, 6.0))
    assert torch.equal(mask, new.grad != 0)


def test_decoupled_ppo_bounds_the_discrepancy_and_clips_the_drift():
    # Decoupled PPO: π_old is a proximal policy; r_d = π_prox/μ within [1/c, c] = [1/3, 3],
    # r_s = πθ/π_prox clipped at ε = 0.2. Token 0: r_d 2, r_s 1.1, A + → kept; token 1: r_d 4 → masked
    # although its drift is fine; token 2: r_d 1, r_s 1.5, A + → clipped.
    beh = torch.zeros(1, 3, dtype=torch.float64)
    old = _row(LN2, 2 * LN2, 0.0)
    new = old + _row(math.log(1.1), 0.0, math.log(1.5))
    mask = mis_token_mask(new, old, beh, _row(1, 1, 1), eps_low=0.2, eps_high=0.2, c=3.0)
    assert mask.tolist() == [[True, False, False]]


def test_ewma_beta():
    # W / (W + 2): W = 1 → 1/3, W = 2 → 1/2, W = 3 → 3/5.
    assert [ewma_beta(w) for w in (1, 2, 3)] == pytest.approx([1 / 3, 0.5, 0.6])
    with pytest.raises(ValueError):
        ewma_beta(0)


def test_ewma_step_and_reset():
    prox = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    cur = {"w": torch.tensor([4.0, -1.0]), "b": torch.tensor([3.0])}
    # β = 0.5: (0.5·1 + 4)/1.5 = 3, (0.5·2 − 1)/1.5 = 0, (0 + 3)/1.5 = 2.
    new, reset = ewma_proxy_step(prox, cur, beta=0.5, active_fraction=0.95)
    assert not reset
    assert new["w"].tolist() == pytest.approx([3.0, 0.0]) and new["b"].tolist() == pytest.approx([2.0])
    assert prox["w"].tolist() == [1.0, 2.0]  # inputs untouched
    # ρ_t = 0.89 < τ = 0.9: hard reset to a copy of the current parameters.
    new, reset = ewma_proxy_step(prox, cur, beta=0.5, active_fraction=0.89)
    assert reset and new["w"].tolist() == [4.0, -1.0]
    new["w"][0] = 99.0
    assert cur["w"][0].item() == 4.0  # a copy, not an alias of the live parameters
    # exactly τ does not reset (the paper resets when ρ_t < τ).
    assert ewma_proxy_step(prox, cur, beta=0.5, active_fraction=0.9)[1] is False
    with pytest.raises(ValueError, match="names differ"):
        ewma_proxy_step(prox, {"w": cur["w"]}, beta=0.5, active_fraction=1.0)


def test_snapshot_window():
    store = SnapshotStore(window=2)
    for v in (1, 2, 3):
        store.put(v, {"w": torch.full((2, 2), float(v))})
    # W = 2 keeps versions 2 and 3; version 1 is outside the window.
    assert store.versions() == [2, 3]
    assert store.get(1) is None and store.get(3)["w"].tolist() == [[3.0, 3.0], [3.0, 3.0]]
    # two float32 tensors of 4 elements: 2 · 4 · 4 bytes.
    assert store.nbytes() == 32
    live = torch.zeros(2)
    store.put(4, {"w": live})
    live += 7.0
    assert store.get(4)["w"].tolist() == [0.0, 0.0]  # a copy taken at put
    with pytest.raises(ValueError, match="not newer"):
        store.put(4, {"w": live})
    with pytest.raises(ValueError):
        SnapshotStore(0)
