"""The off-policy correction family of "Missing Old Logits in Asynchronous Agentic RL".

Source: papers/004 (docs/design.md §5.5). Section 4 rewrites PPO's clip as a token mask (the MIS view)
and separates the two ratios that a single importance ratio folds together:

- the train–inference discrepancy ``r_d = π_old / μ`` (μ: the behaviour policy as served, whose
  logprobs the server logs; π_old: the same policy version recomputed by the learner), and
- the policy drift ``r_s = πθ / π_old`` (how far the current update has moved).

A token contributes iff ``M_[1/c, c](r_d) · (1[A ≥ 0]·1[r_s ≤ 1+ε_high] + 1[A < 0]·1[r_s ≥ 1−ε_low])``.
Table 1's variants are settings of this one mask (``tests/unit/learner/algo/test_offpolicy.py`` checks each):

- PPO clip: π_old = μ (so ``r_d = 1``) and any ``c ≥ 1``;
- decoupled PPO: π_old a proximal policy, ``r_d`` bounded by ``c``;
- SAO's DIS (``learner.algo.dis``): no old policy (π_old := πθ, so ``r_s = 1``) and the discrepancy
  interval ``(1 − ε_l, 1 + ε_h)`` on ``πθ / μ`` (pass ``c`` as that interval; DIS's bounds are
  open, the mask's closed, which differs only on a ratio exactly at a bound).

When π_old is missing, Section 5.1 keeps snapshots of the last W versions' parameters
(``SnapshotStore``) and Section 5.2 replaces π_old by a revised PPO-EWMA proxy
(``ewma_beta``, ``ewma_proxy_step``) with a hard reset when the active-token fraction ρ_t
falls below τ = 0.9. Everything here is pure: tensors in, tensors out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch

from learner.algo.dis import check_token_inputs
from learner.algo.finite import usable_tokens

RESET_TAU = 0.9
"""Reset threshold τ on the active-token fraction ρ_t (papers/004 §5.2, Appendix F)."""


def _interval(c: float | tuple[float, float]) -> tuple[float, float]:
    if isinstance(c, tuple):
        lo, hi = c
        if not 0.0 <= lo <= 1.0 <= hi:
            raise ValueError(f"the r_d interval must satisfy 0 <= low <= 1 <= high, got {c}")
        return float(lo), float(hi)
    if c < 1.0:
        raise ValueError(f"c must be >= 1, got {c}")
    return 1.0 / c, float(c)


def mis_token_mask(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    c: float | tuple[float, float],
    action_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MIS token mask (papers/004 §4, the dual-constraint view of Table 1).

    ``r_d = exp(logp_old − logp_behaviour)``, ``r_s = exp(logp_new − logp_old)``; a token is kept
    iff ``low ≤ r_d ≤ high`` and (``A ≥ 0`` and ``r_s ≤ 1 + eps_high``, or ``A < 0`` and
    ``r_s ≥ 1 − eps_low``). A token whose logprob is not finite, or below
    ``learner.algo.finite.LOGPROB_FLOOR``, in any of the three tensors is never kept.

    Args:
        logp_new: [B, T] float, log πθ of the taken tokens (nats); read detached.
        logp_old: [B, T] float, log π_old (a snapshot's or the EWMA proxy's), nats.
        logp_behaviour: [B, T] float, log μ, the logged rollout logprobs (nats).
        advantages: [B, T] float; only the sign is read (0 counts as ``A ≥ 0``); a token with a
            non-finite advantage is never kept.
        eps_low: drift tolerance below 1 for negative advantages, ``0 <= eps_low <= 1``.
        eps_high: drift tolerance above 1 for positive advantages, ``eps_high >= 0``.
        c: the discrepancy bound: a float ``c >= 1`` gives ``[1/c, c]``; a tuple ``(low, high)``
            with ``0 <= low <= 1 <= high`` gives that interval (DIS's asymmetric one).
        action_mask: optional [B, T] 0/1; tokens outside it are never kept.

    Returns:
        [B, T] bool tensor, True where the token contributes to the loss.

    Raises:
        ValueError: shapes differ or are not 2-D, or a bound is out of range.
    """
    named = {"logp_old": logp_old, "logp_behaviour": logp_behaviour, "advantages": advantages}
    check_token_inputs("logp_new", logp_new, named, eps_low, eps_high)
    shape = logp_new.shape
    low, high = _interval(c)
    action = (
        torch.ones(shape, dtype=torch.bool, device=logp_new.device)
        if action_mask is None
        else action_mask.bool()
    )
    usable, _ = usable_tokens(action, logp_new, logp_old, logp_behaviour)
    new, old, beh = (t.detach().double() for t in (logp_new, logp_old, logp_behaviour))
    # Ratios in float64 at usable positions only, so inf/NaN elsewhere cannot leak through.
    r_d = torch.exp(torch.where(usable, old - beh, 0.0))
    r_s = torch.exp(torch.where(usable, new - old, 0.0))
    adv = advantages.detach()
    drift_ok = torch.where(adv >= 0, r_s <= 1.0 + eps_high, r_s >= 1.0 - eps_low)
    return usable & (r_d >= low) & (r_d <= high) & drift_ok & torch.isfinite(adv)


