"""``GET /dashboard/state`` and ``/metrics`` on a database written by hand, the operators' dashboard
(issue 23) and the lifecycle (issue 22): version 1 rejected and version 2 restoring version 0,
then versions 3 and 4 on probation with the learner's verdict on them. ``test_dashboard_state``
takes ``database_url`` (tests/unit: SQLite; tests/integration: PostgreSQL) and runs in
tests/unit/server/test_dashboard.py and tests/integration/test_dashboard.py; the database it
writes (``populate``, ``add_lineage``) is also the page's in tests/system/test_dashboard.py."""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import timedelta
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert
from starlette.testclient import TestClient

from core.control import GUARD_OFF, GUARD_PIN, GUARD_VERDICT, PAUSED, ROLLBACK_TO, set_flag
from core.db import (
    FeedbackClaim,
    LearnerCounter,
    LearnerSample,
    LearnerStep,
    PolicyVersion,
    TrajectoryIndex,
    make_engine,
)
from core.records import utcnow
from core.sequential import RuleParams, decide
from testing.servers import ADMIN, make_settings

__all__ = ["test_dashboard_state"]

# Trajectories logged 11..40 s ago (none in the last 10 s) and 12 more 2..3.8 minutes ago:
# over the last 60 s, 30 requests / 60 s = 0.5 requests/s.
RECENT, OLDER = 30, 12


# Received completion feedback by the version that began the answer: version 0 (1, 0, 1),
# mean 2/3 over 3; version 2, the rollback (1), mean 1 over 1.
REWARDS = [(0, 1.0), (0, 0.0), (0, 1.0), (2, 1.0)]


STEP = {
    "reward_mean": 0.75,
    "kept_fraction": 0.9,
    "explained_variance": 0.3,
    "staleness_mean": 0.5,
    "policy_loss": 0.1,
    "critic_loss": 0.2,
    "sample_ids": ["s1", "s2", "s3", "s4"],
}


def verdict_flag(lineage: list[int], candidate: list[float], promoted: list[float]) -> tuple[str, object]:
    """The ``guard_verdict`` flag as ``learner.guard.guard.Guard._record_verdict`` writes it, for the rule's
    verdict on these rewards (default parameters), and that verdict."""
    verdict = decide(candidate, promoted, RuleParams())
    record = {"lineage": lineage, "at": utcnow().isoformat()} | asdict(verdict)
    return json.dumps(record), verdict


def populate(db_url: str) -> None:
    """Versions 0 (base, promoted), 1 (learner step 1, rejected) and 2 (a rollback to 0,
    promoted); that one learner step; learning paused and a rollback to 1 pending; 3 samples
    waiting; counters; the trajectories and claims above; a verdict on the lineage [1], which
    is no longer the lineage (none is on probation)."""
    now = utcnow()
    db = make_engine(db_url)
    try:
        with db.begin() as conn:
            for v, parent, metrics, stage in (
                (0, None, None, "promoted"),
                (1, 0, {"reward_mean": 0.75}, "rejected"),
                (2, 0, {"rollback_to": 0}, "promoted"),
            ):
                conn.execute(
                    insert(PolicyVersion).values(
                        version=v,
                        path=f"/policies/{v}",
                        sha256="0" * 64,
                        status="committed",
                        parent_version=parent,
                        metrics=metrics,
                        created_at=now - timedelta(seconds=300 - 100 * v),
                        lifecycle=stage,
                    )
                )
            conn.execute(
                insert(LearnerStep).values(run_id="r", step=1, version=1, metrics=STEP, created_at=now)
            )
            conn.execute(
                insert(LearnerCounter),
                [{"name": "rollback_refused", "value": 2}, {"name": "expired", "value": 3}],
            )
            conn.execute(
                insert(LearnerSample),
                [dict(id=f"w{i}", prompt_id="p", payload="{}", created_at=now) for i in range(3)],
            )
            ages = [11 + i for i in range(RECENT)] + [120 + 10 * i for i in range(OLDER)]
            conn.execute(
                insert(TrajectoryIndex),
                [
                    dict(
                        id=f"t{i}",
                        prompt_id="p",
                        dispatch_version=REWARDS[i][0] if i < len(REWARDS) else 1,
                        last_version=1,
                        n_response_tokens=4,
                        finish_reason="stop",
                        log_partition=0,
                        log_offset=i,
                        created_at=now - timedelta(seconds=age),
                    )
                    for i, age in enumerate(ages)
                ],
            )
            claims = [("t:" + f"t{i}", "received", r) for i, (_, r) in enumerate(REWARDS)]
            # Not in reward by version: a claim still being appended, and episode feedback.
            claims += [("t:t4", "claimed", None), ("e:ep", "received", 0.0)]
            conn.execute(
                insert(FeedbackClaim),
                [dict(target=t, state=s, reward=r, claimed_at=now, received_at=now) for t, s, r in claims],
            )
        set_flag(db, PAUSED, "1")
        set_flag(db, ROLLBACK_TO, "1")
        set_flag(db, GUARD_VERDICT, verdict_flag([1], [0.0] * 30, [1.0] * 30)[0])
    finally:
        db.dispose()


