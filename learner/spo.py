"""The SPO++ update (papers 000/002, DESIGN §5.4): the learner's ``spo`` estimator.

Per trajectory ``A_i = R_i − v̂_i`` with ``v̂_i`` the prompt value frozen at dispatch (the
server logged it in the trajectory; never a later value), normalised under the action-token
measure (``learner.advantages.token_measure_normalize``; trajectory whitening is the
ablation), then one epoch of the SPO++ objective: PPO clip [0.2, 0.28], rollout importance
ratio truncated at 2, dual clip c = 2 on negative advantages. With one epoch π_old is the
policy at the start of the step (detached), so the PPO ratio starts at 1 and the rollout IS
weight π_old/π_rollout carries the off-policy correction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedModel

from learner.advantages import (
    batch_stats,
    spo_advantages,
    spo_ppo_loss,
    token_measure_normalize,
    trajectory_whiten,
)
from learner.algorithm import Algorithm, make_adamw, optimizer_step, throughput
from learner.batch import Batch, policy_logprobs
from learner.finite import usable_tokens

if TYPE_CHECKING:
    from learner.config import LearnerConfig
    from learner.samples import Sample


@dataclass
class SPOConfig:
    """SPO++ hyper-parameters (§2.4 defaults) and the normalisation switch."""

    policy_lr: float = 1e-6
    clip_low: float = 0.2
    clip_high: float = 0.28
    rollout_is_cap: float = 2.0
    dual_clip: float = 2.0
    normalize: str = "token"  # "token" (SPO++) | "trajectory" (whitening ablation)
    grad_clip: float = 1.0
    adam_beta1: float = 0.9  # as ``SAOConfig.adam_beta1``
    chunk_tokens: int = 512


class SPOLearner(Algorithm):
    """One SPO++ policy update per ``step(batch)`` (``batch.baseline_values`` required); no critic."""

    critic = None

    def __init__(self, policy: PreTrainedModel, config: SPOConfig):
        if config.normalize not in ("token", "trajectory"):
            raise ValueError(f"unknown normalisation {config.normalize!r}")
        self.config = config
        self.policy = policy.float().eval()
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.policy_opt = make_adamw(self.params, config.policy_lr, 0.0, config.adam_beta1)
        self.steps = 0

    @classmethod
    def build(cls, config: LearnerConfig, load_policy: Callable[[], PreTrainedModel]) -> SPOLearner:
        """SPO++ on a fresh base policy with ``config``'s learning rate, β1 and clip settings."""
        return cls(
            load_policy(),
            SPOConfig(
                policy_lr=config.policy_lr,
                adam_beta1=config.adam_beta1,
                grad_clip=config.grad_clip,
                chunk_tokens=config.chunk_tokens,
                **config.algorithm.model_dump(exclude={"name"}),
            ),
        )

    def step(self, batch: Batch, samples: Sequence[Sample] | None = None) -> dict:
        """One update; ``batch.baseline_values`` ([B] float) is v̂ frozen at dispatch per
        trajectory. ``samples`` is not read.

        Action tokens with a non-finite or impossibly small logprob are masked and counted
        (``nonfinite_tokens``, ``learner.finite``). Returns metrics: policy_loss, the loss
        stats, Cov_n(L, A) and the token-weighted centre before/after normalisation,
        reward_mean, step_time_s, tokens_per_s.
        Raises ValueError on an invalid batch or one without ``baseline_values``.
        """
        t0 = time.perf_counter()
        cfg = self.config
        batch.validate()
        if batch.baseline_values is None:
            raise ValueError("the spo algorithm needs batch.baseline_values")
        baseline_values = batch.baseline_values
        mask = batch.action_mask.bool()
        lengths = mask.sum(dim=1).float()
        raw = spo_advantages(batch.rewards.float(), baseline_values.float())
        adv = token_measure_normalize(raw, lengths) if cfg.normalize == "token" else trajectory_whiten(raw)
        stats = batch_stats(raw, lengths)
        lp = policy_logprobs(
            self.policy,
            batch.input_ids,
            batch.attention_mask,
            batch.temperatures,
            positions=mask,
            chunk_tokens=cfg.chunk_tokens,
        )
        loss, loss_stats = spo_ppo_loss(
            lp,
            lp.detach(),
            batch.rollout_logprobs,
            adv,
            mask,
            cfg.clip_low,
            cfg.clip_high,
            cfg.rollout_is_cap,
            cfg.dual_clip,
        )
        grad_norm = optimizer_step(self.policy_opt, loss, self.params, cfg.grad_clip)
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
            "policy_lr": cfg.policy_lr,
            "kept_fraction": 1.0 - loss_stats["rollout_is_truncated_fraction"],
            "mean_abs_log_ratio": log_ratio.abs().mean().item() if log_ratio.numel() else 0.0,
            "reward_mean": batch.rewards.float().mean().item(),
            "baseline_mean": baseline_values.float().mean().item(),
            **throughput(batch, t0),
            "step": self.steps,
        }

    def state_dict(self) -> dict:
        return {
            "step": self.steps,
            "policy": self.policy.state_dict(),
            "policy_optimizer": self.policy_opt.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.policy_opt.load_state_dict(state["policy_optimizer"])
        self.steps = state["step"]