def ewma_beta(window: int) -> float:
    """The EWMA decay ``β = W / (W + 2)`` (papers/004 §5.2 (iii)).

    With it the proxy's reference lies at the centroid of a staleness window of W versions.

    Args:
        window: W, the maximum version gap (versions), ``>= 1``.

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return window / (window + 2)


def ewma_proxy_step(
    prox: Mapping[str, torch.Tensor],
    current: Mapping[str, torch.Tensor],
    *,
    beta: float,
    active_fraction: float,
    tau: float = RESET_TAU,
) -> tuple[dict[str, torch.Tensor], bool]:
    """One update of the revised PPO-EWMA proxy θ_prox (papers/004 §5.2 (ii), (iv)).

    If ``active_fraction < tau`` the proxy is hard-reset to a copy of ``current``; otherwise
    ``θ_prox ← (β·θ_prox + θ) / (β + 1)`` per tensor.

    Args:
        prox: parameter name → tensor, the proxy before the step (not modified).
        current: parameter name → tensor, the policy's parameters after the step (not modified,
            never aliased by the result: the result holds new tensors).
        beta: the decay, ``>= 0`` (``ewma_beta(W)``).
        active_fraction: ρ_t, the fraction of action tokens still active after the mask, in [0, 1].
        tau: the reset threshold τ (0.9 in the paper).

    Returns:
        ``(new_prox, reset)``: a new dict with the same keys and each tensor's dtype, and whether
        the reset fired.

    Raises:
        ValueError: the key sets or a tensor's shape differ, or ``beta < 0``.
    """
    if beta < 0.0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if set(prox) != set(current):
        raise ValueError(f"parameter names differ: {sorted(set(prox) ^ set(current))[:5]}")
    for k, v in current.items():
        if prox[k].shape != v.shape:
            raise ValueError(f"{k}: proxy {tuple(prox[k].shape)} vs current {tuple(v.shape)}")
    if active_fraction < tau:
        return {k: v.detach().clone() for k, v in current.items()}, True
    return {
        k: ((beta * prox[k].detach().double() + v.detach().double()) / (beta + 1.0)).to(prox[k].dtype)
        for k, v in current.items()
    }, False


class SnapshotStore:
    """The parameters of the last W policy versions (papers/004 §5.1, snapshots; kept on the
    learner's device, the paper keeps them in CPU memory).

    π_old of a token is computed with the snapshot of the version that generated it (the
    trajectory's ``token_versions``); a version older than the window is gone (``get`` → None)
    and its samples cannot get exact old logits.
    """

    def __init__(self, window: int):
        """``window``: W, how many versions are kept (``>= 1``). Raises ValueError otherwise."""
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._states: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    def put(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """Keep a copy of ``state`` (name → tensor, on the tensors' device: the learner's,
        issue 38) as ``version``; drop the oldest beyond W.

        Raises ValueError when ``version`` is not newer than every stored one (versions are
        monotone; a rollback publishes a new version).
        """
        if self._states and version <= next(reversed(self._states)):
            raise ValueError(f"version {version} is not newer than {next(reversed(self._states))}")
        self._states[version] = {k: v.detach().clone() for k, v in state.items()}
        while len(self._states) > self.window:
            self._states.popitem(last=False)

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        """The stored parameters of ``version`` (not to be modified), or None outside the window."""
        return self._states.get(version)

    def versions(self) -> list[int]:
        """The stored versions, oldest first."""
        return list(self._states)

    def nbytes(self) -> int:
        """Memory held by the snapshots (bytes)."""
        return sum(t.numel() * t.element_size() for s in self._states.values() for t in s.values())
