"""The contract every learner algorithm implements, the shared optimiser step and metrics.

``learner.process`` drives any algorithm through ``Algorithm`` only: it builds one with
``build_algorithm(config, load_policy)`` (the config's ``algorithm.implementation`` names the
class), calls ``step(batch, samples)`` for the metrics of one update, publishes
``policy_weights``, checkpoints ``state_dict`` and restores ``load_state_dict``. Adding an
algorithm is a config model in ``learner.config`` plus a module with its ``Algorithm`` subclass.
"""

from __future__ import annotations

import importlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.batch import Batch
    from learner.config import LearnerConfig
    from learner.samples import Sample


def make_adamw(
    params: list[torch.nn.Parameter], lr: float, weight_decay: float, beta1: float = 0.9
) -> torch.optim.AdamW:
    """AdamW with betas ``(beta1, 0.999)`` for the learners' models (no I/O; raises nothing).

    Fused AdamW exists for CPU and CUDA float32 parameters and is several times faster than the
    per-tensor loop on 135M parameters.
    """
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=(beta1, 0.999), weight_decay=weight_decay, fused=fused)


def optimizer_step(
    opt: torch.optim.Optimizer, loss: torch.Tensor, params: Sequence[torch.nn.Parameter], grad_clip: float
) -> float:
    """Zero the gradients, back-propagate ``loss``, clip the global L2 norm to ``grad_clip``,
    step ``opt``; returns the gradient norm before clipping (float)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip).item()
    opt.step()
    return norm


def throughput(batch: Batch, started: float) -> dict[str, float]:
    """``tokens`` (attended tokens of ``batch``), ``step_time_s`` (seconds since ``started``, a
    ``time.perf_counter()`` value) and ``tokens_per_s``."""
    elapsed = time.perf_counter() - started
    tokens = int(batch.attention_mask.bool().sum().item())
    return {
        "tokens": tokens,
        "step_time_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else math.inf,
    }


class Algorithm(ABC):
    """One policy-update algorithm on in-memory models.

    Attributes every implementation sets: ``policy`` (the float32 policy it trains),
    ``policy_opt`` (its optimizer) and ``steps`` (updates done).
    """

    policy: PreTrainedModel
    policy_opt: torch.optim.Optimizer
    steps: int

    @classmethod
    @abstractmethod
    def build(cls, config: LearnerConfig, load_policy: Callable[[], PreTrainedModel]) -> Algorithm:
        """A fresh learner for ``config``; ``load_policy()`` returns a new float32 copy of the
        base policy each call (the policy, and e.g. the KL reference or the critic's body)."""

    @abstractmethod
    def step(self, batch: Batch, samples: Sequence[Sample] | None = None) -> dict:
        """One update on ``batch`` (collated from ``samples``); returns metrics (JSON-able
        numbers, dicts of numbers). Raises ValueError on an invalid batch."""

    @abstractmethod
    def state_dict(self) -> dict:
        """Everything a restart needs to continue (models, optimizers, counters)."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()`` of a learner built from the same config."""

    def warm_start(self, policy_dir: Path) -> Path | None:
        """Initialise from files in ``policy_dir`` when there is no checkpoint; the file loaded,
        or None (default: none)."""
        return None

    def on_version(self, version: int) -> None:
        """The policy now is ``version`` (loaded at start, after a step, or a rollback's);
        default: nothing to do."""
        return

    def reset_policy_optimizer(self) -> None:
        """Forget the policy optimizer's moments (a rollback abandons their updates)."""
        self.policy_opt.state.clear()

    def policy_weights(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """A detached copy of the policy's state dict cast to ``dtype`` (for publishing)."""
        return {k: v.detach().to(dtype=dtype, copy=True) for k, v in self.policy.state_dict().items()}


def build_algorithm(config: LearnerConfig, load_policy: Callable[[], PreTrainedModel]) -> Algorithm:
    """The implementation named by ``config.algorithm.implementation`` ("module:Class"), built."""
    module, _, cls = config.algorithm.implementation.partition(":")
    return getattr(importlib.import_module(module), cls).build(config, load_policy)
