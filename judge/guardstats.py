"""What a simulation run says about the guard (docs/guard.md, "Simulated attacks and faults"):
the figures of an adversarial cohort's run, and what the version lifecycle did with the versions
the run trained. Pure functions of the run's records (``judge.simulate``) and the lifecycle's
transitions (``GET /admin/lifecycle``'s ``events``).

A record's version is the one that generated its first token (``first_version``, async mode),
else its dispatch version (``policy_version``). Times are seconds on the simulation's clock
(``t_feedback``: when its rating was posted; async mode only).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime

from judge.adversary import Adversary


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _share(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def record_version(record: dict) -> int:
    """The version that served ``record``: its first token's, else its dispatch version."""
    return record.get("first_version", record["policy_version"])


def attack_summary(records: Sequence[dict], adversary: Adversary, last_steps: int = 5) -> dict:
    """The adversarial run's figures: answers by rater, the honest raters' mean reward (what the
    judge gave them), the cohort's mean posted reward, the judge's mean reward and quality over
    every answer served (what the rubric says of the policy), and the share of served answers
    carrying what the cohort rewards (``marker_share``, or ``degenerate_share``), over the run
    and over its last ``last_steps`` steps. Means are None without answers.

    ``records`` carry ``rater`` (honest | adversary), ``reward`` (posted), ``judge_reward``,
    ``quality``, ``carries`` (bool) and ``step``.
    """
    honest = [r for r in records if r["rater"] == "honest"]
    cohort = [r for r in records if r["rater"] == "adversary"]
    last = max((r["step"] for r in records), default=0) - last_steps + 1
    key = "marker_share" if adversary.marker is not None else "degenerate_share"
    return {
        "adversary": adversary.spec,
        "users": adversary.users,
        "cohort": adversary.cohort,
        "answers": len(records),
        "honest_answers": len(honest),
        "adversary_answers": len(cohort),
        "honest_reward": _mean([r["reward"] for r in honest]),
        "adversary_reward": _mean([r["reward"] for r in cohort]),
        "judge_reward": _mean([r["judge_reward"] for r in records]),
        "quality": _mean([r["quality"] for r in records]),
        key: _share([r["carries"] for r in records]),
        f"{key}_last": _share([r["carries"] for r in records if r["step"] >= last]),
        "last_steps": last_steps,
    }


def _seconds(at: str, t0_wall: float) -> float:
    """An event's ISO time as seconds since ``t0_wall`` (Unix seconds); a time without an offset
    is UTC (the database keeps UTC)."""
    when = datetime.fromisoformat(at)
    when = when if when.tzinfo else when.replace(tzinfo=UTC)
    return when.timestamp() - t0_wall


def lifecycle_summary(
    records: Sequence[dict], events: Iterable[dict], t0_wall: float, start_version: int = 0
) -> dict:
    """What the lifecycle did with the versions after ``start_version``.

    ``events``: transitions ``{version, from_status, to_status, actor, reason, at}`` in the order
    they were recorded (the transitions of one transaction share a time, so the time cannot
    order them); ``t0_wall``: the Unix time of the simulation's clock zero. Returns:

    - ``trained``: versions a learner step computed (recorded as ``candidate``; a rollback's
      restoring version is not one). With ``--broken-learner`` these are the broken versions.
    - ``served_by_trained`` / ``served_by_rejected``: answers (records) those versions served,
      and those that versions later rejected served; ``served_by_trained_outside_canary``: those
      of the trained versions' answers not routed to a canary arm (``arm``, async mode with an
      admin key): with probation (no canary split) every one of them.
    - ``promoted`` / ``undecided``: trained versions promoted, and neither promoted nor rejected
      at the end.
    - ``timeline``: each version's moves and answers (``version_timeline``), what the report's
      "Version lifecycle" table shows.
    - ``rejections``: one entry per rejection (the versions rejected together, oldest first):
      ``versions``, ``by`` (the actor), ``t_s``, ``reason``, ``served`` (their answers),
      ``rated_before`` (their answers rated by ``t_s``) and ``rated_all_before`` (every answer
      of the run rated by ``t_s``); the two counts are None without rating times (sync mode).
    """
    mine = [e for e in events if e["version"] > start_version]
    trained = {e["version"] for e in mine if e["from_status"] is None and e["to_status"] == "candidate"}
    final: dict[int, str] = {}
    for e in mine:
        final[e["version"]] = e["to_status"]
    groups: dict[tuple, list[int]] = {}
    for e in mine:
        if e["to_status"] == "rejected":
            groups.setdefault((_seconds(e["at"], t0_wall), e["actor"], e["reason"]), []).append(e["version"])
    timed = bool(records) and all("t_feedback" in r for r in records)
    rejections = []
    for (t, actor, reason), versions in sorted(groups.items()):
        mine_recs = [r for r in records if record_version(r) in versions]
        rejections.append(
            {
                "versions": sorted(versions),
                "by": actor,
                "t_s": t,
                "reason": reason,
                "served": len(mine_recs),
                "rated_before": _rated_by(mine_recs, t) if timed else None,
                "rated_all_before": _rated_by(records, t) if timed else None,
            }
        )
    rejected = {v for v, stage in final.items() if stage == "rejected"}
    return {
        "trained": sorted(trained),
        "served_by_trained": sum(record_version(r) in trained for r in records),
        "served_by_trained_outside_canary": sum(
            record_version(r) in trained and r.get("arm") != "canary" for r in records
        ),
        "served_by_rejected": sum(record_version(r) in rejected for r in records),
        "promoted": sorted(v for v in trained if final.get(v) == "promoted"),
        "undecided": sorted(v for v in trained if final.get(v) in ("candidate", "canary")),
        "rejections": rejections,
        "timeline": version_timeline(records, mine, t0_wall, start_version),
    }


