"""Decoder layers compiled with ``torch.compile``, so their elementwise chains run as fused loops.

Why (docs/precision.md): once the matmuls run on AMX in bf16 (``learner.models.precision``), a learner
step spends about as long in elementwise work as in matmuls: each RMSNorm (upcast, square, mean,
rsqrt, two multiplies, downcast), the rotary embedding, SiLU·up and the residual adds are separate
passes over [B, T, H] tensors in eager mode, forward and backward. Inductor fuses each chain into
one loop.

``compile_layers(model)`` compiles every decoder layer of ``model`` in place (the modules that
transformers builds as ``GradientCheckpointingLayer``, e.g. ``LlamaDecoderLayer``), with dynamic
shapes so that batches of other sizes and lengths reuse the compiled code. Layers of one class
share it; a pass without gradients, a model whose frozen parameters differ (the critic) and the
shared-prefix pass each compile once more. Compilation happens on the first call: tens of seconds
to a few minutes on 2 cores, once per process.
"""

from __future__ import annotations

import torch
from transformers.modeling_layers import GradientCheckpointingLayer


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer in ``model`` (``nn.Module.compile``, ``dynamic=True``).

    Args:
        model: a transformers model, or a module holding one (e.g. ``learner.algo.critic.ValueModel``).

    Returns:
        The number of layers compiled (0 when the model has none).
    """
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)
