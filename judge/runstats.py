"""What an online run measures besides rewards: staleness, feedback→served latency, traffic.

Pure functions over plain records (no I/O), used by ``judge.report`` and
``bench/bench_feedback_latency.py``. Inputs:

- learner steps: the learner's per-step metrics as ``GET /admin/learner`` returns them
  (``learner_steps`` rows): ``{"version": int, "staleness_hist": {"<versions>": tokens},
  "completing_sample": trajectory id, "kept_fraction", "mean_abs_log_ratio", ...}``.
- answer records of the async simulation (``judge.simulate``): ``{"id", "first_version",
  "t_answer": s since the run started, "t_feedback": s or None}``.

Staleness (SAO §2.2, DESIGN §5.1): for each trained action token, the version the learner
trained from minus the version that generated the token (the record's spans). Issue 10 asks
for its distribution per run, not only a per-step mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between order statistics (numpy's default).

    Position ``q·(n−1)`` in the sorted values. Raises ``ValueError`` for no values or ``q``
    outside [0, 1].
    """
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def staleness_distribution(steps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run's distribution of token staleness (versions), summed over its learner steps.

    Returns ``{"mean": float | None, "p95": int | None, "histogram": {"<k>": tokens},
    "tokens": int}``; ``p95`` is the smallest staleness k with at least 95 % of the tokens at
    or below k (staleness is an integer, so no interpolation). None when no step holds a
    histogram. Raises ``ValueError`` for a negative staleness or count.
    """
    hist: dict[int, int] = {}
    for step in steps:
        for k, n in (step.get("staleness_hist") or {}).items():
            k, n = int(k), int(n)
            if k < 0 or n < 0:
                raise ValueError(f"negative staleness or count in {step.get('staleness_hist')}")
            hist[k] = hist.get(k, 0) + n
    total = sum(hist.values())
    if total == 0:
        return {"mean": None, "p95": None, "histogram": {}, "tokens": 0}
    mean = sum(k * n for k, n in hist.items()) / total
    cum, p95 = 0, None
    for k in sorted(hist):
        cum += hist[k]
        if cum >= 0.95 * total:
            p95 = k
            break
    return {
        "mean": mean,
        "p95": p95,
        "histogram": {str(k): hist[k] for k in sorted(hist)},
        "tokens": total,
    }


def feedback_to_served(
    steps: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per learner step: seconds from the feedback that completed its batch to the first
    answer served by the version it trained (or a later one).

    For a step that published version v with ``completing_sample`` c: ``completed`` = the
    ``t_feedback`` of record c, ``served`` = the smallest ``t_answer`` among records whose
    ``first_version`` >= v (the answer came back to the user; its first token was generated
    by v or later). Steps whose completing sample has no record with a feedback time (traffic
    from elsewhere, or feedback not posted), or whose version served no answer in the run, are
    left out. Returns ``[{"version", "completed", "served", "latency_s"}]`` in step order.
    """
    by_id = {r["id"]: r for r in records if "id" in r}
    served_at: list[tuple[int, float]] = sorted(
        (int(r["first_version"]), float(r["t_answer"]))
        for r in records
        if r.get("first_version") is not None and r.get("t_answer") is not None
    )
    out = []
    for step in steps:
        rec = by_id.get(step.get("completing_sample"))
        if rec is None or rec.get("t_feedback") is None:
            continue
        v = int(step["version"])
        later = [t for fv, t in served_at if fv >= v]
        if not later:
            continue
        completed, served = float(rec["t_feedback"]), min(later)
        out.append({"version": v, "completed": completed, "served": served, "latency_s": served - completed})
    return out


def feedback_to_swap(
    steps: Sequence[Mapping[str, Any]],
    records: Sequence[Mapping[str, Any]],
    timeline: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Per learner step: seconds from the feedback that completed its batch to the first
    timeline sample (``{"t", "version"}``, about one a second) at which the server served its
    version or a later one. The part of ``feedback_to_served`` before the first new answer
    begins: queueing behind the previous step, the step itself, publishing and the swap.
    Same omissions as ``feedback_to_served``; returns ``[{"version", "completed", "swapped",
    "latency_s"}]``.
    """
    by_id = {r["id"]: r for r in records if "id" in r}
    out = []
    for step in steps:
        rec = by_id.get(step.get("completing_sample"))
        if rec is None or rec.get("t_feedback") is None:
            continue
        v = int(step["version"])
        seen = [float(x["t"]) for x in timeline if int(x["version"]) >= v]
        if not seen:
            continue
        completed, swapped = float(rec["t_feedback"]), min(seen)
        out.append(
            {"version": v, "completed": completed, "swapped": swapped, "latency_s": swapped - completed}
        )
    return out


def latency_summary(latencies: Sequence[float]) -> dict[str, float | None]:
    """``{"p50", "p95", "n"}`` of latencies in seconds (None without any)."""
    if not latencies:
        return {"p50": None, "p95": None, "n": 0}
    return {"p50": quantile(latencies, 0.5), "p95": quantile(latencies, 0.95), "n": len(latencies)}


def requests_per_second(times: Sequence[float], bin_s: float) -> list[float]:
    """Answers per second in consecutive bins of ``bin_s`` seconds from t = 0 to the last time.

    ``times``: seconds since the run started (each answer's ``t_answer``). Raises
    ``ValueError`` for ``bin_s <= 0`` or a negative time.
    """
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    if not times:
        return []
    if min(times) < 0:
        raise ValueError("times must be >= 0 (seconds since the run started)")
    counts = [0] * (int(max(times) // bin_s) + 1)
    for t in times:
        counts[int(t // bin_s)] += 1
    return [c / bin_s for c in counts]


def step_series(steps: Sequence[Mapping[str, Any]], key: str) -> list[float | None]:
    """One learner metric per step, in step order (None where a step lacks it or it is NaN)."""
    out: list[float | None] = []
    for s in steps:
        v = s.get(key)
        out.append(float(v) if isinstance(v, int | float) and not math.isnan(v) else None)
    return out
