"""Floating-point operations of one SAO learner step, from the model's config.

The denominator of the learner benchmarks' ratios (``bench/bench_learner_precision.py``): a
step's FLOPs divided by its time is its achieved rate, compared with the machine's matmul rate
(docs/design.md §7). Only the matmuls are counted (linear layers, attention scores and their
weighted sum, the LM head, the value head); norms, activations and the optimizer are not, as they
are a fraction of a percent of the arithmetic (though not of the time).

Conventions (multiply-add = 2 FLOPs):
    - A linear layer of ``k → n`` on N tokens: ``2·N·k·n`` forward. Backward: the input gradient
      (``2·N·k·n``) always (it carries the gradient to the layers below), plus the weight gradient
      (``2·N·k·n``) when the weight is trained: 2× forward for a trained weight, 1× for a frozen one.
      That the first layer's input gradients are not needed when the embeddings are frozen (the
      critic) is not modelled: an overcount of at most 1/L of the critic's backward.
    - Attention of one head over P (query, key) pairs with head dimension d: ``2·P·d`` for the
      scores and ``2·P·d`` for the weighted sum of values, forward; 2× that backward. P counts
      the causal pairs a query actually attends (``T(T+1)/2`` for a row of T tokens), not the
      masked square an implementation may compute.
    - LM head (``learner.data.batch.policy_logprobs``): ``2·N·H·V`` per pass over N action tokens;
      with gradients, backward recomputes the logits and forms two gradients: 3 more (4× in all).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The matmul sizes of a Llama-family decoder (``transformers`` config field names).

    Fields: hidden_size H, intermediate_size I, num_hidden_layers L, num_attention_heads,
    num_key_value_heads, head_dim d, vocab_size V (all counts).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, config) -> Shape:
        """From a transformers ``PretrainedConfig`` (``head_dim`` defaults to H / heads)."""
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
        )

    def attention_weights(self) -> int:
        """Weights of one layer's q, k, v, o projections."""
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return self.hidden_size * (2 * q + 2 * kv)

    def mlp_weights(self) -> int:
        """Weights of one layer's gate, up and down projections."""
        return 3 * self.hidden_size * self.intermediate_size


@dataclass(frozen=True)
class Tokens:
    """What one pass of a batch through the decoder body processes.

    Fields: ``tokens`` (token positions run through the body), ``pairs`` (causal (query, key)
    pairs attended, summed over rows and positions), ``heads`` (action tokens through the LM head).
    """

    tokens: int
    pairs: int
    heads: int

    @classmethod
    def rows(cls, rows: int, seq: int, actions: int, shared_prefix: int = 0) -> Tokens:
        """``rows`` unpadded rows of ``seq`` tokens, ``actions`` of them through the LM head.

        With ``shared_prefix`` P > 0 the first P tokens are run once (``learner.algo.prefix``) and each
        row's remaining ``seq − P`` queries attend the prefix and their own earlier tokens.
        """
        full = seq * (seq + 1) // 2
        head = shared_prefix * (shared_prefix + 1) // 2
        if shared_prefix:
            tokens = shared_prefix + rows * (seq - shared_prefix)
            pairs = head + rows * (full - head)
        else:
            tokens, pairs = rows * seq, rows * full
        return cls(tokens=tokens, pairs=pairs, heads=rows * actions)


def forward_flops(shape: Shape, t: Tokens) -> dict[str, int]:
    """Forward FLOPs of the body, split by kind: ``attention_proj`` (q/k/v/o), ``mlp``,
    ``attention`` (scores and values); summed over the L layers. The LM head is separate."""
    layers = shape.num_hidden_layers
    return {
        "attention_proj": 2 * t.tokens * shape.attention_weights() * layers,
        "mlp": 2 * t.tokens * shape.mlp_weights() * layers,
        "attention": 4 * t.pairs * shape.head_dim * shape.num_attention_heads * layers,
    }


def lm_head_flops(shape: Shape, t: Tokens) -> int:
    """One LM-head matmul over the action tokens: ``2·N·H·V``."""
    return 2 * t.heads * shape.hidden_size * shape.vocab_size


def sao_step_flops(
    shape: Shape,
    t: Tokens,
    critic_updates: int = 2,
    critic_trainable: str = "mlp",
    kl_anchor: bool = True,
) -> dict[str, int]:
    """FLOPs of one ``SAOLearner.step`` with the DIS update, by pass, and their ``total``.

    Passes: ``critic fwd+bwd`` (× ``critic_updates``; with ``critic_trainable="mlp"`` the
    attention projections are frozen, ``"all"`` trains them), ``critic fwd`` (values, no grad),
    ``policy fwd+bwd`` (every weight trained, LM head 4×), and with the KL anchor
    ``reference fwd`` (body and LM head, forward only). The value head (``H → 1``) is counted with
    the critic's passes. See the module docstring for the conventions.

    Raises:
        ValueError: ``critic_trainable`` is not "mlp" or "all", or ``critic_updates`` < 0.
    """
    if critic_trainable not in ("mlp", "all"):
        raise ValueError(f"critic_trainable must be 'mlp' or 'all', got {critic_trainable!r}")
    if critic_updates < 0:
        raise ValueError(f"critic_updates must be >= 0, got {critic_updates}")
    fwd = forward_flops(shape, t)
    body = sum(fwd.values())
    value_head = 2 * t.tokens * shape.hidden_size
    proj_backward = fwd["attention_proj"] * (2 if critic_trainable == "all" else 1)
    critic_train = body + value_head + proj_backward + 2 * fwd["mlp"] + 2 * fwd["attention"] + 2 * value_head
    head = lm_head_flops(shape, t)
    out = {
        "critic fwd+bwd": critic_updates * critic_train,
        "critic fwd": body + value_head,
        "policy fwd+bwd": 3 * body + 4 * head,
    }
    if kl_anchor:
        out["reference fwd"] = body + head
    out["total"] = sum(out.values())
    return out
