"""SPO++ advantages and policy loss (learner/algo/advantages.py): hand-computed cases and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from learner.algo.advantages import (
    batch_stats,
    spo_advantages,
    spo_ppo_loss,
    token_measure_normalize,
    trajectory_whiten,
)

F64 = torch.float64


def t(*xs, dtype=F64):
    return torch.tensor(xs, dtype=dtype)


def test_token_measure_normalize_hand_computed():
    # A = (1, −1), L = (3, 1): μ = (3·1 + 1·(−1))/4 = 0.5;
    # σ² = (3·(0.5)² + 1·(−1.5)²)/(4 − 1) = (0.75 + 2.25)/3 = 1; Ã = (0.5, −1.5)/(1 + 1e-8).
    out = token_measure_normalize(t(1.0, -1.0), torch.tensor([3, 1]))
    assert out.dtype == F64
    assert out.tolist() == pytest.approx([0.5 / (1 + 1e-8), -1.5 / (1 + 1e-8)], rel=1e-12)
    # Token-weighted centre: (3·0.5 − 1.5)/4 = 0.
    assert float((t(3, 1) * out).sum()) == pytest.approx(0.0, abs=1e-12)


def test_trajectory_whiten_hand_computed():
    # A = (1, −1): μ = 0, σ² = (1 + 1)/(2 − 1) = 2, Ã = ±1/√2 (up to the 1e-8).
    out = trajectory_whiten(t(1.0, -1.0))
    assert out.tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-7)


def test_spo_advantages_hand_computed():
    # A = R − v̂ = (1 − 0.25, 0 − 0.75)
    assert spo_advantages(t(1.0, 0.0), t(0.25, 0.75)).tolist() == [0.75, -0.75]
    with pytest.raises(ValueError):
        spo_advantages(t(1.5, 0.0), t(0.25, 0.75))
    with pytest.raises(ValueError):
        spo_advantages(t(1.0), t(0.25, 0.75))


def test_batch_stats_hand_computed():
    # A = (1, −1), L = (3, 1): L̄ = 2, Ā = 0; Cov_n = ((3−2)(1) + (1−2)(−1))/2 = 1.
    # Centre before = (3 − 1)/4 = 0.5; after token normalisation = 0.
    # Trajectory-whitened Ã = ±1/√2: centre = (3 − 1)/(4√2) = 0.35355… = Cov_n(L, Ã)/L̄ = (1/√2)/2.
    stats = batch_stats(t(1.0, -1.0), torch.tensor([3, 1]))
    assert stats["cov_n_length_adv"] == pytest.approx(1.0)
    assert stats["mean_length"] == pytest.approx(2.0)
    assert stats["token_centre_before"] == pytest.approx(0.5)
    assert stats["token_centre_after"] == pytest.approx(0.0, abs=1e-12)
    assert stats["token_centre_traj_whitened"] == pytest.approx(1 / (2 * math.sqrt(2)), rel=1e-7)


@pytest.mark.parametrize(
    "adv, lengths",
    [
        (t(1.0, -1.0), torch.tensor([1, 0])),  # one action token: no n−1 variance
        (t(1.0, -1.0), torch.tensor([3, -1])),
        (t(1.0, -1.0), torch.tensor([3, 1, 2])),
        (t(1.0, math.nan), torch.tensor([3, 1])),
        (torch.tensor([1, -1]), torch.tensor([3, 1])),
    ],
)
def test_normalize_rejects(adv, lengths):
    with pytest.raises(ValueError):
        token_measure_normalize(adv, lengths)


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.floats(-5, 5, allow_subnormal=False), st.integers(0, 100)), min_size=2, max_size=30
    )
)
def test_token_normalisation_properties(pairs):
    a = t(*[p[0] for p in pairs])
    w = t(*[p[1] for p in pairs])
    total = w.sum()
    assume(total >= 2)
    mu = (w * a).sum() / total
    sigma = float(((w * (a - mu) ** 2).sum() / (total - 1)).sqrt())
    assume(sigma > 1e-3)
    out = token_measure_normalize(a, w.to(torch.int64))
    # Length-weighted mean 0, length-weighted (n−1) variance 1 (σ²/(σ + 1e-8)² exactly).
    assert float((w * out).sum() / total) == pytest.approx(0.0, abs=1e-9)
    var = float((w * out**2).sum() / (total - 1))
    assert var == pytest.approx(sigma**2 / (sigma + 1e-8) ** 2, rel=1e-9)
    stats = batch_stats(a, w)
    assert stats["token_centre_after"] == pytest.approx(0.0, abs=1e-9)
    # The paper's identity: the token-weighted centre of whitened advantages is Cov_n(L, Ã)/L̄.
    wh = trajectory_whiten(a)
    cov = float(((w - w.mean()) * (wh - wh.mean())).mean())
    assert stats["token_centre_traj_whitened"] == pytest.approx(cov / float(w.mean()), abs=1e-9)


# Five single-token trajectories (B = 5, T = 1), π_old = 1 so log r = log π_θ:
#  A = +1, r = 1.5: max(−1.5, −1.28) = −1.28   (clipped above 1 + 0.28; no gradient)
#  A = +1, r = 0.5: max(−0.5, −0.8)  = −0.5    (unclipped)
#  A = −1, r = 0.5: max(0.5, 0.8)    =  0.8    (clipped below 1 − 0.2; no gradient)
#  A = −1, r = 1.5: max(1.5, 1.28)   =  1.5;  min(1.5, c = 2) = 1.5
#  A = −1, r = 3.0: max(3.0, 1.28)   =  3.0;  min(3.0, 2)     = 2   (dual clip; no gradient)
ADV = [1.0, 1.0, -1.0, -1.0, -1.0]
RATIOS = [1.5, 0.5, 0.5, 1.5, 3.0]


def _case(is_weights):
    logp = torch.tensor([[math.log(r)] for r in RATIOS], dtype=F64, requires_grad=True)
    old = torch.zeros(5, 1, dtype=F64)
    rollout = -torch.log(t(*is_weights)).unsqueeze(-1)  # π_old/π_rollout = w
    mask = torch.ones(5, 1, dtype=torch.bool)
    return logp, old, rollout, mask


def test_ppo_loss_clip_and_dual_clip_hand_computed():
    logp, old, rollout, mask = _case([1, 1, 1, 1, 1])
    loss, stats = spo_ppo_loss(logp, old, rollout, t(*ADV), mask)
    # (−1.28 − 0.5 + 0.8 + 1.5 + 2)/5 = 2.52/5 = 0.504
    assert loss.item() == pytest.approx(0.504, rel=1e-12)
    loss.backward()
    # dℓ/dlog π = −A·r where unclipped: token 2: −0.5, token 4: +1.5; then /5 tokens.
    assert logp.grad.squeeze(-1).tolist() == pytest.approx([0.0, -0.1, 0.0, 0.3, 0.0], abs=1e-12)
    assert stats["clip_fraction"] == pytest.approx(2 / 5)  # tokens 1 and 3
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 5)  # token 5
    assert stats["rollout_is_mean"] == pytest.approx(1.0)
    assert stats["n_action_tokens"] == 5.0


def test_ppo_loss_rollout_is_truncation_hand_computed():
    # π_old/π_rollout = (3, 0.5, 1, 1, 1) → truncated at 2: (2, 0.5, 1, 1, 1).
    logp, old, rollout, mask = _case([3, 0.5, 1, 1, 1])
    loss, stats = spo_ppo_loss(logp, old, rollout, t(*ADV), mask)
    # (2·(−1.28) + 0.5·(−0.5) + 0.8 + 1.5 + 2)/5 = (−2.56 − 0.25 + 4.3)/5 = 1.49/5 = 0.298
    assert loss.item() == pytest.approx(0.298, rel=1e-12)
    loss.backward()
    # Token 2's gradient is scaled by its weight 0.5: 0.5·(−0.5)/5 = −0.05.
    assert logp.grad.squeeze(-1).tolist() == pytest.approx([0.0, -0.05, 0.0, 0.3, 0.0], abs=1e-12)
    assert stats["rollout_is_truncated_fraction"] == pytest.approx(1 / 5)
    assert stats["rollout_is_mean"] == pytest.approx((2 + 0.5 + 1 + 1 + 1) / 5)


def test_ppo_loss_ignores_padding_and_broadcasts_advantages():
    # One trajectory of two action tokens and two padding tokens holding −inf/NaN.
    logp = torch.tensor([[math.log(0.5), 0.0, -math.inf, math.nan]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, -math.inf, 0.0]], dtype=F64)
    rollout = torch.tensor([[0.0, 0.0, math.nan, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 0]])
    loss, stats = spo_ppo_loss(logp, old, rollout, t(1.0), mask)
    # Tokens: r = 0.5 → −0.5; r = 1 → −1; mean = −0.75.
    assert loss.item() == pytest.approx(-0.75, rel=1e-12)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert stats["n_action_tokens"] == 2.0
    per_token = torch.tensor([[1.0, 1.0, 5.0, 5.0]], dtype=F64)
    assert spo_ppo_loss(logp.detach(), old, rollout, per_token, mask)[0].item() == pytest.approx(-0.75)


def test_ppo_loss_bf16_inputs_compute_in_float32():
    logp = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = spo_ppo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"action_mask": torch.zeros(5, 1)},
        {"advantages": torch.zeros(4)},
        {"old_logprobs": torch.zeros(5, 2, dtype=F64)},
        {"dual_clip": 1.0},
        {"clip_low": 1.0},
        {"rollout_is_cap": 0.0},
    ],
)
def test_ppo_loss_rejects(kwargs):
    logp, old, rollout, mask = _case([1, 1, 1, 1, 1])
    args = {
        "logprobs": logp,
        "old_logprobs": old,
        "rollout_logprobs": rollout,
        "advantages": t(*ADV),
        "action_mask": mask,
    }
    args.update(kwargs)
    with pytest.raises(ValueError):
        spo_ppo_loss(**args)
