"""The report's figures (SAO §3.4 Figure 5 and the issue-10 panels), drawn from
``judge.metrics`` output on matplotlib Agg canvases (no display) and written as PNG files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from judge.metrics import (
    LEARNER_SERIES,
    RATE_BIN_S,
)
from judge.styles import STYLE_NAMES, Schedule

_PALETTE = colormaps["tab10"]
_METHOD_PALETTE = colormaps["Dark2"]


def style_color(style: str) -> Any:
    """A fixed colour per catalogue style (other names share the last colour)."""
    idx = STYLE_NAMES.index(style) if style in STYLE_NAMES else len(STYLE_NAMES)
    return _PALETTE(idx % 10)


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


def _mean_label(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


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
            label=f"{name} (mean {_mean_label(m['staleness']['mean'])})",
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
