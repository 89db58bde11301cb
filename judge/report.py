"""Metrics and the report of the online preference-shift simulation.

Source: SAO paper §3.4 (Figure 5: per-style share over steps with the preference switches
shaded; SAO vs the running-mean baseline's reward) and DESIGN §6 (adaptation lag, normalised
area under the reward curve, last-5 mean, methods side by side from the same schedule).

Input format (one list per method). A record is a mapping with at least::

    {"step": int >= 0, "target_style": str, "detected_style": str, "reward": float in [0, 1]}

A step is one learner step (one batch); one record per judged request, several records may
share a step. ``write_report`` aggregates per step: the step's reward is the mean reward of its
records, the step's style share counts its records' detected styles. Steps must cover
0..max(step) without gaps, and every record's ``target_style`` must be the schedule's target at
its step (a mismatch means the data and the schedule disagree, and the report would be wrong).
Extra keys (``quality``, ``method``, ``prompt_id``, ...) are ignored.

The pure functions take plain lists; the plotting functions draw on matplotlib Agg canvases
(no display) and write PNG files.
"""

from __future__ import annotations

import argparse
import html
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from judge.runstats import (
    feedback_to_served,
    feedback_to_swap,
    latency_summary,
    quantile,
    requests_per_second,
    staleness_distribution,
    step_series,
)
from judge.styles import STYLE_NAMES, Schedule, schedule_from_spec

REQUIRED_KEYS = ("step", "target_style", "detected_style", "reward")
_PALETTE = colormaps["tab10"]
_METHOD_PALETTE = colormaps["Dark2"]


def style_color(style: str) -> Any:
    """A fixed colour per catalogue style (other names share the last colour)."""
    idx = STYLE_NAMES.index(style) if style in STYLE_NAMES else len(STYLE_NAMES)
    return _PALETTE(idx % 10)


