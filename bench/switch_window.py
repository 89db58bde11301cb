"""What each method's baseline held at the first switch of a demo/compare run (SAO Figure 5).

The paper's claim (SAO §3.4, Figure 5): after a preference switch the running-mean baseline
lags, because each prompt's window of its last 8 rewards still holds the old target's rewards.
That needs an old target that was learned (its share high before the switch) and prompts that
recur within the window. This script reads a ``saoserve demo``/``compare`` folder and replays,
for each run, the learner's batches in training order (``learner_steps[*].sample_ids`` →
records) up to the first batch that holds an answer judged under the new target:

- the old target's share over the report's trailing window (``metrics.json``'s, or ``--window``
  with ``--schedule`` for a folder whose run has not written one) at the step before the switch;
- the running mean's window at that batch: for each of the batch's prompts, the mean of its last
  ``--rm-window`` rewards trained before it (``learner.algo.baselines.RunningMeanBaseline``'s
  window), averaged over the batch, with the prompts whose window was full;
- SAO's critic at that batch: the step's ``value_mean`` (the clamped values GAE used);
- how long the old target had been learned at the switch: the steps since its share first
  reached the threshold (the precondition: a running mean's window of 8 rewards per prompt holds
  the learned rate only if that is at least 8 steps with every prompt in each batch);
- from the switch's batch on, the medians of the critic's explained variance before and after
  its K updates (``explained_variance``, ``explained_variance_after``) and of the policy's
  gradient norm: how much of the batch's return the critic had already fitted when it scored it;
- the lag, AUC and last-5 of the run (``judge.metrics.method_metrics``, the report's window and
  threshold).

Prints a Markdown table, one row per run.

    .venv/bin/python bench/switch_window.py /tmp/R/fig5

Pure reading of the folder's ``records-*.jsonl``, ``details-*.json`` and ``metrics.json``;
the running mean's window is replayed here, not read from the learner, which does not log it.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
from pathlib import Path


def sample_ids(step: dict) -> list[str]:
    """The learner step's sample ids (stored as the repr of a list in the step metrics)."""
    ids = step.get("sample_ids") or []
    return ast.literal_eval(ids) if isinstance(ids, str) else list(ids)


def replay(records: list[dict], details: dict, new_target: str, rm_window: int) -> dict:
    """The running mean's and the critic's baseline at the first batch with a ``new_target``
    answer: {"step", "rm_baseline", "rm_full_prompts", "batch_prompts", "value_mean"}. The
    running mean is the learner's own (``RunningMeanBaseline``), fed the batches in training
    order: "rm_baseline" is the mean over the batch of what it would subtract."""
    from learner.algo.baselines import RunningMeanBaseline

    by_id = {r["id"]: r for r in records}
    baseline = RunningMeanBaseline(window=rm_window)
    for step in sorted(details["learner_steps"], key=lambda s: s["step"]):
        batch = [by_id[i] for i in sample_ids(step) if i in by_id]
        prompts = [r["prompt_id"] for r in batch]
        if any(r["target_style"] == new_target for r in batch):
            history = baseline.state_dict()["history"]
            return {
                "step": step["step"],
                "rm_baseline": baseline.baselines(prompts).mean().item() if prompts else None,
                "rm_full_prompts": sum(1 for p in prompts if len(history.get(p, [])) == rm_window),
                "batch_prompts": len(batch),
                "value_mean": step.get("value_mean"),
            }
        baseline.update(prompts, [float(r["reward"]) for r in batch])
    return {}


def learned_for(share: list[float | None], switch: int, threshold: float) -> int | None:
    """Steps between the first step whose old-target share reached ``threshold`` and the switch
    (``switch`` − that step); None if it never did before the switch."""
    for step, value in enumerate(share[:switch]):
        if value is not None and value >= threshold:
            return switch - step
    return None


def median_from(steps: list[dict], first: int, key: str) -> float | None:
    """The median of ``key`` over the learner steps numbered ``first`` and later (None: none
    has it)."""
    values = [s[key] for s in steps if s["step"] >= first and s.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rm-window", type=int, default=8, help="the running mean's window (rewards)")
    parser.add_argument("--schedule", help="default: the folder's metrics.json (a run still going has none)")
    parser.add_argument("--window", type=int, default=3, help="share window in steps, with --schedule")
    parser.add_argument("--threshold", type=float, default=0.4, help="lag threshold, with --schedule")
    args = parser.parse_args()

    from judge.metrics import method_metrics
    from judge.report import load_records
    from judge.styles import schedule_from_spec

    if args.schedule is None:
        meta = json.loads((args.folder / "metrics.json").read_text())
        spec = ",".join(f"{s['style']}:{s['end'] - s['start']}" for s in meta["schedule"])
    else:
        meta = {"window": args.window, "threshold": args.threshold}
        spec = args.schedule
    schedule = schedule_from_spec(spec)
    switch = schedule.switch_steps[0]
    old, new = schedule.styles[0], schedule.styles[1]
    print(
        f"| run | {old} share before the switch (window {meta['window']}) | mean reward, {old} segment "
        f"| steps since {old} reached {meta['threshold']} | first batch with {new} "
        f"| running mean's window: mean (full prompts / batch) | critic value mean "
        f"| critic EV before / after its updates, median from there | policy grad norm, median from there "
        f"| lag | AUC | last-5 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sorted(args.folder.glob("details-*.json")):
        name = path.stem.removeprefix("details-")
        details = json.loads(path.read_text())
        records = load_records(args.folder / f"records-{name}.jsonl")
        m = method_metrics(records, schedule, meta["window"], meta["threshold"], details)
        at = replay(records, details, new, args.rm_window)
        rm = at.get("rm_baseline")
        value = at.get("value_mean")
        steps = details["learner_steps"]
        first = at.get("step", 0)
        print(
            f"| {name} | {m['target_share'][switch - 1]:.2f} | {m['segment_mean_reward'][0]:.3f} "
            f"| {learned_for(m['target_share'], switch, meta['threshold'])} "
            f"| step {at.get('step')} | {'—' if rm is None else f'{rm:.3f}'} "
            f"({at.get('rm_full_prompts')} / {at.get('batch_prompts')}) "
            f"| {'—' if value is None else f'{value:.3f}'} "
            f"| {_fmt(median_from(steps, first, 'explained_variance'))} / "
            f"{_fmt(median_from(steps, first, 'explained_variance_after'))} "
            f"| {_fmt(median_from(steps, first, 'policy_grad_norm'))} "
            f"| {m['adaptation_lag']} | {m['auc']:.3f} | {m['last5_mean']:.3f} |"
        )


if __name__ == "__main__":
    main()
