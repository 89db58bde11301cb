"""The guard's decision rule: an anytime-valid non-inferiority test of a canary against the promoted version.

Pure arithmetic, no I/O, no clock. Source: docs/design.md §9.1 (a version goes candidate →
canary → promoted or rejected) and docs/guard.md "The decision rule" (the measured error rates
and sample sizes).

The question. While a candidate lineage serves a canary share of the traffic, the promoted
version serves the rest; the rated answers of both *in the same time window* are two streams of
rewards in [0, 1] (often binary). With ``Δ = μ_candidate − μ_promoted`` (reward units), the rule
promotes when the candidate is not worse by more than ``δ`` (``Δ > −δ``) and rejects when it is
worse (``Δ < 0``), each with confidence ``1 − α``, and may be looked at after every rating.

The test: one-sided predictable-plug-in empirical-Bernstein (PrPl-EB) confidence sequences for
each arm's mean, each side at level ``α/2``, with running intersections. Waudby-Smith & Ramdas,
"Estimating means of bounded random variables by betting", JRSS-B 86(1), 2024 (arXiv
2010.09686), Theorem 2 and its recommended predictable bets, truncated at ``c = 1/2``; the
supermartingale is Howard et al., "Time-uniform, nonparametric, nonasymptotic confidence
sequences", Ann. Statist. 49(2), 2021, Theorem 4. For one arm with rewards ``x_1 … x_t`` and
``L = log(2/α)`` (one side at level ``α/2``)::

    μ̂_i  = (1/2 + Σ_{j≤i} x_j) / (i + 1)          σ̂²_i = (1/4 + Σ_{j≤i} (x_j − μ̂_j)²) / (i + 1)
    λ_i  = min(c, sqrt(2L / (σ̂²_{i−1} · i · log(1 + i))))                      (predictable)
    ψ(λ) = −log(1 − λ) − λ
    lower_t = max_{s≤t} (Σ_{i≤s} λ_i x_i − L − Σ_{i≤s} (x_i − μ̂_{i−1})² ψ(λ_i)) / Σ_{i≤s} λ_i

clipped to [0, 1]; ``upper_t`` is the same computed on ``1 − x`` and mirrored (the bets and the
penalty are symmetric, so ``upper`` and ``lower`` share one margin before the intersections).
The difference's bounds are ``lower(Δ) = lower_C − upper_P`` and ``upper(Δ) = upper_C − lower_P``.

Why this test. The rewards are bounded, so a bounded-mean method needs no distributional
assumption (binary and graded rewards alike); a confidence sequence holds at every sample size
at once (Ville's inequality on a nonnegative supermartingale), so the guard may decide after
every rating, forever, without inflating its error; empirical Bernstein adapts to the variance
(a reward rate near 0 or 1 decides sooner than one near 1/2); it is closed form and O(1) per
rating. One sequence per arm, rather than pairing ratings across arms, because the canary gets
a small share of the traffic: each arm uses all of its ratings and arms of any sizes combine.

Guarantees, at any stopping time however often the rule is consulted, assuming each arm's
ratings have a constant conditional mean given the past (independent ratings of one version in
one window): the bounds promote a candidate with ``Δ ≤ −δ`` with probability at most ``α`` (it
needs ``lower_C > μ_C`` or ``upper_P < μ_P``, each at most ``α/2``), and reject one with
``Δ ≥ 0`` with probability at most ``α`` likewise. The two one-sided bounds together form a
``1 − 2α`` confidence sequence for ``Δ``. The time-out adds its own decisions: with
``on_timeout = REJECT`` no false promotion is added, and a candidate with ``Δ ≥ 0`` is also
rejected when it times out (so ``P(REJECT | Δ ≥ 0) ≤ α + P(time-out)``); ``PROMOTE`` is the
mirror image.

The decision, in this order:

1. ``REJECT`` if ``upper(Δ) < 0`` and both arms have ``min_samples`` ratings: the candidate is
   shown worse. This takes precedence, so a version shown worse is never promoted even when it
   is also shown within ``δ``; once true it stays true (running intersections).
2. ``PROMOTE`` if ``lower(Δ) > −δ`` and both arms have ``min_samples`` ratings.
3. At a time-out (the candidate has ``max_samples`` ratings, or ``elapsed_s >= max_seconds``)
   the configured ``on_timeout`` decision; ``REJECT`` by default, the conservative choice: a
   candidate that cannot show it is not worse does not get promoted.
4. ``CONTINUE`` otherwise (no data at all is ``CONTINUE``).

A lineage of versions (each trained from the one before) is judged one version at a time, each
on its own ratings and at its own share of α: ``decide_lineage`` (issue 40; docs/guard.md, "A
version is judged as itself"), so that the constant mean assumed above holds for every stream.

Receipt order: the bounds after any set of ratings depend on each arm's own ratings in the order
that arm received them (the bets use only the past), never on how the two arms' ratings were
interleaved. So :func:`decide` on the two sequences equals :class:`CanaryComparison` fed the
same ratings in any interleaving; a caller that stops at the first non-``CONTINUE`` decision
stops at a point that depends on the interleaving, but under either error bound above.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from core.evidence import check_reward

DELTA = 0.05
"""Default non-inferiority margin δ (reward units: a fraction of rated answers for binary rewards)."""

ALPHA = 0.05
"""Default error rate α of each decision (false promotion, false rejection)."""

MIN_SAMPLES = 20
"""Default ratings each arm needs before a bound can decide."""

MAX_SAMPLES = 50_000
"""Default time-out: the candidate's rated answers after which ``on_timeout`` applies."""

