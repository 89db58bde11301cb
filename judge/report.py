"""The report of the online preference-shift simulation: ``metrics.json``, the figures and
``index.html`` from one list of records per method (``write_report``), and the command that
rebuilds a report from saved records or a demo/compare folder (``python -m judge.report``).

The numbers are ``judge.metrics`` (record format there), the figures ``judge.plots``.
"""

from __future__ import annotations

import argparse
import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from judge.metrics import (
    LEARNER_SERIES,
    method_metrics,
    seed_summary,
)
from judge.plots import (
    plot_comparison,
    plot_learner,
    plot_reward,
    plot_seed_bands,
    plot_staleness,
    plot_style_share,
    plot_wallclock,
)
from judge.runstats import learner_utilisation, quantile
from judge.styles import Schedule, schedule_from_spec


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


def _median(xs: Sequence[float | None]) -> float | None:
    """Median of the finite values (None without any)."""
    finite = [float(x) for x in xs if x is not None and math.isfinite(x)]
    return quantile(finite, 0.5) if finite else None


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
    lifecycle = _lifecycle_html(metrics)
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
over a full window of {metrics["window"]} steps after the switch reaches {metrics["threshold"]}
(so at least {metrics["window"] - 1}); "never" if not before the next switch. AUC: trapezoid
area under the per-step reward divided by the step span.</p>
<h2>Schedule</h2>
<table><tr><th>target style</th><th>first step</th><th>end step (exclusive)</th></tr>{seg_rows}</table>
<h2>Metrics</h2>
<table><tr><th>method</th><th>AUC</th><th>last-5 mean</th>{switch_heads}{seg_heads}
<th>steps</th><th>records</th></tr>{rows}</table>
<p>All numbers: <a href="metrics.json">metrics.json</a>.</p>
{seeds}{online}{lifecycle}
<h2>Figures</h2>{figs}
{examples}
</body></html>
"""


def _online_html(metrics: dict[str, Any]) -> str:
    e = html.escape
    rows, steps, settings = "", "", ""
    for name, m in metrics["methods"].items():
        st, lat, bl = m["staleness"], m["feedback_to_served_s"], m["backlog"]
        util = m["learner_utilisation"]
        if m.get("traffic"):
            given = ", ".join(f"{k} {v}" for k, v in m["traffic"].items() if v is not None)
            settings += f"<li>{e(name)}: {e(given)}</li>"
        kept = [x for x in m["dis_kept_fraction"] if x is not None]
        rows += (
            f"<tr><td>{e(name)}</td><td>{e(str(m['mode']))}</td><td>{_fmt(m['wall_s'])}</td>"
            f"<td>{_fmt(m['requests_per_s'])}</td><td>{_fmt(st['mean'])}</td><td>{_fmt(st['p95'])}</td>"
            f"<td>{_fmt(lat['p50'])}</td><td>{_fmt(lat['p95'])}</td>"
            f"<td>{_fmt(util['busy_fraction'])}</td><td>{_fmt(util['full_wait_s']['p50'])}</td>"
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
second), before the new answer begins. Learner busy: the learner's step time over the span from
its first step's start to its last version's commit; full batch waited: per step, seconds from
the later of the previous commit and the batch's completion to the step's start. Backlog: samples waiting for the learner (feedback posted
minus a batch per new version), sampled each second; held: seconds new requests waited for it.</p>
<ul>{settings}</ul>
<table><tr><th>method</th><th>mode</th><th>wall s</th><th>answers/s</th><th>staleness mean</th>
<th>staleness p95</th><th>feedback→served p50 s</th><th>p95 s</th><th>learner busy</th>
<th>full batch waited p50 s</th><th>feedback→first token p50 s</th>
<th>feedback→swap p50 s</th>
<th>backlog mean</th>
<th>backlog max</th><th>held s</th><th>learner steps</th><th>mean DIS kept</th></tr>{rows}</table>
<details><summary>Per learner step</summary>
<table><tr><th>method</th><th>version</th>{heads}</tr>{steps}</table></details>
"""