def normalized_auc(rewards: Sequence[float]) -> float:
    """Area under the per-step reward curve by the trapezoid rule, divided by the step span.

    ``sum((r[i] + r[i+1]) / 2) / (len - 1)``; a single point gives that point. Same unit as the
    rewards (in [0, 1] for the simulation's binary rewards averaged per step). DESIGN §6.
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
    """Mean of the last ``k`` per-step rewards (all of them if fewer). DESIGN §6 (last-5 mean).

    Raises ``ValueError`` for an empty list or ``k < 1``.
    """
    if not rewards:
        raise ValueError("last_k_mean of an empty reward list")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    tail = rewards[-k:]
    return float(sum(tail) / len(tail))


def adaptation_lag(
    style_share_target_series: Sequence[float], switch_steps: Sequence[int], threshold: float = 0.5
) -> list[int | None]:
    """Steps after each switch until the new target style's share reaches ``threshold``.

    ``style_share_target_series[t]`` is the share (in [0, 1]) of answers at step ``t`` written in
    the style that is the target at step ``t``. For a switch at step ``s`` (the first step of
    the new target) the lag is the smallest ``d >= 0`` with ``series[s + d] >= threshold`` and
    ``s + d`` before the next switch (or the end of the series); ``None`` if that never happens.
    One entry per switch, in order. DESIGN §6; SAO §3.4 (adaptation lag of the running mean).
    Raises ``ValueError`` for switch steps that are not increasing.
    """
    switches = list(switch_steps)
    if any(b <= a for a, b in zip(switches[:-1], switches[1:], strict=True)):
        raise ValueError(f"switch steps must be strictly increasing, got {switches}")
    lags: list[int | None] = []
    for i, start in enumerate(switches):
        end = switches[i + 1] if i + 1 < len(switches) else len(style_share_target_series)
        end = min(end, len(style_share_target_series))
        lag = next((t - start for t in range(start, end) if style_share_target_series[t] >= threshold), None)
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
        "adaptation_lag": adaptation_lag(target_share, schedule.switch_steps, threshold),
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


# metrics.json key -> the learner step metric it lists per step (learner.sao / learner.dis).
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


def _median(xs: Sequence[float | None]) -> float | None:
    """Median of the finite values (None without any)."""
    finite = [float(x) for x in xs if x is not None and math.isfinite(x)]
    return quantile(finite, 0.5) if finite else None


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


def _figure(size: tuple[float, float]) -> Figure:
    # An Agg canvas per figure instead of pyplot: no global figure registry to leak or to
    # share between threads, and no display needed (the simulation runs headless).
    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig


def _shade(ax: Axes, schedule: Schedule, n_steps: int) -> None:
    for seg in schedule.as_dicts():
        if seg["start"] >= n_steps:
            break
        end = min(seg["end"], n_steps) - 0.5
        ax.axvspan(seg["start"] - 0.5, end, color=style_color(seg["style"]), alpha=0.12, lw=0)
        ax.text(
            (seg["start"] - 0.5 + end) / 2,
            1.0,
            f"target: {seg['style']}",
            ha="center",
            va="bottom",
            fontsize=7,
            color=style_color(seg["style"]),
            transform=ax.get_xaxis_transform(),
        )
    for s in schedule.switch_steps:
        if s < n_steps:
            ax.axvline(s - 0.5, color="grey", ls="--", lw=0.8)


def _draw_share(ax: Axes, share: Mapping[str, Sequence[float]], schedule: Schedule, title: str) -> None:
    n = max((len(v) for v in share.values()), default=0)
    _shade(ax, schedule, n)
    for style, values in share.items():
        ax.plot(range(len(values)), values, color=style_color(style), lw=1.5, label=style)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("share of answers")
    ax.set_title(title, pad=14)
    # Outside the axes: shares span the whole [0, 1] range, any inside spot hides a line.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _draw_reward(ax: Axes, rewards: Mapping[str, Sequence[float]], schedule: Schedule, title: str) -> None:
    n = max((len(v) for v in rewards.values()), default=0)
    _shade(ax, schedule, n)
    for i, (method, values) in enumerate(rewards.items()):
        ax.plot(range(len(values)), values, lw=1.5, label=method, color=_METHOD_PALETTE(i % 8))
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title, pad=14)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_style_share(
    share: Mapping[str, Sequence[float]], schedule: Schedule, path: str | Path, title: str = "style share"
) -> Path:
    """Plot each style's share per step; each segment shaded in its target style's colour,
    switch points dashed (SAO Figure 5, left). Writes a PNG to ``path`` and returns it."""
    fig = _figure((8, 4))
    _draw_share(fig.subplots(), share, schedule, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_reward(
    rewards: Mapping[str, Sequence[float]], schedule: Schedule, path: str | Path, title: str = "reward"
) -> Path:
    """Plot the per-step mean reward of each method (``{method: [reward per step]}``) on one
    axes with the schedule shaded (SAO Figure 5, right). Writes a PNG and returns its path."""
    fig = _figure((8, 4))
    _draw_reward(fig.subplots(), rewards, schedule, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_comparison(methods: Mapping[str, Mapping[str, Any]], schedule: Schedule, path: str | Path) -> Path:
    """Methods side by side: one column per method, style share on top, reward below.

    ``methods`` maps a method name to its ``method_metrics`` dict (``style_share``,
    ``reward``). Writes a PNG and returns its path. Raises ``ValueError`` if empty.
    """
    if not methods:
        raise ValueError("plot_comparison needs at least one method")
    cols = len(methods)
    fig = _figure((5.5 * cols, 7))
    axes = fig.subplots(2, cols, squeeze=False, sharey="row")
    for col, (name, m) in enumerate(methods.items()):
        _draw_share(axes[0][col], m["style_share"], schedule, f"{name}: style share")
        _draw_reward(axes[1][col], {name: m["reward"]}, schedule, f"{name}: reward")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def _nan(xs: Sequence[float | None]) -> list[float]:
    return [math.nan if x is None else float(x) for x in xs]


def plot_learner(methods: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """The learner's per-step metrics over policy versions (one panel each, methods overlaid):
    DIS kept fraction, mean |log r|, explained variance, critic loss, KL to the base, mean
    staleness, step time. Writes a PNG and returns its path."""
    keys = list(LEARNER_SERIES)
    fig = _figure((13, 6))
    axes = fig.subplots(2, 4).ravel()
    for ax, key in zip(axes, keys, strict=False):
        for i, (name, m) in enumerate(methods.items()):
            xs = m["learner_versions"]
            if xs:
                ax.plot(xs, _nan(m[key]), lw=1.2, marker=".", label=name, color=_METHOD_PALETTE(i % 8))
        ax.set_title(key.replace("_", " "), fontsize=9)
        ax.set_xlabel("policy version", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    axes[-1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def plot_staleness(methods: Mapping[str, Mapping[str, Any]], path: str | Path) -> Path:
    """Histogram of trained tokens' staleness (versions) per method, as fractions of tokens."""
    fig = _figure((6, 3.5))
    ax = fig.subplots()
    width = 0.8 / max(len(methods), 1)
    for i, (name, m) in enumerate(methods.items()):
        hist = m["staleness"]["histogram"]
        total = sum(hist.values()) or 1
        ks = [int(k) for k in hist]
        ax.bar(
            [k + i * width for k in ks],
            [hist[str(k)] / total for k in ks],
            width=width,
            label=f"{name} (mean {_fmt(m['staleness']['mean'])})",
            color=_METHOD_PALETTE(i % 8),
        )
    ax.set_xlabel("staleness (versions between generating and training a token)")
    ax.set_ylabel("share of trained tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def plot_wallclock(
    methods: Mapping[str, Mapping[str, Any]], details: Mapping[str, Mapping[str, Any]], path: str | Path
) -> Path:
    """Over wall-clock seconds: mean reward and target share per bin, answers/s, and the served
    version with the backlog (samples waiting for the learner). Writes a PNG, returns its path."""
    fig = _figure((12, 3.5 * len(methods)))
    axes = fig.subplots(len(methods), 3, squeeze=False)
    for row, (name, m) in enumerate(methods.items()):
        wc = m["wallclock"]
        t = [(b + 0.5) * wc["bin_s"] for b in range(len(wc["reward"]))]
        ax = axes[row][0]
        ax.plot(t, _nan(wc["reward"]), marker=".", label="reward")
        ax.plot(t, _nan(wc["target_share"]), marker=".", label="target share")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{name}: reward per {wc['bin_s']:.0f} s", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[row][1]
        rate = m["requests_per_s_series"]
        ax.step([b * RATE_BIN_S for b in range(len(rate))], rate, where="post")
        ax.set_title(f"{name}: answers/s", fontsize=9)
        ax = axes[row][2]
        tl = (details.get(name) or {}).get("timeline") or []
        ax.plot([x["t"] for x in tl], [x["backlog"] for x in tl], color="tab:red", label="backlog")
        ax.set_ylabel("samples waiting", fontsize=8)
        twin = ax.twinx()
        twin.plot([x["t"] for x in tl], [x["version"] for x in tl], color="tab:blue", label="served version")
        twin.set_ylabel("served version", fontsize=8)
        ax.set_title(f"{name}: backlog (red), served version (blue)", fontsize=9)
        for a in axes[row]:
            a.set_xlabel("seconds", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def plot_seed_bands(
    seeds: Mapping[str, Sequence[Sequence[float]]], schedule: Schedule, path: str | Path
) -> Path:
    """Per method, the mean per-step reward over seeds with a band from the lowest to the
    highest seed (``seeds``: method -> one reward list per seed). Writes a PNG."""
    fig = _figure((8, 4))
    ax = fig.subplots()
    n = max((len(r) for runs in seeds.values() for r in runs), default=0)
    _shade(ax, schedule, n)
    for i, (name, runs) in enumerate(seeds.items()):
        cols = [[r[t] for r in runs if t < len(r) and not math.isnan(r[t])] for t in range(n)]
        mean = [sum(c) / len(c) if c else math.nan for c in cols]
        color = _METHOD_PALETTE(i % 8)
        ax.plot(range(n), mean, color=color, lw=1.5, label=f"{name} (mean of {len(runs)})")
        lo = [min(c) if c else math.nan for c in cols]
        hi = [max(c) if c else math.nan for c in cols]
        ax.fill_between(range(n), lo, hi, color=color, alpha=0.2, lw=0)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step (policy version)")
    ax.set_ylabel("mean reward")
    ax.set_title("reward over seeds (line: mean, band: min to max)", pad=14)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "method"


def _fmt(x: Any) -> str:
    if x is None:
        return "never"
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _index_html(schedule: Schedule, metrics: dict[str, Any], images: dict[str, str]) -> str:
    e = html.escape
    seg_rows = "".join(
        f"<tr><td>{e(s['style'])}</td><td>{s['start']}</td><td>{s['end']}</td></tr>"
        for s in metrics["schedule"]
    )
    switch_heads = "".join(f"<th>lag @ {s}</th>" for s in schedule.switch_steps)
    seg_heads = "".join(f"<th>reward: {e(s['style'])}</th>" for s in metrics["schedule"])
    rows = ""
    for name, m in metrics["methods"].items():
        lags = "".join(f"<td>{_fmt(x)}</td>" for x in m["adaptation_lag"])
        segs = "".join(f"<td>{_fmt(x)}</td>" for x in m["segment_mean_reward"])
        rows += (
            f"<tr><td>{e(name)}</td><td>{_fmt(m['auc'])}</td><td>{_fmt(m['last5_mean'])}</td>"
            f"{lags}{segs}<td>{m['steps']}</td><td>{m['records']}</td></tr>"
        )
    figs = "".join(
        f'<figure><img src="{e(src)}" alt="{e(cap)}"><figcaption>{e(cap)}</figcaption></figure>'
        for cap, src in images.items()
    )
    online = _online_html(metrics)
    seeds = _seeds_html(schedule, metrics)
    examples = _examples_html(metrics)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Preference-shift simulation report</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 8px}}
