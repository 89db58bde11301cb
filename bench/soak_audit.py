"""The chaos soak's audit (bench/chaos_soak.py), from the database and the log once the traffic
has stopped and the learner has trained what was left: each check of the soak's docstring, the
figures it prints, and ``print_report``.
"""

from __future__ import annotations

import bisect
import contextlib
import json
from collections import Counter
from dataclasses import asdict
from datetime import UTC
from pathlib import Path

import httpx
from soak_faults import SIGKILL, Window
from soak_traffic import Call


class SoakAudit:
    """The audit methods of ``Soak`` (bench/chaos_soak.py), on its fields: ``calls``,
    ``windows``, ``lives``, ``plans``, ``ready_log``, ``restarts``, ``replicas``,
    ``swaps_before_restart``, ``dep``, ``home``, ``seed`` and ``args``."""

    def accepted(self) -> list[Call]:
        return [c for c in self.calls if c.kind == "feedback" and c.status == 202]

    def accounted(self, db) -> tuple[Counter, dict[str, str]]:
        """Trained trajectory ids (with multiplicity) and the dead letters' ids with their kinds."""
        from sqlalchemy import select

        from core.db import DeadLetter, LearnerStep

        with db.connect() as conn:
            steps = conn.execute(select(LearnerStep.metrics)).scalars().all()
            letters = conn.execute(select(DeadLetter.kind, DeadLetter.key, DeadLetter.payload)).all()
        trained = Counter(sid for m in steps for sid in (m or {}).get("sample_ids", []))
        dead = {}
        for kind, key, payload in letters:
            tid = None
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                tid = json.loads(payload).get("trajectory_id")
            for ident in (tid, key, (key or "").removeprefix("t:")):
                if ident:
                    dead[ident] = kind
        return trained, dead

    def unaccounted(self, db) -> list[str]:
        trained, dead = self.accounted(db)
        return [c.id for c in self.accepted() if c.store and c.id not in trained and c.id not in dead]

    def in_window(self, c: Call) -> Window | None:
        g = self.args.grace_s
        for w in self.windows:
            if (w.slot is None or w.slot == c.slot) and c.t0 <= w.end + g and c.t1 >= w.start:
                return w
        return None

    def audit(self, db, model_dir: Path) -> dict:
        from sqlalchemy import select

        from core.db import PolicyVersion, TrajectoryIndex
        from core.logbus import open_log
        from core.records import (
            TOPIC_FEEDBACK,
            TOPIC_POLICY,
            TOPIC_TRAJECTORIES,
            FeedbackRecord,
            PolicyEvent,
            TrajectoryRecord,
        )
        from core.sealing import SubjectKeys
        from testing.logs import read_topic
        from testing.replicas import metric

        problems: list[str] = []
        log = open_log(self.dep.log_url)
        try:
            keys = SubjectKeys(db)  # a Kafka log's records are sealed per subject (core.sealing)
            records = [
                TrajectoryRecord.model_validate_json(keys.open(e.value))
                for e in read_topic(log, TOPIC_TRAJECTORIES)
            ]
            feedback = [FeedbackRecord.model_validate_json(e.value) for e in read_topic(log, TOPIC_FEEDBACK)]
            events = [PolicyEvent.model_validate_json(e.value) for e in read_topic(log, TOPIC_POLICY)]
        finally:
            log.close()
        with db.connect() as conn:
            indexed = Counter(conn.execute(select(TrajectoryIndex.id)).scalars().all())
            versions = conn.execute(
                select(PolicyVersion.version, PolicyVersion.parent_version, PolicyVersion.status).order_by(
                    PolicyVersion.version
                )
            ).all()
            created = sorted(aware_ts(t) for t in conn.execute(select(PolicyVersion.created_at)).scalars())

        chats = [c for c in self.calls if c.kind == "chat"]
        ok = [c for c in chats if c.status == 200 and not c.broken]
        by_id = Counter(r.id for r in records)
        rec_of = {r.id: r for r in records}

        # Every 2xx chat: exactly one trajectory in the log, one index row.
        for c in ok:
            if by_id[c.id] != 1:
                problems.append(f"2xx chat {c.id} has {by_id[c.id]} trajectories in the log")
            if indexed[c.id] != 1:
                problems.append(f"2xx chat {c.id} has {indexed[c.id]} index rows")
        answered = {c.id for c in self.calls if c.kind in ("chat", "pad") and c.id}
        orphans = [r.id for r in records if r.id not in answered]

        # Every 202 feedback trained once, or set aside with its reason, or opted out.
        trained, dead = self.accounted(db)
        twice = [k for k, n in trained.items() if n > 1]
        problems += [f"trajectory {k} trained {trained[k]} times" for k in twice]
        accepted = self.accepted()
        fate = Counter()
        for c in accepted:
            if not c.store:
                fate["opted out"] += 1
                if c.id in trained:
                    problems.append(f"opted-out {c.id} was trained")
            elif c.id in trained:
                fate["trained"] += 1
            elif c.id in dead:
                fate[f"dead letter: {dead[c.id]}"] += 1
            else:
                fate["unaccounted"] += 1
                problems.append(f"202 feedback for {c.id} neither trained nor set aside")
        fb_log = Counter((f.trajectory_id, f.reward) for f in feedback)
        for c in accepted:
            if fb_log[(c.id, c.reward)] < 1:
                problems.append(f"202 feedback for {c.id} is not in the log")

        # Failures only inside the outage windows.
        failures = [
            c for c in self.calls if c.kind != "pad" and (c.status is None or c.status >= 500 or c.broken)
        ]
        outside = [c for c in failures if self.in_window(c) is None]
        problems += [
            f"{c.kind} to slot {c.slot} at {c.t0:.2f}–{c.t1:.2f}: {c.status} {c.error[:160]} outside every window"
            for c in outside
        ]
        client_errors = [c for c in self.calls if c.status is not None and 400 <= c.status < 500]
        problems += [f"{c.kind} answered {c.status}: {c.error[:160]}" for c in client_errors]

        # Versions never go backwards, per replica slot (across its restart).
        floors = version_floors(
            [(c.t1, c.slot, c.version) for c in chats if c.version is not None]
            + [(t, s, b["policy_version"]) for t, s, code, b in self.ready_log if code == 200]
        )
        for c in ok:
            floor = floors(c.slot, c.t0)
            if c.version < floor:
                problems.append(f"{c.id} on slot {c.slot} answered from version {c.version} after {floor}")
            rec = rec_of.get(c.id)
            if rec is not None:
                spans = [v for v, _ in rec.token_versions]
                if spans != sorted(spans) or (spans and spans[0] < rec.dispatch_version):
                    problems.append(
                        f"{c.id}: token versions {rec.token_versions} from dispatch {rec.dispatch_version}"
                    )
        for r in self.restarts:
            seen = [
                (t, code, b)
                for t, s, code, b in self.ready_log
                if s == r["slot"] and r["spawned"] <= t <= r["ready"] + 2
            ]
            answers = [(t, code, b) for t, code, b in seen if code is not None]
            first_ok = next((k for k, (_, code, _) in enumerate(answers) if code == 200), None)
            if first_ok is None:
                problems.append(f"restarted slot {r['slot']}: no 200 seen")
                continue
            before = answers[:first_ok]
            r["unready_answers"] = len(before)
            r["reasons"] = sorted({b.get("policy", "") for _, _, b in before})
            if answers[first_ok][2]["policy_version"] < r["newest_at_spawn"]:
                problems.append(
                    f"restarted slot {r['slot']} ready at version {answers[first_ok][2]['policy_version']} "
                    f"below the newest at its start ({r['newest_at_spawn']})"
                )
            r["ready_version"] = answers[first_ok][2]["policy_version"]

        # The versions: 0..N, each the child of the one before, all published.
        numbers = [v for v, _, _ in versions]
        if numbers != list(range(len(numbers))):
            problems.append(f"versions are not 0..N: {numbers[:20]}…")
        problems += [f"version {v} has parent {p}" for v, p, _ in versions if v and p != v - 1]
        problems += [f"version {v} is {st}" for v, _, st in versions if st != "published"]
        announced = {e.version for e in events}
        problems += [f"version {v} has no policy event" for v in numbers if v and v not in announced]

        # Learner lives: each ended by its kill, or at its start while the database was down
        # (``saoserve learn`` migrates first and exits: compose's restart policy starts it again).
        db_windows = [w for w in self.windows if w.what == "database"]
        exits_in_outage = 0
        for life in self.lives:
            if life.rc is None:
                continue
            if life.point and life.rc == 137 or life.sigkilled and life.rc == -9:
                continue
            log_text = (self.home / f"learner-{life.n}.log").read_text(errors="replace")
            in_outage = any(life.started <= w.end and w.start <= life.ended for w in db_windows)
            if life.rc == 1 and in_outage and "Connection refused" in log_text:
                exits_in_outage += 1
                continue
            problems.append(f"learner life {life.n} ({life.point or 'unarmed'}) ended with {life.rc}")

        missed = sum(plan == SIGKILL for plan in self.plans) + sum(
            life.planned_sigkill and not life.sigkilled and life.rc is None for life in self.lives
        )
        if missed:
            problems.append(f"{missed} planned learner SIGKILL(s) not sent")

        # A killed learner is back when its next life commits a version.
        back = []
        for life in self.lives:
            if life.ended is not None:
                k = bisect.bisect_right(created, life.ended)
                if k < len(created):
                    back.append(created[k] - life.ended)

        swaps = 0.0
        with httpx.Client(timeout=10) as http:
            for r in self.replicas:
                swaps += (
                    metric(http.get(f"{r.url}/metrics").text, "saoserve_policy_swaps_total", result="ok")
                    or 0.0
                )
        swaps += sum(self.swaps_before_restart.values())
        in_windows = Counter(
            self.in_window(c).what.split(" ")[0] for c in failures if self.in_window(c) is not None
        )
        return {
            "seed": self.seed,
            "requests": {
                "chats": len(chats),
                "chats_2xx": len(ok),
                "chats_503": sum(c.status == 503 for c in chats),
                "no_answer": sum(c.status is None for c in self.calls if c.kind != "pad"),
                "broken_streams": sum(c.broken for c in chats),
                "feedback": sum(c.kind == "feedback" for c in self.calls),
                "feedback_202": len(accepted),
                "feedback_503": sum(c.kind == "feedback" and c.status == 503 for c in self.calls),
                "failures_in_windows": dict(in_windows),
                "failures_outside_windows": len(outside),
                "4xx": len(client_errors),
                "padding": sum(c.kind == "pad" for c in self.calls),
            },
            "log": {
                "trajectories": len(records),
                "trajectories_without_a_2xx": len(orphans),
                "feedback_records": len(feedback),
                "policy_events": len(events),
            },
            "feedback_fate": dict(fate),
            "versions": len(numbers) - 1,
            "swaps": swaps,
            "learner": {
                "lives": len(self.lives),
                "point_kills": sum(life.point is not None and life.rc == 137 for life in self.lives),
                "points": [life.point for life in self.lives if life.point and life.rc == 137],
                "sigkills": sum(life.sigkilled and life.rc == -9 for life in self.lives),
                "sigkill_at_s": [
                    life.sigkill_at_s for life in self.lives if life.sigkilled and life.rc == -9
                ],
                "death_to_next_version_s": sorted(round(b, 1) for b in back),
                "exits_at_start_in_a_database_outage": exits_in_outage,
            },
            "windows": [asdict(w) for w in self.windows],
            "restarts": self.restarts,
            "grace_s": self.args.grace_s,
            "problems": problems,
        }


