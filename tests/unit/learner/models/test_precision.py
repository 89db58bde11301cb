"""bf16 compute with float32 master weights (learner.models.precision) against the float32 step."""

import copy
import math

import pytest
import torch

from learner.algo.critic import ValueModel
from learner.algo.metrics import masked_mse
from learner.algo.sao import SAOLearner
from learner.algo.spo import SPOLearner
from learner.config import ConfigError
from learner.data.batch import policy_logprobs
from learner.models import attention
from learner.models.optim import make_adamw, optimizer_step
from learner.models.precision import MasterWeights, MixedPrecisionAdamW
from testing.models import FAST, make_batch, make_config, tiny_policy


def _policy_loss(model, batch):
    """A DIS-shaped loss: −Σ A_t log π(a_t) / Σ mask, with fixed advantages in [−1, 1]."""
    mask = batch.action_mask.bool()
    adv = torch.where(mask, torch.linspace(-1.0, 1.0, mask.numel()).view(mask.shape), 0.0)
    lp = policy_logprobs(model, batch.input_ids, batch.attention_mask, batch.temperatures, positions=mask)
    return -(lp * adv).sum() / mask.sum(), lp


def _flat(tensors):
    return torch.cat([t.detach().float().flatten() for t in tensors])


def test_bf16_policy_loss_logprobs_and_gradients_track_float32():
    p32 = tiny_policy()
    batch = make_batch(p32)
    p16 = copy.deepcopy(p32)
    opt = MixedPrecisionAdamW(p16, lr=1e-3, weight_decay=0.0)
    assert {p.dtype for p in p16.parameters()} == {torch.bfloat16}
    assert {w.dtype for w in opt.master.params} == {torch.float32}
    loss32, lp32 = _policy_loss(p32, batch)
    loss16, lp16 = _policy_loss(p16, batch)
    loss32.backward()
    loss16.backward()
    opt.master.grads_to_master()
    # bf16 keeps 8 significant bits (unit roundoff 2^-8 = 0.0039): the loss, a mean of 33 terms,
    # within 1% (measured 0.02%); each log-probability (|lp| ≈ 4 nats here) within 0.02 nats,
    # 5 roundoffs of a 4-nat logit (measured 0.0013).
    assert abs(loss16.item() - loss32.item()) <= 0.01 * abs(loss32.item())
    assert (lp16 - lp32).abs().max().item() < 0.02
    g32 = _flat(p.grad for p in p32.parameters())
    g16 = _flat(w.grad for w in opt.master.params)
    # The whole gradient within 3% in L2 (measured 0.5%), pointing the same way.
    assert ((g16 - g32).norm() / g32.norm()).item() < 0.03
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0).item() > 0.999


def test_bf16_critic_keeps_its_head_float32_and_its_gradients_track_float32():
    policy = tiny_policy()
    batch = make_batch(policy)
    c32 = ValueModel.from_policy(policy, trainable="mlp", head_std=0.1)
    c16 = copy.deepcopy(c32)
    opt = MixedPrecisionAdamW(c16, lr=1e-3, weight_decay=0.0, keep_float32=["head"])
    assert c16.head.weight.dtype == torch.float32
    assert c16.backbone.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16  # frozen: bf16, no master
    assert opt.master.names == [n for n, p in c16.named_parameters() if p.requires_grad]
    assert all(".mlp." in n or n.startswith("head.") for n in opt.master.names)
    mask = batch.action_mask.bool()
    target = batch.rewards[:, None].expand(mask.shape)
    l32 = masked_mse(c32(batch.input_ids, batch.attention_mask), target, mask)
    l16 = masked_mse(c16(batch.input_ids, batch.attention_mask), target, mask)
    l32.backward()
    l16.backward()
    opt.master.grads_to_master()
    assert abs(l16.item() - l32.item()) <= 0.01 * l32.item()
    g32 = _flat(p.grad for p in c32.trainable_parameters())
    g16 = _flat(w.grad for w in opt.master.params)
    assert ((g16 - g32).norm() / g32.norm()).item() < 0.03


