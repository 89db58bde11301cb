"""The SAO step on a tiny random Llama: log-probabilities, critic/policy updates, checkpoints."""

import math

import pytest
import torch

from learner.algo.baselines import RunningMeanBaseline
from learner.algo.critic import ValueModel
from learner.algo.dis import dis_loss
from learner.algo.metrics import explained_variance
from learner.algo.pretrain import pretrain_critic
from learner.algo.sao import SAOLearner
from learner.data.batch import Batch, policy_logprobs
from testing.models import FAST, make_batch, make_config, tiny_policy


def test_policy_logprobs_match_log_softmax_and_its_gradient():
    policy = tiny_policy()
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(5))
    attn = torch.ones_like(ids)
    attn[2, 6:] = 0
    temps = torch.tensor([1.0, 0.5, 2.0])
    lp = policy_logprobs(policy, ids, attn, temps, chunk_tokens=5)
    logits = policy(input_ids=ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temps[:, None, None], -1)
    ref = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ref = torch.cat([torch.zeros(3, 1), ref], dim=1) * attn
    assert torch.allclose(lp, ref, atol=1e-5)
    weights = torch.randn(3, 9, generator=torch.Generator().manual_seed(6))
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    (ref * weights).sum().backward()
    for n, p in policy.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-5), n
    # positions subset: only those are computed, the rest are 0
    pos = torch.zeros_like(attn)
    pos[:, 4:6] = 1
    sub = policy_logprobs(policy, ids, attn, temps, positions=pos)
    assert torch.allclose(sub, ref * pos, atol=1e-5)


def test_left_padded_logprobs_equal_unpadded():
    policy = tiny_policy()
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(7))
    plain = policy_logprobs(policy, ids, torch.ones_like(ids), torch.tensor([1.0]))
    pids = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], dim=1)
    pattn = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones_like(ids)], dim=1)
    padded = policy_logprobs(policy, pids, pattn, torch.tensor([1.0]))
    assert torch.allclose(padded[:, 3:], plain[:, 1:], atol=1e-5)


def test_token_rewards_on_last_action_token():
    batch = make_batch(tiny_policy(), rewards=(1.0, 0.5, 0.25, 2.0))
    tr = batch.token_rewards()
    assert tr[0, 9] == 1.0 and tr[1, 9] == 0.5 and tr[2, 9] == 0.25 and tr[3, 7] == 2.0
    assert tr.sum().item() == pytest.approx(3.75)


def test_step_updates_policy_and_only_trainable_critic_params():
    policy = tiny_policy()
    critic = ValueModel.from_policy(policy, trainable="mlp")
    learner = SAOLearner(make_config(**FAST), policy, critic)
    batch = make_batch(policy)
    p_before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    c_before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    metrics = learner.step(batch)
    expected = {
        "policy_loss",
        "kept_fraction",
        "mean_abs_log_ratio",
        "approx_kl",
        "critic_loss",
        "explained_variance",
        "critic_grad_norm",
        "policy_grad_norm",
        "reward_mean",
        "tokens",
        "step_time_s",
        "tokens_per_s",
    }
    assert expected <= set(metrics)
    # rollout log-probs came from this policy: every ratio is 1, every token kept
    assert metrics["kept_fraction"] == 1.0
    assert metrics["mean_abs_log_ratio"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["tokens"] == 38 and metrics["reward_mean"] == 0.5
    assert any(not torch.equal(p_before[n], p) for n, p in policy.named_parameters())
    for n, p in critic.named_parameters():
        if not p.requires_grad:
            assert torch.equal(c_before[n], p), n
    assert not torch.equal(c_before["head.bias"], critic.head.bias)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight  # tie survives the fp32 cast


def test_repeated_steps_raise_the_rewarded_tokens_logprob():
    policy = tiny_policy(seed=1)
    critic = ValueModel.from_policy(policy)
    learner = SAOLearner(make_config(**FAST), policy, critic)
    good, bad = 11, 12
    ids = torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(8))
    ids[:, :3] = torch.tensor([5, 9, 3])
    ids[:4, 3] = good
    ids[4:, 3] = bad
    attn = torch.ones_like(ids)
    act = torch.zeros(8, 6)
    act[:, 3:] = 1
    temps = torch.ones(8)
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4)

    def logprob_of(token):
        probe = ids[:1].clone()
        probe[0, 3] = token
        with torch.no_grad():
            return policy_logprobs(policy, probe, attn[:1], temps[:1])[0, 3].item()

    start_good, start_bad = logprob_of(good), logprob_of(bad)
    for _ in range(5):
        with torch.no_grad():
            rollout = policy_logprobs(policy, ids, attn, temps) * act
        learner.step(Batch(ids, attn, act, rollout, rewards, temps))
    assert logprob_of(good) > start_good + 0.5
    assert logprob_of(bad) < start_bad