img{{max-width:100%}}figure{{margin:1em 0}}</style></head><body>
<h1>Online preference-shift simulation (SAO §3.4)</h1>
<p>Reward = quality × [detected style = target style]; per-step values are means over the
step's judged answers. Adaptation lag: steps after a switch until the target style's share
(window {metrics["window"]}) reaches {metrics["threshold"]}; "never" if not before the next
switch. AUC: trapezoid area under the per-step reward divided by the step span.</p>
<h2>Schedule</h2>
<table><tr><th>target style</th><th>first step</th><th>end step (exclusive)</th></tr>{seg_rows}</table>
<h2>Metrics</h2>
<table><tr><th>method</th><th>AUC</th><th>last-5 mean</th>{switch_heads}{seg_heads}
<th>steps</th><th>records</th></tr>{rows}</table>
<p>All numbers: <a href="metrics.json">metrics.json</a>.</p>
{seeds}{online}
<h2>Figures</h2>{figs}
{examples}
</body></html>
"""


def _online_html(metrics: dict[str, Any]) -> str:
    e = html.escape
    rows, steps, settings = "", "", ""
    for name, m in metrics["methods"].items():
        st, lat, bl = m["staleness"], m["feedback_to_served_s"], m["backlog"]
        if m.get("traffic"):
            given = ", ".join(f"{k} {v}" for k, v in m["traffic"].items() if v is not None)
            settings += f"<li>{e(name)}: {e(given)}</li>"
        kept = [x for x in m["dis_kept_fraction"] if x is not None]
        rows += (
            f"<tr><td>{e(name)}</td><td>{e(str(m['mode']))}</td><td>{_fmt(m['wall_s'])}</td>"
            f"<td>{_fmt(m['requests_per_s'])}</td><td>{_fmt(st['mean'])}</td><td>{_fmt(st['p95'])}</td>"
            f"<td>{_fmt(lat['p50'])}</td><td>{_fmt(lat['p95'])}</td>"
            f"<td>{_fmt(m['feedback_to_first_token_s']['p50'])}</td>"
            f"<td>{_fmt(m['feedback_to_swap_s']['p50'])}</td>"
            f"<td>{_fmt(bl['mean'])}</td><td>{_fmt(bl['max'])}</td><td>{_fmt(bl['held_s'])}</td>"
            f"<td>{len(m['learner_versions'])}</td>"
            f"<td>{_fmt(sum(kept) / len(kept)) if kept else 'n/a'}</td></tr>"
        )
        for i, v in enumerate(m["learner_versions"]):
            cells = "".join(f"<td>{_fmt(m[k][i])}</td>" for k in LEARNER_SERIES)
            steps += f"<tr><td>{e(name)}</td><td>{v}</td>{cells}</tr>"
    if not rows:
        return ""
    heads = "".join(f"<th>{e(k.replace('_', ' '))}</th>" for k in LEARNER_SERIES)
    return f"""<h2>Learning while serving</h2>
