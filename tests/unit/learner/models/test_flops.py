"""FLOPs of an SAO step from the model config (learner.models.flops), checked by hand on a tiny Llama."""

import pytest
from transformers import LlamaConfig

from learner.models.flops import Shape, Tokens, forward_flops, lm_head_flops, sao_step_flops

TINY = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_one_layer_by_hand():
    shape = Shape.of(TINY)
    assert shape.head_dim == 8  # 32 / 4 heads
    # q and o: 32 x 32 each; k and v: 32 x (2 kv heads * 8) = 32 x 16 each.
    assert shape.attention_weights() == 1024 + 1024 + 512 + 512
    # gate, up: 32 x 64; down: 64 x 32.
    assert shape.mlp_weights() == 3 * 2048
    # One row of 10 tokens, 7 of them actions: 10 * 11 / 2 = 55 causal pairs.
    t = Tokens.rows(rows=1, seq=10, actions=7)
    assert (t.tokens, t.pairs, t.heads) == (10, 55, 7)
    fwd = forward_flops(shape, t)
    assert fwd["attention_proj"] == 2 * 10 * 3072  # 61,440
    assert fwd["mlp"] == 2 * 10 * 6144  # 122,880
    # scores and weighted values: 2 * 55 pairs * 8 dims each, 4 heads.
    assert fwd["attention"] == 4 * 55 * 8 * 4  # 7,040
    body = 61_440 + 122_880 + 7_040  # 191,360
    head = 2 * 7 * 32 * 64  # 28,672
    assert lm_head_flops(shape, t) == head
    value_head = 2 * 10 * 32  # 640
    # Critic update: forward, then input grads everywhere (1x the projections, frozen), weight
    # grads of the MLP (2x mlp in all), attention 2x, value head 2x.
    critic = body + value_head + 61_440 + 2 * 122_880 + 2 * 7_040 + 2 * value_head
    got = sao_step_flops(shape, t, critic_updates=2, critic_trainable="mlp", kl_anchor=True)
    assert got["critic fwd+bwd"] == 2 * critic == 2 * 514_560
    assert got["critic fwd"] == body + value_head == 192_000
    assert got["policy fwd+bwd"] == 3 * body + 4 * head == 688_768
    assert got["reference fwd"] == body + head == 220_032
    assert got["total"] == 1_029_120 + 192_000 + 688_768 + 220_032


def test_training_attention_in_the_critic_adds_its_weight_gradients():
    shape = Shape.of(TINY)
    t = Tokens.rows(rows=1, seq=10, actions=7)
    mlp = sao_step_flops(shape, t, critic_updates=1, critic_trainable="mlp", kl_anchor=False)
    full = sao_step_flops(shape, t, critic_updates=1, critic_trainable="all", kl_anchor=False)
    assert full["critic fwd+bwd"] - mlp["critic fwd+bwd"] == 2 * 10 * 3072
    assert "reference fwd" not in mlp


def test_shared_prefix_runs_the_prefix_once():
    # 3 rows of 10 tokens sharing 4: 4 + 3 * 6 = 22 positions; pairs: the prefix's 4 * 5 / 2 = 10
    # once, and each row's queries 4..9 attend 5..10 keys: 55 - 10 = 45 per row.
    t = Tokens.rows(rows=3, seq=10, actions=5, shared_prefix=4)
    assert (t.tokens, t.pairs, t.heads) == (22, 10 + 3 * 45, 15)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"critic_trainable": "none"}, "critic_trainable"), ({"critic_updates": -1}, "critic_updates")],
)
def test_bad_arguments_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        sao_step_flops(Shape.of(TINY), Tokens.rows(1, 10, 7), **kwargs)
