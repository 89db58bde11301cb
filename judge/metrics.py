"""The numbers of the online preference-shift simulation: pure functions over plain records.

Source: SAO paper §3.4 (Figure 5: per-style share over steps, SAO vs the running-mean
baseline's reward) and docs/design.md §6 (adaptation lag, normalised area under the reward curve,
last-5 mean, methods side by side from the same schedule). ``judge.plots`` draws them and
``judge.report`` writes them with the page.

Input format (one list per method). A record is a mapping with at least::

    {"step": int >= 0, "target_style": str, "detected_style": str, "reward": float in [0, 1]}

A step is one learner step (one batch); one record per judged request, several records may
share a step. Per step, the step's reward is the mean reward of its records, the step's style
share counts its records' detected styles. Steps must cover 0..max(step) without gaps, and
every record's ``target_style`` must be the schedule's target at its step (a mismatch means the
data and the schedule disagree, and the report would be wrong). Extra keys (``quality``,
``method``, ``prompt_id``, ...) are ignored.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from judge.runstats import (
    feedback_to_served,
    feedback_to_swap,
    latency_summary,
    requests_per_second,
    staleness_distribution,
    step_series,
)
from judge.styles import STYLE_NAMES, Schedule

REQUIRED_KEYS = ("step", "target_style", "detected_style", "reward")


def normalized_auc(rewards: Sequence[float]) -> float:
    """Area under the per-step reward curve by the trapezoid rule, divided by the step span.

    ``sum((r[i] + r[i+1]) / 2) / (len - 1)``; a single point gives that point. Same unit as the
    rewards (in [0, 1] for the simulation's binary rewards averaged per step). docs/design.md §6.
    Raises ``ValueError`` for an empty list.
    """
    if not rewards:
        raise ValueError("normalized_auc of an empty reward list")
    if len(rewards) == 1:
        return float(rewards[0])
    area = sum((a + b) / 2.0 for a, b in zip(rewards[:-1], rewards[1:], strict=True))
    return float(area / (len(rewards) - 1))


def present_auc(rewards: Sequence[float]) -> float:
    """``normalized_auc`` over the steps that have a reward (NaN = a step without answers):
    trapezoids between consecutive present steps, weighted by their distance in steps, divided
    by the span from the first to the last present step. Equals ``normalized_auc`` without
    gaps. Raises ``ValueError`` if no step has a reward.
    """
    pts = [(t, float(r)) for t, r in enumerate(rewards) if not math.isnan(r)]
    if not pts:
        raise ValueError("present_auc: no step has a reward")
    if len(pts) == 1:
        return pts[0][1]
    area = sum((ra + rb) / 2.0 * (tb - ta) for (ta, ra), (tb, rb) in zip(pts[:-1], pts[1:], strict=True))
    return float(area / (pts[-1][0] - pts[0][0]))


def last_k_mean(rewards: Sequence[float], k: int = 5) -> float:
    """Mean of the last ``k`` per-step rewards (all of them if fewer). docs/design.md §6 (last-5 mean).

    Raises ``ValueError`` for an empty list or ``k < 1``.
    """
    if not rewards:
        raise ValueError("last_k_mean of an empty reward list")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    tail = rewards[-k:]
    return float(sum(tail) / len(tail))


def adaptation_lag(
    style_share_target_series: Sequence[float],
    switch_steps: Sequence[int],
    threshold: float = 0.5,
    window: int = 1,
) -> list[int | None]:
    """Steps after each switch until the new target style's share reaches ``threshold``.

    ``style_share_target_series[t]`` is the share (in [0, 1]) of answers at step ``t`` written in
    the style that is the target at step ``t``, pooled over a trailing ``window`` of steps that
    never reaches back past the switch (``rolling_share`` with the switches as ``starts``). For a
    switch at step ``s`` (the first step of the new target) the lag is the smallest
    ``d >= window - 1`` with ``series[s + d] >= threshold`` and ``s + d`` before the next switch
    (or the end of the series); ``None`` if that never happens. One entry per switch, in order.

    Why ``d >= window - 1``: before then the window holds fewer steps than it should (one step
    at ``d = 0``: 16 answers at the demo's batch), all answered by versions trained before or
    just after the switch, and a lucky step reads as adaptation (a share of 0.5 at ``d = 0`` in
    an unadapted run, docs/log/2026-12-05-demo-runs.md, eleventh session). So the lag of a window of ``w`` steps is
    at least ``w - 1``. docs/design.md §6; SAO §3.4 (adaptation lag of the running mean).

    Raises ``ValueError`` for switch steps that are not increasing or ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    switches = list(switch_steps)
    if any(b <= a for a, b in zip(switches[:-1], switches[1:], strict=True)):
        raise ValueError(f"switch steps must be strictly increasing, got {switches}")
    lags: list[int | None] = []
    for i, start in enumerate(switches):
        end = switches[i + 1] if i + 1 < len(switches) else len(style_share_target_series)
        end = min(end, len(style_share_target_series))
        full = start + window - 1
        lag = next((t - start for t in range(full, end) if style_share_target_series[t] >= threshold), None)
        lags.append(lag)
    return lags


def rolling_share(
    styles_per_step: Sequence[Sequence[str]],
    window: int,
    styles: Sequence[str] | None = None,
    starts: Sequence[int] = (),
) -> dict[str, list[float]]:
    """Share of each style among the answers of the trailing ``window`` steps, per step.

    ``styles_per_step[t]`` lists the detected style of every answer at step ``t``. The value at
    step ``t`` pools the answers of steps ``max(0, t - window + 1, s) .. t``, where ``s`` is the
    last of ``starts`` at or before ``t`` (a window never reaches back past a segment's first
    step, so a share after a switch counts only answers written for the new target; ``window =
    1`` is the per-step share); NaN where the pooled steps hold no answer. ``styles`` fixes the
    keys (default: every style seen, in catalogue order). Raises ``ValueError`` if ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if styles is None:
        seen = {s for step in styles_per_step for s in step}
        styles = [s for s in STYLE_NAMES if s in seen] + sorted(seen - set(STYLE_NAMES))
    counts = [Counter(step) for step in styles_per_step]
    out: dict[str, list[float]] = {s: [] for s in styles}
    for t in range(len(counts)):
        floor = max((s for s in starts if s <= t), default=0)
        pooled: Counter[str] = Counter()
        for c in counts[max(0, t - window + 1, floor) : t + 1]:
            pooled.update(c)
        total = sum(pooled.values())
        for s in styles:
            out[s].append(pooled[s] / total if total else math.nan)
    return out


@dataclass(frozen=True)
class StepSeries:
    """One method's records aggregated per step (index = step)."""

    reward: list[float]
    styles: list[list[str]]
    target: list[str]
    n_records: int


def per_step(
    records: Sequence[Mapping[str, Any]], schedule: Schedule, allow_gaps: bool = False
) -> StepSeries:
    """Aggregate records (module docstring format) per step and check them.

    ``allow_gaps``: a step without records gets a NaN reward and no styles instead of an error
    (async runs: a version the learner replaced before any answer it began came back).
    Raises ``ValueError`` for a record without a required key, a negative or non-integer step,
    a reward outside [0, 1], a target style that is not the schedule's target at its step,
    missing steps (unless ``allow_gaps``), or no records at all.
    """
    if not records:
        raise ValueError("no records")
    by_step: dict[int, list[Mapping[str, Any]]] = {}
    for i, rec in enumerate(records):
        missing = [k for k in REQUIRED_KEYS if k not in rec]
        if missing:
            raise ValueError(f"record {i} lacks {', '.join(missing)}: {dict(rec)}")
        step, reward = rec["step"], rec["reward"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"record {i}: step must be an integer >= 0, got {step!r}")
        if not isinstance(reward, int | float) or not 0.0 <= reward <= 1.0:
            raise ValueError(f"record {i}: reward must be in [0, 1], got {reward!r}")
        expected = schedule.target_at(step)
        if rec["target_style"] != expected:
            raise ValueError(
                f"record {i}: target_style {rec['target_style']!r} at step {step}, "
                f"but the schedule's target there is {expected!r}"
            )
        by_step.setdefault(step, []).append(rec)
    n = max(by_step) + 1
    gaps = [t for t in range(n) if t not in by_step]
    if gaps and not allow_gaps:
        raise ValueError(f"steps without records: {gaps[:10]}{' ...' if len(gaps) > 10 else ''}")
    return StepSeries(
        reward=[
            sum(float(r["reward"]) for r in by_step[t]) / len(by_step[t]) if t in by_step else math.nan
            for t in range(n)
        ],
        styles=[[str(r["detected_style"]) for r in by_step.get(t, [])] for t in range(n)],
        target=[schedule.target_at(t) for t in range(n)],
        n_records=len(records),
    )


def method_metrics(
    records: Sequence[Mapping[str, Any]],
    schedule: Schedule,
    window: int = 1,
    threshold: float = 0.5,
    details: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The metrics of one method (the ``metrics.json`` entry; see ``write_report``).

    ``details``: ``SimulationResult.details()`` of the run (learner steps, async timeline);
    without it the learner and traffic fields are empty.
    """
    details = details or {}
    series = per_step(records, schedule, allow_gaps=details.get("mode") == "async")
    styles = list(dict.fromkeys(schedule.styles + [s for step in series.styles for s in step]))
    styles = [s for s in STYLE_NAMES if s in styles] + [s for s in styles if s not in STYLE_NAMES]
    share = rolling_share(series.styles, window, styles)
    # The target's share pools only its own segment's steps: at a switch, a window reaching back
    # would count the new style's base rate before the switch as adaptation (a lag of 0 seen in
    # an unadapted run, docs/offpolicy.md).
    own = rolling_share(series.styles, window, styles, starts=schedule.switch_steps)
    target_share = [own[tgt][t] for t, tgt in enumerate(series.target)]
    n = len(series.reward)
    segment_mean = []
    for seg in schedule.as_dicts():
        chunk = [r for r in series.reward[seg["start"] : min(seg["end"], n)] if not math.isnan(r)]
        segment_mean.append(sum(chunk) / len(chunk) if chunk else None)
    present = [r for r in series.reward if not math.isnan(r)]
    steps = list(details.get("learner_steps") or [])
    timeline = list(details.get("timeline") or [])
    answered = [float(r["t_answer"]) for r in records if r.get("t_answer") is not None]
    latencies = [x["latency_s"] for x in feedback_to_served(steps, records)]
    to_first = [x["latency_s"] for x in feedback_to_served(steps, records, at="t_first_token")]
    to_swap = [x["latency_s"] for x in feedback_to_swap(steps, records, timeline)]
    wall = details.get("wall_s")
    return {
        "auc": present_auc(series.reward),
        "last5_mean": last_k_mean(present, 5),
        "adaptation_lag": adaptation_lag(target_share, schedule.switch_steps, threshold, window),
        "segment_mean_reward": segment_mean,
        "steps": n,
        "records": series.n_records,
        "reward": series.reward,
        "target_share": target_share,
        "style_share": share,
        "mode": details.get("mode"),
        "traffic": details.get("traffic"),
        "wall_s": wall,
        "staleness": staleness_distribution(steps),
        "feedback_to_served_s": latency_summary(latencies),
        "feedback_to_first_token_s": latency_summary(to_first),
        "feedback_to_swap_s": latency_summary(to_swap),
        "learner_versions": [int(x["version"]) for x in steps],
        **{name: step_series(steps, key) for name, key in LEARNER_SERIES.items()},
        "requests_per_s": len(records) / wall if wall else None,
        "requests_per_s_series": requests_per_second(answered, RATE_BIN_S),
        "backlog": {
            "mean": sum(x["backlog"] for x in timeline) / len(timeline) if timeline else None,
            "max": max((x["backlog"] for x in timeline), default=None),
            "final": timeline[-1]["backlog"] if timeline else None,
            "held_s": details.get("held_s"),
        },
        "examples": example_answers(records, schedule),
        "wallclock": wallclock_series(records, RATE_BIN_S),
    }


def wallclock_series(records: Sequence[Mapping[str, Any]], bin_s: float) -> dict[str, Any]:
    """Mean reward and the target style's share per ``bin_s`` seconds of answer time
    (``t_answer``; None for a bin without answers, and empty lists for records without times)."""
    timed = [r for r in records if r.get("t_answer") is not None]
    bins: dict[int, list[Mapping[str, Any]]] = {}
    for r in timed:
        bins.setdefault(int(float(r["t_answer"]) // bin_s), []).append(r)
    n = max(bins, default=-1) + 1
    reward = [sum(r["reward"] for r in bins[b]) / len(bins[b]) if b in bins else None for b in range(n)]
    share = [
        sum(r["detected_style"] == r["target_style"] for r in bins[b]) / len(bins[b]) if b in bins else None
        for b in range(n)
    ]
    return {"bin_s": bin_s, "reward": reward, "target_share": share}


# metrics.json key -> the learner step metric it lists per step (learner.algo.sao / learner.algo.dis).
LEARNER_SERIES = {
    "dis_kept_fraction": "kept_fraction",
    "mean_abs_log_ratio": "mean_abs_log_ratio",
    "explained_variance": "explained_variance",
    "critic_loss": "critic_loss",
    "kl_ref": "kl_ref",
    "staleness_mean_per_step": "staleness_mean",
    "step_time_s": "step_time_s",
}
RATE_BIN_S = 30.0
EXAMPLES_PER_END = 2
EXAMPLE_CHARS = 240


def example_answers(
    records: Sequence[Mapping[str, Any]], schedule: Schedule, per_end: int = EXAMPLES_PER_END
) -> list[dict[str, Any]]:
    """A few answers at the start and at the end of each segment, so a reader sees the style
    change in text: the first ``per_end`` answers of the segment's first step that has any and
    the last ``per_end`` of its last such step (by step, then answer time where known, then
    record order). Each: ``{"segment", "where": "start" | "end", "step", "target_style",
    "detected_style", "reward", "request", "answer"}`` (answer cut to EXAMPLE_CHARS characters).
    """
    out: list[dict[str, Any]] = []
    ordered = sorted(enumerate(records), key=lambda p: (p[1]["step"], p[1].get("t_answer") or 0.0, p[0]))
    for k, seg in enumerate(schedule.as_dicts()):
        inside = [r for _, r in ordered if seg["start"] <= r["step"] < seg["end"]]
        if not inside:
            continue
        first_step, last_step = inside[0]["step"], inside[-1]["step"]
        start = [r for r in inside if r["step"] == first_step][:per_end]
        end = [r for r in inside if r["step"] == last_step][-per_end:] if last_step != first_step else []
        for where, rows in (("start", start), ("end", end)):
            for r in rows:
                answer = str(r.get("answer", ""))
                out.append(
                    {
                        "segment": k,
                        "where": where,
                        "step": r["step"],
                        "target_style": r["target_style"],
                        "detected_style": r["detected_style"],
                        "reward": r["reward"],
                        "request": str(r.get("request", "")),
                        "answer": answer if len(answer) <= EXAMPLE_CHARS else answer[:EXAMPLE_CHARS] + "…",
                    }
                )
    return out


def seed_summary(per_seed: Sequence[Mapping[str, Any]], n_switches: int) -> dict[str, Any]:
    """Mean and spread over seeds of AUC, last-5 mean and adaptation lag.

    ``per_seed``: ``[{"seed", "auc", "last5_mean", "adaptation_lag": [per switch]}]``.
    AUC and last-5: ``{"mean", "std" (sample, n−1; 0 for one seed), "min", "max"}``. Lag, per
    switch: ``{"crossed": seeds that crossed the threshold, "of": seeds, "mean": mean lag of
    those that crossed (None if none), "min", "max"}``.
    """

    def spread(xs: list[float]) -> dict[str, float]:
        m = sum(xs) / len(xs)
        var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
        return {"mean": m, "std": math.sqrt(var), "min": min(xs), "max": max(xs)}

    lags = []
    for i in range(n_switches):
        crossed = [s["adaptation_lag"][i] for s in per_seed if s["adaptation_lag"][i] is not None]
        lags.append(
            {
                "crossed": len(crossed),
                "of": len(per_seed),
                "mean": sum(crossed) / len(crossed) if crossed else None,
                "min": min(crossed, default=None),
                "max": max(crossed, default=None),
            }
        )
    return {
        "auc": spread([s["auc"] for s in per_seed]),
        "last5_mean": spread([s["last5_mean"] for s in per_seed]),
        "adaptation_lag": lags,
    }
