"""The SPO++ estimator's update on a tiny model (hand-computed advantages) and sample collation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from core.records import TrajectoryRecord, utcnow
from learner.algo.advantages import spo_ppo_loss
from learner.algo.spo import SPOLearner
from learner.data.batch import Batch, policy_logprobs
from learner.data.samples import NotLearnable, collate, episode_sample, single_turn_sample
from testing.models import make_config, tiny_policy


def two_rows(policy) -> Batch:
    # Row 0: 3 action tokens, row 1: 1 action token (right-padded).
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    act = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.float32)
    temps = torch.tensor([1.0, 1.0])
    with torch.no_grad():
        rollout = policy_logprobs(policy, ids, attn, temps) * act
    return Batch(ids, attn, act, rollout, torch.tensor([1.0, 0.0]), temps)


def test_spo_step_uses_frozen_values_and_token_measure():
    policy = tiny_policy()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    learner = SPOLearner(make_config("spo", policy_lr=1e-2), policy)
    m = learner.step(replace(two_rows(policy), baseline_values=torch.tensor([0.5, 0.5])))
    # A = R − v̂ = (1 − 0.5, 0 − 0.5) = (0.5, −0.5); lengths (3, 1):
    # token-weighted centre μ = (3·0.5 + 1·(−0.5)) / 4 = 0.25; after normalisation 0.
    assert m["token_centre_before"] == pytest.approx(0.25)
    assert m["token_centre_after"] == pytest.approx(0.0, abs=1e-6)
    # On-policy rollout (same weights): the rollout IS weight is 1, nothing truncated.
    assert m["rollout_is_mean"] == pytest.approx(1.0, abs=1e-5) and m["kept_fraction"] == 1.0
    assert m["reward_mean"] == 0.5 and m["baseline_mean"] == 0.5 and learner.steps == 1
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())


def _rec(**kw) -> TrajectoryRecord:
    base = dict(
        id="t1",
        prompt_id="p",
        created_at=utcnow(),
        model="m",
        prompt_token_ids=[1, 2, 3],
        response_token_ids=[4, 5],
        rollout_logprobs=[-0.5, -0.25],
        token_versions=[(2, 1), (3, 1)],
        dispatch_version=2,
        sampling={"temperature": 0.8, "max_tokens": 4},
        finish_reason="stop",
        baseline={"alpha": 4, "beta": 4, "value": 0.5, "version": 2, "z": 0.27},
    )
    base.update(kw)
    return TrajectoryRecord(**base)


def test_single_turn_sample_and_collate():
    s = single_turn_sample(_rec(), 1.0)
    assert s.input_ids == [1, 2, 3, 4, 5] and s.actions == [(3, 5)] and s.token_versions == [2, 3]
    assert s.baseline_value == 0.5 and s.result_version == 2
    b = collate(
        [
            s,
            single_turn_sample(
                _rec(id="t2", response_token_ids=[9], rollout_logprobs=[-1.0], token_versions=[(3, 1)]), 0.0
            ),
        ],
        current_version=4,
    )
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 9, 0]]
    assert b.action_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]]
    assert b.rollout_logprobs.tolist() == [[0, 0, 0, -0.5, -0.25], [0, 0, 0, -1.0, 0]]
    # staleness = current version 4 − token version: (4−2, 4−3) and (4−3).
    assert b.token_staleness.tolist() == [[0, 0, 0, 2, 1], [0, 0, 0, 1, 0]]
    assert b.temperatures.tolist() == pytest.approx([0.8, 0.8])


@pytest.mark.parametrize(
    ("sampling", "reason"),
    [
        ({"temperature": 1.0, "top_p": 0.9, "max_tokens": 4}, "excluded_truncated_sampling"),
        ({"temperature": 1.0, "top_k": 5, "max_tokens": 4}, "excluded_truncated_sampling"),
        ({"temperature": 0.0, "max_tokens": 4}, "excluded_greedy"),
    ],
)
def test_unlearnable_rollouts_are_named(sampling, reason):
    with pytest.raises(NotLearnable, match=reason):
        single_turn_sample(_rec(sampling=sampling), 1.0)


def test_episode_sample_marks_observations_between_actions():
    # Turn 0: prompt [1,2], response [3,4]; turn 1 re-renders it and adds a tool observation [7,8].
    t0 = _rec(
        id="a",
        episode_id="e",
        turn=0,
        prompt_token_ids=[1, 2],
        response_token_ids=[3, 4],
        rollout_logprobs=[-0.1, -0.2],
        token_versions=[(0, 2)],
    )
    t1 = _rec(
        id="b",
        episode_id="e",
        turn=1,
        prompt_token_ids=[1, 2, 3, 4, 7, 8],
        response_token_ids=[9],
        rollout_logprobs=[-0.3],
        token_versions=[(1, 1)],
    )
    s, misaligned = episode_sample("e", [t1, t0], 1.0)
    assert misaligned == 0 and s.id == "e:e"
    assert s.input_ids == [1, 2, 3, 4, 7, 8, 9] and s.actions == [(2, 4), (6, 7)]
    assert s.rollout_logprobs == [-0.1, -0.2, -0.3] and s.token_versions == [0, 0, 1]
    # A re-tokenised history that no longer matches stays observation and is counted.
    t1b = _rec(
        id="b",
        episode_id="e",
        turn=1,
        prompt_token_ids=[1, 2, 3, 5, 7, 8],
        response_token_ids=[9],
        rollout_logprobs=[-0.3],
        token_versions=[(1, 1)],
    )
    s, misaligned = episode_sample("e", [t0, t1b], 1.0)
    assert misaligned == 1 and s.actions == [(6, 7)]


def test_adam_beta1_reaches_the_spo_optimizer():
    assert SPOLearner(make_config("spo", adam_beta1=0.5), tiny_policy()).policy_opt.param_groups[0][
        "betas"
    ] == (
        0.5,
        0.999,
    )
    assert SPOLearner(make_config("spo"), tiny_policy()).policy_opt.param_groups[0]["betas"] == (0.9, 0.999)


BAD_LOGPROBS = [math.nan, -math.inf, -9999.0]


@pytest.mark.parametrize("bad", BAD_LOGPROBS)
def test_spo_loss_masks_and_counts_non_finite_rollout_logprobs(bad):
    # Issue 13 item 6: rollout logprobs [0, −0.5, bad, −0.5], action mask [0, 1, 1, 1], A = 0.7.
    logp = torch.tensor([[0.0, -0.4, -0.3, -0.6]], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([[0.0, -0.5, bad, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1]])
    loss, stats = spo_ppo_loss(logp, logp.detach(), rollout, torch.tensor([0.7], dtype=torch.float64), mask)
    # Token 2 is dropped (NaN, −inf, or below the −100 floor); tokens 1 and 3 remain, π_old = πθ so
    # r = 1 and each ℓ = −A·r = −0.7, weighted by w = min(exp(old − rollout), 2):
    #   w1 = exp(−0.4 + 0.5) = e^0.1 = 1.1051709, w3 = exp(−0.6 + 0.5) = e^−0.1 = 0.9048374.
    #   loss = (1.1051709·(−0.7) + 0.9048374·(−0.7)) / 2 = −0.7·2.0100083/2 = −0.7035029.
    assert loss.item() == pytest.approx(-0.7 * (math.exp(0.1) + math.exp(-0.1)) / 2, rel=1e-12)
    assert loss.item() == pytest.approx(-0.7035029, abs=1e-7)
    loss.backward()
    # ∂loss/∂logπθ_t = −A·w_t/2 on the kept tokens: −0.3868098, 0, −0.3166931.
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.35 * math.exp(0.1), 0.0, -0.35 * math.exp(-0.1)])
    assert stats["nonfinite_tokens"] == 1 and stats["n_action_tokens"] == 2.0
    assert stats["rollout_is_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.1)) / 2)
    assert stats["rollout_is_truncated_fraction"] == 0.0
    assert all(math.isfinite(v) for v in stats.values())


def test_spo_loss_floor_is_inclusive_and_all_masked_gives_zero():
    # −100 itself is usable; −100.5 is not. All unusable: loss 0 with a graph, stats 0.
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 1, 1]])
    _, stats = spo_ppo_loss(logp, logp.detach(), torch.tensor([[0.0, -100.0, -100.5]]), torch.ones(1), mask)
    assert stats["n_action_tokens"] == 1.0 and stats["nonfinite_tokens"] == 1
    loss, stats = spo_ppo_loss(
        logp, logp.detach(), torch.tensor([[0.0, math.nan, -1e4]]), torch.ones(1), mask
    )
    loss.backward()
    assert loss.item() == 0.0 and logp.grad.tolist() == [[0.0, 0.0, 0.0]]
    assert stats["nonfinite_tokens"] == 2 and stats["n_action_tokens"] == 0.0 and stats["ratio_mean"] == 0.0


@pytest.mark.parametrize("bad", BAD_LOGPROBS)
def test_spo_step_keeps_weights_finite_with_a_non_finite_rollout_logprob(bad):
    policy = tiny_policy()
    batch = two_rows(policy)
    batch.rollout_logprobs[0, 3] = bad
    learner = SPOLearner(make_config("spo", policy_lr=1e-2), policy)
    m = learner.step(replace(batch, baseline_values=torch.tensor([0.5, 0.5])))
    assert all(torch.isfinite(v).all() for v in policy.state_dict().values())
    assert m["nonfinite_tokens"] == 1 and m["n_action_tokens"] == 3.0
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