def test_running_mean_baseline_step_and_history():
    base = RunningMeanBaseline(window=2, default=0.5)
    assert base.baselines(["a"]).tolist() == [0.5]
    base.update(["a", "a", "a"], [1.0, 0.0, 0.5])
    assert base.baselines(["a", "b"]).tolist() == [pytest.approx((0.0 + 0.5) / 2), 0.5]
    restored = RunningMeanBaseline()
    restored.load_state_dict(base.state_dict())
    assert restored.baselines(["a"]).tolist() == [0.25]

    policy = tiny_policy()
    learner = SAOLearner(make_config("running_mean", policy_lr=1e-2), policy)
    batch = make_batch(policy, rewards=(1.0, 0.0, 1.0, 0.0))
    m1 = learner.step(batch)
    assert m1["baseline_mean"] == 0.5 and "critic_loss" not in m1
    # second step: p0 saw [1, 1] -> 1, p1 saw [0] -> 0, p2 saw [0] -> 0
    m2 = learner.step(make_batch(policy))
    assert m2["baseline_mean"] == pytest.approx((1 + 0 + 1 + 0) / 4)
    with pytest.raises(ValueError):
        SAOLearner(make_config("running_mean"), policy, ValueModel.from_policy(policy))


@pytest.mark.parametrize("mode", ["step_mean", "step_last"])
def test_step_level_gae_modes_run(mode):
    policy = tiny_policy()
    learner = SAOLearner(make_config(gae_mode=mode, **FAST), policy, ValueModel.from_policy(policy))
    metrics = learner.step(make_batch(policy))
    assert metrics["policy_grad_norm"] > 0


def test_bf16_autocast_step_keeps_fp32_master_weights():
    policy = tiny_policy()
    learner = SAOLearner(make_config(autocast_bf16=True, **FAST), policy, ValueModel.from_policy(policy))
    metrics = learner.step(make_batch(policy))
    assert metrics["kept_fraction"] > 0.5
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    assert learner.policy_weights()["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_state_dict_round_trip():
    policy = tiny_policy()
    learner = SAOLearner(make_config(**FAST), policy, ValueModel.from_policy(policy))
    learner.step(make_batch(policy))
    state = _deep_clone(learner.state_dict())
    saved = {n: p.detach().clone() for n, p in policy.named_parameters()}
    saved_critic = {n: p.detach().clone() for n, p in learner.critic.named_parameters()}
    learner.step(make_batch(policy, seed=1))
    learner.load_state_dict(state)
    assert learner.steps == 1
    assert all(torch.equal(saved[n], p) for n, p in policy.named_parameters())
    assert all(torch.equal(saved_critic[n], p) for n, p in learner.critic.named_parameters())
    # the restored learner continues exactly like one that never took the extra step
    twin_policy = tiny_policy()
    twin = SAOLearner(make_config(**FAST), twin_policy, ValueModel.from_policy(twin_policy))
    twin.load_state_dict(_deep_clone(state))
    batch = make_batch(policy, seed=2)
    a, b = learner.step(batch), twin.step(batch)
    assert a["policy_loss"] == pytest.approx(b["policy_loss"])
    assert a["critic_loss"] == pytest.approx(b["critic_loss"])


def _deep_clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _deep_clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deep_clone(v) for v in obj]
    return obj


