"""Compiled decoder layers (learner.models.fused): the same log-probabilities and gradients as eager."""

import copy

import pytest
import torch

from learner.algo.prefix import body_hidden
from learner.data.batch import policy_logprobs
from learner.models import attention
from learner.models.fused import compile_layers
from testing.models import make_batch, tiny_policy


@pytest.mark.slow  # inductor compiles C++ kernels: about a minute on 2 cores
def test_compiled_layers_match_eager_logprobs_gradients_and_other_shapes():
    eager = tiny_policy()
    compiled = copy.deepcopy(eager)
    attention.install(compiled)
    assert compile_layers(compiled) == 2  # the tiny model's two decoder layers
    batch = make_batch(eager)
    mask = batch.action_mask.bool()
    for rows in (4, 3):  # a second batch size reuses the dynamic-shape code
        lp_e = policy_logprobs(
            eager, batch.input_ids[:rows], batch.attention_mask[:rows], batch.temperatures[:rows], mask[:rows]
        )
        lp_c = policy_logprobs(
            compiled,
            batch.input_ids[:rows],
            batch.attention_mask[:rows],
            batch.temperatures[:rows],
            mask[:rows],
        )
        assert torch.allclose(lp_c, lp_e, atol=1e-5)
        eager.zero_grad()
        compiled.zero_grad()
        lp_e.sum().backward()
        lp_c.sum().backward()
        for (n, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
            assert torch.allclose(a.grad, b.grad, atol=1e-5), n
    # The shared-prefix pass (a key/value cache into the layers) compiles too and agrees.
    ids = batch.input_ids.clone()
    ids[:, :5] = ids[0, :5]
    with torch.no_grad():
        shared = body_hidden(compiled.model, ids, batch.attention_mask, min_shared=4)
        plain = body_hidden(eager.model, ids, batch.attention_mask, min_shared=100)
    assert torch.allclose(shared, plain, atol=1e-5)