def test_master_weights_track_the_float32_run_over_steps():
    p32 = tiny_policy()
    batch = make_batch(p32)
    p16 = copy.deepcopy(p32)
    start = _flat(p32.parameters())
    opt32 = make_adamw(list(p32.parameters()), 1e-3, 0.0)
    opt16 = MixedPrecisionAdamW(p16, lr=1e-3, weight_decay=0.0)
    for _ in range(20):
        optimizer_step(opt32, _policy_loss(p32, batch)[0], list(p32.parameters()), 1.0)
        optimizer_step(opt16, _policy_loss(p16, batch)[0], list(p16.parameters()), 1.0)
    moved = _flat(p32.parameters()) - start
    gap = _flat(opt16.master.params) - _flat(p32.parameters())
    # 20 AdamW steps of ~1e-3 move the weights by ~1.9 in L2; the bf16 run's masters stay within
    # 5% of that distance of the float32 run (measured 1.5%), and the compute weights are exactly
    # the masters rounded to bf16.
    assert moved.norm().item() > 1.0
    assert (gap.norm() / moved.norm()).item() < 0.05
    for p, w in zip(p16.parameters(), opt16.master.params, strict=True):
        assert torch.equal(p, w.to(torch.bfloat16))


def test_updates_below_bf16_spacing_survive_only_in_the_master():
    # lr 1e-6 (the paper's policy rate): AdamW's first steps move each weight by about lr, far
    # below the bf16 spacing of an initial weight of 0.02 (2^-13 ≈ 1.2e-4).
    batch = make_batch(tiny_policy())
    pure = tiny_policy().to(torch.bfloat16)
    start = _flat(pure.parameters())
    pure_opt = torch.optim.AdamW(pure.parameters(), lr=1e-6, weight_decay=0.0)
    mixed = tiny_policy()
    mixed_start = _flat(mixed.parameters())
    mixed_opt = MixedPrecisionAdamW(mixed, lr=1e-6, weight_decay=0.0)
    for _ in range(3):
        optimizer_step(pure_opt, _policy_loss(pure, batch)[0], list(pure.parameters()), 1.0)
        optimizer_step(mixed_opt, _policy_loss(mixed, batch)[0], list(mixed.parameters()), 1.0)
    changed = (_flat(pure.parameters()) != start).float().mean().item()
    master_moved = (_flat(mixed_opt.master.params) - mixed_start).abs()
    # bf16 weights alone: only weights under ~2.6e-4 in size can move at all (measured: 1.9% did).
    assert changed < 0.05
    # The masters: 3 steps of about 1e-6 each on every weight with a gradient (measured: 99.8%).
    assert ((master_moved > 2e-6) & (master_moved < 4e-6)).float().mean().item() > 0.9


def test_checkpoint_of_bf16_model_and_optimizer_restores_the_masters():
    batch = make_batch(tiny_policy())
    a = tiny_policy()
    opt_a = MixedPrecisionAdamW(a, lr=1e-3, weight_decay=0.0)
    for _ in range(2):
        optimizer_step(opt_a, _policy_loss(a, batch)[0], list(a.parameters()), 1.0)
    saved = copy.deepcopy({"model": a.state_dict(), "opt": opt_a.state_dict()})
    b = tiny_policy(seed=1)
    opt_b = MixedPrecisionAdamW(b, lr=1e-3, weight_decay=0.0)
    b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    assert all(torch.equal(x, y) for x, y in zip(opt_a.master.params, opt_b.master.params, strict=True))
    la = optimizer_step(opt_a, _policy_loss(a, batch)[0], list(a.parameters()), 1.0)
    lb = optimizer_step(opt_b, _policy_loss(b, batch)[0], list(b.parameters()), 1.0)
    assert la == lb
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_sync_from_model_takes_loaded_weights_and_warmup_can_set_the_rate():
    a = tiny_policy()
    opt = MixedPrecisionAdamW(a, lr=1e-3, weight_decay=0.0)
    other = tiny_policy(seed=3).to(torch.bfloat16)
    a.load_state_dict(other.state_dict())
    opt.sync_from_model()
    assert all(torch.equal(p.float(), w) for p, w in zip(a.parameters(), opt.master.params, strict=True))
    opt.param_groups[0]["lr"] = 5e-4
    assert opt.inner.param_groups[0]["lr"] == 5e-4
    opt.state.clear()
    assert opt.inner.state == {}