def add_lineage(db_url: str):
    """Versions 3 and 4 on probation (canary) after the promoted version 2, the learner's verdict
    on them (10 ratings of the lineage, 30 of the promoted: under min_samples 20, so continue),
    the guard turned off and version 2 pinned; returns the verdict."""
    now = utcnow()
    db = make_engine(db_url)
    try:
        with db.begin() as conn:
            for v in (3, 4):
                conn.execute(
                    insert(PolicyVersion).values(
                        version=v,
                        path=f"/policies/{v}",
                        sha256="0" * 64,
                        status="published",
                        parent_version=v - 1,
                        metrics={},
                        created_at=now - timedelta(seconds=10 - v),
                        lifecycle="canary",
                    )
                )
        flag, verdict = verdict_flag([3, 4], [1.0] * 10, [1.0] * 30)
        set_flag(db, GUARD_VERDICT, flag)
        set_flag(db, GUARD_OFF, "1")
        set_flag(db, GUARD_PIN, "2")
    finally:
        db.dispose()
    return verdict


def scrape(client) -> dict:
    """``/metrics`` as {(name, labels as a sorted tuple): value} for the lifecycle's gauges."""
    families = text_string_to_metric_families(client.get("/metrics").text)
    return {
        (m.name, tuple(sorted(m.labels.items()))): m.value
        for f in families
        for m in f.samples
        if m.name.startswith(
            ("saoserve_policy_versions", "saoserve_policy_promoted", "saoserve_policy_candidate")
        )
        or m.name.startswith(("saoserve_policy_lineage", "saoserve_guard_"))
    }


STAGES_AFTER_POPULATE = {"candidate": 0, "canary": 0, "promoted": 2, "rejected": 1}


def refuse_some(post) -> None:
    """One chat request refused before generation (invalid) and one feedback on an unknown id."""
    assert post("/v1/chat/completions", json={"messages": "not a list"}).status_code == 400
    assert post("/v1/feedback", json={"id": "nope", "feedback_token": "x", "reward": 1}).status_code == 404


EXPECTED_STATE = {
    "serving": 1,
    "newest_version": 2,
    "learning": "paused",
    "rollback_to": 1,
    "samples_trained": 4,
    "samples_waiting": 3,
    "requests_per_s_last_minute": RECENT / 60,
    "outcomes": {"chat": {}, "chat_refused": {"invalid_request": 1}, "feedback": {"unknown": 1}},
}


PROBATION_SAYS = (
    "only watches: this engine serves one full-weight version at a time, so each new version serves "
    "all traffic on probation, compared with the promoted version's earlier ratings (no live "
    "control arm: drift between the two windows is confounded with the version)"
)


