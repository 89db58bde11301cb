"""The MIS policy loss with an old policy: the ``mis_snapshot`` and ``mis_ewma`` corrections.

Source: papers/004 §4 (the dual-constraint view) and §5 (where π_old comes from), docs/design.md
§5.5.
The token mask is ``learner.algo.offpolicy.mis_token_mask``; this module turns it into a loss.

What is implemented, and why: the per-token gradient is ``sg(r_d · r_s) · A · ∇log πθ`` on the
tokens the mask keeps, with ``r_d = π_old/μ`` and ``r_s = πθ/π_old``. Since ``r_d · r_s = πθ/μ``
this is the ordinary importance-weighted policy gradient against the behaviour policy μ that
generated the token (the same weight SAO's DIS applies), and π_old enters only through the
mask: §4 shows that PPO's clip is a mask on r_s, and that the decoupled variants add a mask on
r_d; a token whose r_d leaves ``[1/c, c]`` (the train–inference discrepancy is too large) or
whose r_s moved past the clip in the direction of its advantage contributes nothing. The mask
alone leaves the weight of a kept token with ``A < 0`` unbounded above (r_s ≥ 1 − ε is its only
drift bound; with logprobs down to the −100 floor, πθ/μ can overflow float32). A dual clip, not in
papers/004, closes that: a token with ``A < 0`` and ``r_s > dual_clip`` is masked as well (dual-clip
PPO, Ye et al. 2020; verl's ``clip_ratio_c`` = 3), so every kept weight is at most
``c · dual_clip``. The loss is the token mean over the usable action tokens, like
``learner.algo.dis.dis_loss``.
"""

from __future__ import annotations

import math

import torch

from learner.algo.finite import usable_tokens
from learner.algo.kl import k3
from learner.algo.offpolicy import mis_token_mask


def mis_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    c: float,
    dual_clip: float | None = 3.0,
) -> tuple[torch.Tensor, dict]:
    """``L = −Σ_t keep_t · sg(πθ/μ)_t · A_t · log πθ_t / Σ_t usable_t`` (papers/004 §4).

    Args:
        logp_new: [B, T] float, log πθ of the taken tokens (nats), with grad.
        logp_old: [B, T] float, log π_old (a snapshot's or the EWMA proxy's), nats, no grad.
        logp_behaviour: [B, T] float, log μ, the logged rollout logprobs (nats).
        advantages: [B, T] float, constants.
        action_mask: [B, T] 0/1; 1 on action tokens.
        eps_low, eps_high: drift bounds on r_s (``mis_token_mask``).
        c: discrepancy bound on r_d, ``c >= 1``.
        dual_clip: a token with ``A < 0`` and ``r_s > dual_clip`` is masked (counted in
            ``masked_by_rs``); ``> 1``, or None for no dual clip (the paper's mask alone).

    Returns:
        ``(loss, stats)``: loss a 0-dim float32 tensor (0 with a graph when no token is usable);
        stats over the usable action tokens: ``action_tokens``, ``nonfinite_tokens`` (action
        tokens dropped for a non-finite or too small logprob, ``learner.algo.finite``), ``kept``
        (tokens kept, int), ``masked_by_rd`` (r_d outside ``[1/c, c]``, int), ``masked_by_rs``
        (r_d inside but the drift bound violated, int), ``sum_abs_log_ratio`` (Σ |log πθ/μ|),
        ``sum_abs_log_rd`` (Σ |log r_d|), ``sum_k3`` (Σ (πθ/μ − 1) − log πθ/μ, ``learner.algo.kl.k3``);
        the sums let a caller average over several updates.

    Raises:
        ValueError: shapes differ or a bound is out of range (``mis_token_mask``), or
            ``dual_clip <= 1``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    keep = mis_token_mask(
        logp_new,
        logp_old,
        logp_behaviour,
        advantages,
        eps_low=eps_low,
        eps_high=eps_high,
        c=c,
        action_mask=action_mask,
    )
    usable, dropped = usable_tokens(action_mask, logp_new, logp_old, logp_behaviour)
    if dual_clip is not None:
        log_rs = torch.where(usable, logp_new.detach().double() - logp_old.detach().double(), 0.0)
        keep = keep & ~((advantages.detach() < 0) & (log_rs > math.log(dual_clip)))
    log_w = torch.where(usable, logp_new.detach().double() - logp_behaviour.double(), 0.0)
    log_rd = torch.where(usable, logp_old.detach().double() - logp_behaviour.double(), 0.0)
    rd_out = usable & ((torch.exp(log_rd) < 1.0 / c) | (torch.exp(log_rd) > c))
    weight = torch.where(keep, torch.exp(log_w) * advantages.detach().double(), 0.0).float()
    # torch.where (not a multiply) so non-finite logprobs at dropped positions cannot leak NaN.
    per_token = torch.where(keep, weight * logp_new.float(), torch.zeros_like(weight))
    n = int(usable.sum().item())
    loss = -per_token.sum() / max(n, 1)
    lw = log_w[usable]
    stats = {
        "action_tokens": n,
        "nonfinite_tokens": dropped,
        "kept": int(keep.sum().item()),
        "masked_by_rd": int(rd_out.sum().item()),
        "masked_by_rs": int((usable & ~rd_out & ~keep).sum().item()),
        "sum_abs_log_ratio": lw.abs().sum().item(),
        "sum_abs_log_rd": log_rd[usable].abs().sum().item(),
        "sum_k3": k3(lw).sum().item(),
    }
    return loss, stats
