"""Prompt-level value evidence in event time (SPO++).

Pure arithmetic, no I/O. Sources: SPO++ (arXiv 2608.24870; write-up ``papers/000_…txt``
§2.1 single-stream value, §2.2 event-time memory, §2.4 sampler, §3.1 Jeffreys
initialisation) and docs/design.md §5.4.

Units: a *version* is a published policy version (an int >= 0). The event coordinate of
version ``v`` is ``z(v) = -v·log ρ`` (ρ = 0.875), so evidence generated ``k`` versions before
the reader weighs ``ρ^k``. Rewards are floats in [0, 1]; a reward ``R`` adds ``R`` success
evidence and ``1 - R`` failure evidence.

Why the representation is safe: ``e^{-(z_q - z_i)} = ρ^(v_q - v_i)`` is never formed as
``e^{z_q}/e^{z_i}`` (``e^{z}`` overflows after ~5300 versions). Sums are kept at a reference
version no older than any term, so every stored weight is ``<= 1``; old terms may underflow
to 0 (they are negligible then), nothing overflows.

Results generated at a version *newer* than the reader's (``v_i > v_q``): the paper's
setting never produces them (it drains old-policy work at each publish and keeps at most one
request in flight per prompt, write-up §2.2/§2.4), but a replica that has not yet swapped
can read evidence a newer policy produced. We apply the paper's formula as written, so such
a result weighs ``ρ^(v_q - v_i) > 1``. This keeps the state a plain sum (receipt-order
invariant and re-expressible at any version by one common factor), and since re-expressing
multiplies α and β by the same factor, the value ``α/(α+β)`` does not depend on the reading
version at all; only the total mass does. Clamping the weight to 1 would make the value depend
on which replica read it. The one failure mode is a reader so far behind (thousands of
versions) that the factor overflows a double: that raises ``ValueError``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass

RHO = 0.875
"""Per-version retention ρ (SPO++ write-up §2.2: fixed at 0.875 in all experiments)."""

JEFFREYS_MASS = 8.0
"""Total Beta mass of the offline prior (SPO++ write-up §3.1)."""

UNCERTAINTY_FLOOR = 0.05
"""Additive floor of the sampler weight (SPO++ write-up §2.4)."""

# Largest x with exp(x) finite: a log-weight above it would overflow.
_LOG_MAX = math.log(sys.float_info.max)
# Log of the largest evidence ``EvidenceState.at_bounded`` returns (e^700 ≈ 1e304): below
# _LOG_MAX (≈ 709.8) with room for α + β and the floor of its factor.
_BOUND_LOG = 700.0


def check_rho(rho: float) -> float:
    """``rho`` as a float; ``ValueError`` unless it is a number in (0, 1)."""
    if not (isinstance(rho, int | float) and 0.0 < rho < 1.0):
        raise ValueError(f"rho must be a number in (0, 1), got {rho!r}")
    return float(rho)


def check_version(version: int, what: str = "version") -> int:
    """``version`` unchanged; ``ValueError`` (naming ``what``) unless it is an int >= 0."""
    # bool is an int subclass; a True "version" is a caller bug, not version 1.
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"{what} must be an int >= 0, got {version!r}")
    return version


def check_reward(reward: float) -> float:
    """``reward`` as a float; ``ValueError`` unless it is a finite number in [0, 1] (not a bool)."""
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ValueError(f"reward must be a number in [0, 1], got {reward!r}")
    if not (math.isfinite(reward) and 0.0 <= reward <= 1.0):
        raise ValueError(f"reward must be a finite number in [0, 1], got {reward!r}")
    return float(reward)


def _check_mass(x: float, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {x!r}")
    return float(x)


def event_coordinate(version: int, rho: float = RHO) -> float:
    """The event coordinate ``z(v) = -v·log ρ`` of policy version ``version`` (SPO++ §2.2).

    Raises ``ValueError`` for a negative or non-int version or ρ outside (0, 1).
    """
    return -check_version(version) * math.log(check_rho(rho))


def decay(x: float, k: int, rho: float = RHO) -> float:
    """``x·ρ^k``: evidence ``x`` re-expressed ``k`` versions later (``k < 0``: earlier).

    For ``k >= 0`` the factor is at most 1 and may underflow to 0 (never an error). For
    ``k < 0`` the factor exceeds 1; ``ValueError`` if the result would overflow a double.
    """
    if x == 0.0:
        return 0.0
    if k >= 0:
        return x * rho**k
    log_x = math.log(x) + k * math.log(rho)
    if log_x > _LOG_MAX:
        raise ValueError(f"evidence {x!r} re-expressed {-k} versions earlier overflows a double")
    return math.exp(log_x)


def evidence_at(
    alpha0: float,
    beta0: float,
    v0: int,
    results: Iterable[tuple[float, int]],
    v_q: int,
    rho: float = RHO,
) -> tuple[float, float]:
    """Evidence ``(α_q, β_q)`` of one prompt as seen by a request dispatched at version ``v_q``.

    ``α_q = e^{-(z_q - z_0)} α_0 + Σ_i e^{-(z_q - z_i)} R_i`` and ``β_q`` likewise with
    ``1 - R_i`` (SPO++ write-up §2.2; docs/design.md §5.4), with ``e^{-(z_q - z_i)} = ρ^(v_q - v_i)``
    evaluated as a log-sum-exp so that thousands of versions neither overflow nor lose the
    largest terms. This is the direct (batch) form of the formula; :class:`EvidenceState` is
    the incremental form and agrees with it.

    Args:
        alpha0, beta0: prior success/failure evidence (floats >= 0) placed at version ``v0``.
        v0: version of the prior (int >= 0).
        results: ``(reward, version)`` pairs: reward in [0, 1], version = the policy version
            that generated the trajectory. Versions after ``v_q`` are allowed and weigh
            ``ρ^(v_q - v_i) > 1`` (see the module docstring).
        v_q: version of the reading (dispatching) policy.
        rho: per-version retention in (0, 1).

    Returns:
        ``(alpha, beta)`` as floats. Both may underflow to 0.0 when all evidence is ~5000+
        versions older than ``v_q``; use :meth:`EvidenceState.value` for a scale-free value.

    Raises:
        ValueError: a reward outside [0, 1] or not finite, a negative or non-int version,
            negative or non-finite prior, ρ outside (0, 1), or a result so much newer than
            ``v_q`` that its weight overflows.
    """
    log_rho = math.log(check_rho(rho))
    v_q = check_version(v_q, "v_q")
    # Log-weights log(x) + (v_q - v)·log ρ of every non-zero term, kept per side.
    succ: list[float] = []
    fail: list[float] = []

    def push(side: list[float], x: float, v: int) -> None:
        if x > 0.0:
            side.append(math.log(x) + (v_q - v) * log_rho)

    push(succ, _check_mass(alpha0, "alpha0"), check_version(v0, "v0"))
    push(fail, _check_mass(beta0, "beta0"), v0)
    for reward, version in results:
        r = check_reward(reward)
        v = check_version(version)
        push(succ, r, v)
        push(fail, 1.0 - r, v)
    return _log_sum_exp(succ), _log_sum_exp(fail)


def _log_sum_exp(logs: list[float]) -> float:
    if not logs:
        return 0.0
    m = max(logs)
    total = m + math.log(math.fsum(math.exp(t - m) for t in logs))
    if total > _LOG_MAX:
        raise ValueError("evidence overflows a double: a result is thousands of versions newer than v_q")
    return math.exp(total)


def jeffreys_prior(successes: int, n: int, mass: float = JEFFREYS_MASS) -> tuple[float, float]:
    """Offline prior from ``successes`` out of ``n`` rollouts, Jeffreys-smoothed.

    ``α_0 = mass·(s + 0.5)/(n + 1)``, ``β_0 = mass - α_0`` (SPO++ write-up §3.1: total Beta
    mass 8 from 8 offline rollouts per prompt; docs/design.md §5.4). ``n = 0`` gives
    ``(mass/2, mass/2)``, value 0.5.

    Raises ``ValueError`` unless ``0 <= successes <= n`` are ints and ``mass`` is finite > 0.
    """
    for name, x in (("successes", successes), ("n", n)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{name} must be an int >= 0, got {x!r}")
    if successes > n:
        raise ValueError(f"successes ({successes}) exceed rollouts ({n})")
    if isinstance(mass, bool) or not isinstance(mass, int | float) or not (math.isfinite(mass) and mass > 0):
        raise ValueError(f"mass must be a finite number > 0, got {mass!r}")
    alpha0 = mass * (successes + 0.5) / (n + 1)
    return alpha0, mass - alpha0


def value(alpha: float, beta: float) -> float:
    """The prompt value ``v̂ = α/(α + β)`` in [0, 1] (SPO++ write-up §2.1).

    Raises ``ValueError`` if either is negative or not finite, or both are 0 (no evidence).
    """
    a = _check_mass(alpha, "alpha")
    b = _check_mass(beta, "beta")
    if a + b == 0.0:
        raise ValueError("no evidence: alpha + beta == 0")
    return a / (a + b)


def uncertainty_weight(v_hat: float, floor: float = UNCERTAINTY_FLOOR) -> float:
    """Sampling weight ``sqrt(v̂(1 - v̂) + floor)`` of a prompt (SPO++ write-up §2.4).

    Prompts near the success/failure boundary are drawn more often; ``floor`` keeps very easy
    and very hard prompts in play. Raises ``ValueError`` unless ``v_hat`` is in [0, 1] and
    ``floor`` is finite >= 0.
    """
    if not (isinstance(v_hat, int | float) and 0.0 <= v_hat <= 1.0):
        raise ValueError(f"v_hat must be in [0, 1], got {v_hat!r}")
    return math.sqrt(v_hat * (1.0 - v_hat) + _check_mass(floor, "floor"))


@dataclass(frozen=True)
class EvidenceState:
    """Event-time evidence of one prompt, expressed at ``ref_version`` (SPO++ §2.2).

    ``alpha``/``beta`` are ``Σ_i ρ^(ref_version - v_i)·x_i`` over every term added (the prior
    included), with ``ref_version`` the newest version among them, so every stored weight is
    ``<= 1``. Adding a term at version ``v`` re-expresses both sides at ``max(ref, v)``. The
    state is a function of the *set* of terms, independent of the order they arrive in
    (receipt-order invariance, exact up to floating-point summation order), and
    :meth:`at` re-expresses it at any version by one factor ``ρ^(v_q - ref_version)``.

    Immutable: :meth:`add` and :meth:`merge` return new states.
    """

    alpha: float
    beta: float
    ref_version: int
    rho: float = RHO

    def __post_init__(self) -> None:
        _check_mass(self.alpha, "alpha")
        _check_mass(self.beta, "beta")
        check_version(self.ref_version, "ref_version")
        check_rho(self.rho)

    def merge(self, other: EvidenceState) -> EvidenceState:
        """The union of two disjoint evidence sets (commutative and associative).

        Raises ``ValueError`` if the two states use different ρ.
        """
        if other.rho != self.rho:
            raise ValueError(f"cannot merge evidence with rho {self.rho} and {other.rho}")
        ref = max(self.ref_version, other.ref_version)
        return EvidenceState(
            alpha=decay(self.alpha, ref - self.ref_version, self.rho)
            + decay(other.alpha, ref - other.ref_version, self.rho),
            beta=decay(self.beta, ref - self.ref_version, self.rho)
            + decay(other.beta, ref - other.ref_version, self.rho),
            ref_version=ref,
            rho=self.rho,
        )

    def add(self, reward: float, version: int) -> EvidenceState:
        """This state plus one result: ``reward`` in [0, 1] generated at policy ``version``.

        Raises ``ValueError`` for a reward outside [0, 1] or a bad version.
        """
        r = check_reward(reward)
        return self.merge(EvidenceState(r, 1.0 - r, check_version(version), self.rho))

    def at(self, version: int) -> tuple[float, float]:
        """``(α, β)`` as read by a request dispatched at ``version``.

        Underflows towards 0 for readers far after ``ref_version``; raises ``ValueError`` if a
        reader thousands of versions before ``ref_version`` would overflow.
        """
        k = check_version(version) - self.ref_version
        return decay(self.alpha, k, self.rho), decay(self.beta, k, self.rho)

    def at_bounded(self, version: int) -> tuple[float, float]:
        """``at(version)``, except that a reader so many versions before ``ref_version`` that
        α or β would overflow gets them re-expressed at the earliest version where they stay
        finite (``e^700/ρ < max(α, β) <= e^700``): both by one factor, so the value ``α/(α+β)``
        is exact; only the mass is capped.

        For reads that must not fail on stored data (a request's dispatch freeze, the
        operators' evidence routes): evidence placed at a version far ahead of the reader.
        Raises ``ValueError`` only for a bad ``version``.
        """
        k = check_version(version) - self.ref_version
        top = max(self.alpha, self.beta)
        if k >= 0 or top == 0.0:
            return self.at(version)
        # log(top·ρ^k) <= _BOUND_LOG  ⇔  k >= (_BOUND_LOG - log top) / log ρ  (log ρ < 0).
        k = max(k, math.ceil((_BOUND_LOG - math.log(top)) / math.log(self.rho)))
        return decay(self.alpha, k, self.rho), decay(self.beta, k, self.rho)

    @property
    def value(self) -> float:
        """``α/(α+β)``; the same at every reading version. ``ValueError`` if empty."""
        return value(self.alpha, self.beta)