BET_CAP = 0.5
"""Truncation ``c`` of the bets λ (Waudby-Smith & Ramdas 2024, §3.2: 1/2 or 3/4)."""


class Decision(StrEnum):
    """What the guard does with the candidate now."""

    CONTINUE = "continue"
    PROMOTE = "promote"
    REJECT = "reject"


class Arm(StrEnum):
    """Which version a rated answer came from."""

    CANDIDATE = "candidate"
    PROMOTED = "promoted"


@dataclass(frozen=True)
class RuleParams:
    """The decision rule's parameters (module docstring; defaults: the module constants).

    - ``delta``: margin δ in (0, 1], reward units.
    - ``alpha``: error rate α in (0, 1) of each decision.
    - ``min_samples``: ratings (int >= 1) each arm needs before a bound decides.
    - ``max_samples``: the candidate's ratings (int >= ``min_samples``) at which the test times
      out; ``None``: never on count.
    - ``max_seconds``: seconds since the canary started (finite > 0) at which it times out;
      ``None``: never on time.
    - ``on_timeout``: ``REJECT`` or ``PROMOTE``, applied at a time-out if no bound decided.
    - ``bet_cap``: truncation ``c`` in (0, 1) of the bets.

    Raises ``ValueError`` on any value outside these ranges.
    """

    delta: float = DELTA
    alpha: float = ALPHA
    min_samples: int = MIN_SAMPLES
    max_samples: int | None = MAX_SAMPLES
    max_seconds: float | None = None
    on_timeout: Decision = Decision.REJECT
    bet_cap: float = BET_CAP

    def __post_init__(self) -> None:
        _check_open_unit(self.alpha, "alpha")
        _check_open_unit(self.bet_cap, "bet_cap")
        if not (_is_number(self.delta) and 0.0 < self.delta <= 1.0):
            raise ValueError(f"delta must be a number in (0, 1], got {self.delta!r}")
        if not _is_count(self.min_samples) or self.min_samples < 1:
            raise ValueError(f"min_samples must be an int >= 1, got {self.min_samples!r}")
        if self.max_samples is not None and (
            not _is_count(self.max_samples) or self.max_samples < self.min_samples
        ):
            raise ValueError(
                f"max_samples must be None or an int >= min_samples ({self.min_samples}), got {self.max_samples!r}"
            )
        if self.max_seconds is not None and not (
            _is_number(self.max_seconds) and math.isfinite(self.max_seconds) and self.max_seconds > 0
        ):
            raise ValueError(f"max_seconds must be None or a finite number > 0, got {self.max_seconds!r}")
        if not isinstance(self.on_timeout, str) or self.on_timeout not in (Decision.REJECT, Decision.PROMOTE):
            raise ValueError(f"on_timeout must be 'reject' or 'promote', got {self.on_timeout!r}")
        object.__setattr__(self, "on_timeout", Decision(self.on_timeout))


@dataclass(frozen=True)
class ArmBounds:
    """One arm's state: ``n`` ratings, their plain ``mean`` (0.0 when ``n == 0``), and the
    one-sided confidence bounds ``lower``/``upper`` on its mean in [0, 1] (``0``/``1`` before any
    rating). ``lower > upper`` is possible (probability at most α under the assumptions) and is a
    sign that the arm's mean moved within the window."""

    n: int
    mean: float
    lower: float
    upper: float


