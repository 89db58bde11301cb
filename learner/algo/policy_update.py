"""SAO's policy update as a strategy: the DIS step, or the MIS steps with an old policy.

Step 3 of ``learner.algo.sao.SAOLearner.step`` (the critic and the advantages come first) is one of:

- ``DISUpdate`` (the ``dis`` correction, SAO §2.2, docs/design.md §5.1): one policy step on
  ``learner.algo.dis.dis_loss`` against the logged behaviour logprobs; no old policy.
- ``MISUpdate`` (``mis_snapshot``, ``mis_ewma``; papers/004, docs/design.md §5.5): the rows
  with a token older than the window are dropped, then ``epochs × minibatches`` steps on
  ``learner.algo.mis.mis_loss`` with π_old from ``learner.algo.old_logits`` (CPU snapshots or the EWMA
  proxy). Only this class knows that π_old exists.

Both add ``kl_coef · k3_kl(πθ, π_ref)`` when the learner holds a ``learner.algo.kl.KLAnchor``.
``build_policy_update`` picks the strategy from the validated correction config.

Shapes: ``mask`` and ``advantages`` are [B, T] (bool; float32), aligned with the batch's tokens.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from typing import TYPE_CHECKING, Protocol

import torch

from learner.algo.dis import dis_loss
from learner.algo.mis import mis_loss
from learner.algo.old_logits import EWMAOldPolicy, SnapshotOldPolicy
from learner.config import DISCorrection, MISSnapshotCorrection

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.algo.kl import KLAnchor
    from learner.config import Correction, MISEWMACorrection
    from learner.data.batch import Batch


class Trainee(Protocol):
    """What a policy update needs from its learner (``learner.algo.sao.SAOLearner``)."""

    policy: PreTrainedModel

    def logprobs(self, model: PreTrainedModel, batch: Batch, positions: torch.Tensor) -> torch.Tensor:
        """[B, T] float32 logprobs of ``batch``'s tokens at ``positions`` under ``model``."""

    def policy_step(self, loss: torch.Tensor) -> float:
        """One clipped optimiser step of the policy on ``loss``; the gradient norm before clipping."""


class PolicyUpdate(ABC):
    """Step 3 of an SAO step: the policy's update on a batch whose advantages are known."""

    def on_version(self, version: int, policy: PreTrainedModel) -> None:
        """The policy now is ``version`` (at start, after a published step, a rollback);
        default: nothing to remember."""
        return

    def fresh_rows(self, batch: Batch, metrics: dict) -> Batch | None:
        """The rows this update can train on (default: all of ``batch``); None when none is left.
        May add metrics."""
        return batch

    def models(self) -> list[torch.nn.Module]:
        """The models this update holds besides the learner's (π_old's), for the learner to
        place on its device (``learner.models.placement``); default: none."""
        return []

    @abstractmethod
    def apply(
        self, trainee: Trainee, batch: Batch, mask: torch.Tensor, advantages: torch.Tensor, metrics: dict
    ) -> tuple[float, float]:
        """Update ``trainee.policy``; adds the loss statistics to ``metrics``; returns (policy
        loss, gradient norm before clipping), each a mean over the updates made."""


class DISUpdate(PolicyUpdate):
    """One step on the DIS loss (SAO §2.2) with the interval ``(1 − eps_low, 1 + eps_high)``,
    plus the KL anchor's term when ``anchor`` is given."""

    def __init__(self, eps_low: float, eps_high: float, anchor: KLAnchor | None) -> None:
        self.eps_low = eps_low
        self.eps_high = eps_high
        self.anchor = anchor

    def apply(
        self, trainee: Trainee, batch: Batch, mask: torch.Tensor, advantages: torch.Tensor, metrics: dict
    ) -> tuple[float, float]:
        """Metrics added: ``dis_loss``'s stats (action_tokens, nonfinite_tokens, kept_fraction,
        mean_abs_log_ratio, approx_kl, mean_abs_log_ratio_by_staleness with staleness) and, with
        the anchor, kl_ref (nats per action token)."""
        lp = trainee.logprobs(trainee.policy, batch, mask)
        loss, stats = dis_loss(
            lp, batch.rollout_logprobs, advantages, mask, self.eps_low, self.eps_high, batch.token_staleness
        )
        if self.anchor is not None:
            ref_lp = self.anchor.reference_logprobs(trainee.logprobs, batch, mask)
            term, kl = self.anchor.penalty(lp, ref_lp, mask)
            loss = loss + term
            metrics["kl_ref"] = kl.item()
        norm = trainee.policy_step(loss)
        metrics.update(stats)
        return loss.item(), norm


