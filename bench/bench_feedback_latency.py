"""Feedback→served latency of the asynchronous main job (issue 10; target: p50 ≤ step time + 2 s).

From the feedback that completes a learner batch to the first answer returned whose first token
came from the version trained on that batch (``judge.runstats.feedback_to_served``), and to
the earliest first token of such an answer (n/a for runs from before the simulation streamed).
Either reads finished runs (a ``demo``/``compare`` folder: ``records-<run>.jsonl`` and
``details-<run>.json``) or runs a short async job itself (``saoserve serve`` + ``saoserve
learn`` as processes, the offline judge; the engine machine-wide lock is taken by the caller):

    .venv/bin/python bench/bench_feedback_latency.py --from report
    flock /tmp/saoserve-engine.lock .venv/bin/python bench/bench_feedback_latency.py \\
        [--schedule cute:6] [--batch-size 8] [--concurrency 8] [--feedback-delay-s 0] [--pace] [--rate R] [--seed S] [--out DIR]

Prints one row per run: versions measured, p50 and p95 latency (s), the p50 to the first token
and of feedback→swap (the server first seen serving the version, before the new answer
begins), the learner's median step time (s), the target (step time + 2 s), p50 / target and
the learner's busy fraction; then the median of each part of the way (``PHASES``: the join,
the wait for the learner, the step, writing and committing the version, announcing and
swapping it in, the first token, the rest of the answer), for runs that recorded their times.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from datetime import datetime
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from judge.report import load_records  # noqa: E402
from judge.runstats import (  # noqa: E402
    feedback_to_served,
    feedback_to_swap,
    latency_summary,
    learner_utilisation,
    unix_s,
)

TARGET_MARGIN_S = 2.0
# The server's line for each version it started serving (server.engine), and its time stamp.
LOADED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*policy version (\d+) loaded from ")
PHASES = (
    ("join", "feedback → its join"),
    ("queue", "join → step start"),
    ("step", "the step"),
    ("commit", "step end → commit"),
    ("serve", "commit → serving"),
    ("token", "serving → first token"),
    ("answer", "first token → answer"),
)


def served_at(server_log: Path) -> dict[int, float]:
    """Unix s at which the server's log says each version started serving (the end of its swap;
    the log's local-time stamps, as Python's logging writes them)."""
    out: dict[int, float] = {}
    if not server_log.exists():
        return out
    for line in server_log.read_text(encoding="utf-8", errors="replace").splitlines():
        m = LOADED.match(line)
        if m:
            when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.setdefault(int(m.group(2)), when)
    return out


def phases(records: list[dict], details: dict, server_log: Path) -> dict[str, float | None]:
    """Median seconds of each of ``PHASES`` over the run's versions, from the feedback that
    completed a version's batch to the first whole answer of that version (or a later one): the
    simulation's clock (``t0_wall`` + record times, as ``judge.runstats.feedback_to_served``
    picks them), the learner's step (``step_started_at``, ``step_time_s``,
    ``batch_completed_at``, ``created_at`` = its commit) and the server's log. Also
    ``serving_p50``: the median from the feedback to the server serving the version (the
    learner's and server's part, before any answer). A figure is None where a run lacks its
    times (runs from before they were recorded)."""
    t0 = details.get("t0_wall")
    steps = details.get("learner_steps") or []
    swaps = served_at(server_log)
    answers = {x["version"]: x for x in feedback_to_served(steps, records)}
    tokens = {x["version"]: x["served"] for x in feedback_to_served(steps, records, at="t_first_token")}
    parts: dict[str, list[float]] = {k: [] for k, _ in PHASES}
    serving: list[float] = []  # feedback → the server serving the version, per version
    for s in steps:
        v = int(s["version"])
        if t0 is None or "step_started_at" not in s or v not in swaps or v not in answers or v not in tokens:
            continue
        start = float(s["step_started_at"])
        times = [
            t0 + answers[v]["completed"],
            float(s["batch_completed_at"]),
            start,
            start + float(s["step_time_s"]),
            unix_s(s["created_at"]),
            swaps[v],
            t0 + tokens[v],
            t0 + answers[v]["served"],
        ]
        for (key, _), (a, b) in zip(PHASES, pairwise(times), strict=True):
            parts[key].append(b - a)
        serving.append(swaps[v] - times[0])
    medians = {k: statistics.median(x) if x else None for k, x in parts.items()}
    return medians | {"serving_p50": statistics.median(serving) if serving else None}


def row(name: str, records: list[dict], details: dict) -> dict:
    steps = details.get("learner_steps") or []
    lat = latency_summary([x["latency_s"] for x in feedback_to_served(steps, records)])
    first = latency_summary([x["latency_s"] for x in feedback_to_served(steps, records, at="t_first_token")])
    swap = latency_summary(
        [x["latency_s"] for x in feedback_to_swap(steps, records, details.get("timeline") or [])]
    )
    times = [float(s["step_time_s"]) for s in steps if isinstance(s.get("step_time_s"), int | float)]
    step_s = statistics.median(times) if times else None
    target = step_s + TARGET_MARGIN_S if step_s is not None else None
    ratio = lat["p50"] / target if lat["p50"] is not None and target else None
    return {
        "run": name,
        **lat,
        "first_token_p50": first["p50"],
        "swap_p50": swap["p50"],
        "step_s": step_s,
        "target_s": target,
        "ratio": ratio,
        "busy": learner_utilisation(steps)["busy_fraction"],
    }


def from_folder(folder: Path) -> list[dict]:
    rows = []
    for details_path in sorted(folder.glob("details-*.json")):
        name = details_path.stem.removeprefix("details-")
        records = load_records(folder / f"records-{name}.jsonl")
        details = json.loads(details_path.read_text())
        rows.append(
            row(name, records, details) | phases(records, details, folder / "logs" / name / "server.log")
        )
    return rows


def run_once(args: argparse.Namespace) -> list[dict]:
    from core.settings import get_settings
    from judge.offline import OfflineJudge
    from judge.styles import schedule_from_spec
    from saoserve.demo import run_method
    from saoserve.model import prepare_model

    out = Path(args.out or tempfile.mkdtemp(prefix="bench-latency-"))
    model = prepare_model(get_settings().resolved_model_dir)
    home = out / "run-sao"
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "model").exists():
        (home / "model").symlink_to(Path(model).resolve(), target_is_directory=True)
    traffic = {
        "mode": "async",
        "concurrency": args.concurrency,
        "feedback_delay_s": args.feedback_delay_s,
        "max_backlog": 2 * args.batch_size,
        "pace": args.pace,
        "rate": args.rate,
    }
    run_method(
        "sao",
        schedule_from_spec(args.schedule),
        OfflineJudge(),
        out,
        batch_size=args.batch_size,
        max_tokens=48,
        seed=args.seed,
        traffic=traffic,
    )
    return from_folder(out)


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="folder", type=Path, help="read finished runs from this folder")
    ap.add_argument("--schedule", default="cute:6")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--feedback-delay-s", type=float, default=0.0)
    ap.add_argument(
        "--rate", type=float, help="requests/s (Poisson arrivals) instead of --concurrency in flight"
    )
    ap.add_argument("--seed", type=int, default=0, help="the simulation's seed (prompts, arrivals)")
    ap.add_argument("--pace", action="store_true", help="pace the traffic to the learner (judge.pacing)")
    ap.add_argument("--out", type=Path, help="folder of the run (default: a temporary one)")
    args = ap.parse_args()
    rows = from_folder(args.folder) if args.folder else run_once(args)
    if not rows:
        sys.exit("no runs found (details-<run>.json)")
    print(
        f"{'run':<20}{'n':>4}{'p50 s':>9}{'p95 s':>9}{'1st token p50':>14}{'swap p50':>10}{'step s':>9}"
        f"{'target s':>10}{'p50/target':>12}{'busy':>7}"
    )
    for r in rows:
        print(
            f"{r['run']:<20}{r['n']:>4}{fmt(r['p50']):>9}{fmt(r['p95']):>9}{fmt(r['first_token_p50']):>14}"
            f"{fmt(r['swap_p50']):>10}"
            f"{fmt(r['step_s']):>9}"
            f"{fmt(r['target_s']):>10}{fmt(r['ratio']):>12}{fmt(r['busy']):>7}"
        )
    print("\nmedian seconds of each part, per version:")
    print(f"{'run':<20}" + "".join(f"{label:>24}" for _, label in PHASES) + f"{'feedback → serving p50':>24}")
    for r in rows:
        cells = "".join(f"{fmt(r[key]):>24}" for key, _ in PHASES)
        print(f"{r['run']:<20}{cells}{fmt(r['serving_p50']):>24}")


if __name__ == "__main__":
    main()
