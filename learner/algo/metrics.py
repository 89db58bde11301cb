"""Masked reductions and the per-step diagnostics the learners report (pure: tensors in, numbers out).

One home for what the SAO and SPO++ steps and value pretraining all compute: the mean of a
``[B, T]`` tensor over a token mask (``masked_mean``; the token-mean losses and statistics), the
value loss (``masked_mse``), the critic's explained variance, and a step's throughput.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from learner.data.batch import Batch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_t mask_t · x_t / Σ_t mask_t`` over a token mask; 0 (with a graph) when the mask is empty.

    Args:
        x: [B, T] float (any float dtype, kept); values outside the mask are never read, even if
            non-finite (``torch.where``, not a multiply, so no NaN leaks into the sum or gradient).
        mask: [B, T] bool or 0/1, the tokens averaged over.

    Returns:
        0-dim tensor of ``x``'s dtype.
    """
    m = mask.bool()
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


def masked_mse(values: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The value loss: mean of ``(values − targets)²`` over mask-1 positions, in float32.

    ``values`` and ``targets`` are [B, T] (any float dtype), ``mask`` [B, T] bool or 0/1; 0 when the
    mask is empty. The difference is zeroed outside the mask before it is squared, so a
    non-finite value at a padding position gets no (NaN) gradient.
    """
    m = mask.bool()
    diff = torch.where(m, values.float() - targets.float(), 0.0)
    return masked_mean(diff * diff, m)


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """``EV = 1 − Var(R − V) / Var(R)`` over mask-1 positions (population variances, float64).

    ``returns``, ``values``: [B, T] float; ``mask``: [B, T] bool or 0/1. Defined as 0.0 when
    ``Var(R) = 0`` (e.g. every reward in the batch equal) or the mask is empty: there is nothing to
    explain, and 0 is what a constant predictor scores; a float (never NaN) keeps metrics JSON-safe.
    """
    m = mask.bool()
    r = returns[m].double()
    v = values[m].double()
    if r.numel() == 0:
        return 0.0
    var_r = r.var(unbiased=False).item()
    if var_r == 0.0:
        return 0.0
    return 1.0 - (r - v).var(unbiased=False).item() / var_r


def throughput(batch: Batch, started: float) -> dict[str, float]:
    """``tokens`` (attended tokens of ``batch``), ``step_time_s`` (seconds since ``started``, a
    ``time.perf_counter()`` value) and ``tokens_per_s`` (inf when no time has passed)."""
    elapsed = time.perf_counter() - started
    tokens = int(batch.attention_mask.bool().sum().item())
    return {
        "tokens": tokens,
        "step_time_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else math.inf,
    }
