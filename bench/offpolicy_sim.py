"""The off-policy corrections compared on the asynchronous simulation (papers/004 §6, issue 11).

Usage: ``python bench/offpolicy_sim.py --out DIR [--corrections dis mis_snapshot mis_ewma
mis_ewma_noreset] [--schedule pirate:3,poetic:9] [--batch-size 8] [--minibatches 2]
[--epochs 1] [--seeds 1] [--seed 0]``. The engine's precision is the server's setting: run it
once as is (float32, as the learner) and once with ``SAOSERVE_DTYPE=bfloat16`` for the
train–inference discrepancy the paper studies.

Each correction runs the real job of ``saoserve demo`` (server and learner processes, the async
traffic of the demo: 8 requests in flight, new requests held while 3 batches of samples wait, so
tokens reach the learner up to 2–3 versions stale) with the ``demo`` preset's learner and only
the correction changed: ``dis`` (SAO's, one update per batch), ``mis_snapshot`` (exact π_old
from the last W = 3 versions' snapshots), ``mis_ewma`` (the revised proxy with the reset rule)
and ``mis_ewma_noreset`` (the same proxy without it). The MIS corrections do ``--minibatches``
policy updates per batch (and ``--epochs`` passes), so the drift ratio r_s departs from 1; DIS
makes one update by construction. The report (``index.html``, ``metrics.json``) has every run;
the script prints one table: reward AUC, last-5 mean, adaptation lag, staleness, the active-token
fraction ρ_t (mean, minimum, mean of the last 3 steps), the fractions masked by r_d and r_s,
resets, the KL to the base (k3, as trained), the step and correction times.

The driver is this script rather than a CLI command: it is a measurement, and its runs differ
only in ``LearnerConfig.correction``, which ``saoserve learn --config`` already takes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
from pathlib import Path

from judge.report import write_report
from learner.config import build_config
from saoserve.demo import run_method
from saoserve.model import prepare_model
from saoserve.run_commands import REPORT_THRESHOLD, REPORT_WINDOW
from saoserve.run_options import demo_traffic, make_judge, make_schedule

CORRECTIONS = {
    "dis": ("dis", {}),
    "mis_snapshot": ("mis_snapshot", {}),
    "mis_ewma": ("mis_ewma", {"reset": True}),
    "mis_ewma_noreset": ("mis_ewma", {"reset": False}),
}


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarise(label: str, metrics: dict, steps: list[dict]) -> dict:
    """One row of the table from the report's method metrics and the learner's step metrics
    (``/admin/learner``: one dict per version, its ``metrics``)."""
    m = [s.get("metrics", s) for s in steps]
    rho = [x["kept_fraction"] for x in m if "kept_fraction" in x]
    kl = [x["kl_ref"] for x in m if "kl_ref" in x]
    return {
        "run": label,
        "auc": metrics["auc"],
        "last5_mean": metrics["last5_mean"],
        "adaptation_lag": metrics["adaptation_lag"],
        "staleness_mean": metrics["staleness"]["mean"],
        "staleness_p95": metrics["staleness"]["p95"],
        "rho_mean": _mean(rho),
        "rho_min": min(rho) if rho else None,
        "rho_last3": _mean(rho[-3:]),
        "masked_by_rd": _mean([x["masked_by_rd_fraction"] for x in m if "masked_by_rd_fraction" in x]),
        "masked_by_rs": _mean([x["masked_by_rs_fraction"] for x in m if "masked_by_rs_fraction" in x]),
        "mean_abs_log_rd": _mean([x["mean_abs_log_rd"] for x in m if "mean_abs_log_rd" in x]),
        "resets": max([x.get("ewma_resets", 0) for x in m], default=0),
        "dropped_stale_samples": sum(x.get("dropped_stale_samples", 0) for x in m),
        "kl_ref_mean": _mean(kl),
        "kl_ref_last": kl[-1] if kl else None,
        "step_time_s": statistics.median([x["step_time_s"] for x in m if "step_time_s" in x] or [0.0]),
        "correction_time_s": _mean([x["correction_time_s"] for x in m if "correction_time_s" in x]),
        "rho_per_step": rho,
        "wall_s": metrics.get("wall_s"),
    }


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("report-offpolicy"))
    ap.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=list(CORRECTIONS))
    ap.add_argument("--schedule", default="pirate:3,poetic:9")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--minibatches", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1)
    args = ap.parse_args()
    # Started in the background by a shell, SIGINT arrives ignored; Ctrl-C (kill -INT) must stop
    # the current run and still write the report.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    from core.settings import get_settings

    settings = get_settings()
    prepare_model(settings.resolved_model_dir)
    sched = make_schedule(args.schedule, 1)
    judge = make_judge("offline")
    traffic = demo_traffic("async", args.batch_size, None, None, 0.0, None, None, None, pace=False)
    args.out.mkdir(parents=True, exist_ok=True)
    records: dict[str, list] = {}
    details: dict[str, dict] = {}
    seeds: dict[str, list] = {}
    for s in range(args.seed, args.seed + args.seeds):
        for label in args.corrections:
            kind, extra = CORRECTIONS[label]
            if kind != "dis":
                extra = extra | {"minibatches": args.minibatches, "epochs": args.epochs}
            config = build_config(
                "demo", algorithm="sao", correction=kind, overrides={"correction": extra} if extra else None
            )
            name = label if args.seeds == 1 else f"{label}-s{s}"
            home = args.out / f"run-{name}"
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir(parents=True)
            (home / "model").symlink_to(settings.resolved_model_dir.resolve(), target_is_directory=True)
            result = run_method(
                "sao",
                sched,
                judge,
                args.out,
                batch_size=args.batch_size,
                max_tokens=args.max_tokens,
                seed=s,
                learner_config=config,
                traffic=traffic,
                name=name,
            )
            if not result.records:
                continue
            seeds.setdefault(label, []).append(
                {"seed": s, "records": result.records, "details": result.details()}
            )
            records.setdefault(label, result.records)
            details.setdefault(label, result.details())
    metrics = write_report(
        args.out,
        sched,
        records,
        window=REPORT_WINDOW,
        threshold=REPORT_THRESHOLD,
        details=details,
        seeds=seeds if args.seeds > 1 else None,
    )
    rows = []
    for label, runs in seeds.items():
        for run in runs:
            single = write_report(
                args.out / "per-run" / f"{label}-s{run['seed']}",
                sched,
                {label: run["records"]},
                window=REPORT_WINDOW,
                threshold=REPORT_THRESHOLD,
                details={label: run["details"]},
            )["methods"][label]
            row = summarise(label, single, run["details"].get("learner_steps", []))
            rows.append(row | {"seed": run["seed"]})
    meta = {
        "engine_dtype": os.environ.get("SAOSERVE_DTYPE", settings.dtype),
        "schedule": args.schedule,
        "batch_size": args.batch_size,
        "minibatches": args.minibatches,
        "epochs": args.epochs,
        "traffic": traffic,
    }
    (args.out / "offpolicy.json").write_text(json.dumps({"settings": meta, "runs": rows}, indent=1))
    cols = [
        "run", "seed", "auc", "last5_mean", "adaptation_lag", "staleness_mean", "rho_mean", "rho_min",
        "rho_last3", "masked_by_rd", "masked_by_rs", "mean_abs_log_rd", "resets",
        "dropped_stale_samples", "kl_ref_mean", "kl_ref_last", "step_time_s", "correction_time_s",
    ]  # fmt: skip
    print(f"settings: {json.dumps(meta)}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    print(f"report: {(args.out / 'index.html').resolve()}  (all runs: {len(metrics['methods'])})")


if __name__ == "__main__":
    main()
