"""Trajectory advantages and the SPO++ policy loss (pure torch, no I/O).

Sources: SPO++ (arXiv 2608.24870; write-up ``papers/000_…txt``): §2.1 advantage
``A_i = R_i - v̂``, §2.3 action-token-measure normalisation (and trajectory whitening, the
ablation), §2.4 the objective (PPO clip [0.2, 0.28], rollout importance ratio truncated at 2,
dual-clip on negative advantages with c = 2; SPO used c = 10); docs/design.md §5.4. The clipped
surrogate is PPO's; the asymmetric clip range is DAPO's "clip-higher"; the dual clip is
Dual-clip PPO (Ye et al., 2020).

Shapes: ``N`` trajectories; ``[B, T]`` token tensors (batch, time). ``L_i`` is the number of
*action* tokens of trajectory ``i`` (tokens the model generated; observation tokens and
padding excluded), the measure the token-mean loss averages over.
"""

from __future__ import annotations

import torch

from learner.algo.finite import usable_tokens
from learner.algo.kl import k3
from learner.algo.metrics import masked_mean

NORM_EPS = 1e-8
"""Added to σ before dividing (SPO++ write-up §2.3)."""


def _vector(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} must be finite")
    return x


def _floating(x: torch.Tensor, name: str) -> torch.Tensor:
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x


