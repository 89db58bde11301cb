"""Skip-observation token GAE, length-adaptive λ and step-level GAE (SAO §2.4, appendix A.1)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.algo.gae import length_adaptive_lambda, step_gae, step_values, token_gae


def _t(*rows):
    return torch.tensor([list(r) for r in rows], dtype=torch.float32)


def test_single_action_segment_gamma1_lam_half():
    # positions: 0 prompt, 1..3 actions; reward 1 on the last action token.
    mask = _t([0, 1, 1, 1])
    values = _t([9.0, 0.5, 0.3, 0.8])
    rewards = _t([0, 0, 0, 1.0])
    adv, ret = token_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    d3 = 1.0 + 0.0 - 0.8  # terminal: V after the last action = 0
    d2 = 0.0 + 0.8 - 0.3
    d1 = 0.0 + 0.3 - 0.5
    a3 = d3
    a2 = d2 + 0.5 * a3
    a1 = d1 + 0.5 * a2
    assert adv.tolist()[0] == pytest.approx([0.0, a1, a2, a3], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0.0, a1 + 0.5, a2 + 0.3, a3 + 0.8], abs=1e-6)


def test_two_actions_with_observation_between():
    # [prompt, a0, a0, obs, obs, a1, pad]; gamma 0.9, lam 0.5
    mask = _t([0, 1, 1, 0, 0, 1, 0])
    values = _t([5.0, 0.5, 0.6, 100.0, -100.0, 0.7, 1e6])
    rewards = _t([0, 0, 0, 0, 0, 1.0, 0])
    g, lam = 0.9, 0.5
    d5 = 1.0 + g * 0.0 - 0.7  # last action token: terminal
    d2 = 0.0 + g * 0.7 - 0.6  # last token of a0 bootstraps from the first token of a1 (skips obs)
    d1 = 0.0 + g * 0.6 - 0.5
    a5 = d5
    a2 = d2 + g * lam * a5
    a1 = d1 + g * lam * a2
    adv, ret = token_gae(rewards, values, mask, gamma=g, lam=lam)
    assert adv.tolist()[0] == pytest.approx([0, a1, a2, 0, 0, a5, 0], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0, a1 + 0.5, a2 + 0.6, 0, 0, a5 + 0.7, 0], abs=1e-6)


def test_values_at_observation_and_padding_change_nothing():
    mask = _t([0, 1, 1, 0, 0, 1, 0, 0])
    rewards = _t([0, 0, 0, 0, 0, 1.0, 0, 0])
    values = _t([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    base = token_gae(rewards, values, mask, gamma=0.95, lam=0.7)
    huge = values.clone()
    huge[0, [0, 3, 4, 6, 7]] = torch.tensor([1e30, -1e30, float("nan"), float("inf"), 1e30])
    other = token_gae(rewards, huge, mask, gamma=0.95, lam=0.7)
    assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])


def test_lambda_per_row_tensor_matches_separate_rows():
    mask = _t([0, 1, 1, 1, 0], [0, 0, 1, 1, 1])
    values = _t([0, 0.2, 0.4, 0.1, 0], [0, 0, 0.9, 0.3, 0.5])
    rewards = _t([0, 0, 0, 1.0, 0], [0, 0, 0, 0, 0.5])
    lam = torch.tensor([0.3, 0.9])
    adv, ret = token_gae(rewards, values, mask, gamma=1.0, lam=lam)
    for i, li in enumerate([0.3, 0.9]):
        a_i, r_i = token_gae(rewards[i : i + 1], values[i : i + 1], mask[i : i + 1], 1.0, li)
        assert torch.allclose(adv[i], a_i[0]) and torch.allclose(ret[i], r_i[0])
    # row 0 by hand: d3 = 1 - 0.1, d2 = 0.1 - 0.4, d1 = 0.4 - 0.2
    a3 = 1 - 0.1
    a2 = (0.1 - 0.4) + 0.3 * a3
    a1 = (0.4 - 0.2) + 0.3 * a2
    assert adv[0].tolist() == pytest.approx([0, a1, a2, a3, 0], abs=1e-6)


def test_lambda_one_gives_monte_carlo_return_independent_of_values():
    mask = _t([0, 1, 0, 1, 1])
    rewards = _t([0, 0, 0, 0, 0.7])
    _, ret_a = token_gae(rewards, _t([0, 3.0, 0, -2.0, 5.0]), mask, gamma=0.5, lam=1.0)
    _, ret_b = token_gae(rewards, torch.zeros_like(rewards), mask, gamma=0.5, lam=1.0)
    # return at action j = 0.5^(actions after j) · 0.7
    assert ret_a.tolist()[0] == pytest.approx([0, 0.25 * 0.7, 0, 0.5 * 0.7, 0.7], abs=1e-6)
    assert torch.allclose(ret_a, ret_b)


def test_errors():
    mask = _t([0, 1])
    with pytest.raises(ValueError):
        token_gae(_t([1.0, 0]), _t([0, 0]), mask)  # reward on a non-action position
    with pytest.raises(ValueError):
        token_gae(_t([0, 1.0]), _t([0, 0]), mask, lam=1.5)
    with pytest.raises(ValueError):
        token_gae(_t([0, 1.0]), _t([0, 0]), mask, lam=torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError):
        token_gae(_t([0, 1.0]), _t([0, 0, 0]), mask)


def test_length_adaptive_lambda():
    lam = length_adaptive_lambda(torch.tensor([2, 1, 10, 0]), alpha=1.5)
    assert lam.tolist() == pytest.approx([1 - 1 / 3, 1 - 1 / 1.5, 1 - 1 / 15, 0.0], abs=1e-6)
    assert length_adaptive_lambda(torch.tensor([4]), alpha=0.5).tolist() == pytest.approx([1 - 1 / 2])
    with pytest.raises(ValueError):
        length_adaptive_lambda(torch.tensor([4]), alpha=0.0)


def test_step_values_mean_and_last():
    mask = _t([0, 1, 1, 0, 1, 1, 1])
    values = _t([7.0, 1.0, 3.0, 9.0, 2.0, 4.0, 6.0])
    assert step_values(values, mask, "mean").tolist()[0] == pytest.approx([7, 2, 2, 9, 4, 4, 4])
    assert step_values(values, mask, "last").tolist()[0] == pytest.approx([7, 3, 3, 9, 6, 6, 6])
    with pytest.raises(ValueError):
        step_values(values, mask, "first")


def test_step_gae_by_hand():
    # two steps: tokens 1-2 and 4-6; reward 1 on the last token; gamma 1, lam 0.5, mode mean
    mask = _t([0, 1, 1, 0, 1, 1, 1])
    values = _t([7.0, 0.2, 0.4, 9.0, 0.5, 0.6, 0.7])
    rewards = _t([0, 0, 0, 0, 0, 0, 1.0])
    v0 = (0.2 + 0.4) / 2
    v1 = (0.5 + 0.6 + 0.7) / 3
    a1 = 1.0 + 0.0 - v1
    a0 = (0.0 + v1 - v0) + 0.5 * a1
    adv, ret = step_gae(rewards, values, mask, gamma=1.0, lam=0.5, mode="mean")
    assert adv.tolist()[0] == pytest.approx([0, a0, a0, 0, a1, a1, a1], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0, a0 + v0, a0 + v0, 0, a1 + v1, a1 + v1, a1 + v1], abs=1e-6)
    adv_last, _ = step_gae(rewards, values, mask, gamma=1.0, lam=0.5, mode="last")
    b1 = 1.0 - 0.7
    b0 = (0.7 - 0.4) + 0.5 * b1
    assert adv_last.tolist()[0] == pytest.approx([0, b0, b0, 0, b1, b1, b1], abs=1e-6)


def test_step_values_with_token_gae_is_step_gae_when_gamma_lambda_is_one():
    mask = _t([0, 1, 1, 0, 1, 1, 1])
    values = _t([7.0, 0.2, 0.4, 9.0, 0.5, 0.6, 0.7])
    rewards = _t([0, 0, 0, 0, 0, 0, 1.0])
    a, _ = token_gae(rewards, step_values(values, mask, "mean"), mask, 1.0, 1.0)
    b, _ = step_gae(rewards, values, mask, 1.0, 1.0, "mean")
    assert torch.allclose(a, b, atol=1e-6)


@st.composite
def _episode(draw):
    n_actions = draw(st.integers(1, 4))
    segments = [draw(st.integers(1, 4)) for _ in range(n_actions)]
    total = sum(segments)
    vals = draw(st.lists(st.floats(-2, 2, width=32), min_size=total, max_size=total))
    reward = draw(st.floats(-1, 1, width=32))
    gaps = [draw(st.integers(1, 3)) for _ in range(n_actions - 1)]
    gamma = draw(st.sampled_from([1.0, 0.9]))
    lam = draw(st.floats(0, 1))
    return segments, vals, reward, gaps, gamma, lam


@settings(max_examples=60, deadline=None)
@given(_episode())
def test_inserting_observations_leaves_action_advantages_unchanged(ep):
    segments, vals, reward, gaps, gamma, lam = ep

    def build(obs_gaps):
        mask, values = [0], [0.0]
        k = 0
        for i, n in enumerate(segments):
            for _ in range(n):
                mask.append(1)
                values.append(vals[k])
                k += 1
            if i < len(segments) - 1:
                mask += [0] * obs_gaps[i]
                values += [123.0] * obs_gaps[i]
        rewards = [0.0] * len(mask)
        rewards[len(mask) - 1] = reward
        m = torch.tensor([mask], dtype=torch.float32)
        adv, ret = token_gae(torch.tensor([rewards]), torch.tensor([values]), m, gamma, lam)
        keep = m[0].bool()
        return adv[0][keep], ret[0][keep]

    adv_plain, ret_plain = build([0] * len(gaps))
    adv_obs, ret_obs = build(gaps)
    assert torch.equal(adv_plain, adv_obs)
    assert torch.equal(ret_plain, ret_obs)
