"""Error rates and power of the guard's lineage rule on seeded A/A and A/B streams, including
lineages whose versions change, against the pooled rule it replaced, side by side (issue 40,
item 2; docs/guard.md, "A version is judged as itself").

A simulated lineage: versions 1 … K−1 each serve ``m`` rated answers of the canary arm before
the next version replaces it, and the newest serves until a decision or the time-out (the
lineage's ``--horizon`` rated answers in all, which rejects). Version j's answers are
Bernoulli(p + Δ_j), the control arm's Bernoulli(p), ``--ratio`` control ratings per canary
rating in the same window (4: a 20% canary share). Both rules see the same draws and are
consulted after every canary rating; a run stops at its rule's first decision:

- **per version** (``core.sequential.lineage_verdict``, what the guard runs): each version's own
  ratings against the control ratings of its window, at α_j = α/(j(j+1)); reject when any
  version is shown worse, promote when the newest is shown not worse by more than δ;
- **pooled** (the rule before issue 40): the lineage's ratings as one stream, since its first
  version, against the control since then, at α, with running intersections.

The decision's label comes from the real code: at each run's first decision the bench calls
``lineage_verdict`` (or ``verdict_from_bounds`` for the pooled rule) on the bounds it kept and
checks that it decides the same. An error is a **false promotion** when the version promoted
(the newest at that moment) has Δ_j ≤ −δ, a **false rejection** (time-outs included) when
every version so far has Δ_j ≥ 0; ``n`` is the decided version's own ratings (per version) or
the lineage's (pooled) at the decision.

    OMP_NUM_THREADS=1 flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_lineage_rule.py \
        [--runs 1000] [--seed 0] [--record]

Pure code, no engine; ``--record`` writes the table to docs/results.md (``bench/results.py``).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import numpy as np

from bench.bench_sequential import wilson
from bench.results import record
from core.sequential import (
    ArmBounds,
    Decision,
    MeanConfidenceSequence,
    RuleParams,
    lineage_verdict,
    member_alpha,
    verdict_from_bounds,
)

BASE = 0.5
BLOCK = 128  # canary ratings simulated per step of the loop


@dataclass(frozen=True)
class Scenario:
    """A lineage: ``diffs`` the versions' Δ_j, oldest first; each but the newest serves ``m``
    canary ratings."""

    name: str
    diffs: tuple[float, ...]
    m: int


def scenarios(delta: float) -> list[Scenario]:
    decline = tuple(round(0.3 - 0.6 * j / 9, 3) for j in range(10))
    return [
        Scenario("A/A: one version, Δ = 0", (0.0,), 0),
        Scenario("A/A: 10 versions of 20 ratings, every Δ = 0", (0.0,) * 10, 20),
        Scenario(f"A/B: 10 versions of 20 ratings, every Δ = −{2 * delta:g}", (-2 * delta,) * 10, 20),
        Scenario(f"A/B: 10 versions of 20 ratings, every Δ = +{2 * delta:g}", (2 * delta,) * 10, 20),
        Scenario("changing: Δ = +0.3 for 15 ratings, then the newest Δ = −0.4", (0.3, -0.4), 15),
        Scenario("changing: 10 versions of 10 ratings, Δ from +0.3 down to −0.3", decline, 10),
    ]


class PerVersion:
    """The per-version rule's state over ``runs`` runs: the current version's two sequences and
    every earlier version's final bounds (for the label)."""

    def __init__(self, runs: int, params: RuleParams) -> None:
        self.runs, self.params = runs, params
        self.done: list[tuple[MeanConfidenceSequence, MeanConfidenceSequence]] = []
        self.cand = self.prom = None

    def next_version(self) -> None:
        if self.cand is not None:
            self.done.append((self.cand, self.prom))
        side = member_alpha(self.params.alpha, len(self.done) + 1) / 2
        self.cand = MeanConfidenceSequence(side, self.params.bet_cap, shape=(self.runs,))
        self.prom = MeanConfidenceSequence(side, self.params.bet_cap, shape=(self.runs,))

    def label(self, run: int, cand: ArmBounds, prom: ArmBounds) -> tuple[int | None, Decision]:
        """The real combination (``lineage_verdict``) on run ``run``'s bounds."""
        earlier = [(_bounds(c, run), _bounds(p, run)) for c, p in self.done]
        j, verdict = lineage_verdict([*earlier, (cand, prom)], self.params)
        return j, Decision.REJECT if verdict.timed_out else verdict.decision


def _bounds(seq: MeanConfidenceSequence, run: int) -> ArmBounds:
    return ArmBounds(seq.n, math.nan, float(seq.lower[run]), float(seq.upper[run]))