<p>Staleness: per trained token, the version the learner trained from minus the version that
generated the token (the trajectory's spans), over all the run's steps. Feedback→served: from
the feedback that completed a batch to the first answer returned whose first token came from the
version trained on it (or a later one); feedback→first token stops at the earliest first text
of such an answer (the version's first token to reach a user); feedback→swap when the server is first seen serving that version (sampled each
second), before the new answer begins. Backlog: samples waiting for the learner (feedback posted
minus a batch per new version), sampled each second; held: seconds new requests waited for it.</p>
<ul>{settings}</ul>
<table><tr><th>method</th><th>mode</th><th>wall s</th><th>answers/s</th><th>staleness mean</th>
<th>staleness p95</th><th>feedback→served p50 s</th><th>p95 s</th><th>feedback→first token p50 s</th>
<th>feedback→swap p50 s</th>
<th>backlog mean</th>
<th>backlog max</th><th>held s</th><th>learner steps</th><th>mean DIS kept</th></tr>{rows}</table>
<details><summary>Per learner step</summary>
<table><tr><th>method</th><th>version</th>{heads}</tr>{steps}</table></details>
"""


def _seeds_html(schedule: Schedule, metrics: dict[str, Any]) -> str:
    e = html.escape
    rows = ""
    for name, m in metrics["methods"].items():
        summ = m.get("seed_summary")
        if not summ:
            continue
        lags = "".join(
            f"<td>{x['crossed']}/{x['of']} crossed, mean {_fmt(x['mean'])}</td>"
            for x in summ["adaptation_lag"]
        )
        auc, last5 = summ["auc"], summ["last5_mean"]
        rows += (
            f"<tr><td>{e(name)}</td><td>{len(m['seeds'])}</td>"
            f"<td>{auc['mean']:.3f} ± {auc['std']:.3f} [{auc['min']:.3f}, {auc['max']:.3f}]</td>"
            f"<td>{last5['mean']:.3f} ± {last5['std']:.3f} [{last5['min']:.3f}, {last5['max']:.3f}]</td>"
            f"{lags}</tr>"
        )
    if not rows:
        return ""
    per_seed = "".join(
        f"<tr><td>{e(name)}</td><td>{r['seed']}</td><td>{_fmt(r['auc'])}</td><td>{_fmt(r['last5_mean'])}</td>"
        f"<td>{e(str(r['adaptation_lag']))}</td><td>{_num(r.get('staleness_mean'))}</td>"
        f"<td>{_num(r.get('feedback_to_served_p50'))}</td><td>{_num(r.get('step_time_median_s'))}</td>"
        f"<td>{_num(r.get('wall_s'))}</td></tr>"
        for name, m in metrics["methods"].items()
        for r in m.get("seeds", [])
    )
    switch_heads = "".join(f"<th>lag @ {s}</th>" for s in schedule.switch_steps)
    return f"""<h2>Over seeds</h2>
<p>Mean ± sample standard deviation [min, max] over seeds; the other tables and figures show the
first seed, except the reward bands.</p>
<table><tr><th>method</th><th>seeds</th><th>AUC</th><th>last-5 mean</th>{switch_heads}</tr>{rows}</table>
<table><tr><th>method</th><th>seed</th><th>AUC</th><th>last-5</th><th>lag</th><th>staleness mean</th>
<th>feedback→served p50 (s)</th><th>learner step median (s)</th><th>wall (s)</th></tr>{per_seed}</table>
"""


def _examples_html(metrics: dict[str, Any]) -> str:
    e = html.escape
    rows = ""
    for name, m in metrics["methods"].items():
        for x in m["examples"]:
            rows += (
                f"<tr><td>{e(name)}</td><td>{x['segment']} ({x['where']})</td><td>{x['step']}</td>"
                f"<td>{e(x['target_style'])}</td><td>{e(x['detected_style'])}</td><td>{_fmt(x['reward'])}</td>"
                f"<td>{e(x['request'])}</td><td>{e(x['answer'])}</td></tr>"
            )
    if not rows:
        return ""
    return f"""<h2>Example answers</h2>
<p>The first answers of each segment's first step and the last of its last step.</p>
<table><tr><th>method</th><th>segment</th><th>step</th><th>target</th><th>detected</th>
<th>reward</th><th>request</th><th>answer</th></tr>{rows}</table>
"""


def _finite(x: Any) -> Any:
    """NaN → None, recursively (a step or time bin without answers), so the JSON stays valid."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def write_report(
    out_dir: str | Path,
    schedule: Schedule | str,
    methods: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    window: int = 1,
    threshold: float = 0.5,
    details: Mapping[str, Mapping[str, Any]] | None = None,
    seeds: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Write ``metrics.json``, PNG figures and ``index.html`` into ``out_dir``; return the metrics.

    ``schedule``: a ``Schedule`` or a spec for ``schedule_from_spec``. ``methods``: method name
    -> its records (module docstring format). ``window``: trailing window in steps of the style
    shares (and so of the adaptation lag, which a window > 1 delays by up to ``window - 1``
    steps); ``threshold``: the share that ends the adaptation lag. ``details``: method -> the
    run's ``SimulationResult.details()`` (learner steps, async timeline); ``seeds``: method ->
    ``[{"seed", "records", "details"?}]``, one per seed (the first is the run ``methods`` holds).

    ``metrics.json``::

        {"schedule": [{"style", "start", "end"}], "switch_steps": [...], "window", "threshold",
         "methods": {"<method>": {"auc", "last5_mean", "adaptation_lag": [one per switch,
             int or null], "segment_mean_reward": [one per segment], "steps", "records",
             "reward": [per step], "target_share": [per step],
             "style_share": {"<style>": [per step]}, "mode", "traffic": {the simulation's
             settings, ``judge.simulate.TRAFFIC_FIELDS``} or null, "wall_s",
             "staleness": {"mean", "p95", "histogram": {"<versions>": tokens}, "tokens"},
             "feedback_to_served_s": {"p50", "p95", "n"} (to the first answer of the new version
             returned), "feedback_to_first_token_s" (to the earliest first token of an answer
             begun by that version or a later one),
             "feedback_to_swap_s" (to the server seen serving it): (same),
             "learner_versions": [per step],
             "dis_kept_fraction", "mean_abs_log_ratio", "explained_variance", "critic_loss",
             "kl_ref", "staleness_mean_per_step", "step_time_s": [per learner step],
             "requests_per_s", "requests_per_s_series": [per 30 s],
             "backlog": {"mean", "max", "final", "held_s"},
             "examples": [see example_answers], "wallclock": {"bin_s", "reward", "target_share"},
             with seeds: "seeds": [{"seed", "auc", "last5_mean", "adaptation_lag",
                 "staleness_mean", "feedback_to_served_p50", "step_time_median_s", "wall_s"}],
             "seed_summary": {see seed_summary}}}}

    A step without answers (async runs only) has reward null; AUC and last-5 use the steps
    that have answers (``present_auc``).

    Figures: ``comparison.png`` (methods side by side), ``reward.png`` (all methods' rewards
    on one axes), ``style_share_<method>.png`` per method; with learner steps ``learner.png``
    and ``staleness.png``; with answer times ``wallclock.png``; with seeds ``seeds.png``.
    Raises ``ValueError`` for bad records (see ``per_step``) or no methods.
    """
    if not methods:
        raise ValueError("write_report needs at least one method")
    sched = schedule_from_spec(schedule) if isinstance(schedule, str) else schedule
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    details = details or {}
    per_method = {
        name: method_metrics(recs, sched, window, threshold, details.get(name))
        for name, recs in methods.items()
    }
    seed_rewards: dict[str, list[list[float]]] = {}
    for name, runs in (seeds or {}).items():
        if name not in per_method:
            continue
        rows = []
        for run in runs:
            m = method_metrics(run["records"], sched, window, threshold, run.get("details"))
            rows.append(
                {
                    "seed": run["seed"],
                    "auc": m["auc"],
                    "last5_mean": m["last5_mean"],
                    "adaptation_lag": m["adaptation_lag"],
                    "staleness_mean": m["staleness"]["mean"],
                    "feedback_to_served_p50": m["feedback_to_served_s"]["p50"],
                    "step_time_median_s": _median(m["step_time_s"]),
                    "wall_s": m["wall_s"],
                }
            )
            seed_rewards.setdefault(name, []).append(m["reward"])
        per_method[name]["seeds"] = rows
        per_method[name]["seed_summary"] = seed_summary(rows, len(sched.switch_steps))
    metrics = {
        "schedule": sched.as_dicts(),
        "switch_steps": sched.switch_steps,
        "window": window,
        "threshold": threshold,
        "methods": per_method,
    }
    # NaN (a step or bin without answers) is written as null; allow_nan=False then catches any
    # other non-finite value instead of writing invalid JSON.
    (out / "metrics.json").write_text(
        json.dumps(_finite(metrics), indent=1, allow_nan=False), encoding="utf-8"
    )
    images = {"methods side by side": plot_comparison(per_method, sched, out / "comparison.png").name}
    images["reward per step"] = plot_reward(
        {n: m["reward"] for n, m in per_method.items()}, sched, out / "reward.png"
    ).name
    for name, m in per_method.items():
        path = plot_style_share(m["style_share"], sched, out / f"style_share_{_slug(name)}.png", name)
        images[f"{name}: style share"] = path.name
    if seed_rewards:
        images["reward over seeds"] = plot_seed_bands(seed_rewards, sched, out / "seeds.png").name
    if any(m["learner_versions"] for m in per_method.values()):
        images["learner metrics per policy version"] = plot_learner(per_method, out / "learner.png").name
        images["staleness of trained tokens"] = plot_staleness(per_method, out / "staleness.png").name
    timed = {n: m for n, m in per_method.items() if m["wallclock"]["reward"]}
    if timed:
        images["over wall-clock seconds"] = plot_wallclock(timed, details, out / "wallclock.png").name
    (out / "index.html").write_text(_index_html(sched, metrics, images), encoding="utf-8")
    return _finite(metrics)


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records from a JSON list file or a JSON-lines file (one record per non-empty line)."""
    text = Path(path).read_text(encoding="utf-8").strip()
    if text.startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_runs(folder: str | Path) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """The runs a ``saoserve demo``/``compare`` folder holds, for ``write_report``.

    Reads ``records-<name>.jsonl`` and, where present, ``details-<name>.json``; a name
    ``<method>-s<seed>`` is one seed of ``method``, any other name a single run with seed 0. A
    run without records (interrupted before its first answer) is left out, as ``compare``
    leaves it out. Returns ``(seeds, details)``: method -> ``[{"seed", "records", "details"}]``
    by seed, and method -> the first seed's details. Raises ``FileNotFoundError`` if the folder
    holds no records.
    """
    root = Path(folder)
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(root.glob("records-*.jsonl")):
        name = path.name[len("records-") : -len(".jsonl")]
        method, sep, seed = name.rpartition("-s")
        if not (sep and seed.isdigit()):
            method, seed = name, "0"
        records = load_records(path)
        if not records:
            continue
        info = root / f"details-{name}.json"
        details = json.loads(info.read_text(encoding="utf-8")) if info.exists() else {}
        runs.setdefault(method, []).append({"seed": int(seed), "records": records, "details": details})
    if not runs:
        raise FileNotFoundError(f"no records-*.jsonl in {root}")
    for rows in runs.values():
        rows.sort(key=lambda r: r["seed"])
    return runs, {m: rows[0]["details"] for m, rows in runs.items()}


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m judge.report --schedule SPEC (--method NAME=RECORDS.jsonl ... | --runs
    DIR) --out DIR``. ``--runs`` rebuilds the report of a demo/compare folder with its details
    and seeds (``load_runs``), and by default the window and threshold of the folder's
    ``metrics.json`` (otherwise 1 and 0.5)."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--schedule", required=True, help="schedule spec or name, e.g. cute:40,formal:40")
    ap.add_argument("--method", action="append", help="NAME=path to records (JSON/JSONL)")
    ap.add_argument("--runs", help="a saoserve demo/compare folder (records-*.jsonl, details-*.json)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--window", type=int, help="default: the --runs folder's, else 1")
    ap.add_argument("--threshold", type=float, help="default: the --runs folder's, else 0.5")
    args = ap.parse_args(argv)
    if bool(args.method) == bool(args.runs):
        ap.error("give either --method NAME=PATH (repeatable) or --runs DIR")
    before = Path(args.runs or ".") / "metrics.json"
    given = json.loads(before.read_text(encoding="utf-8")) if args.runs and before.exists() else {}
    if args.window is None:
        args.window = given.get("window", 1)
    if args.threshold is None:
        args.threshold = given.get("threshold", 0.5)
    if args.runs:
        try:
            seeds, details = load_runs(args.runs)
        except FileNotFoundError as exc:
            ap.error(str(exc))
        methods = {m: rows[0]["records"] for m, rows in seeds.items()}
        many = {m: rows for m, rows in seeds.items() if len(rows) > 1}
        write_report(
            args.out,
            args.schedule,
            methods,
            window=args.window,
            threshold=args.threshold,
            details=details,
            seeds=many or None,
        )
    else:
        methods = {}
        for item in args.method:
            name, sep, path = item.partition("=")
            if not sep:
                ap.error(f"--method {item!r} is not NAME=PATH")
            methods[name] = load_records(path)
        write_report(args.out, args.schedule, methods, window=args.window, threshold=args.threshold)
    print(f"report written to {Path(args.out) / 'index.html'}")


if __name__ == "__main__":
    main()