class MISUpdate(PolicyUpdate):
    """The MIS loss (papers/004 §4) with π_old from snapshots (§5.1) or the EWMA proxy (§5.2).

    Tracks the policy's version (``on_version``) to turn each token's staleness into the version
    that generated it. Raises (``fresh_rows``) ValueError when the batch has no
    ``token_staleness``.
    """

    def __init__(
        self,
        correction: MISSnapshotCorrection | MISEWMACorrection,
        policy: PreTrainedModel,
        anchor: KLAnchor | None,
    ) -> None:
        self.correction = correction
        if isinstance(correction, MISSnapshotCorrection):
            self.old_policy = SnapshotOldPolicy(policy, correction.window)
        else:
            self.old_policy = EWMAOldPolicy(policy, correction.window, correction.reset, correction.tau)
        self.anchor = anchor
        self.version = 0

    def models(self) -> list[torch.nn.Module]:
        """The model π_old is evaluated with (the snapshots' scratch copy, or the EWMA proxy)."""
        return [self.old_policy.model]

    def on_version(self, version: int, policy: PreTrainedModel) -> None:
        """Record ``version`` and give it to the old-policy source (a snapshot, or the proxy's
        restart)."""
        self.version = version
        self.old_policy.on_version(version, policy)

    def fresh_rows(self, batch: Batch, metrics: dict) -> Batch | None:
        """``batch`` without the rows that have a token older than the old-policy window
        (counted in ``dropped_stale_samples``); None when no row is left."""
        if batch.token_staleness is None:
            raise ValueError(f"the {self.correction.kind} correction needs batch.token_staleness")
        versions = self.version - batch.token_staleness
        missing = self.old_policy.missing_rows(versions, batch.action_mask.bool())
        metrics["dropped_stale_samples"] = int(missing.sum().item())
        if bool(missing.all()):
            return None
        return batch.select(~missing) if bool(missing.any()) else batch

    def apply(
        self, trainee: Trainee, batch: Batch, mask: torch.Tensor, advantages: torch.Tensor, metrics: dict
    ) -> tuple[float, float]:
        """``epochs`` × ``minibatches`` policy steps, each on a contiguous share of the rows, with
        π_old computed once before the first; then the proxy update.

        Metrics added (loss stats summed over the updates): kept_fraction = active_fraction (ρ_t),
        masked_by_rd_fraction, masked_by_rs_fraction, mean_abs_log_ratio (|log πθ/μ|),
        mean_abs_log_rd (|log π_old/μ|), approx_kl, action_tokens and nonfinite_tokens (per
        epoch), policy_updates, ewma_reset (0/1), ewma_resets (total), old_policy_bytes,
        correction_time_s (seconds: π_old forward passes and snapshot loads, the last snapshot
        copy, the proxy update), the old-policy source's own (snapshot_switches,
        snapshot_switch_s) and, with the anchor, kl_ref (mean over the updates).
        """
        corr = self.correction
        t0 = time.perf_counter()
        old, old_stats = self.old_policy.logprobs(
            batch, mask, self.version - batch.token_staleness, trainee.logprobs
        )
        extra = time.perf_counter() - t0 + self.old_policy.put_s
        ref_lp = None
        if self.anchor is not None:
            ref_lp = self.anchor.reference_logprobs(trainee.logprobs, batch, mask)
        parts = torch.arange(mask.shape[0], device=mask.device).chunk(corr.minibatches)
        totals: Counter = Counter()
        losses, norms, kls = [], [], []
        for _ in range(corr.epochs):
            for idx in parts:
                sub, m = batch.select(idx), mask[idx]
                lp = trainee.logprobs(trainee.policy, sub, m)
                loss, stats = mis_loss(
                    lp,
                    old[idx],
                    sub.rollout_logprobs,
                    advantages[idx],
                    m,
                    eps_low=corr.clip_low,
                    eps_high=corr.clip_high,
                    c=corr.c,
                    dual_clip=corr.dual_clip,
                )
                if ref_lp is not None:
                    term, kl = self.anchor.penalty(lp, ref_lp[idx], m)
                    loss = loss + term
                    kls.append(kl.item())
                norms.append(trainee.policy_step(loss))
                losses.append(loss.item())
                totals.update(stats)
        n = totals["action_tokens"]
        active = totals["kept"] / n if n else 0.0
        reset = self.old_policy.after_step(trainee.policy, active)
        extra += self.old_policy.update_s
        if kls:
            metrics["kl_ref"] = sum(kls) / len(kls)
        metrics.update(
            old_stats,
            action_tokens=n // corr.epochs,
            nonfinite_tokens=totals["nonfinite_tokens"] // corr.epochs,
            kept_fraction=active,
            active_fraction=active,
            masked_by_rd_fraction=totals["masked_by_rd"] / n if n else 0.0,
            masked_by_rs_fraction=totals["masked_by_rs"] / n if n else 0.0,
            mean_abs_log_ratio=totals["sum_abs_log_ratio"] / n if n else 0.0,
            mean_abs_log_rd=totals["sum_abs_log_rd"] / n if n else 0.0,
            approx_kl=totals["sum_k3"] / n if n else 0.0,
            policy_updates=len(losses),
            ewma_reset=int(reset),
            ewma_resets=self.old_policy.resets,
            old_policy_bytes=self.old_policy.nbytes(),
            correction_time_s=extra,
        )
        return sum(losses) / len(losses), sum(norms) / len(norms)


def build_policy_update(
    correction: Correction, eps_low: float, eps_high: float, policy: PreTrainedModel, anchor: KLAnchor | None
) -> PolicyUpdate:
    """The strategy of the validated ``correction``: ``DISUpdate`` with the algorithm's DIS
    interval for ``dis``, else ``MISUpdate`` (its π_old source copies ``policy``'s architecture)."""
    if isinstance(correction, DISCorrection):
        return DISUpdate(eps_low, eps_high, anchor)
    return MISUpdate(correction, policy, anchor)
