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
    styles_per_step: Sequence[Sequence[str]], window: int, styles: Sequence[str] | None = None
) -> dict[str, list[float]]:
    """Share of each style among the answers of the trailing ``window`` steps, per step.

    ``styles_per_step[t]`` lists the detected style of every answer at step ``t``. The value at
    step ``t`` pools the answers of steps ``max(0, t - window + 1) .. t`` (so ``window = 1`` is the
    per-step share); NaN where the pooled steps hold no answer. ``styles`` fixes the keys
    (default: every style seen, in catalogue order). Raises ``ValueError`` if ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if styles is None:
        seen = {s for step in styles_per_step for s in step}
        styles = [s for s in STYLE_NAMES if s in seen] + sorted(seen - set(STYLE_NAMES))
    counts = [Counter(step) for step in styles_per_step]
    out: dict[str, list[float]] = {s: [] for s in styles}
    for t in range(len(counts)):
        pooled: Counter[str] = Counter()
        for c in counts[max(0, t - window + 1) : t + 1]:
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


def per_step(records: Sequence[Mapping[str, Any]], schedule: Schedule) -> StepSeries:
    """Aggregate records (module docstring format) per step and check them.

    Raises ``ValueError`` for a record without a required key, a negative or non-integer step,
    a reward outside [0, 1], a target style that is not the schedule's target at its step,
    missing steps, or no records at all.
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
    if gaps:
        raise ValueError(f"steps without records: {gaps[:10]}{' ...' if len(gaps) > 10 else ''}")
    return StepSeries(
        reward=[sum(float(r["reward"]) for r in by_step[t]) / len(by_step[t]) for t in range(n)],
        styles=[[str(r["detected_style"]) for r in by_step[t]] for t in range(n)],
        target=[schedule.target_at(t) for t in range(n)],
        n_records=len(records),
    )


def method_metrics(
    records: Sequence[Mapping[str, Any]], schedule: Schedule, window: int = 1, threshold: float = 0.5
) -> dict[str, Any]:
    """The metrics of one method (the ``metrics.json`` entry; see ``write_report``)."""
    series = per_step(records, schedule)
    styles = list(dict.fromkeys(schedule.styles + [s for step in series.styles for s in step]))
    styles = [s for s in STYLE_NAMES if s in styles] + [s for s in styles if s not in STYLE_NAMES]
    share = rolling_share(series.styles, window, styles)
    target_share = [share[tgt][t] for t, tgt in enumerate(series.target)]
    n = len(series.reward)
    segment_mean = []
    for seg in schedule.as_dicts():
        chunk = series.reward[seg["start"] : min(seg["end"], n)]
        segment_mean.append(sum(chunk) / len(chunk) if chunk else None)
    return {
        "auc": normalized_auc(series.reward),
        "last5_mean": last_k_mean(series.reward, 5),
        "adaptation_lag": adaptation_lag(target_share, schedule.switch_steps, threshold),
        "segment_mean_reward": segment_mean,
        "steps": n,
        "records": series.n_records,
        "reward": series.reward,
        "target_share": target_share,
        "style_share": share,
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


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "method"


def _fmt(x: Any) -> str:
    if x is None:
        return "never"
    if isinstance(x, float):
        return f"{x:.3f}"
    return str(x)


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
<h2>Figures</h2>{figs}
</body></html>
"""


def write_report(
    out_dir: str | Path,
    schedule: Schedule | str,
    methods: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    window: int = 1,
    threshold: float = 0.5,
) -> dict[str, Any]:
    """Write ``metrics.json``, PNG figures and ``index.html`` into ``out_dir``; return the metrics.

    ``schedule``: a ``Schedule`` or a spec for ``schedule_from_spec``. ``methods``: method name
    -> its records (module docstring format). ``window``: trailing window in steps of the style
    shares (and so of the adaptation lag, which a window > 1 delays by up to ``window - 1``
    steps); ``threshold``: the share that ends the adaptation lag.

    ``metrics.json``::

        {"schedule": [{"style", "start", "end"}], "switch_steps": [...], "window", "threshold",
         "methods": {"<method>": {"auc", "last5_mean", "adaptation_lag": [one per switch,
             int or null], "segment_mean_reward": [one per segment], "steps", "records",
             "reward": [per step], "target_share": [per step],
             "style_share": {"<style>": [per step]}}}}

    Figures: ``comparison.png`` (methods side by side), ``reward.png`` (all methods' rewards
    on one axes), ``style_share_<method>.png`` per method. Raises ``ValueError`` for bad
    records (see ``per_step``) or no methods.
    """
    if not methods:
        raise ValueError("write_report needs at least one method")
    sched = schedule_from_spec(schedule) if isinstance(schedule, str) else schedule
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_method = {name: method_metrics(recs, sched, window, threshold) for name, recs in methods.items()}
    metrics = {
        "schedule": sched.as_dicts(),
        "switch_steps": sched.switch_steps,
        "window": window,
        "threshold": threshold,
        "methods": per_method,
    }
    # allow_nan=False: every step has records, so a NaN here would be a bug; fail loudly
    # instead of writing invalid JSON.
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, allow_nan=False), encoding="utf-8")
    images = {"methods side by side": plot_comparison(per_method, sched, out / "comparison.png").name}
    images["reward per step"] = plot_reward(
        {n: m["reward"] for n, m in per_method.items()}, sched, out / "reward.png"
    ).name
    for name, m in per_method.items():
        path = plot_style_share(m["style_share"], sched, out / f"style_share_{_slug(name)}.png", name)
        images[f"{name}: style share"] = path.name
    (out / "index.html").write_text(_index_html(sched, metrics, images), encoding="utf-8")
    return metrics


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records from a JSON list file or a JSON-lines file (one record per non-empty line)."""
    text = Path(path).read_text(encoding="utf-8").strip()
    if text.startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m judge.report --schedule SPEC --method NAME=RECORDS.jsonl ... --out DIR``."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--schedule", required=True, help="schedule spec or name, e.g. cute:40,formal:40")
    ap.add_argument("--method", action="append", required=True, help="NAME=path to records (JSON/JSONL)")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--threshold", type=float, default=0.5)
    args = ap.parse_args(argv)
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
