"""Grouped-query attention as two batched matmuls, for training passes on CPU in bf16.

Why (docs/precision.md): on the CPU build of torch, ``scaled_dot_product_attention`` runs its
forward in a fast flash kernel, but its bf16 backward is slow, many times the forward, and a large
share of a bf16 learner step. For the learner's short rows (≈ 160 tokens) the plain formulation
is faster: the query heads that share one key/value head are stacked into
one matrix, so each layer is one ``[G·T, D] × [D, T]`` and one ``[G·T, T] × [T, D]`` matmul per
(row, key/value head) on AMX, no key/value repeat is materialised, and the softmax runs in one
fused kernel (computed in float32 inside the kernel, stored in the activations' dtype).

``install(model)`` registers the function with transformers' attention interface under
``NAME`` and switches the model (and every submodule with its own config, e.g. a critic body
deep-copied from the policy) to it. The masks it accepts are the ones transformers' ``sdpa``
mask builder produces: None (causal), or a 4-D boolean mask (True = attend).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "saoserve_grouped"


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Softmax attention with grouped key/value heads, in the inputs' dtype.

    Args:
        module: the attention module (unused; the interface passes it).
        query: [B, H, Tq, D].
        key, value: [B, KV, Tk, D] with H a multiple of KV; query head ``h`` reads key/value head
            ``h // (H / KV)`` (transformers' ``repeat_kv`` order).
        attention_mask: None for causal attention aligned to the last key (a query at position i
            of Tq sees keys ``j <= i + Tk − Tq``, which is also right for a query block that
            follows a cached prefix), or a [B or 1, 1, Tq, Tk] boolean mask (True = attend) or
            additive float mask.
        scaling: score scale (default ``D ** -0.5``).
        dropout: must be 0 (the learner runs models in eval mode).

    Returns:
        ([B, Tq, H, D] attention output, None), as transformers' attention functions return. A
        query with every key masked gets the mean of the values (finite, like transformers'
        eager path), never NaN.

    Raises:
        ValueError: dropout > 0, or H not a multiple of KV.
    """
    if dropout:
        raise ValueError("grouped_attention does not implement dropout")
    b, h, tq, d = query.shape
    kv, tk = key.shape[1], key.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads cannot share {kv} key/value heads")
    g = h // kv
    scale = d**-0.5 if scaling is None else scaling
    q = (query * scale).reshape(b, kv, g * tq, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).view(b, kv, g, tq, tk)
    low = torch.finfo(scores.dtype).min
    if attention_mask is None:
        causal = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)
        scores.masked_fill_(~causal, low)
    elif attention_mask.dtype == torch.bool:
        scores.masked_fill_(~attention_mask[:, :, None], low)
    else:
        scores = scores + attention_mask[:, :, None].to(scores.dtype)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(b, kv, g * tq, tk), value)
    return out.view(b, h, tq, d).transpose(1, 2), None


def install(model: torch.nn.Module) -> None:
    """Make ``model`` (a transformers model, or a module holding transformers bodies) and all
    its submodules with a config use ``grouped_attention``; idempotent."""
    AttentionInterface.register(NAME, grouped_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel):
            sub.config._attn_implementation = NAME
