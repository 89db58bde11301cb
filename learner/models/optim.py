"""The learners' optimiser: AdamW on float32 master weights, and one clipped update.

The settings come from ``learner.config.OptimizerConfig`` (the policy's learning rate, β1, weight
decay, gradient clip); the critic uses the same with its own learning rate
(``SAOAlgorithm.critic_lr``), value pretraining with the one it is given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from learner.models.placement import full_tensor


def make_adamw(
    params: list[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    beta1: float = 0.9,
    lr_scales: Sequence[float] | None = None,
) -> torch.optim.AdamW:
    """AdamW with betas ``(beta1, 0.999)`` over ``params`` (no I/O).

    ``lr_scales`` (one per parameter, in ``params``' order; None: all 1) gives each parameter the
    rate ``lr × scale``: one parameter group per distinct scale, in order of first appearance
    (LoRA+'s faster B, ``learner.config.LoraPolicy.b_lr_ratio``). Fused AdamW exists for CPU and
    CUDA float32 parameters and is several times faster than the per-tensor loop on 135M
    parameters.

    Raises:
        ValueError: ``lr_scales`` has another length than ``params``.
    """
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    scales = [1.0] * len(params) if lr_scales is None else list(lr_scales)
    if len(scales) != len(params):
        raise ValueError(f"{len(scales)} learning-rate scales for {len(params)} parameters")
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for p, scale in zip(params, scales, strict=True):
        groups.setdefault(scale, []).append(p)
    return torch.optim.AdamW(
        [{"params": ps, "lr": lr * scale} for scale, ps in groups.items()],
        lr=lr,
        betas=(beta1, 0.999),
        weight_decay=weight_decay,
        fused=fused,
    )


def optimizer_step(
    opt: torch.optim.Optimizer, loss: torch.Tensor, params: Sequence[torch.nn.Parameter], grad_clip: float
) -> float:
    """Zero the gradients, back-propagate ``loss`` (0-dim), clip the global L2 norm of ``params``'
    gradients to ``grad_clip``, step ``opt``; returns the gradient norm before clipping (float).
    With sharded parameters (FSDP2 DTensors, ``learner.models.placement``) the norm is over every
    rank's shards (torch reduces it), the same on every rank."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, grad_clip)).item()
    opt.step()
    return norm
