"""Shared-prefix forward (learner.algo.prefix): same hidden states and gradients as the plain forward."""

import pytest
import torch

import learner.algo.prefix as prefix
from learner.algo.critic import ValueModel
from learner.algo.prefix import body_hidden, position_ids_from_mask, shared_prefix_length
from learner.data.batch import policy_logprobs
from testing.models import tiny_policy


def _rows(prefix_len: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """3 rows: a common prefix, then different tails of 6, 9 and 4 tokens, right-padded to 29."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 64, (prefix_len,), generator=g)
    lengths = (6, 9, 4)
    width = prefix_len + max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    attn = torch.zeros(3, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        tail = torch.randint(0, 64, (n,), generator=g)
        tail[0] = (prefix[-1] + 1 + i) % 64  # the rows differ from their first tail token on
        ids[i, : prefix_len + n] = torch.cat([prefix, tail])
        attn[i, : prefix_len + n] = 1
    return ids, attn


def _plain(body, ids, attn):
    return body(
        input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn), use_cache=False
    ).last_hidden_state


def test_shared_prefix_length_counts_common_attended_tokens() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 7, 9, 1], [5, 6, 7, 8, 2]])
    attn = torch.ones_like(ids)
    assert shared_prefix_length(ids, attn) == 3  # rows 0 and 1 differ at position 3
    attn[2, 1:] = 0  # row 2 is padding from position 1: only position 0 is shared
    assert shared_prefix_length(ids, attn) == 1
    same = torch.tensor([[1, 2, 3], [1, 2, 3]])
    assert shared_prefix_length(same, torch.ones_like(same)) == 2  # capped at T - 1


def test_hidden_states_equal_the_plain_forward_on_attended_positions() -> None:
    body = tiny_policy().base_model
    ids, attn = _rows()
    assert shared_prefix_length(ids, attn) == 20
    with torch.no_grad():
        want = _plain(body, ids, attn)
        got = body_hidden(body, ids, attn, min_shared=1)
    mask = attn.bool()
    assert got.shape == want.shape
    assert torch.allclose(got[mask], want[mask], atol=1e-5)


def test_short_prefix_or_single_row_is_the_plain_forward() -> None:
    body = tiny_policy().base_model
    ids, attn = _rows(prefix_len=3)
    with torch.no_grad():
        assert torch.equal(body_hidden(body, ids, attn, min_shared=16), _plain(body, ids, attn))
        assert torch.equal(
            body_hidden(body, ids[:1], attn[:1], min_shared=1), _plain(body, ids[:1], attn[:1])
        )


@pytest.mark.parametrize("which", ["policy", "critic"])
def test_gradients_equal_the_plain_forward(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The repeated prefix cache sums the rows' gradients into the one prefix pass."""
    ids, attn = _rows()
    actions = attn.clone()
    actions[:, :21] = 0  # the rows' tails are the actions
    grads, body_calls = [], []
    for min_shared in (10_000, 1):  # plain, then shared
        monkeypatch.setattr(prefix, "MIN_SHARED_TOKENS", min_shared)
        policy = tiny_policy()
        model = policy if which == "policy" else ValueModel.from_policy(policy, trainable="all", head_std=0.5)
        body = policy.base_model if which == "policy" else model.backbone
        calls: list[int] = []
        body.register_forward_hook(lambda *_, seen=calls: seen.append(1))
        if which == "policy":
            out = policy_logprobs(policy, ids, attn, torch.tensor([1.0, 0.7, 1.3]), positions=actions)
            loss = (out * torch.linspace(-1, 1, out.shape[1])).sum()
        else:
            out = model(ids, attn)
            loss = (out * actions).sum()
        loss.backward()
        body_calls.append(len(calls))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert body_calls == [1, 2]  # the shared run really went through the prefix pass and the tails
    plain, shared = grads
    assert plain.keys() == shared.keys() and plain
    for name in plain:
        assert torch.allclose(plain[name], shared[name], atol=1e-5, rtol=1e-4), name