def test_pretrain_critic_reduces_loss():
    policy = tiny_policy()
    critic = ValueModel.from_policy(policy)
    batches = [make_batch(policy, rewards=(1.0, 0.0, 1.0, 0.0), seed=s) for s in range(2)]
    losses = pretrain_critic(critic, batches, epochs=8, lr=1e-2)
    assert len(losses) == 16
    assert losses[-1] < losses[0]


def test_explained_variance_definition():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    r = torch.tensor([[1.0, 0.0, 1.0, 5.0]])
    # Var(R) = 2/9; R - V = [0.5, -0.5, 0.5] has Var = 2/9 -> EV = 0
    assert explained_variance(r, torch.full((1, 4), 0.5), mask) == pytest.approx(0.0)
    assert explained_variance(r, r, mask) == pytest.approx(1.0)
    assert explained_variance(torch.ones(1, 4), torch.zeros(1, 4), mask) == 0.0  # Var(R) = 0


def test_batch_validation():
    policy = tiny_policy()
    batch = make_batch(policy)
    bad = make_batch(policy)
    bad.action_mask[0, 0] = 1
    with pytest.raises(ValueError, match="position 0"):
        bad.validate()
    bad = make_batch(policy)
    bad.action_mask[3, 9] = 1
    with pytest.raises(ValueError, match="padding"):
        bad.validate()
    bad = make_batch(policy)
    bad.temperatures[0] = 0.0
    with pytest.raises(ValueError, match="temperatures"):
        bad.validate()
    bad = make_batch(policy)
    bad.action_mask[2] = 0
    with pytest.raises(ValueError, match="no action"):
        bad.validate()
    batch.validate()
    with pytest.raises(ValueError):
        SAOLearner(make_config(), policy, None)


def test_adam_beta1_reaches_both_optimizers():
    """β1 sets both AdamW first-moment decays; β2 stays 0.999. Default 0.9."""
    policy = tiny_policy()
    learner = SAOLearner(make_config(adam_beta1=0.5, **FAST), policy, ValueModel.from_policy(policy))
    assert learner.policy_opt.param_groups[0]["betas"] == (0.5, 0.999)
    assert learner.critic_opt.param_groups[0]["betas"] == (0.5, 0.999)
    default = SAOLearner(make_config(**FAST), policy, ValueModel.from_policy(policy))
    assert default.policy_opt.param_groups[0]["betas"] == (0.9, 0.999)


