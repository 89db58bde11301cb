"""Grouped-query attention as batched matmuls (learner.models.attention) against torch's SDPA."""

import copy

import pytest
import torch
import torch.nn.functional as F

from learner.algo.prefix import body_hidden
from learner.data.batch import policy_logprobs
from learner.models import attention
from learner.models.attention import grouped_attention
from testing.models import tiny_policy

B, H, KV, D = 2, 6, 2, 8


def _qkv(tq: int, tk: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, tq, D, generator=g).requires_grad_()
    k = torch.randn(B, KV, tk, D, generator=g).requires_grad_()
    v = torch.randn(B, KV, tk, D, generator=g).requires_grad_()
    return q, k, v


def _sdpa(q, k, v, mask=None, causal=False):
    rep = H // KV
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, is_causal=causal
    )
    return out.transpose(1, 2)


def _same_with_grads(ours, theirs, inputs, atol=1e-5):
    assert ours.shape == theirs.shape == (B, inputs[0].shape[2], H, D)
    assert torch.allclose(ours, theirs, atol=atol)
    g = torch.randn(ours.shape, generator=torch.Generator().manual_seed(9))
    for a, b in zip(
        torch.autograd.grad(ours, inputs, g), torch.autograd.grad(theirs, inputs, g), strict=True
    ):
        assert torch.allclose(a, b, atol=atol)


def test_causal_attention_equals_sdpa_with_gradients():
    q, k, v = _qkv(7, 7)
    out, weights = grouped_attention(None, q, k, v, None)
    assert weights is None
    _same_with_grads(out, _sdpa(q, k, v, causal=True), (q, k, v))


def test_boolean_padding_mask_equals_sdpa():
    q, k, v = _qkv(7, 7)
    mask = torch.ones(7, 7, dtype=torch.bool).tril().repeat(B, 1, 1, 1)
    mask[1, :, :, 5:] = False  # row 1 is right-padded after 5 tokens
    out, _ = grouped_attention(None, q, k, v, mask)
    _same_with_grads(out, _sdpa(q, k, v, mask=mask), (q, k, v))


def test_queries_after_a_cached_prefix_see_the_prefix_and_their_past():
    # 3 queries after 4 cached keys: query i sees keys j <= 4 + i, the last 3 rows of a 7 x 7
    # causal mask.
    q, k, v = _qkv(3, 7)
    out, _ = grouped_attention(None, q, k, v, None)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[4:]
    _same_with_grads(out, _sdpa(q, k, v, mask=mask), (q, k, v))


def test_additive_float_mask_equals_sdpa():
    q, k, v = _qkv(5, 5)
    mask = torch.zeros(1, 1, 5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    out, _ = grouped_attention(None, q, k, v, mask)
    _same_with_grads(out, _sdpa(q, k, v, mask=mask), (q, k, v))


def test_a_query_with_every_key_masked_stays_finite():
    q, k, v = _qkv(4, 4)
    mask = torch.ones(B, 1, 4, 4, dtype=torch.bool).tril()
    mask[0, :, 0, :] = False
    out, _ = grouped_attention(None, q, k, v, mask)
    assert torch.isfinite(out).all()
    # Uniform weights over the 4 (masked) keys: the mean of the values of each query's group.
    assert torch.allclose(out[0, 0], v[0].mean(dim=1).repeat_interleave(H // KV, 0), atol=1e-6)


def test_installed_model_matches_sdpa_model_logprobs_gradients_and_prefix_pass(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return grouped_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "grouped_attention", counted)
    ref = tiny_policy()
    ours = copy.deepcopy(ref)
    attention.install(ours)
    assert ours.config._attn_implementation == attention.NAME
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(2))
    ids[:, :6] = ids[0, :6]  # a shared prefix of 6 tokens
    attn = torch.ones_like(ids)
    attn[2, 9:] = 0
    temps = torch.tensor([1.0, 0.7, 1.3])
    lp_ref = policy_logprobs(ref, ids, attn, temps)
    lp = policy_logprobs(ours, ids, attn, temps)
    assert torch.allclose(lp, lp_ref, atol=1e-5)
    assert len(calls) == 2  # one per layer of the tiny model
    lp.sum().backward()
    lp_ref.sum().backward()
    for (n, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), n
    with torch.no_grad():
        shared = body_hidden(ours.model, ids, attn, min_shared=4)
        plain = body_hidden(ref.model, ids, attn, min_shared=100)
    assert torch.allclose(shared, plain, atol=1e-5)


def test_bf16_grouped_attention_is_as_close_to_float32_as_sdpa_bf16():
    q, k, v = _qkv(16, 16)
    exact = _sdpa(q, k, v, causal=True)
    ours, _ = grouped_attention(None, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    theirs = _sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    # bf16 inputs carry 2^-9 relative error, the probabilities another: both within 0.05 of the
    # float32 output (|out| < 3) and within 2x of each other.
    err_ours = (ours.float() - exact).abs().max().item()
    err_theirs = (theirs.float() - exact).abs().max().item()
    assert err_ours < 0.05 and err_ours < 2 * err_theirs + 1e-3


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"dropout": 0.1}, "dropout"), ({"kv_heads": 4}, "cannot share")],
    ids=["dropout", "heads"],
)
def test_unsupported_inputs_are_named(kwargs, needle):
    q, k, v = _qkv(3, 3)
    if "kv_heads" in kwargs:
        k = torch.randn(B, kwargs["kv_heads"], 3, D)
        v = torch.randn(B, kwargs["kv_heads"], 3, D)
    with pytest.raises(ValueError, match=needle):
        grouped_attention(None, q, k, v, None, dropout=kwargs.get("dropout", 0.0))