@dataclass(frozen=True)
class Verdict:
    """The rule's answer at one moment.

    ``lower``/``upper``: the bounds on ``Δ = μ_candidate − μ_promoted`` in [−1, 1];
    ``timed_out``: the decision came from the time-out; ``reason``: one line for the record.
    """

    decision: Decision
    lower: float
    upper: float
    candidate: ArmBounds
    promoted: ArmBounds
    timed_out: bool
    reason: str


class MeanConfidenceSequence:
    """PrPl-EB lower and upper confidence sequences for the means of a batch of streams in [0, 1].

    ``shape`` is the batch's shape (``()``: one stream); every stream of a batch has received the
    same number of ratings ``n``. Each side has miscoverage at most ``side_alpha`` over all times
    together (module docstring; Waudby-Smith & Ramdas 2024, Theorem 2). O(1) memory per stream,
    O(T) time per block of ``T`` ratings. Raises ``ValueError`` on ``side_alpha`` or ``bet_cap``
    outside (0, 1).
    """

    def __init__(self, side_alpha: float, bet_cap: float = BET_CAP, shape: tuple[int, ...] = ()) -> None:
        self.side_alpha = _check_open_unit(side_alpha, "side_alpha")
        self.bet_cap = _check_open_unit(bet_cap, "bet_cap")
        self._log_inv = math.log(1.0 / self.side_alpha)
        self.n = 0
        zeros = np.zeros(shape)
        self._sum_x = zeros.copy()
        self._sum_sq = zeros.copy()  # Σ (x_j − μ̂_j)²: the variance estimate's numerator
        self._sum_lam = zeros.copy()
        self._sum_lam_x = zeros.copy()
        self._sum_pen = zeros.copy()  # Σ (x_i − μ̂_{i−1})² ψ(λ_i)
        self.lower = zeros.copy()
        self.upper = np.ones(shape)

    def observe(self, reward: float) -> None:
        """Add one rating to a one-stream batch. Raises ``ValueError`` unless it is a finite
        number in [0, 1], or if the batch has more than one stream."""
        if self.lower.shape != ():
            raise ValueError(f"observe feeds a one-stream batch; this one has shape {self.lower.shape}")
        self.extend(np.array([check_reward(reward)]))

    def extend(self, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Add a block of ratings and return the bounds after each of them.

        Args:
            rewards: ``[*shape, T]`` float array in [0, 1], the last axis in receipt order.

        Returns:
            ``(lower, upper)``, each ``[*shape, T]`` float64: the intersected bounds after
            ratings ``n+1 … n+T``. Feeding a stream in blocks gives the same bounds as feeding
            it at once, up to floating-point summation order.

        Raises:
            ValueError: a reward that is not finite or outside [0, 1], or a block of the wrong
                shape; nothing is recorded then.
        """
        x = np.asarray(rewards, dtype=np.float64)
        if x.shape[:-1] != self.lower.shape or x.ndim != self.lower.ndim + 1:
            raise ValueError(f"rewards must have shape {(*self.lower.shape, 'T')}, got {x.shape}")
        bad = ~(np.isfinite(x) & (x >= 0.0) & (x <= 1.0))
        if bad.any():
            raise ValueError(f"rewards must be finite numbers in [0, 1], got {x[bad].flat[0]!r}")
        i = self.n + np.arange(1, x.shape[-1] + 1, dtype=np.float64)

        def running(total: np.ndarray, terms: np.ndarray) -> np.ndarray:
            return total[..., None] + np.cumsum(terms, axis=-1)

        sum_x = running(self._sum_x, x)
        mu_prev = (0.5 + sum_x - x) / i
        sq = (x - (0.5 + sum_x) / (i + 1)) ** 2
        sum_sq = running(self._sum_sq, sq)
        var_prev = (0.25 + sum_sq - sq) / i
        lam = np.minimum(self.bet_cap, np.sqrt(2.0 * self._log_inv / (var_prev * i * np.log1p(i))))
        sum_lam = running(self._sum_lam, lam)
        sum_lam_x = running(self._sum_lam_x, lam * x)
        sum_pen = running(self._sum_pen, (x - mu_prev) ** 2 * (-np.log1p(-lam) - lam))
        centre = sum_lam_x / sum_lam
        margin = (self._log_inv + sum_pen) / sum_lam
        lower = np.maximum.accumulate(np.maximum(centre - margin, self.lower[..., None]), axis=-1)
        upper = np.minimum.accumulate(np.minimum(centre + margin, self.upper[..., None]), axis=-1)
        if x.shape[-1]:
            self.n += x.shape[-1]
            # Copies, so the state does not keep the whole block's paths alive.
            last = [a[..., -1].copy() for a in (sum_x, sum_sq, sum_lam, sum_lam_x, sum_pen, lower, upper)]
            (
                self._sum_x,
                self._sum_sq,
                self._sum_lam,
                self._sum_lam_x,
                self._sum_pen,
                self.lower,
                self.upper,
            ) = last
        return lower, upper

    def take(self, index: np.ndarray) -> MeanConfidenceSequence:
        """A new batch holding the streams ``index`` selects (a boolean mask or integer indices
        over the first axis); this batch is unchanged."""
        out = MeanConfidenceSequence(self.side_alpha, self.bet_cap)
        out.n = self.n
        for name in ("_sum_x", "_sum_sq", "_sum_lam", "_sum_lam_x", "_sum_pen", "lower", "upper"):
            setattr(out, name, getattr(self, name)[index])
        return out

    def bounds(self) -> ArmBounds:
        """A one-stream batch's count, plain mean and current bounds. Raises ``ValueError`` on a
        batch of more than one stream."""
        if self.lower.shape != ():
            raise ValueError(f"bounds describes a one-stream batch; this one has shape {self.lower.shape}")
        return ArmBounds(
            n=self.n,
            mean=float(self._sum_x) / self.n if self.n else 0.0,
            lower=float(self.lower),
            upper=float(self.upper),
        )


class CanaryComparison:
    """The decision rule's state, fed one rating at a time (module docstring).

    Holds nothing but one :class:`MeanConfidenceSequence` per arm (each side at
    ``params.alpha / 2``); no clock: the caller passes the seconds since the canary started.
    """

    def __init__(self, params: RuleParams | None = None) -> None:
        self.params = params or RuleParams()
        self._arms = {
            arm: MeanConfidenceSequence(self.params.alpha / 2.0, self.params.bet_cap) for arm in Arm
        }

    def observe(self, arm: Arm | str, reward: float, *, elapsed_s: float | None = None) -> Verdict:
        """Add one rated answer of ``arm`` (``"candidate"`` or ``"promoted"``) and return the
        verdict at ``elapsed_s`` seconds since the canary started (``None``: no time-out check).

        Raises ``ValueError`` on an unknown arm, a reward that is not a finite number in
        [0, 1] (NaN included; nothing is recorded then), or a negative or non-finite
        ``elapsed_s``.
        """
        self._arms[_arm(arm)].observe(reward)
        return self.verdict(elapsed_s=elapsed_s)

    def extend(self, arm: Arm | str, rewards: Iterable[float]) -> None:
        """Add an arm's ratings in the order received; same errors as :meth:`observe` (an
        invalid reward anywhere records none of them)."""
        self._arms[_arm(arm)].extend(np.array([check_reward(r) for r in rewards], dtype=np.float64))

    def bounds(self) -> tuple[ArmBounds, ArmBounds]:
        """The candidate's and the promoted arm's bounds now."""
        return self._arms[Arm.CANDIDATE].bounds(), self._arms[Arm.PROMOTED].bounds()

    def verdict(self, *, elapsed_s: float | None = None) -> Verdict:
        """The decision now (module docstring, "The decision"); ``elapsed_s`` as in
        :meth:`observe`. Raises ``ValueError`` on a negative or non-finite ``elapsed_s``."""
        if elapsed_s is not None and not (
            _is_number(elapsed_s) and math.isfinite(elapsed_s) and elapsed_s >= 0
        ):
            raise ValueError(f"elapsed_s must be None or a finite number >= 0, got {elapsed_s!r}")
        cand, prom = self.bounds()
        return verdict_from_bounds(cand, prom, self.params, elapsed_s)


def verdict_from_bounds(
    cand: ArmBounds, prom: ArmBounds, params: RuleParams, elapsed_s: float | None = None
) -> Verdict:
    """The decision from the candidate's and the promoted arm's bounds (module docstring, "The
    decision"), ``elapsed_s`` seconds since the canary started (``None``: no time-out check).
    The caller checks ``elapsed_s`` (:meth:`CanaryComparison.verdict` does)."""
    p = params
    lower = cand.lower - prom.upper
    upper = cand.upper - prom.lower
    enough = min(cand.n, prom.n) >= p.min_samples
    timed_out = (p.max_samples is not None and cand.n >= p.max_samples) or (
        p.max_seconds is not None and elapsed_s is not None and elapsed_s >= p.max_seconds
    )
    bounds = f"Δ in [{lower:+.4f}, {upper:+.4f}] (n_candidate={cand.n}, n_promoted={prom.n})"
    if enough and upper < 0.0:
        return Verdict(Decision.REJECT, lower, upper, cand, prom, False, f"worse: upper bound < 0; {bounds}")
    if enough and lower > -p.delta:
        reason = f"not worse by more than {p.delta}: lower bound > {-p.delta}; {bounds}"
        return Verdict(Decision.PROMOTE, lower, upper, cand, prom, False, reason)
    if timed_out:
        reason = f"time-out, {p.on_timeout.value} by configuration; {bounds}"
        return Verdict(p.on_timeout, lower, upper, cand, prom, True, reason)
    return Verdict(Decision.CONTINUE, lower, upper, cand, prom, False, f"undecided; {bounds}")


def decide(
    candidate: Iterable[float],
    promoted: Iterable[float],
    params: RuleParams | None = None,
    *,
    elapsed_s: float | None = None,
) -> Verdict:
    """The verdict on two arms' ratings, each in the order its arm received them: the pure form
    of :class:`CanaryComparison` (equal to it fed the same ratings in any interleaving, up to
    floating-point summation order).

    Raises ``ValueError`` as :meth:`CanaryComparison.observe` does.
    """
    state = CanaryComparison(params)
    state.extend(Arm.CANDIDATE, candidate)
    state.extend(Arm.PROMOTED, promoted)
    return state.verdict(elapsed_s=elapsed_s)


def _arm(arm: object) -> Arm:
    if isinstance(arm, str) and arm in Arm.__members__.values():
        return Arm(arm)
    raise ValueError(f"arm must be 'candidate' or 'promoted', got {arm!r}")


def _is_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float)


def _is_count(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int)


def _check_open_unit(x: float, what: str) -> float:
    if not (_is_number(x) and 0.0 < x < 1.0):
        raise ValueError(f"{what} must be a number in (0, 1), got {x!r}")
    return float(x)


def member_alpha(alpha: float, position: int) -> float:
    """The error rate spent on the ``position``-th version of a lineage (1: its oldest):
    ``α_j = α / (j (j + 1))``. The series telescopes, ``α/(j(j+1)) = α/j − α/(j+1)``, so
    ``Σ_{j≥1} α_j = α`` however long the lineage grows: α_1 = α/2, α_2 = α/6, α_3 = α/12.
    Raises ``ValueError`` for ``alpha`` outside (0, 1) or a ``position`` below 1."""
    _check_open_unit(alpha, "alpha")
    if not _is_count(position) or position < 1:
        raise ValueError(f"position must be an int >= 1, got {position!r}")
    return alpha / (position * (position + 1))


def decide_lineage(
    members: Sequence[tuple[Sequence[float], Sequence[float]]],
    params: RuleParams | None = None,
    *,
    elapsed_s: float | None = None,
    promotes: bool = True,
) -> tuple[int | None, Verdict]:
    """The verdict on a lineage whose versions are each judged on their own ratings
    (docs/guard.md, "A version is judged as itself"; issue 40, item 2).

    Args:
        members: one ``(ratings, comparison)`` pair per version of the lineage, oldest first:
            the rewards in [0, 1] of the answers that version served, in receipt order, and the
            comparison arm's for that version (the promoted versions' answers of the same
            window), in receipt order.
        params: δ, α, ``min_samples`` and the time-outs (``RuleParams``).
        elapsed_s: seconds since the lineage's first version (the time-out on time).
        promotes: False for a veto, which only ever rejects (and has no time-out).

    Returns:
        ``(j, verdict)``: ``j`` the index into ``members`` of the version the verdict is about
        (None: no version, an empty lineage), ``verdict`` that version's ``Verdict``:

        1. ``REJECT`` if any version's own bounds show it worse (``upper(Δ_j) < 0``), tested at
           ``α_j = member_alpha(α, j)``: the first such version.
        2. ``PROMOTE`` (when ``promotes``) if the newest version's bounds, at its ``α_j``, show
           it not worse by more than δ (``lower(Δ_j) > −δ``). Older versions' ratings never
           promote the newest: a version is promoted on ratings of its own only.
        3. At a time-out (the lineage's ratings in all reach ``max_samples``, or ``elapsed_s``
           reaches ``max_seconds``): ``on_timeout``, except that a promotion waits until the
           newest version has ``min_samples`` ratings of its own (``CONTINUE`` until then).
        4. ``CONTINUE`` otherwise, with the newest version's bounds.

    Why it holds for an arm that changes. Each version's confidence sequences see only that
    version's ratings, so each has the constant mean the PrPl-EB bound assumes (the running
    intersection of one sequence over a lineage does not: 60 ratings at 0.8 of one version and
    then 60 at 0.1 of the next keep the first version's lower bound, so the lineage looks like
    0.8 long after it became 0.1). The versions share the error rate by a union bound:

        P(reject | every version has Δ_j ≥ 0) ≤ Σ_j P(upper(Δ_j) < 0) ≤ Σ_j α_j ≤ α
        P(promote a version with Δ_j ≤ −δ)    ≤ Σ_j P(lower(Δ_j) > −δ) ≤ Σ_j α_j ≤ α

    at every stopping time, however many versions the lineage grows to (each sequence is
    anytime-valid, module docstring; ``Σ α_j = α``, ``member_alpha``). The price: the j-th
    version's bound uses ``L = log(2/α_j)`` = log(80), log(240), log(480) … at α = 0.05 instead of
    log(40), so it needs more ratings to decide, growing about as log j; and a version that
    serves for fewer than ``min_samples`` ratings per arm decides nothing.

    Raises:
        ValueError: as ``decide`` (a reward outside [0, 1], a negative ``elapsed_s``).
    """
    p = params or RuleParams()
    bounds = []
    for j, (own, comparison) in enumerate(members, start=1):
        arms = CanaryComparison(replace(p, alpha=member_alpha(p.alpha, j)))
        arms.extend(Arm.CANDIDATE, own)
        arms.extend(Arm.PROMOTED, comparison)
        bounds.append(arms.bounds())
    return lineage_verdict(bounds, p, elapsed_s=elapsed_s, promotes=promotes)


def lineage_verdict(
    bounds: Sequence[tuple[ArmBounds, ArmBounds]],
    params: RuleParams,
    *,
    elapsed_s: float | None = None,
    promotes: bool = True,
) -> tuple[int | None, Verdict]:
    """``decide_lineage`` from each version's bounds, oldest first: ``(own, comparison)`` as
    ``ArmBounds``, each version's computed at its ``member_alpha`` (the rule's combination
    alone, for callers that keep the sequences themselves, as ``bench/bench_lineage_rule.py``
    does). The caller checks ``elapsed_s``."""
    p = params
    if not bounds:
        empty = ArmBounds(0, 0.0, 0.0, 1.0)
        return None, Verdict(Decision.CONTINUE, -1.0, 1.0, empty, empty, False, "undecided; no version")
    plain = replace(p, max_samples=None, max_seconds=None)
    verdicts = [verdict_from_bounds(own, comparison, plain) for own, comparison in bounds]
    newest = len(bounds) - 1

    def about(j: int, v: Verdict) -> Verdict:
        alpha_j = member_alpha(p.alpha, j + 1)
        return replace(v, reason=f"version {j + 1} of {len(bounds)} (α_j = {alpha_j:.3g}): {v.reason}")

    worse = next((j for j, v in enumerate(verdicts) if v.decision == Decision.REJECT), None)
    if worse is not None:
        return worse, about(worse, verdicts[worse])
    last = verdicts[newest]
    if promotes and last.decision == Decision.PROMOTE:
        return newest, about(newest, last)
    total = sum(v.candidate.n for v in verdicts)
    timed_out = promotes and (
        (p.max_samples is not None and total >= p.max_samples)
        or (p.max_seconds is not None and elapsed_s is not None and elapsed_s >= p.max_seconds)
    )
    waits = p.on_timeout == Decision.PROMOTE and last.candidate.n < p.min_samples
    if timed_out and not waits:
        reason = (
            f"time-out ({total} ratings of the lineage), {p.on_timeout.value} by configuration; {last.reason}"
        )
        return newest, about(newest, replace(last, decision=p.on_timeout, timed_out=True, reason=reason))
    return newest, about(newest, replace(last, decision=Decision.CONTINUE))
