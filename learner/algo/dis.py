"""DIS: direct double-sided importance sampling, the SAO policy loss.

Source: SAO (arXiv 2607.07508) §2.2 "直接双边 token 级重要性采样" (papers/001, and papers/003
§二(一)), docs/design.md §5.1. The ratio is taken directly against the logged rollout log-probability
(no old-policy forward pass), and a token whose ratio leaves the open interval
``(1 - eps_low, 1 + eps_high)`` is dropped from the gradient whatever the sign of its advantage
(unlike PPO clipping, which looks at the sign).
"""

from __future__ import annotations

import torch

from learner.algo.finite import usable_tokens
from learner.algo.kl import k3

# (eps_low, eps_high) per task family, from SAO §3 experimental setup (papers/003 §三(一)).
DIS_PRESETS: dict[str, tuple[float, float]] = {
    "math_tir": (0.3, 5.0),
    "coding_agent": (0.8, 3.0),
}


def check_token_inputs(
    name: str, first: torch.Tensor, others: dict[str, torch.Tensor | None], eps_low: float, eps_high: float
) -> None:
    """The input checks of a token-level ratio loss or mask (``dis_loss``,
    ``learner.algo.offpolicy.mis_token_mask``): ``first`` (called ``name``) is [B, T], each tensor of
    ``others`` (None: absent, skipped) has its shape, ``0 <= eps_low <= 1`` and ``eps_high >= 0``.

    Raises:
        ValueError: naming the tensor whose shape is wrong, or the bound out of range.
    """
    shape = first.shape
    if first.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got {tuple(shape)}")
    for other, t in others.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{other} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not 0.0 <= eps_low <= 1.0:
        raise ValueError(f"eps_low must be in [0, 1], got {eps_low}")
    if eps_high < 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")


def dis_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    staleness: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """DIS loss ``L = -Σ_t sg(f(r_t)) · A_t · log πθ(a_t|s_t) · m_t / Σ_t m_t`` (token mean).

    ``r_t = exp(logprobs - rollout_logprobs)``; ``f(r) = r`` if ``1 - eps_low < r < 1 + eps_high``
    (strict on both sides) else 0. ``f`` is a constant in the graph (stop-gradient), so the
    gradient is ``-f(r_t) A_t ∇log πθ / Σ m``. Source: SAO §2.2; defaults are the math/TIR preset
    (``DIS_PRESETS``).

    Args:
        logprobs: [B, T] float, current-policy log-probabilities of the taken tokens (nats), with
            grad. Values outside the action mask are ignored (they may be anything finite or not).
        rollout_logprobs: [B, T] float, the logged behaviour log-probabilities (nats). An action
            token whose logprob here or in ``logprobs`` is not finite or is below
            ``learner.algo.finite.LOGPROB_FLOOR`` is dropped from the loss, its denominator and the
            stats, and counted in ``nonfinite_tokens`` (``learner.algo.finite.usable_tokens``).
        advantages: [B, T] float, treated as constants (detached here).
        action_mask: [B, T] 0/1 float or bool; 1 on tokens the model generated.
        eps_low: lower tolerance, ``0 <= eps_low <= 1``.
        eps_high: upper tolerance, ``eps_high >= 0``.
        staleness: optional [B, T] integer tensor (policy versions between the token's sampling and
            now); when given, adds the stat ``mean_abs_log_ratio_by_staleness``.

    Returns:
        ``(loss, stats)``: loss is a 0-dim float32 tensor (0 with a graph when there is no action
        token). stats holds python numbers over action tokens: ``action_tokens`` (count),
        ``kept_fraction`` (fraction with ratio inside the interval), ``mean_abs_log_ratio``
        (mean ``|log r|``), ``approx_kl`` (``learner.algo.kl.k3``, mean of ``(r - 1) - log r``: an unbiased
        estimate of ``KL(π_rollout ‖ πθ)`` under rollout samples, computed in float64), and, with
        ``staleness``, ``mean_abs_log_ratio_by_staleness`` ``{staleness: mean |log r|}``.
        All stats are 0 when there is no usable action token; every stat is finite.

    Raises:
        ValueError: shapes differ or are not 2-D, or eps out of range.
    """
    named = {"rollout_logprobs": rollout_logprobs, "advantages": advantages, "action_mask": action_mask}
    check_token_inputs("logprobs", logprobs, named | {"staleness": staleness}, eps_low, eps_high)
    mask, dropped = usable_tokens(action_mask, logprobs, rollout_logprobs)
    log_ratio = torch.where(mask, logprobs.detach().float() - rollout_logprobs.float(), 0.0)
    ratio = torch.exp(log_ratio)
    keep = mask & (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)
    weight = torch.where(keep, ratio * advantages.detach().float(), 0.0)
    # torch.where (not a multiply) so non-finite logprobs at masked positions cannot leak NaN.
    per_token = torch.where(keep, weight * logprobs.float(), torch.zeros_like(weight))
    n = mask.sum()
    loss = -per_token.sum() / n.clamp(min=1)

    n_tokens = int(n.item())
    stats: dict = {"action_tokens": n_tokens, "nonfinite_tokens": dropped}
    if n_tokens == 0:
        stats.update(kept_fraction=0.0, mean_abs_log_ratio=0.0, approx_kl=0.0)
        if staleness is not None:
            stats["mean_abs_log_ratio_by_staleness"] = {}
        return loss, stats
    lr64 = log_ratio[mask].double()
    stats["kept_fraction"] = keep.sum().item() / n_tokens
    stats["mean_abs_log_ratio"] = lr64.abs().mean().item()
    stats["approx_kl"] = k3(lr64).mean().item()
    if staleness is not None:
        stale = staleness[mask]
        abs_lr = lr64.abs()
        stats["mean_abs_log_ratio_by_staleness"] = {
            int(s): abs_lr[stale == s].mean().item() for s in torch.unique(stale).tolist()
        }
    return loss, stats
