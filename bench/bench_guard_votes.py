"""One identity rating by arm against the guard's verdict, with and without the identity cap on
the votes (issue 40, item 1; docs/guard.md, "Who votes"), on seeded simulated rating streams.

Traffic: ``--honest`` identities (API keys) send requests at equal rates; one more key, the
attacker, sends ``--flood`` of all requests. Each request goes to the canary arm with
probability ``--share`` (0.2, the default canary share), else to the control arm. An honest
rating is Bernoulli(p + Δ) on the canary's answers and Bernoulli(p) on the control's; the
attacker rates by arm, whatever the answer: 0 on the canary's and 1 on the control's when the
honest lineage should be promoted (Δ ≥ 0), the reverse when it should be rejected.

Each stream is judged by the guard's own code: ``learner.guard.guard_votes.ballot`` (who may vote,
then the identity cap per arm) and ``core.sequential.decide_lineage`` (one version), consulted
at checkpoints (after 100 canary requests, then every 25% more) up to ``--horizon`` canary
requests; the first decision is the verdict (``continue`` when none came). The conditions, on the same
draws and at the same points in time: no attacker (the attacker's requests left out), the
attacker with the cap off (``GuardConfig.vote_identity_share`` None), the cap at share s
(``Electorate.of(s, 16)``: windows of max(16, ⌈1/s⌉) votes, the demo's batch of 16) for s =
0.25, 1/16, 0.02 and 0.01, and the attacker's key opted out of training (its ratings never
vote).

    OMP_NUM_THREADS=1 flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_guard_votes.py \
        [--seeds 0 1 2] [--record]

Pure code, no engine; ``--record`` writes the table to docs/results.md (``bench/results.py``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench.results import record
from core.sequential import Decision, RuleParams, decide_lineage
from learner.guard.guard_votes import Electorate, Vote, ballot

BASE = 0.5
BATCH = 16
ATTACKER = "key:kattacker0000000"
CONDITIONS: dict[str, Electorate | None] = {
    "no attacker": Electorate(None, BATCH),
    "attacker, no cap": Electorate(None, BATCH),
    "attacker, cap 0.25": Electorate.of(0.25, BATCH),
    "attacker, cap 1/16 of 16": Electorate.of(1 / 16, BATCH),
    "attacker, cap 0.02": Electorate.of(0.02, BATCH),
    "attacker, cap 0.01": Electorate.of(0.01, BATCH),
    "attacker's key opted out": Electorate(None, BATCH),
}


def requests(diff: float, args, rng) -> tuple[np.ndarray, list[Vote]]:
    """Every rated request in receipt order: its arm (0 canary, 1 control) and its vote."""
    n = int(args.horizon / args.share / (1 - args.flood)) + 1
    attacker = rng.random(n) < args.flood
    honest = rng.integers(0, args.honest, n)
    arm = (rng.random(n) >= args.share).astype(np.int64)
    good = rng.random(n)
    push = 0.0 if diff >= 0 else 1.0  # what the attacker gives the canary's answers
    votes = []
    for i in range(n):
        if attacker[i]:
            votes.append(Vote(push if arm[i] == 0 else 1.0 - push, ATTACKER, True, None))
        else:
            rate = BASE + diff if arm[i] == 0 else BASE
            votes.append(Vote(float(good[i] < rate), f"key:k{honest[i]:016x}", True, True))
    return arm, votes


def verdict(
    arm: np.ndarray, votes: list[Vote], keep: np.ndarray, voters: Electorate, args
) -> tuple[str, int]:
    """The first decision at the checkpoints, and the canary votes that counted then. The
    checkpoints are points in time (requests received), the same for every condition: after
    the first 100 canary requests, then every 25% more, up to ``--horizon``."""
    params = RuleParams(max_samples=None)
    canary_at = np.cumsum(arm == 0)
    arms: tuple[list[Vote], list[Vote]] = ([], [])
    counts = np.zeros((len(votes) + 1, 2), dtype=np.int64)
    for i, (a, v) in enumerate(zip(arm, votes, strict=True)):
        if keep[i]:
            arms[a].append(v)
        counts[i + 1] = len(arms[0]), len(arms[1])
    target = 100
    while True:
        t = int(np.searchsorted(canary_at, min(target, args.horizon))) + 1
        c, p = counts[min(t, len(votes))]
        _, v = decide_lineage([(ballot(arms[0][:c], voters), ballot(arms[1][:p], voters))], params)
        if v.decision != Decision.CONTINUE or target >= args.horizon:
            return v.decision.value, v.candidate.n
        target = int(target * 1.25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--honest", type=int, default=200, help="honest identities")
    ap.add_argument("--flood", type=float, default=0.5, help="the attacker's share of all requests")
    ap.add_argument("--share", type=float, default=0.2, help="the canary share")
    ap.add_argument(
        "--horizon", type=int, default=50_000, help="canary requests at most (the guard's max_samples)"
    )
    ap.add_argument("--record", action="store_true", help="write the table to docs/results.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for diff in (0.1, 0.0, -0.15):
        for seed in args.seeds:
            arm, votes = requests(diff, args, np.random.default_rng(seed))
            everyone = np.ones(len(votes), dtype=bool)
            honest = np.array([v.identity != ATTACKER for v in votes])
            opted_out = [
                Vote(v.value, v.identity, True, False) if v.identity == ATTACKER else v for v in votes
            ]
            row: dict = {"honest Δ": f"{diff:+.2f}", "seed": seed}
            for name, voters in CONDITIONS.items():
                if name == "no attacker":
                    decision, n = verdict(arm, votes, honest, voters, args)
                elif name == "attacker's key opted out":
                    decision, n = verdict(arm, opted_out, everyone, voters, args)
                else:
                    decision, n = verdict(arm, votes, everyone, voters, args)
                row[name] = f"{decision} ({n})"
            same = row["attacker, cap 0.01"].split()[0] == row["no attacker"].split()[0]
            row["cap 0.01: verdict as without the attacker"] = "yes" if same else "no"
            rows.append(row)
            print(row, flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s wall")
    if args.record:
        record(
            "guard_votes_attack",
            "One identity rating by arm: the guard's verdict with and without the identity cap on votes",
            rows,
            notes=(
                f"{args.honest} honest API keys and one attacker key sending {args.flood:.0%} of the requests; "
                f"canary share {args.share}; control p = {BASE}, the canary's honest ratings at p + Δ; the attacker "
                "rates 0 on the canary's answers and 1 on the control's (Δ ≥ 0) or the reverse (Δ < 0). The verdict "
                "is the guard's own code (learner.guard.guard_votes.ballot, core.sequential.decide_lineage, δ 0.05, α 0.05) "
                "at checkpoints in time (after 100 canary requests, then every 25% more, up to "
                f"{args.horizon}); in brackets the canary ratings that voted at the decision. Cap s: at most "
                "max(1, ⌊s·W⌋) votes of one key per window of W = max(16, ⌈1/s⌉) votes of an arm."
            ),
        )


if __name__ == "__main__":
    main()
