"""Error rates and sample sizes of the guard's decision rule on synthetic Bernoulli rewards.

The rule is ``core/sequential.py`` at its defaults (δ 0.05, α 0.05, 20 ratings per arm at
least, time-out at 20 000 candidate ratings, rejecting at the time-out). Each simulated run
draws independent Bernoulli rewards, the promoted version's at the base rate ``p`` and the
candidate's at ``p + Δ``; the promoted arm gets ``--ratio`` ratings per candidate rating (1: a
50% canary share, 9: a 10% share), and the rule is consulted after every candidate rating, the
run stopping at its first decision. Prints one Markdown table per ratio: for each base rate and
true difference, the shares of runs promoted, rejected by the bound and timed out (the time-out
rejects), the error rate that applies (false promotion when Δ <= −δ, false rejection,
time-outs included, when Δ >= 0) with its 95% Wilson interval, the nominal α, and the median
and 90th percentile of the candidate's rated answers at the decision (the promoted arm had
``ratio`` times as many).

    .venv/bin/python bench/bench_sequential.py [--runs 1000] [--ratios 1 9] [--seed 0]

Pure code, no engine; the figures are in docs/guard.md "The decision rule".
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from core.sequential import (
    MAX_SAMPLES,
    ArmBounds,
    MeanConfidenceSequence,
    RuleParams,
    verdict_from_bounds,
)

BASES = (0.2, 0.5)
BLOCK = 256  # candidate ratings simulated per step of the loop


def differences(delta: float) -> tuple[float, ...]:
    """The table's true differences Δ = μ_candidate − μ_promoted."""
    return (-0.2, -0.1, -delta, -delta / 2, 0.0, 0.05, 0.1)


def simulate(
    base: float, diff: float, ratio: int, runs: int, params: RuleParams, rng: np.random.Generator
) -> tuple[list[str], list[int]]:
    """Outcome (``promote``, ``reject`` or ``time-out``) and the candidate's rating count at the
    decision, for each of ``runs`` runs."""
    side = params.alpha / 2
    cand = MeanConfidenceSequence(side, params.bet_cap, shape=(runs,))
    prom = MeanConfidenceSequence(side, params.bet_cap, shape=(runs,))
    live = np.arange(runs)
    outcomes = [""] * runs
    counts = [0] * runs
    horizon = params.max_samples or 0
    while live.size:
        block = min(BLOCK, horizon - cand.n)
        lc, uc = cand.extend((rng.random((live.size, block)) < base + diff).astype(np.float64))
        lp, up = prom.extend((rng.random((live.size, block * ratio)) < base).astype(np.float64))
        # The promoted arm's bounds when each candidate rating arrives (after ``ratio`` of its own).
        lp, up = lp[:, ratio - 1 :: ratio], up[:, ratio - 1 :: ratio]
        k = cand.n - block + np.arange(1, block + 1)
        # The promoted arm has ``ratio`` >= 1 times the candidate's ratings: the candidate's count decides.
        hit = (k >= params.min_samples)[None, :] & (((uc - lp) < 0.0) | ((lc - up) > -params.delta))
        hit[:, -1] |= cand.n >= horizon
        done = hit.any(axis=1)
        for row in np.flatnonzero(done):
            j = int(hit[row].argmax())
            verdict = verdict_from_bounds(
                ArmBounds(int(k[j]), math.nan, float(lc[row, j]), float(uc[row, j])),
                ArmBounds(int(k[j]) * ratio, math.nan, float(lp[row, j]), float(up[row, j])),
                params,
            )
            outcomes[live[row]] = "time-out" if verdict.timed_out else verdict.decision.value
            counts[live[row]] = int(k[j])
        keep = ~done
        live, cand, prom = live[keep], cand.take(keep), prom.take(keep)
    return outcomes, counts


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000, help="simulated runs per row")
    ap.add_argument(
        "--ratios", type=int, nargs="+", default=[1, 9], help="promoted ratings per candidate rating"
    )
    ap.add_argument("--max-samples", type=int, default=MAX_SAMPLES, help="the time-out, candidate ratings")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    params = RuleParams(max_samples=args.max_samples)
    rng = np.random.default_rng(args.seed)
    t0, cpu0 = time.perf_counter(), time.process_time()
    print(
        f"rule: PrPl-EB confidence sequences, δ={params.delta}, α={params.alpha}, "
        f"min {params.min_samples}/arm, time-out {params.max_samples} candidate ratings → "
        f"{params.on_timeout.value}; {args.runs} runs per row, seed {args.seed}"
    )
    for ratio in args.ratios:
        print(f"\nratio {ratio} (canary share {1 / (1 + ratio):.0%})\n")
        print("| base p | Δ | promote | reject | time-out | error | rate [95% CI] | α | median n | p90 n |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for base in BASES:
            for diff in differences(params.delta):
                outcomes, counts = simulate(base, diff, ratio, args.runs, params, rng)
                share = {o: outcomes.count(o) / args.runs for o in ("promote", "reject", "time-out")}
                promoted = outcomes.count("promote")
                if diff <= -params.delta + 1e-12:
                    kind, errors = "false promotion", promoted
                elif diff >= 0:
                    # The time-out rejects: a candidate as good as the promoted one that times out is lost too.
                    kind, errors = "false rejection", args.runs - promoted
                else:
                    kind, errors = "", None
                if errors is None:
                    rate = "(either is right)"
                else:
                    lo, hi = wilson(errors, args.runs)
                    rate = f"{errors / args.runs:.3f} [{lo:.3f}, {hi:.3f}]"
                median, p90 = np.percentile(counts, [50, 90])
                print(
                    f"| {base} | {diff:+.3f} | {share['promote']:.3f} | {share['reject']:.3f} "
                    f"| {share['time-out']:.3f} | {kind} | {rate} | {params.alpha} "
                    f"| {median:.0f} | {p90:.0f} |"
                )
    print(f"\n{time.perf_counter() - t0:.0f} s wall, {time.process_time() - cpu0:.0f} s CPU")


if __name__ == "__main__":
    main()
