"""Where π_old comes from when the learner needs it: snapshots or the PPO-EWMA proxy.

Source: papers/004 §5.1 (exact old logits from parameter snapshots; the paper keeps them in CPU
memory, the learner on its device: issue 38) and §5.2
(the revised PPO-EWMA proxy with a reset), docs/design.md §5.5. Both keep one scratch copy of the
policy's architecture to evaluate old parameters; the live policy is never modified here.

- ``SnapshotOldPolicy``: ``on_version(v, policy)`` stores a copy of version v's trained
  parameters (``learner.algo.offpolicy.SnapshotStore`` of the last W + 1 versions: the current one
  and W older); ``logprobs`` evaluates each token with the snapshot of the version that
  generated it, loading that snapshot into the scratch model (the "switch"). Rows with a token
  whose version is no longer stored are reported, for the caller to drop. Only parameters with
  ``requires_grad`` are stored (the frozen ones never change, and the scratch copy has them):
  with full fine-tuning every weight (540 MB per version for 135M in float32), with a LoRA policy
  only the adapter (``learner.models.lora``: r·(in + out) per targeted projection, 9.8 MB at rank 8 on
  all seven projections of the 135M model, 1.2 MB at rank 1), so W can be ~50x larger in the
  same memory (docs/lora.md).
- ``EWMAOldPolicy``: the proxy θ_prox starts at the policy and after every learner step becomes
  ``(β θ_prox + θ)/(β + 1)``, β = W/(W + 2), or θ itself when the step's active-token fraction
  ρ_t < τ (``reset``). Not checkpointed: after a restart the proxy starts again at the policy,
  as after a reset.

Both expose ``put_s`` (seconds of the last ``on_version``), ``update_s`` (of the last
``after_step``) and ``resets`` (count), so the learner reports the extra time per step. Their
one user is ``learner.algo.policy_update.MISUpdate``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from learner.algo.offpolicy import SnapshotStore, ewma_beta, ewma_proxy_step
from learner.data.batch import Batch
from learner.models.placement import load_full

LogprobFn = Callable[[PreTrainedModel, Batch, torch.Tensor], torch.Tensor]
"""(model, batch, positions [B, T] bool) → [B, T] float32 logprobs at those positions."""


def _scratch(policy: PreTrainedModel) -> PreTrainedModel:
    return copy.deepcopy(policy).eval().requires_grad_(False)


def _distinct(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the second name of a tied tensor (e.g. ``lm_head.weight``)."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            out[k] = v
    return out


class SnapshotOldPolicy:
    """Exact π_old per token from the snapshots of the last ``window + 1`` versions."""

    def __init__(self, policy: PreTrainedModel, window: int):
        """``window``: W, the largest staleness (versions) served exactly (``>= 1``)."""
        self.store = SnapshotStore(window + 1)
        self.scratch = _scratch(policy)
        self.model = self.scratch
        self.put_s = 0.0
        self.update_s = 0.0
        self.resets = 0

    def on_version(self, version: int, policy: PreTrainedModel) -> None:
        """Keep a copy of ``policy``'s trained parameters (on their device, and with N ranks
        this rank's shard of each) (``requires_grad``; a tied tensor
        once) as ``version`` (the newest)."""
        t0 = time.perf_counter()
        self.store.put(version, {n: p for n, p in policy.named_parameters() if p.requires_grad})
        self.put_s = time.perf_counter() - t0

    def missing_rows(self, versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B] bool: rows with an action token whose version has no snapshot (too stale)."""
        stored = torch.tensor(self.store.versions(), dtype=versions.dtype, device=versions.device)
        known = torch.isin(versions, stored)
        return (mask & ~known).any(dim=1)

    def logprobs(
        self, batch: Batch, mask: torch.Tensor, versions: torch.Tensor, logprobs: LogprobFn
    ) -> tuple[torch.Tensor, dict]:
        """[B, T] log π_old: each action token under its own version's snapshot (no grad).

        ``versions``: [B, T] long, the version that generated each token; every action token's
        version must be stored (drop ``missing_rows`` first). Returns the logprobs and
        ``{"snapshot_switches": n, "snapshot_switch_s": seconds loading snapshots}``.

        Raises:
            KeyError: an action token's version has no snapshot.
        """
        out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        switches, switch_s = 0, 0.0
        for v in torch.unique(versions[mask]).tolist():
            state = self.store.get(int(v))
            if state is None:
                raise KeyError(f"no snapshot of version {v}")
            t0 = time.perf_counter()
            # strict=False: a snapshot holds the trained parameters only, a tied one under its
            # first name.
            load_full(self.scratch, state, strict=False)
            switch_s += time.perf_counter() - t0
            switches += 1
            sel = mask & (versions == v)
            with torch.no_grad():
                out = torch.where(sel, logprobs(self.scratch, batch, sel), out)
        return out, {"snapshot_switches": switches, "snapshot_switch_s": switch_s}

    def after_step(self, policy: PreTrainedModel, active_fraction: float) -> bool:
        """Nothing to update (snapshots come with ``on_version``); never resets."""
        return False

    def nbytes(self) -> int:
        """Memory held by the snapshots (bytes, on the policy's device; with N ranks this rank's
        shards; the scratch model not counted)."""
        return self.store.nbytes()


class EWMAOldPolicy:
    """The revised PPO-EWMA proxy of π_old (papers/004 §5.2)."""

    def __init__(self, policy: PreTrainedModel, window: int, reset: bool, tau: float):
        """``window``: W for β = W/(W + 2); ``reset``: apply the ρ_t < ``tau`` reset."""
        self.beta = ewma_beta(window)
        self.tau = tau if reset else -math.inf
        self.proxy = _scratch(policy)
        self.model = self.proxy
        self.resets = 0
        self.put_s = 0.0
        self.update_s = 0.0
        self._stepped = False

    def on_version(self, version: int, policy: PreTrainedModel) -> None:
        """A version not made by a step of this proxy's learner (the one loaded at start, or a
        rollback's) restarts the proxy at ``policy`` (θ_prox⁽⁰⁾ = θ⁽⁰⁾, §5.2 (i))."""
        if not self._stepped:
            load_full(self.proxy, policy.state_dict())
        self._stepped = False

    def missing_rows(self, versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """No row lacks a proxy: [B] all False."""
        return torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)

    def logprobs(
        self, batch: Batch, mask: torch.Tensor, versions: torch.Tensor, logprobs: LogprobFn
    ) -> tuple[torch.Tensor, dict]:
        """[B, T] log π_prox at the action tokens (no grad); ``versions`` is not read."""
        with torch.no_grad():
            return logprobs(self.proxy, batch, mask), {}

    def after_step(self, policy: PreTrainedModel, active_fraction: float) -> bool:
        """Move the proxy towards the updated ``policy`` (or reset it); returns whether it reset.
        ``update_s``: the seconds it took."""
        t0 = time.perf_counter()
        new, reset = ewma_proxy_step(
            self.proxy.state_dict(),
            policy.state_dict(),
            beta=self.beta,
            active_fraction=active_fraction,
            tau=self.tau,
        )
        load_full(self.proxy, new)
        self.resets += int(reset)
        self._stepped = True
        self.update_s = time.perf_counter() - t0
        return reset

    def nbytes(self) -> int:
        """Memory held by the proxy's parameters (bytes)."""
        return sum(t.numel() * t.element_size() for t in _distinct(self.proxy.state_dict()).values())
