"""DIS loss (SAO §2.2): interval bounds, sign-independent masking, hand-computed values."""

import math

import pytest
import torch

from learner.algo.dis import DIS_PRESETS, dis_loss


def _row(*xs):
    return torch.tensor([list(xs)], dtype=torch.float32)


def test_presets():
    assert DIS_PRESETS["math_tir"] == (0.3, 5.0)
    assert DIS_PRESETS["coding_agent"] == (0.8, 3.0)


def test_loss_value_and_stats_on_1x3():
    # ratios r = exp(lp - rollout) = [1, 0.5, 2]; interval (0.7, 6): token 2 (r = 0.5) is dropped.
    lp = _row(-1.0, -2.0, -0.5).requires_grad_()
    rollout = _row(-1.0, -2.0 + math.log(2.0), -0.5 - math.log(2.0))
    adv = _row(1.0, -2.0, 0.5)
    mask = _row(1, 1, 1)
    loss, stats = dis_loss(lp, rollout, adv, mask, eps_low=0.3, eps_high=5.0)
    # L = -(1·1·(-1.0) + 0 + 2·0.5·(-0.5)) / 3 = 1.5 / 3
    assert loss.item() == pytest.approx(1.5 / 3, abs=1e-6)
    loss.backward()
    # dL/dlp_t = -f(r_t)·A_t/3 = [-1·1/3, 0, -2·0.5/3]
    assert lp.grad.tolist()[0] == pytest.approx([-1 / 3, 0.0, -1 / 3], abs=1e-6)
    assert stats["action_tokens"] == 3
    assert stats["kept_fraction"] == pytest.approx(2 / 3)
    assert stats["mean_abs_log_ratio"] == pytest.approx((0 + math.log(2) + math.log(2)) / 3, abs=1e-6)
    # k3: (r-1) - log r = 0, (-0.5 + ln 2), (1 - ln 2); the ln 2 terms cancel in the sum: 0.5 / 3
    assert stats["approx_kl"] == pytest.approx(0.5 / 3, abs=1e-6)


def _ratio_of(log_ratio: float) -> float:
    """The float32 ratio dis_loss computes for this log ratio (to place a bound exactly on it)."""
    return torch.exp(torch.tensor(log_ratio, dtype=torch.float32)).item()


@pytest.mark.parametrize("side", ["low", "high"])
def test_ratio_exactly_at_bound_is_excluded_and_just_inside_is_kept(side):
    log_ratio = math.log(0.7) if side == "low" else math.log(6.0)
    r = _ratio_of(log_ratio)
    lp = _row(log_ratio).requires_grad_()
    rollout = _row(0.0)
    adv = _row(1.0)
    mask = _row(1)
    # Bound placed exactly on r: 1 - eps_low == r, or 1 + eps_high == r (both exact in binary).
    at = {"eps_low": 1.0 - r, "eps_high": 5.0} if side == "low" else {"eps_low": 0.3, "eps_high": r - 1.0}
    loss, stats = dis_loss(lp, rollout, adv, mask, **at)
    loss.backward()
    assert stats["kept_fraction"] == 0.0
    assert lp.grad.item() == 0.0
    if side == "low":
        widened = {"eps_low": 1.0 - r + 1e-4, "eps_high": 5.0}
    else:
        widened = {"eps_low": 0.3, "eps_high": r - 1.0 + 1e-4}
    lp.grad = None
    loss, stats = dis_loss(lp, rollout, adv, mask, **widened)
    loss.backward()
    assert stats["kept_fraction"] == 1.0
    # grad = -f(r)·A / 1 = -r
    assert lp.grad.item() == pytest.approx(-r, rel=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_out_of_interval_masked_whatever_the_advantage_sign(sign):
    # r = 0.5 (below 0.7) and r = 8 (above 6), both with advantage of the same sign.
    lp = _row(math.log(0.5), math.log(8.0)).requires_grad_()
    rollout = _row(0.0, 0.0)
    adv = _row(sign, sign)
    loss, stats = dis_loss(lp, rollout, adv, _row(1, 1))
    loss.backward()
    assert loss.item() == 0.0
    assert lp.grad.tolist() == [[0.0, 0.0]]
    assert stats["kept_fraction"] == 0.0


def test_masked_positions_do_not_count_even_when_non_finite():
    lp = _row(-1.0, float("-inf"), -2.0).requires_grad_()
    rollout = _row(-1.0, 0.0, -2.0)
    adv = _row(2.0, 5.0, 1.0)
    mask = torch.tensor([[True, False, True]])
    loss, stats = dis_loss(lp, rollout, adv, mask)
    # L = -(1·2·(-1) + 1·1·(-2)) / 2 = 2
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-1.0, 0.0, -0.5])
    assert stats["action_tokens"] == 2


def test_coding_agent_preset_interval():
    eps_low, eps_high = DIS_PRESETS["coding_agent"]
    # interval (0.2, 4.0): r = 0.25 kept, r = 0.15 dropped, r = 3.5 kept, r = 4.5 dropped
    lp = _row(*(math.log(x) for x in (0.25, 0.15, 3.5, 4.5)))
    _, stats = dis_loss(lp, _row(0, 0, 0, 0), _row(1, 1, 1, 1), _row(1, 1, 1, 1), eps_low, eps_high)
    assert stats["kept_fraction"] == pytest.approx(2 / 4)


def test_staleness_breakdown():
    lp = _row(math.log(2.0), 0.0, math.log(0.5), 0.0)
    staleness = torch.tensor([[0, 0, 3, 3]])
    mask = _row(1, 1, 1, 0)
    _, stats = dis_loss(lp, _row(0, 0, 0, 0), _row(1, 1, 1, 1), mask, staleness=staleness)
    by = stats["mean_abs_log_ratio_by_staleness"]
    # staleness 0: (ln 2 + 0) / 2; staleness 3: only the unmasked token, |ln 0.5| = ln 2
    assert set(by) == {0, 3}
    assert by[0] == pytest.approx(math.log(2) / 2, abs=1e-6)
    assert by[3] == pytest.approx(math.log(2), abs=1e-6)


def test_empty_mask_gives_zero_loss_with_graph():
    lp = _row(-1.0, -2.0).requires_grad_()
    loss, stats = dis_loss(lp, _row(0, 0), _row(1, 1), _row(0, 0))
    loss.backward()
    assert loss.item() == 0.0
    assert stats["kept_fraction"] == 0.0


def test_errors():
    x = _row(0.0, 0.0)
    with pytest.raises(ValueError):
        dis_loss(x, _row(0.0), x, x)
    with pytest.raises(ValueError):
        dis_loss(x, x, x, x, eps_low=1.5)
    with pytest.raises(ValueError):
        dis_loss(x, x, x, x, eps_high=-1.0)