def _lifecycle_html(metrics: dict[str, Any]) -> str:
    """The "Version lifecycle" section: per method, each trained version's moves (stage, when,
    by whom) and the answers it served; empty when no run has the lifecycle (no admin key)."""
    e = html.escape
    rows = ""
    for name, m in metrics["methods"].items():
        for v in (m.get("lifecycle") or {}).get("timeline", []):
            moves = " → ".join(
                f"{e(str(st['stage']))} {st['t_s']:.0f} s ({e(str(st['by']))})" for st in v["stages"]
            )
            why = "; ".join(e(str(st["reason"])) for st in v["stages"] if st["reason"])
            final = e(str(v["stages"][-1]["stage"])) if v["stages"] else ""
            rows += (
                f"<tr><td>{e(name)}</td><td>{v['version']}</td><td>{final}</td><td>{moves}</td>"
                f"<td>{v['served']}</td><td>{why}</td></tr>"
            )
    if not rows:
        return ""
    return f"""<h2>Version lifecycle</h2>
<p>Each version the run recorded, with its moves through the guard's lifecycle (candidate →
canary → promoted or rejected; docs/guard.md): the stage, the second of the run it was reached
and who moved it, the answers the version served, and the recorded reasons.</p>
<table><tr><th>method</th><th>version</th><th>final stage</th><th>moves</th><th>answers served</th>
<th>reasons</th></tr>{rows}</table>
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
        f"<td>{_num(r.get('feedback_to_served_p50'))}</td><td>{_num(r.get('learner_busy_fraction'))}</td>"
        f"<td>{_num(r.get('step_time_median_s'))}</td>"
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
<th>feedback→served p50 (s)</th><th>learner busy</th><th>learner step median (s)</th><th>wall (s)</th></tr>{per_seed}</table>
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


def _with_utilisation(m: dict[str, Any], details: Mapping[str, Any] | None) -> dict[str, Any]:
    """``m`` with ``learner_utilisation`` of the run's learner steps (``judge.runstats``) and the
    run's ``lifecycle`` (``judge.guardstats.lifecycle_summary``; None without one)."""
    details = details or {}
    return m | {
        "learner_utilisation": learner_utilisation(details.get("learner_steps") or []),
        "lifecycle": details.get("lifecycle"),
    }


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
             settings, ``judge.sim_config.TRAFFIC_FIELDS``} or null, "wall_s",
             "staleness": {"mean", "p95", "histogram": {"<versions>": tokens}, "tokens"},
             "feedback_to_served_s": {"p50", "p95", "n"} (to the first answer of the new version
             returned), "feedback_to_first_token_s" (to the earliest first token of an answer
             begun by that version or a later one),
             "feedback_to_swap_s" (to the server seen serving it): (same),
             "learner_utilisation": {"busy_fraction", "busy_s", "span_s", "steps",
                 "full_wait_s": {"p50", "max", "total", "n"}} (``judge.runstats``),
             "learner_versions": [per step],
             "lifecycle": the run's ``judge.guardstats.lifecycle_summary`` or null,
             "dis_kept_fraction", "mean_abs_log_ratio", "explained_variance", "critic_loss",
             "kl_ref", "staleness_mean_per_step", "step_time_s": [per learner step],
             "requests_per_s", "requests_per_s_series": [per 30 s],
             "backlog": {"mean", "max", "final", "held_s"},
             "examples": [see example_answers], "wallclock": {"bin_s", "reward", "target_share"},
             with seeds: "seeds": [{"seed", "auc", "last5_mean", "adaptation_lag",
                 "staleness_mean", "feedback_to_served_p50", "learner_busy_fraction",
                 "step_time_median_s", "wall_s"}],
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
        name: _with_utilisation(
            method_metrics(recs, sched, window, threshold, details.get(name)), details.get(name)
        )
        for name, recs in methods.items()
    }
    seed_rewards: dict[str, list[list[float]]] = {}
    for name, runs in (seeds or {}).items():
        if name not in per_method:
            continue
        rows = []
        for run in runs:
            m = _with_utilisation(
                method_metrics(run["records"], sched, window, threshold, run.get("details")),
                run.get("details"),
            )
            rows.append(
                {
                    "seed": run["seed"],
                    "auc": m["auc"],
                    "last5_mean": m["last5_mean"],
                    "adaptation_lag": m["adaptation_lag"],
                    "staleness_mean": m["staleness"]["mean"],
                    "feedback_to_served_p50": m["feedback_to_served_s"]["p50"],
                    "learner_busy_fraction": m["learner_utilisation"]["busy_fraction"],
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
    """Records from a JSON list file or a JSON-lines file (one record per non-empty line).

    Lines end at ``\n`` only: ``judge.sim_result.save_records`` writes ``ensure_ascii=False``,
    so an answer keeps U+2028, U+2029 or U+0085 raw inside its string, and ``str.splitlines``
    would cut the record there. Raises ``json.JSONDecodeError`` for a line that is not JSON."""
    text = Path(path).read_text(encoding="utf-8").strip()
    if text.startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.split("\n") if line.strip()]


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