def check_state(body: dict) -> None:
    assert {k: body[k] for k in EXPECTED_STATE} == EXPECTED_STATE
    assert [
        (v["version"], v["parent_version"], v["rollback_to"], v["lifecycle"]) for v in body["versions"]
    ] == [
        (0, None, None, "promoted"),
        (1, 0, None, "rejected"),
        (2, 0, 0, "promoted"),
    ]
    # The verdict on [1] is not shown: version 1 was rejected, nothing is on probation. A
    # full-weight engine (no adapters): the guard can only watch.
    assert body["guard"] == {
        "on": True,
        "pinned": None,
        "promoted": 2,
        "lineage": [],
        "stages": STAGES_AFTER_POPULATE,
        "verdict": None,
        "mode": "probation",
        "can": "watch",
        "says": PROBATION_SAYS,
    }
    assert all(v["created_at"].endswith("+00:00") for v in body["versions"])
    assert [(r["version"], r["n"]) for r in body["reward_by_version"]] == [(0, 3), (2, 1)]
    assert [r["reward_mean"] for r in body["reward_by_version"]] == pytest.approx([2 / 3, 1.0])


def test_dashboard_state(tmp_path, database_url):
    settings = make_settings(tmp_path, database_url=database_url)
    from server.app import create_app

    app = create_app(settings, engine=SimpleNamespace(version=1, adapters=None), watch_policy=False)
    with TestClient(app) as client:
        empty = client.get("/dashboard/state").json()
        assert (empty["learning"], empty["rollback_to"], empty["newest_version"]) == ("running", None, None)
        assert (empty["samples_trained"], empty["requests_per_s_last_minute"]) == (0, 0.0)
        populate(settings.resolved_database_url)
        refuse_some(client.post)
        check_state(client.get("/dashboard/state").json())
        # The learner's turn: resumed, the rollback carried out (its flag cleared).
        assert client.post("/admin/resume", headers=ADMIN).status_code == 200
        db = make_engine(settings.resolved_database_url)
        set_flag(db, ROLLBACK_TO, None)
        db.dispose()
        after = client.get("/dashboard/state").json()
        assert (after["learning"], after["rollback_to"]) == ("running", None)
        assert scrape(client) == {
            **{("saoserve_policy_versions", (("stage", k),)): n for k, n in STAGES_AFTER_POPULATE.items()},
            ("saoserve_policy_promoted_version", ()): 2,
            ("saoserve_policy_lineage_versions", ()): 0,
            ("saoserve_guard_enabled", ()): 1,
        }
        verdict = add_lineage(settings.resolved_database_url)
        guard = client.get("/dashboard/state").json()["guard"]
        assert (guard["on"], guard["pinned"], guard["promoted"], guard["lineage"]) == (False, 2, 2, [3, 4])
        assert guard["stages"] == STAGES_AFTER_POPULATE | {"canary": 2}
        v = guard["verdict"]
        assert (v["lineage"], v["decision"], v["candidate"]["n"], v["promoted"]["n"]) == (
            [3, 4],
            "continue",
            10,
            30,
        )
        assert (v["lower"], v["upper"]) == (verdict.lower, verdict.upper)
        # Both arms all wins: means 1.0 each.
        assert (v["candidate"]["mean"], v["promoted"]["mean"]) == (1.0, 1.0)
        gauges = scrape(client)
        assert gauges.pop(("saoserve_guard_verdict_timestamp_seconds", ())) > 0
        assert gauges == {
            **{
                ("saoserve_policy_versions", (("stage", k),)): n
                for k, n in (STAGES_AFTER_POPULATE | {"canary": 2}).items()
            },
            ("saoserve_policy_promoted_version", ()): 2,
            ("saoserve_policy_candidate_version", ()): 4,
            ("saoserve_policy_lineage_versions", ()): 2,
            ("saoserve_guard_enabled", ()): 0,
            ("saoserve_guard_pinned_version", ()): 2,
            ("saoserve_guard_delta_bound", (("bound", "lower"),)): verdict.lower,
            ("saoserve_guard_delta_bound", (("bound", "upper"),)): verdict.upper,
            ("saoserve_guard_ratings", (("arm", "candidate"),)): 10,
            ("saoserve_guard_ratings", (("arm", "promoted"),)): 30,
            ("saoserve_guard_arm_mean", (("arm", "candidate"),)): 1.0,
            ("saoserve_guard_arm_mean", (("arm", "promoted"),)): 1.0,
            ("saoserve_guard_decision", (("decision", "continue"),)): 1,
            ("saoserve_guard_decision", (("decision", "promote"),)): 0,
            ("saoserve_guard_decision", (("decision", "reject"),)): 0,
        }
