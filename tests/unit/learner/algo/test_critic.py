"""Value model (SAO §2.3): frozen attention, value alignment, no shared tensors with the policy."""

import pytest
import torch

from learner.algo.critic import ValueModel
from testing.models import tiny_policy


def _train_steps(critic: ValueModel, n: int) -> None:
    opt = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    target = torch.rand(2, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(n):
        loss = ((critic(ids, am) - target)[:, 1:] ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_initial_values_are_head_bias_and_position_zero_is_zero():
    critic = ValueModel.from_policy(tiny_policy())
    ids = torch.randint(0, 64, (2, 6))
    v = critic(ids, torch.ones_like(ids))
    assert v.shape == (2, 6) and v.dtype == torch.float32
    assert v[:, 0].tolist() == [0.0, 0.0]
    assert torch.allclose(v[:, 1:], torch.full((2, 5), 0.5))


def test_mlp_mode_freezes_attention_embeddings_and_norms():
    critic = ValueModel.from_policy(tiny_policy(), trainable="mlp")
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in critic.named_parameters() if ".mlp." in n or n.startswith("head.")}
    assert not any("self_attn" in n or "embed_tokens" in n or "norm" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    # two steps: the zero-initialised head passes no gradient to the body on the first one
    _train_steps(critic, 2)
    for n, p in critic.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == (n in trainable), n


def test_all_mode_changes_every_parameter():
    critic = ValueModel.from_policy(tiny_policy(), trainable="all")
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    assert len(critic.trainable_parameters()) == len(before)
    _train_steps(critic, 2)
    unchanged = [n for n, p in critic.named_parameters() if torch.equal(before[n], p.detach())]
    assert unchanged == []


def test_value_at_t_depends_only_on_tokens_before_t():
    critic = ValueModel.from_policy(tiny_policy(), head_std=0.5)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    am = torch.ones_like(ids)
    v = critic(ids, am)
    changed = ids.clone()
    changed[0, 4] = (changed[0, 4] + 1) % 64
    w = critic(changed, am)
    # V(s_t) is read from the hidden state at t-1: changing token 4 leaves values[:, :5] alone
    assert torch.equal(v[:, :5], w[:, :5])
    assert not torch.allclose(v[:, 5:], w[:, 5:])
    # and equals head(hidden at t-1)
    hidden = critic.backbone(input_ids=ids, attention_mask=am).last_hidden_state
    expect = critic.head(hidden).squeeze(-1)[:, :-1]
    assert torch.allclose(v[:, 1:], expect, atol=1e-6)


def test_left_padding_gives_same_values_as_unpadded():
    critic = ValueModel.from_policy(tiny_policy(), head_std=0.5)
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    plain = critic(ids, torch.ones_like(ids))
    padded_ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    padded_am = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    padded = critic(padded_ids, padded_am)
    assert torch.allclose(padded[:, 4:], plain[:, 1:], atol=1e-5)


def test_no_tensor_shared_with_policy():
    policy = tiny_policy()
    critic = ValueModel.from_policy(policy, trainable="all")
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in critic.parameters()}
    snapshot = {n: p.detach().clone() for n, p in policy.named_parameters()}
    _train_steps(critic, 2)
    assert all(torch.equal(snapshot[n], p) for n, p in policy.named_parameters())


def test_from_pretrained_matches_policy_body(tmp_path):
    policy = tiny_policy()
    policy.save_pretrained(tmp_path)
    critic = ValueModel.from_pretrained(tmp_path, trainable="mlp")
    body = dict(policy.model.named_parameters())
    for n, p in critic.backbone.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p, body[n]), n


def test_invalid_trainable():
    with pytest.raises(ValueError):
        ValueModel.from_policy(tiny_policy(), trainable="attention")
