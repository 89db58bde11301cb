"""The contract every learner algorithm implements.

``learner.process`` drives any algorithm through ``Algorithm`` only: it builds one from the
run's validated ``LearnerConfig`` (``learner.registry.build_algorithm``: the config's algorithm
model names the class), calls ``step(batch)`` for the metrics of one update, publishes
``policy_weights``, checkpoints ``state_dict`` and restores ``load_state_dict``. Adding an
algorithm is a config model in ``learner.config``, a module with its ``Algorithm`` subclass, and
one entry in ``learner.registry.ALGORITHMS``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from learner.precision import MixedPrecisionAdamW

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.batch import Batch
    from learner.config import LearnerConfig


class Algorithm(ABC):
    """One policy-update algorithm on in-memory models.

    Attributes every implementation sets: ``config`` (the ``LearnerConfig`` it was built from),
    ``policy`` (the float32 policy it trains), ``policy_opt`` (its optimizer) and ``steps``
    (updates done).
    """

    config: LearnerConfig
    policy: PreTrainedModel
    policy_opt: torch.optim.Optimizer
    steps: int

    @classmethod
    @abstractmethod
    def build(cls, config: LearnerConfig, load_policy: Callable[[], PreTrainedModel]) -> Algorithm:
        """A fresh learner for ``config``; ``load_policy()`` returns a new float32 copy of the
        base policy each call (the policy, and e.g. the KL reference or the critic's body)."""

    @abstractmethod
    def step(self, batch: Batch) -> dict:
        """One update on ``batch``; returns metrics (JSON-able numbers, dicts of numbers).
        Raises ValueError on an invalid batch."""

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

    def load_policy_weights(self, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Load published weights into the policy (``strict=False``: a tied tensor is stored
        once) and, when the optimizer keeps float32 masters (``learner.precision``), into the
        masters too; returns the missing and the unexpected keys."""
        missing, unexpected = self.policy.load_state_dict(weights, strict=False)
        if isinstance(self.policy_opt, MixedPrecisionAdamW):
            self.policy_opt.sync_from_model()
        return missing, unexpected

    def reset_policy_optimizer(self) -> None:
        """Forget the policy optimizer's moments (a rollback abandons their updates)."""
        self.policy_opt.state.clear()

    def policy_weights(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """A detached copy of the policy's state dict cast to ``dtype`` (for publishing)."""
        return {k: v.detach().to(dtype=dtype, copy=True) for k, v in self.policy.state_dict().items()}
