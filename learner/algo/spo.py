"""The SPO++ update (papers 000/002, docs/design.md §5.4): the learner's ``spo`` estimator.

Per trajectory ``A_i = R_i − v̂_i`` with ``v̂_i`` the prompt value frozen at dispatch (the
server logged it in the trajectory; never a later value), normalised under the action-token
measure (``learner.algo.advantages.token_measure_normalize``; trajectory whitening is the
ablation), then one epoch of the SPO++ objective: PPO clip [0.2, 0.28], rollout importance
ratio truncated at 2, dual clip c = 2 on negative advantages. With one epoch π_old is the
policy at the start of the step (detached), so the PPO ratio starts at 1 and the rollout IS
weight π_old/π_rollout carries the off-policy correction. The learner is built from its
validated ``LearnerConfig`` (``learner.config.SPOAlgorithm`` and the optimiser section).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from learner.algo.advantages import (
    batch_stats,
    spo_advantages,
    spo_ppo_loss,
    token_measure_normalize,
    trajectory_whiten,
)
from learner.algo.algorithm import Algorithm
from learner.algo.finite import usable_tokens
from learner.algo.metrics import throughput
from learner.config import LearnerConfig, SPOAlgorithm
from learner.data.batch import Batch
from learner.models.device import resolve
from learner.models.optim import optimizer_step
from learner.models.placement import Placement
from learner.models.precision import prepare_compute


class SPOLearner(Algorithm):
    """One SPO++ policy update per ``step(batch)`` (``batch.baseline_values`` required); no critic.

    Args (constructor):
        config: a validated ``LearnerConfig`` whose algorithm is ``spo``.
        policy: the policy to train; cast to float32 in place and put in eval mode; with a LoRA
            ``config.policy`` only its adapter is trained (``Algorithm.attach_policy``).
        placement: its device and rank (``learner.models.placement.Placement``); None: one process on
            ``config.device`` (``learner.models.device.resolve``, which raises its DeviceError).

    Raises (constructor): ValueError if the algorithm is not ``spo``.
    """

    critic = None

    def __init__(self, config: LearnerConfig, policy: PreTrainedModel, placement: Placement | None = None):
        if not isinstance(config.algorithm, SPOAlgorithm):
            raise ValueError(f"SPOLearner runs the spo algorithm, not {config.algorithm.name}")
        self.config = config
        self.placement = placement or Placement(resolve(config.device))
        self.device = self.placement.device
        self.attach_policy(policy)
        self.placement.place(self.policy)
        self.find_policy_params()
        # With N ranks bf16 is FSDP's mixed precision (learner.models.placement), set when placing.
        masters = config.bf16 and not self.placement.sharded
        self.policy_opt = self.make_policy_optimizer(masters)
        prepare_compute(self.policy, config.bf16, config.compile_layers, self.device)
        self.steps = 0

    @classmethod
    def build(
        cls,
        config: LearnerConfig,
        load_policy: Callable[[], PreTrainedModel],
        placement: Placement | None = None,
    ) -> SPOLearner:
        """Where the model is loaded: SPO++ on a fresh base policy."""
        return cls(config, load_policy(), placement)

    def logprobs(self, batch: Batch, positions: torch.Tensor) -> torch.Tensor:
        """[B, T] float32 log-probabilities of ``batch``'s tokens at ``positions`` ([B, T] bool)
        under the policy, with grad; the learner's one forward pass (with N ranks each rank's
        rows, gathered: ``learner.models.placement``)."""
        return self.placement.logprobs(self.policy, batch, positions, self.config.chunk_tokens)

    def step(self, batch: Batch) -> dict:
        """One update; ``batch.baseline_values`` ([B] float) is v̂ frozen at dispatch per
        trajectory.

        Action tokens with a non-finite or impossibly small logprob are masked and counted
        (``nonfinite_tokens``, ``learner.algo.finite``). Returns metrics: policy_loss, the loss
        stats, Cov_n(L, A) and the token-weighted centre before/after normalisation,
        reward_mean, step_time_s, tokens_per_s.
        Raises ValueError on an invalid batch or one without ``baseline_values``.
        """
        t0 = time.perf_counter()
        algo, opt = self.config.algorithm, self.config.optimizer
        batch = batch.to(self.device)
        batch.validate()
        if batch.baseline_values is None:
            raise ValueError("the spo algorithm needs batch.baseline_values")
        baseline_values = batch.baseline_values
        mask = batch.action_mask.bool()
        lengths = mask.sum(dim=1).float()
        raw = spo_advantages(batch.rewards.float(), baseline_values.float())
        adv = token_measure_normalize(raw, lengths) if algo.normalize == "token" else trajectory_whiten(raw)
        stats = batch_stats(raw, lengths)
        lp = self.logprobs(batch, mask)
        loss, loss_stats = spo_ppo_loss(
            lp,
            lp.detach(),
            batch.rollout_logprobs,
            adv,
            mask,
            algo.clip_low,
            algo.clip_high,
            algo.rollout_is_cap,
            algo.dual_clip,
        )
        grad_norm = optimizer_step(self.policy_opt, loss, self.policy_params, opt.grad_clip)
        self.steps += 1
        # DIS-style diagnostics so the dashboard's kept fraction means the same thing; over the
        # tokens the loss used, so the metric stays finite.
        usable, _ = usable_tokens(mask, lp, batch.rollout_logprobs)
        log_ratio = (lp.detach() - batch.rollout_logprobs)[usable].double()
        return {
            **stats,
            **loss_stats,
            "policy_loss": loss.item(),
            "policy_grad_norm": grad_norm,
            "policy_lr": self.config.policy_lr,
            "kept_fraction": 1.0 - loss_stats["rollout_is_truncated_fraction"],
            "mean_abs_log_ratio": log_ratio.abs().mean().item() if log_ratio.numel() else 0.0,
            "reward_mean": batch.rewards.float().mean().item(),
            "baseline_mean": baseline_values.float().mean().item(),
            **throughput(batch, t0),
            "step": self.steps,
        }

    def state_dict(self) -> dict:
        """Checkpoint: policy (with LoRA its adapter, ``policy_state``), its optimizer, step count."""
        return {
            "step": self.steps,
            "policy": self.policy_state(),
            "policy_optimizer": self.policy_opt.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``."""
        self.load_policy_state(state["policy"])
        self.load_policy_optimizer(state["policy_optimizer"])
        self.steps = state["step"]