def test_values_outside_the_return_range_are_clamped_before_gae():
    """Every return lies in [0, 1] (rewards in [0, 1] on the last action token, γ = 1).

    A critic stuck at V = −0.3 on a batch whose rewards are all 0, with the critic frozen (lr 0):
    - unclamped, token GAE with V(terminal) = 0 gives δ = 0 − (−0.3) = +0.3 on the last action
      token and 0 elsewhere, so Â_t = 0.3·λ^(L−1−t) > 0: every zero-reward answer is reinforced;
      e.g. row 0 has L = 7 action tokens, λ = 1 − 1/(1.5·7) = 0.904762, Â_last = 0.3,
      Â_first = 0.3 · 0.904762⁶ = 0.3 · 0.548537 = 0.16456;
    - clamped to [0, 1], V = 0 everywhere, every δ = 0 and every Â = 0: the policy does not move.
    """
    zeros = (0.0, 0.0, 0.0, 0.0)
    frozen = dict(policy_lr=1e-2, critic_lr=0.0, critic_warmup_steps=0)

    policy = tiny_policy()
    critic = ValueModel.from_policy(policy, head_bias=-0.3)
    learner = SAOLearner(make_config(value_range=None, **frozen), policy, critic)
    batch = make_batch(policy, rewards=zeros)
    mask = batch.action_mask.bool()
    values, _ = learner._critic_phase(batch, mask, batch.token_rewards())
    adv = learner._advantages(values, mask, batch.token_rewards())
    row0 = adv[0][mask[0]]
    assert row0[-1].item() == pytest.approx(0.3, abs=1e-6)
    assert row0[0].item() == pytest.approx(0.3 * (1 - 1 / 10.5) ** 6, abs=1e-5)
    assert row0[0].item() == pytest.approx(0.16456, abs=1e-5)
    assert learner.step(batch)["advantage_mean"] > 0

    policy = tiny_policy()
    critic = ValueModel.from_policy(policy, head_bias=-0.3)
    learner = SAOLearner(make_config(**frozen), policy, critic)
    assert learner.config.algorithm.value_range == (0.0, 1.0)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    metrics = learner.step(make_batch(policy, rewards=zeros))
    assert metrics["value_mean"] == 0.0 and metrics["value_clamped_fraction"] == 1.0
    assert metrics["advantage_mean"] == 0.0 and metrics["policy_loss"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in policy.named_parameters())

    # Above the range: V = 1.4 is read as 1, so a reward of 1 has advantage 0 on every token.
    policy = tiny_policy()
    learner = SAOLearner(make_config(**frozen), policy, ValueModel.from_policy(policy, head_bias=1.4))
    metrics = learner.step(make_batch(policy, rewards=(1.0, 1.0, 1.0, 1.0)))
    assert metrics["value_mean"] == 1.0 and metrics["advantage_mean"] == 0.0


@pytest.mark.parametrize("bad", [(1.0, 0.0), (0.5, 0.5)])
def test_value_range_must_be_increasing(bad):
    policy = tiny_policy()
    with pytest.raises(ValueError, match="value_range"):
        SAOLearner(make_config(value_range=bad), policy, ValueModel.from_policy(policy))


@pytest.mark.parametrize("bad", [math.nan, -math.inf, -9999.0])
def test_dis_loss_drops_non_finite_rollout_logprobs_from_loss_and_stats(bad):
    # The input of issue 13 item 6 through SAO's loss: rollout [0, −0.5, bad, −0.5], mask [0, 1, 1, 1].
    lp = torch.tensor([[0.0, -0.4, -0.3, -0.6]], requires_grad=True)
    rollout = torch.tensor([[0.0, -0.5, bad, -0.5]])
    loss, stats = dis_loss(lp, rollout, torch.full((1, 4), 0.7), torch.tensor([[0, 1, 1, 1]]))
    # Kept: token 1 (log r = 0.1, r = 1.1051709) and token 3 (log r = −0.1, r = 0.9048374), both in
    # (0.7, 6). L = −0.7·(1.1051709·(−0.4) + 0.9048374·(−0.6)) / 2 = 0.7·0.9849708/2 = 0.3447398.
    assert loss.item() == pytest.approx(0.7 * (0.4 * math.exp(0.1) + 0.6 * math.exp(-0.1)) / 2, rel=1e-6)
    assert loss.item() == pytest.approx(0.3447398, abs=1e-6)
    assert stats["nonfinite_tokens"] == 1 and stats["action_tokens"] == 2
    # k3 = mean(e^d − 1 − d) over d = ±0.1 = cosh(0.1) − 1 = 0.0050042; mean |log r| = 0.1.
    assert stats["approx_kl"] == pytest.approx(math.cosh(0.1) - 1, rel=1e-6)
    assert stats["mean_abs_log_ratio"] == pytest.approx(0.1, rel=1e-6)
    assert stats["kept_fraction"] == 1.0


