"""Shared-prefix forward pass: a batch whose rows begin with the same tokens runs them once.

Every request of a deployment usually starts with the same chat template and system prompt (in the
simulation, chat template and SAO §3.4 system prompt are the first 79 of about 92 prompt tokens,
then up to 48 action tokens), so a learner batch repeats that prefix in every row. ``body_hidden`` runs the common prefix once (batch 1, with
gradients), repeats its key/value cache over the batch and runs only the rows' remainders against
it. The result and its gradients equal those of the plain padded forward up to float rounding:
the repeat's backward sums the rows' gradients into the one prefix pass, which is exactly the
gradient the B identical copies would have received. Pure: tensors in, tensors out.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only attended tokens: [B, T] long, 0 at and before the first token.

    HF Llama defaults to ``arange(T)`` whatever the padding; with left padding that would shift the
    real tokens' rotary positions away from what the server used. Counting attended tokens makes
    left and right padding give the same result as the unpadded sequence.
    """
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


# Below this many shared tokens the prefix is not worth a separate pass (a judgement, not measured:
# the saving grows with the prefix, and each pass has a fixed cost).
MIN_SHARED_TOKENS = 16


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Number of leading positions where every row has the same token and attends to it.

    Args:
        input_ids: [B, T] long.
        attention_mask: [B, T] 0/1.

    Returns:
        P in [0, T - 1] (tokens): the common prefix, capped at T - 1 so at least one position is
        left for the per-row pass.
    """
    same = (input_ids == input_ids[:1]).all(dim=0) & attention_mask.bool().all(dim=0)
    differ = (~same).nonzero()
    length = int(differ[0, 0]) if differ.numel() else input_ids.shape[1]
    return min(length, input_ids.shape[1] - 1)


def body_hidden(
    body: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    min_shared: int | None = None,
    shared: int | None = None,
) -> torch.Tensor:
    """Last hidden states of a transformers decoder body, running a shared prefix once.

    Args:
        body: the model's ``base_model`` (e.g. ``LlamaModel``); must accept ``past_key_values``.
        input_ids: [B, T] long; right padding shares a prefix. Left-padded rows (position 0 not
            attended in every row) share nothing and take the plain forward.
        attention_mask: [B, T] 0/1.
        min_shared: the shortest common prefix (tokens) worth a separate pass (default
            ``MIN_SHARED_TOKENS``); below it, or with one row, this is the plain forward.
        shared: the common prefix length to use instead of this batch's own, at most that (a
            learner rank evaluating its share of a batch passes the whole batch's, so that every
            rank runs each layer the same number of times: ``learner.models.placement``); None: this
            batch's ``shared_prefix_length`` (0 for one row).

    Returns:
        [B, T, H] last hidden states (the body's dtype), positions counting attended tokens
        (``position_ids_from_mask``), differentiable w.r.t. the body's parameters.
    """
    positions = position_ids_from_mask(attention_mask)
    n_rows = input_ids.shape[0]
    if shared is None:
        shared = shared_prefix_length(input_ids, attention_mask) if n_rows > 1 else 0
    if shared < (MIN_SHARED_TOKENS if min_shared is None else min_shared):
        return body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
        ).last_hidden_state
    head = body(
        input_ids=input_ids[:1, :shared],
        attention_mask=attention_mask[:1, :shared],
        position_ids=positions[:1, :shared],
        use_cache=True,
    )
    cache = head.past_key_values
    cache.batch_repeat_interleave(n_rows)
    tail = body(
        input_ids=input_ids[:, shared:],
        attention_mask=attention_mask,
        position_ids=positions[:, shared:],
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    return torch.cat([head.last_hidden_state.expand(n_rows, -1, -1), tail], dim=1)