def aware_ts(t) -> float:
    """Unix seconds of a database timestamp (SQLAlchemy gives PostgreSQL's with their zone)."""
    return t.timestamp() if t.tzinfo else t.replace(tzinfo=UTC).timestamp()


def version_floors(seen: list[tuple[float, int, int]]):
    """``floor(slot, t)``: the highest version seen on ``slot`` strictly before ``t``, from
    (time, slot, version) observations (0 when none)."""
    by_slot: dict[int, tuple[list[float], list[int]]] = {}
    for t, slot, v in sorted(seen):
        times, best = by_slot.setdefault(slot, ([], []))
        times.append(t)
        best.append(max(v, best[-1]) if best else v)

    def floor(slot: int, t: float) -> int:
        times, best = by_slot.get(slot, ([], []))
        k = bisect.bisect_left(times, t)
        return best[k - 1] if k else 0

    return floor


def print_report(r: dict) -> None:
    q = r["requests"]
    print(f"\nchaos soak, seed {r['seed']}: {r['seconds']}")
    rows = [
        ("chats sent / 2xx / 503", f"{q['chats']} / {q['chats_2xx']} / {q['chats_503']}"),
        (
            "no answer (connection refused or cut) / broken streams",
            f"{q['no_answer']} / {q['broken_streams']}",
        ),
        ("feedback sent / 202 / 503", f"{q['feedback']} / {q['feedback_202']} / {q['feedback_503']}"),
        ("failures in windows (by window)", json.dumps(q["failures_in_windows"])),
        ("failures outside windows / 4xx", f"{q['failures_outside_windows']} / {q['4xx']}"),
        (
            "trajectories in the log (without a 2xx)",
            f"{r['log']['trajectories']} ({r['log']['trajectories_without_a_2xx']})",
        ),
        ("202 feedback by fate", json.dumps(r["feedback_fate"])),
        ("versions / swaps on the replicas", f"{r['versions']} / {r['swaps']:.0f}"),
        (
            "learner lives / point kills / SIGKILLs / exits at start (database down)",
            f"{r['learner']['lives']} / {r['learner']['point_kills']} / {r['learner']['sigkills']} / "
            f"{r['learner']['exits_at_start_in_a_database_outage']}",
        ),
        ("kill points passed", ", ".join(r["learner"]["points"])),
        ("SIGKILLs: seconds into the life", str(r["learner"]["sigkill_at_s"])),
        ("learner death → next version committed (s)", str(r["learner"]["death_to_next_version_s"])),
        ("padding requests (drain)", str(q["padding"])),
    ]
    for k, v in rows:
        print(f"  {k:<58}{v}")
    print(f"  outage windows (grace {r['grace_s']} s):")
    t0 = min(w["start"] for w in r["windows"]) if r["windows"] else 0.0
    for w in r["windows"]:
        print(
            f"    {w['what']:<34} +{w['start'] - t0:7.1f} s, {w['end'] - w['start']:5.1f} s down, "
            f"every replica ready {w['recovered_s']:.2f} s after"
        )
    for rs in r["restarts"]:
        print(
            f"    restarted slot {rs['slot']}: {rs['ready'] - rs['spawned']:.1f} s to ready, "
            f"{rs.get('unready_answers', '?')} answers 503 first {rs.get('reasons', '')}, ready at version "
            f"{rs.get('ready_version', '?')} (newest at its start {rs['newest_at_spawn']}); "
            f"failed starts: {rs['failed_starts'] or 'none'}"
        )
    print(f"  problems: {len(r['problems'])}")
    for p in r["problems"][:30]:
        print(f"    {p}")
