"""Which action tokens carry usable log-probabilities: one rule for every algorithm.

docs/design.md §8: non-finite numbers never reach the weights; a token whose logprob is not finite is
masked and counted, in every algorithm. The SAO loss (``learner.algo.dis``) and the SPO++ loss
(``learner.algo.advantages.spo_ppo_loss``) both call ``usable_tokens`` on the logprobs they read.

Floor: a token is also unusable when a logprob is below ``LOGPROB_FLOOR`` = −100 nats. The
logprobs are of tokens that were actually sampled; a token of probability e^−100 ≈ 3.7e−44
would take ~10^43 draws to come up once, so such a value is a sentinel (servers write −9999 or
−inf for "no logprob") or a numerical failure, never a measurement. It is also where the
arithmetic breaks: importance ratios are ``exp(log πθ − log π_rollout)``, and float32's exp
overflows to inf above 88.7, so a rollout logprob below about −89 gives an infinite ratio
(the largest importance weight) for any learner logprob near the sampled token's. The same
rule applies to the learner's own logprob: a value below the floor for a token the server
sampled means the two policies disagree beyond any importance correction.
"""

from __future__ import annotations

import torch

LOGPROB_FLOOR = -100.0
"""Smallest usable log-probability of a sampled token (nats); see the module docstring."""


def usable_tokens(action_mask: torch.Tensor, *logprobs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The action tokens whose logprobs are all finite and ``>= LOGPROB_FLOOR``.

    Args:
        action_mask: [B, T] 0/1 (bool, int or float); 1 on action tokens.
        *logprobs: [B, T] float tensors (nats), e.g. the rollout logprobs and the learner's;
            values outside the action mask are not read. Gradients are not tracked here.

    Returns:
        ``(mask, dropped)``: mask is a [B, T] bool tensor, ``action_mask`` with the unusable
        tokens set to False; ``dropped`` is how many action tokens were unusable (int), the
        ``nonfinite_tokens`` metric.

    Raises:
        ValueError: a logprob tensor's shape differs from ``action_mask``'s.
    """
    action = action_mask.bool()
    mask = action.clone()
    for lp in logprobs:
        if lp.shape != action.shape:
            raise ValueError(f"logprobs {tuple(lp.shape)} differ from action_mask {tuple(action.shape)}")
        v = lp.detach()
        mask &= torch.isfinite(v) & (v >= LOGPROB_FLOOR)
    return mask, int((action & ~mask).sum().item())