def test_bad_construction_and_checkpoints_are_named():
    with pytest.raises(ValueError, match="'nohead'"):
        MasterWeights(tiny_policy(), keep_float32=["nohead"])
    with pytest.raises(ValueError, match="no trainable parameter"):
        MasterWeights(tiny_policy().requires_grad_(False))
    opt = MixedPrecisionAdamW(tiny_policy(), lr=1e-3, weight_decay=0.0)
    state = opt.state_dict()
    state["master"] = {k: v for k, v in state["master"].items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        opt.load_state_dict(state)


def _bf16_sao(seed: int = 0) -> SAOLearner:
    """A bf16 SAO learner with the KL anchor; the reference (the base model, not checkpointed)
    is always seed 0's policy."""
    policy = tiny_policy(seed)
    config = make_config(bf16=True, kl_coef=0.1, **FAST)
    return SAOLearner(config, policy, ValueModel.from_policy(policy), tiny_policy(0))


def test_sao_learner_in_bf16_trains_float32_masters_and_publishes_their_rounding():
    learner = _bf16_sao()
    reference = learner.policy_update.anchor.reference
    assert {p.dtype for p in learner.policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    # Buffers (the rotary inverse frequencies) stay float32 in the reference as in the policy.
    assert (
        {b.dtype for b in reference.buffers()}
        == {b.dtype for b in learner.policy.buffers()}
        == {torch.float32}
    )
    assert learner.critic.head.weight.dtype == torch.float32
    assert learner.policy.config._attn_implementation == attention.NAME
    assert learner.critic.backbone.config._attn_implementation == attention.NAME
    before = _flat(learner.policy_opt.master.params)
    metrics = learner.step(make_batch(learner.policy))
    assert metrics["kept_fraction"] > 0.5 and math.isfinite(metrics["kl_ref"])
    assert metrics["policy_grad_norm"] > 0 and metrics["critic_grad_norm"] > 0
    assert not torch.equal(_flat(learner.policy_opt.master.params), before)
    published = learner.policy_weights(torch.bfloat16)
    for name, w in zip(learner.policy_opt.master.names, learner.policy_opt.master.params, strict=True):
        assert torch.equal(published[name], w.to(torch.bfloat16)), name


def test_bf16_sao_checkpoint_continues_exactly_and_loaded_weights_reach_the_masters():
    learner = _bf16_sao()
    learner.step(make_batch(learner.policy))
    state = copy.deepcopy(learner.state_dict())
    twin = _bf16_sao(seed=1)
    twin.load_state_dict(copy.deepcopy(state))
    batch = make_batch(learner.policy, seed=2)
    assert learner.step(batch)["policy_loss"] == twin.step(batch)["policy_loss"]
    assert all(
        torch.equal(a, b) for a, b in zip(learner.policy.parameters(), twin.policy.parameters(), strict=True)
    )
    # Published weights loaded into the policy (a rollback, a resume past the checkpoint) become
    # the masters too, or the next step would write the old masters back.
    other = tiny_policy(seed=5).to(torch.bfloat16).state_dict()
    missing, unexpected = learner.load_policy_weights(other)
    assert (missing, unexpected) == ([], [])
    assert torch.equal(learner.policy_opt.master.params[0], other["model.embed_tokens.weight"].float())


def test_a_float32_checkpoint_resumes_in_bf16():
    policy = tiny_policy()
    fp32 = SAOLearner(make_config(**FAST), policy, ValueModel.from_policy(policy))
    fp32.step(make_batch(policy))
    state = copy.deepcopy(fp32.state_dict())
    policy16 = tiny_policy(seed=1)
    bf16 = SAOLearner(make_config(bf16=True, **FAST), policy16, ValueModel.from_policy(policy16))
    bf16.load_state_dict(state)
    assert torch.equal(
        bf16.policy_opt.master.params[0], state["policy"]["model.embed_tokens.weight"].bfloat16().float()
    )
    assert bf16.policy_opt.state  # the float32 run's AdamW moments came along
    assert math.isfinite(bf16.step(make_batch(policy16))["policy_loss"])


def test_spo_learner_in_bf16_steps_on_masters():
    policy = tiny_policy()
    learner = SPOLearner(make_config("spo", policy_lr=1e-2, bf16=True), policy)
    assert isinstance(learner.policy_opt, MixedPrecisionAdamW)
    batch = make_batch(policy)
    batch.baseline_values = torch.tensor([0.5, 0.5, 0.5, 0.5])
    before = _flat(learner.policy_opt.master.params)
    metrics = learner.step(batch)
    assert math.isfinite(metrics["policy_loss"])
    assert not torch.equal(_flat(learner.policy_opt.master.params), before)


def test_bf16_with_autocast_is_a_config_error():
    with pytest.raises(ConfigError, match="bf16 and autocast_bf16 exclude each other"):
        make_config(bf16=True, autocast_bf16=True)