def simulate(sc: Scenario, runs: int, params: RuleParams, ratio: int, horizon: int, rng) -> dict[str, list]:
    """Each rule's outcome per run: ``(decision, version index, n, timed_out)``."""
    side = params.alpha / 2
    pooled_c = MeanConfidenceSequence(side, params.bet_cap, shape=(runs,))
    pooled_p = MeanConfidenceSequence(side, params.bet_cap, shape=(runs,))
    per = PerVersion(runs, params)
    out: dict[str, list] = {"per version": [None] * runs, "pooled": [None] * runs}
    total = 0
    windows = [sc.m] * (len(sc.diffs) - 1) + [horizon]
    for j, (diff, length) in enumerate(zip(sc.diffs, windows, strict=True)):
        per.next_version()
        served = 0
        while served < length and total < horizon and any(o is None for r in out.values() for o in r):
            b = min(BLOCK, length - served, horizon - total)
            xc = (rng.random((runs, b)) < BASE + diff).astype(np.float64)
            xp = (rng.random((runs, b * ratio)) < BASE).astype(np.float64)
            served, total = served + b, total + b
            last = total >= horizon
            for name, (cs, ps, count) in {
                "per version": (per.cand, per.prom, served),
                "pooled": (pooled_c, pooled_p, total),
            }.items():
                lc, uc = cs.extend(xc)
                lp, up = ps.extend(xp)
                lp, up = lp[:, ratio - 1 :: ratio], up[:, ratio - 1 :: ratio]
                k = count - b + np.arange(1, b + 1)
                hit = (k >= params.min_samples)[None, :] & (((uc - lp) < 0.0) | ((lc - up) > -params.delta))
                if last:
                    hit[:, -1] = True
                for run in np.flatnonzero(hit.any(axis=1)):
                    if out[name][run] is not None:
                        continue
                    i = int(hit[run].argmax())
                    n = int(k[i])
                    cand = ArmBounds(n, math.nan, float(lc[run, i]), float(uc[run, i]))
                    prom = ArmBounds(n * ratio, math.nan, float(lp[run, i]), float(up[run, i]))
                    timed_out = (
                        last
                        and i == b - 1
                        and not ((uc[run, i] - lp[run, i]) < 0 or (lc[run, i] - up[run, i]) > -params.delta)
                    )
                    if name == "pooled":
                        v = verdict_from_bounds(cand, prom, params)
                        decision, version = (Decision.REJECT if timed_out else v.decision), j
                    else:
                        version, decision = (j, Decision.REJECT) if timed_out else per.label(run, cand, prom)
                    assert decision != Decision.CONTINUE, (name, sc.name, run, n)
                    out[name][run] = (decision, version, n, timed_out)
    return out


def rows_for(sc: Scenario, outcomes: dict[str, list], params: RuleParams, runs: int) -> list[dict]:
    rows = []
    for name, res in outcomes.items():
        decided = [r for r in res if r is not None]
        promote = sum(d == Decision.PROMOTE for d, *_ in decided)
        timeouts = sum(t for *_, t in decided)
        reject = len(decided) - promote - timeouts
        false_promotion = sum(
            d == Decision.PROMOTE and sc.diffs[v] <= -params.delta + 1e-12 for d, v, _, _ in decided
        )
        false_rejection = sum(
            d == Decision.REJECT and all(x >= 0 for x in sc.diffs[: v + 1]) for d, v, _, _ in decided
        )
        median = float(np.median([n for _, _, n, _ in decided]))

        def rate(k: int) -> str:
            lo, hi = wilson(k, runs)
            return f"{k / runs:.3f} [{lo:.3f}, {hi:.3f}]"

        rows.append(
            {
                "lineage": sc.name,
                "rule": name,
                "promote": round(promote / runs, 3),
                "reject": round(reject / runs, 3),
                "time-out": round(timeouts / runs, 3),
                "false promotion [95% CI]": rate(false_promotion),
                "false rejection [95% CI]": rate(false_rejection),
                "α": params.alpha,
                "median n": int(median),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000, help="simulated runs per lineage")
    ap.add_argument(
        "--ratio", type=int, default=4, help="control ratings per canary rating (4: a 20%% share)"
    )
    ap.add_argument(
        "--horizon",
        type=int,
        default=50_000,
        help="the time-out: the lineage's canary ratings (the guard's max_samples)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="write the table to docs/results.md")
    args = ap.parse_args()
    params = RuleParams(max_samples=args.horizon)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    rows: list[dict] = []
    for sc in scenarios(params.delta):
        rows += rows_for(
            sc, simulate(sc, args.runs, params, args.ratio, args.horizon, rng), params, args.runs
        )
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(r[h]) for h in header) + " |")
    wall = time.perf_counter() - t0
    print(f"\n{args.runs} runs per lineage, seed {args.seed}, {wall:.0f} s wall")
    if args.record:
        record(
            "guard_lineage_rule",
            "The guard's lineage rule: per version against pooled, A/A and A/B streams",
            rows,
            notes=(
                f"Control at p = {BASE}, {args.ratio} control ratings per canary rating (a "
                f"{1 / (1 + args.ratio):.0%} share), δ = {params.delta}, α = {params.alpha}, min "
                f"{params.min_samples} ratings per arm, time-out at {args.horizon} canary ratings of the "
                f"lineage (rejects); {args.runs} runs per lineage, seed {args.seed}, both rules on the same "
                "draws. False promotion: the version promoted had Δ ≤ −δ; false rejection (time-outs "
                "included): every version so far had Δ ≥ 0. n: the decided version's own ratings (per "
                "version) or the lineage's (pooled) at the decision."
            ),
        )


if __name__ == "__main__":
    main()