def _lengths(advantages: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    _vector(lengths, "lengths")
    if lengths.shape != advantages.shape:
        raise ValueError(f"lengths {tuple(lengths.shape)} and advantages {tuple(advantages.shape)} differ")
    if (lengths < 0).any():
        raise ValueError("lengths must be >= 0")
    return lengths.to(torch.float64)


def token_measure_normalize(advantages: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Standardise trajectory advantages under the action-token measure (SPO++ §2.3).

    ``μ = Σ L_i A_i / Σ L_i``, ``σ² = Σ L_i (A_i - μ)² / (Σ L_i - 1)``,
    ``Ã_i = (A_i - μ)/(σ + 1e-8)``. Broadcast to each trajectory's action tokens, Ã has
    token-weighted mean 0, which is what a token-mean actor loss consumes; trajectory whitening
    only zeroes the equal-weight mean.

    Args:
        advantages: ``[N]`` floating, finite.
        lengths: ``[N]`` action-token counts ``L_i >= 0`` (int or float). A trajectory with
            ``L_i = 0`` has no weight (its Ã is still returned).

    Returns:
        ``[N]``, dtype of ``advantages`` (computed in float64).

    Raises:
        ValueError: shapes differ, non-finite values, negative lengths, or ``Σ L_i <= 1``
            (the n-1 corrected variance needs at least two action tokens).
    """
    a = _floating(_vector(advantages, "advantages"), "advantages")
    w = _lengths(a, lengths)
    total = w.sum()
    if total <= 1:
        raise ValueError(f"need more than one action token in the batch, got {total.item():g}")
    a64 = a.to(torch.float64)
    mu = (w * a64).sum() / total
    sigma = ((w * (a64 - mu) ** 2).sum() / (total - 1)).sqrt()
    return ((a64 - mu) / (sigma + NORM_EPS)).to(a.dtype)


def trajectory_whiten(advantages: torch.Tensor) -> torch.Tensor:
    """Equal-weight whitening, SPO's recipe and the ablation of :func:`token_measure_normalize`.

    ``μ = mean A``, ``σ² = Σ (A_i - μ)²/(n - 1)``, ``Ã_i = (A_i - μ)/(σ + 1e-8)`` (SPO++ §2.3).
    ``advantages``: ``[N]`` floating, finite, ``N >= 2``. Returns ``[N]`` in the input dtype.
    Raises ``ValueError`` otherwise.
    """
    a = _floating(_vector(advantages, "advantages"), "advantages")
    if a.numel() < 2:
        raise ValueError("need at least two trajectories")
    a64 = a.to(torch.float64)
    return ((a64 - a64.mean()) / (a64.std(correction=1) + NORM_EPS)).to(a.dtype)


def spo_advantages(rewards: torch.Tensor, frozen_values: torch.Tensor) -> torch.Tensor:
    """Trajectory advantages ``A_i = R_i - v̂_i`` (SPO++ §2.1; docs/design.md §5.4).

    ``frozen_values`` are the values the server froze at dispatch (logged in each trajectory's
    baseline), never a later read. Both ``[N]`` floating, finite, in [0, 1]. Returns ``[N]`` in
    the dtype of ``rewards``. Raises ``ValueError`` on shape mismatch or out-of-range values.
    """
    r = _floating(_vector(rewards, "rewards"), "rewards")
    v = _floating(_vector(frozen_values, "frozen_values"), "frozen_values")
    if r.shape != v.shape:
        raise ValueError(f"rewards {tuple(r.shape)} and frozen_values {tuple(v.shape)} differ")
    for name, x in (("rewards", r), ("frozen_values", v)):
        if ((x < 0) | (x > 1)).any():
            raise ValueError(f"{name} must lie in [0, 1]")
    return r - v.to(r.dtype)


def batch_stats(advantages: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """Per-batch diagnostics of SPO++ §2.3 / docs/design.md §5.4 ("log per batch").

    Returns floats:

    * ``cov_n_length_adv``: ``Cov_n(L, A) = (1/n) Σ (L_i - L̄)(A_i - Ā)``, the plain
      (divisor ``n``, equal weight per trajectory) covariance of action-token count and the
      given advantage, as in the paper's equation for the token-weighted centre.
    * ``mean_length``: ``L̄``.
    * ``token_centre_before``: ``Σ L_i A_i / Σ L_i`` of the given advantages.
    * ``token_centre_after``: the same after :func:`token_measure_normalize` (0 up to rounding).
    * ``token_centre_traj_whitened``: the same after :func:`trajectory_whiten`, which equals
      ``Cov_n(L, Ã) / L̄`` (SPO++ §2.3), the bias the token measure removes.

    ``advantages``: ``[N]`` floating; ``lengths``: ``[N]`` >= 0 with ``Σ L > 1``; ``N >= 2``.
    Raises ``ValueError`` as those functions do.
    """
    a = _floating(_vector(advantages, "advantages"), "advantages")
    w = _lengths(a, lengths)
    a64 = a.to(torch.float64)

    def centre(x: torch.Tensor) -> float:
        return ((w * x.to(torch.float64)).sum() / w.sum()).item()

    return {
        "cov_n_length_adv": ((w - w.mean()) * (a64 - a64.mean())).mean().item(),
        "mean_length": w.mean().item(),
        "token_centre_before": centre(a64),
        "token_centre_after": centre(token_measure_normalize(a64, lengths)),
        "token_centre_traj_whitened": centre(trajectory_whiten(a64)),
    }


def spo_ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    rollout_is_cap: float = 2.0,
    dual_clip: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SPO++'s actor loss: PPO clip, dual clip on negative advantages, truncated rollout IS.

    Per action token, with ``r = π_θ/π_old`` and advantage ``A``:

    * ``ℓ = max(-A·r, -A·clip(r, 1 - clip_low, 1 + clip_high))`` (PPO; asymmetric range);
    * if ``A < 0``: ``ℓ = min(ℓ, -dual_clip·A)``, the dual clip, which caps the loss of a
      token whose ratio ran far above 1 on a negative advantage;
    * ``ℓ ← w·ℓ`` with ``w = min(π_old/π_rollout, rollout_is_cap)``, detached: the rollout
      importance ratio truncated at 2, correcting for the server's sampler (SPO++ §2.4);
    * loss = token mean of ℓ over all action tokens of the batch (the "token-mean actor loss"
      that action-token normalisation is matched to, §2.3).

    Defaults are SPO++'s (§2.4): clip [0.2, 0.28], IS cap 2, dual clip c = 2.

    Args:
        logprobs: ``[B, T]`` log π_θ of the sampled tokens, in nats; carries the gradient.
        old_logprobs: ``[B, T]`` log π_old (the policy at the start of the update); no gradient.
        rollout_logprobs: ``[B, T]`` log-probabilities the server sampled with. An action token
            whose logprob here, in ``logprobs`` or in ``old_logprobs`` is not finite or is below
            ``learner.algo.finite.LOGPROB_FLOOR`` is dropped from the loss, its token count and the
            stats, and counted in ``nonfinite_tokens`` (the rule SAO's DIS loss applies too).
        advantages: ``[B]`` (one per trajectory, broadcast over its tokens) or ``[B, T]``.
        action_mask: ``[B, T]`` bool or 0/1; only action tokens count. Values at masked-out
            positions are ignored even if they are inf or NaN (padding).
        clip_low, clip_high: clip range ``[1 - clip_low, 1 + clip_high]``, both > 0.
        rollout_is_cap: upper truncation of the rollout importance ratio, > 0.
        dual_clip: the constant ``c > 1`` of the dual clip.

    Returns:
        ``(loss, stats)``: a 0-d float32 tensor (float64 if ``logprobs`` is float64), and
        floats ``clip_fraction`` (tokens where the clipped term is the larger),
        ``dual_clip_fraction`` (negative-advantage tokens capped at ``-c·A``), ``ratio_mean``,
        ``approx_kl`` (mean of ``(r - 1) - log r``, ``learner.algo.kl.k3``: KL(π_old‖π_θ)),
        ``rollout_is_mean`` (after truncation), ``rollout_is_truncated_fraction``,
        ``n_action_tokens`` (usable action tokens) and ``nonfinite_tokens``, all over the usable
        action tokens and all finite. With no usable token the loss is 0 (with a graph) and the
        stats are 0.

    Raises:
        ValueError: shapes differ, no action token, or a hyper-parameter out of range.
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {tuple(shape)}")
    for name, x in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
        if x.shape != shape:
            raise ValueError(f"{name} {tuple(x.shape)} differs from logprobs {tuple(shape)}")
    if action_mask.shape != shape:
        raise ValueError(f"action_mask {tuple(action_mask.shape)} differs from logprobs {tuple(shape)}")
    if advantages.shape == shape[:1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != shape:
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)}")
    if not (clip_low > 0 and clip_high > 0 and clip_low < 1):
        raise ValueError(f"need 0 < clip_low < 1 and clip_high > 0, got {clip_low}, {clip_high}")
    if not rollout_is_cap > 0:
        raise ValueError(f"rollout_is_cap must be > 0, got {rollout_is_cap}")
    if not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if not action_mask.bool().any():
        raise ValueError("no action token in the batch")
    mask, dropped = usable_tokens(action_mask, logprobs, old_logprobs, rollout_logprobs)
    n_tokens = int(mask.sum())

    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    # Zero the log-differences at masked positions first: padding may hold -inf, and
    # 0 * inf = NaN would poison the sum and the gradient.
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    log_ratio = torch.where(mask, logprobs.to(dtype) - old_logprobs.to(dtype).detach(), zero)
    log_is = torch.where(mask, old_logprobs.to(dtype) - rollout_logprobs.to(dtype), zero).detach()
    adv = torch.where(mask, advantages.to(dtype).detach(), zero)

    ratio = log_ratio.exp()
    surr = -adv * ratio
    surr_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(surr, surr_clipped)
    capped = torch.minimum(per_token, -dual_clip * adv)
    negative = adv < 0
    per_token_dual = torch.where(negative, capped, per_token)
    is_weight = log_is.exp().clamp(max=rollout_is_cap)
    denominator = max(n_tokens, 1)
    loss = masked_mean(is_weight * per_token_dual, mask)

    with torch.no_grad():

        def frac(x: torch.Tensor) -> float:
            return ((x & mask).sum() / denominator).item()

        stats = {
            "clip_fraction": frac(surr_clipped > surr),
            "dual_clip_fraction": frac(negative & (per_token > -dual_clip * adv)),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "approx_kl": masked_mean(k3(log_ratio), mask).item(),
            "rollout_is_mean": masked_mean(is_weight, mask).item(),
            "rollout_is_truncated_fraction": frac(log_is.exp() > rollout_is_cap),
            "n_action_tokens": float(n_tokens),
            "nonfinite_tokens": dropped,
        }
    return loss, stats