@pytest.mark.parametrize("bad", [math.nan, -math.inf, -9999.0])
def test_sao_step_metrics_stay_finite_with_a_non_finite_rollout_logprob(bad):
    policy = tiny_policy()
    batch = make_batch(policy)
    batch.rollout_logprobs[0, 4] = bad
    batch.rollout_logprobs[2, 5] = bad
    learner = SAOLearner(make_config(**FAST), policy, ValueModel.from_policy(policy))
    m = learner.step(batch)
    assert m["nonfinite_tokens"] == 2
    assert all(
        math.isfinite(m[k]) for k in ("approx_kl", "mean_abs_log_ratio", "policy_loss", "kept_fraction")
    )
    assert all(torch.isfinite(v).all() for v in policy.state_dict().values())


def test_warm_start_loads_the_pretrained_critic_and_says_so(tmp_path):
    """``warm_start`` loads ``critic_pretrained.pt`` into the critic and returns its path; with
    no such file (or no critic) it returns None and the critic is untouched."""
    from learner.algo.pretrain import PRETRAINED_CRITIC

    policy = tiny_policy()
    critic = ValueModel.from_policy(tiny_policy(seed=1))
    learner = SAOLearner(make_config(**FAST), policy, critic)
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    assert learner.warm_start(tmp_path) is None
    assert all(torch.equal(before[k], v) for k, v in critic.state_dict().items())

    donor = ValueModel.from_policy(tiny_policy(seed=2))
    torch.save(donor.state_dict(), tmp_path / PRETRAINED_CRITIC)
    assert learner.warm_start(tmp_path) == tmp_path / PRETRAINED_CRITIC
    assert all(torch.equal(donor.state_dict()[k], v) for k, v in critic.state_dict().items())
    assert SAOLearner(make_config("running_mean", policy_lr=1e-2), policy).warm_start(tmp_path) is None


def test_before_updates_scores_the_batch_with_the_critic_it_had():
    """``advantage_values`` ``before_updates``: GAE takes the critic's values from before its K
    updates on the batch, which still take place.

    The critic starts at V = 0.3 on every token (zero head weights, bias 0.3), critic lr 1e-2,
    rewards (1, 0, 1, 0). Row 0 has L = 7 action tokens, λ = 1 − 1/(1.5·7) = 0.904762; inside the
    row V(s_t) = V(s_t+1) = 0.3, so δ_t = 0 but on the last action token, where V(terminal) = 0
    and δ = 1 − 0.3 = 0.7: Â_last = 0.7, Â_first = 0.7·λ⁶ = 0.7 · 0.548537 = 0.383976. Row 1
    (reward 0, 5 action tokens around an observation gap): Â_last = 0 − 0.3 = −0.3.
    ``after_updates`` (the paper's) scores with the updated critic instead, whose values moved.
    """
    policy = tiny_policy()
    learner = SAOLearner(
        make_config(advantage_values="before_updates", **FAST),
        policy,
        ValueModel.from_policy(policy, head_bias=0.3),
    )
    batch = make_batch(policy)
    mask = batch.action_mask.bool()
    values, metrics = learner._critic_phase(batch, mask, batch.token_rewards())
    adv = learner._advantages(values, mask, batch.token_rewards())
    row0, row1 = adv[0][mask[0]], adv[1][mask[1]]
    assert row0[-1].item() == pytest.approx(0.7, abs=1e-6)
    assert row0[0].item() == pytest.approx(0.7 * (1 - 1 / 10.5) ** 6, abs=1e-6)
    assert row0[0].item() == pytest.approx(0.383976, abs=1e-6)
    assert row1[-1].item() == pytest.approx(-0.3, abs=1e-6)
    assert metrics["value_mean"] == pytest.approx(0.3, abs=1e-6)
    assert "explained_variance_after" not in metrics
    assert learner.critic.head.bias.item() != pytest.approx(0.3, abs=1e-4)  # the K updates ran

    policy = tiny_policy()
    learner = SAOLearner(make_config(**FAST), policy, ValueModel.from_policy(policy, head_bias=0.3))
    assert learner.config.algorithm.advantage_values == "after_updates"
    values, metrics = learner._critic_phase(batch, mask, batch.token_rewards())
    assert metrics["value_mean"] != pytest.approx(0.3, abs=1e-3) and "explained_variance_after" in metrics