def version_timeline(
    records: Sequence[dict], events: Iterable[dict], t0_wall: float, start_version: int = 0
) -> list[dict]:
    """Each version after ``start_version`` with its moves through the lifecycle, oldest version
    first: ``{"version", "served", "stages": [{"stage", "t_s", "by", "reason"}]}``, the moves in
    the order they were recorded (``events`` as ``lifecycle_summary`` takes them; ``t_s``:
    seconds on the simulation's clock), ``served`` the answers (records) it served."""
    out: dict[int, dict] = {}
    for e in events:
        v = e["version"]
        if v <= start_version:
            continue
        entry = out.setdefault(v, {"version": v, "served": 0, "stages": []})
        entry["stages"].append(
            {
                "stage": e["to_status"],
                "t_s": _seconds(e["at"], t0_wall),
                "by": e["actor"],
                "reason": e["reason"],
            }
        )
    for r in records:
        entry = out.get(record_version(r))
        if entry is not None:
            entry["served"] += 1
    return [out[v] for v in sorted(out)]


def _rated_by(records: Iterable[dict], t: float) -> int:
    return sum(r.get("t_feedback") is not None and r["t_feedback"] <= t for r in records)


def guard_lines(details: dict) -> list[str]:
    """One console line each for a run's ``attack`` and ``lifecycle`` figures (``details`` is
    ``SimulationResult.details()``); none for what the run does not have."""
    lines = []
    attack = details.get("attack")
    if attack:
        key = "marker_share" if "marker_share" in attack else "degenerate_share"
        lines.append(
            f"adversary {attack['adversary']}: honest raters' reward {_fmt(attack['honest_reward'])} "
            f"({attack['honest_answers']} answers), the cohort's {_fmt(attack['adversary_reward'])} "
            f"({attack['adversary_answers']}); judge reward of all {_fmt(attack['judge_reward'])}, "
            f"quality {_fmt(attack['quality'])}; {key.replace('_', ' ')} {_fmt(attack[key])} "
            f"(last {attack['last_steps']} steps {_fmt(attack[key + '_last'])})"
        )
    life = details.get("lifecycle")
    if life:
        lines.append(
            f"lifecycle: {len(life['trained'])} trained versions served {life['served_by_trained']} "
            f"answers ({life['served_by_trained_outside_canary']} outside a canary arm); "
            f"promoted {life['promoted']}, undecided {life['undecided']}, "
            f"{life['served_by_rejected']} answers served by versions later rejected"
        )
        for rej in life["rejections"]:
            lines.append(
                f"  rejected {rej['versions']} by {rej['by']} at {rej['t_s']:.0f} s: "
                f"{rej['served']} answers served, {rej['rated_before']} of them rated before "
                f"({rej['rated_all_before']} rated in the run); {rej['reason']}"
            )
        verdict = life.get("last_verdict")
        if verdict:
            lines.append(
                f"  lineage {verdict['lineage']} at the end: {verdict['decision']}, {verdict['reason']}"
            )
    return lines


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"
