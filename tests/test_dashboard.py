"""The operators' dashboard (issue 23): ``GET /dashboard/state`` on a database written by hand
(SQLite here, PostgreSQL in the integration tier), and the page in headless Chromium against
the real server with one learner step, a rollback version, learning paused and a rollback
pending; screenshots in /tmp/dash_*.png. The lifecycle (issue 22) on both and on ``/metrics``:
version 1 rejected and version 2 restoring version 0, then versions 3 and 4 on probation with
the learner's verdict on them."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from datetime import timedelta
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter
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
from server.metrics import label_counts
from tests import test_chat_page
from tests.conftest import ADMIN, make_settings, running_server

# Headless Chromium under chromedriver, as the chat page's test drives it.
browser = test_chat_page.browser

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
    """The ``guard_verdict`` flag as ``learner.guard.Guard._record_verdict`` writes it, for the rule's
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


def test_the_guard_says_whether_it_can_decide_or_only_watch(tmp_path):
    """What the guard can do is read from this replica (``server.routes.ops.guard_capability``):
    an engine serving adapters decides against a live control arm while its canary split is in
    effect; a lineage without the split (the promoted version not held) is on probation, where
    the guard only watches; the pin says so; ``saoserve admin status`` prints the same words.
    (A full-weight engine: ``test_dashboard_state``, ``PROBATION_SAYS``.)"""
    from core.lifecycle import CanarySplit
    from saoserve.admin.status import _guard_lines
    from server.adapters import AdapterTable
    from server.app import create_app
    from server.canary import CanaryRouter
    from server.metrics import ServerMetrics

    settings = make_settings(tmp_path)
    engine = SimpleNamespace(version=4, adapters=AdapterTable(3))
    app = create_app(settings, engine=engine, watch_policy=False)
    with TestClient(app) as client:

        def guard() -> dict:
            return client.get("/dashboard/state").json()["guard"]

        idle = guard()
        assert (idle["mode"], idle["can"], idle["says"]) == (
            "canary",
            "decide",
            "can decide: nothing under watch now; a new version will get a canary share beside a live "
            "control arm (the promoted version)",
        )
        populate(settings.resolved_database_url)  # version 2 promoted
        add_lineage(settings.resolved_database_url)  # versions 3 and 4 under watch
        db = make_engine(settings.resolved_database_url)
        set_flag(db, GUARD_OFF, None)
        set_flag(db, GUARD_PIN, None)
        unheld = guard()
        assert (unheld["can"], unheld["says"]) == (
            "watch",
            "only watches for now: no canary split is in effect (full-weight versions, or the promoted "
            "version cannot be held beside the lineage), so the lineage serves all traffic on probation, "
            "compared with the promoted version's earlier ratings (no live control arm)",
        )
        assert _guard_lines(unheld)[1] == ("", "promoted version 2; on probation: versions 3, 4")
        # The router holds version 2 beside the lineage: the split is in effect.
        router = CanaryRouter(db, engine, ServerMetrics(), 0.2)
        router.split = CanarySplit(frozenset({3, 4}), 2, 0.2)
        app.state.s.canary = router
        split = guard()
        says = (
            "can decide: versions 3, 4 get a canary share of 0.2 beside a live control arm (version 2), "
            "both rated in the same window"
        )
        assert (split["can"], split["says"]) == ("decide", says)
        assert _guard_lines(split)[:2] == [
            ("guard", says),
            ("", "promoted version 2; on canary: versions 3, 4"),
        ]
        set_flag(db, GUARD_PIN, "2")
        pinned = guard()
        assert (pinned["can"], pinned["says"]) == (
            "pinned",
            "pinned to version 2: the guard promotes and rejects nothing by itself",
        )
        assert _guard_lines(pinned)[1] == ("", "promoted version 2; under watch: versions 3, 4")
        db.dispose()


def test_label_counts_sums_over_the_other_labels():
    c = Counter("x_total", "x", ["stream", "outcome"], registry=CollectorRegistry())
    c.labels("true", "ok").inc(2)
    c.labels("false", "ok").inc()
    c.labels("false", "aborted").inc()
    c.labels("true", "engine_error")  # made, never counted: 0
    assert label_counts(c, "outcome") == {"ok": 3, "aborted": 1, "engine_error": 0}
    assert label_counts(c, "stream") == {"true": 2, "false": 2}


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_dashboard_state(tmp_path, database, request):
    where = {"database_url": request.getfixturevalue("pg_url")} if database == "postgres" else {}
    settings = make_settings(tmp_path, **where)
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


# --------------------------------------------------------------------------- the page in Chromium
# The page as it is between two refreshes, read in one script (a refresh redraws the charts).
SNAPSHOT_JS = """
const text = id => { const el = document.getElementById(id); return el.hidden ? "" : el.textContent.trim(); };
const all = (el, sel) => [...el.querySelectorAll(sel)];
const svg = id => {
  const el = document.getElementById(id);
  return {
    x_label: el.querySelector(".x-label").textContent, y_label: el.querySelector(".y-label").textContent,
    x_ticks: all(el, ".x-tick").map(t => t.textContent), y_ticks: all(el, ".y-tick").map(t => t.textContent),
    points: all(el, "circle.point").map(p => [p.getAttribute("cx"), p.getAttribute("cy")]),
    rollbacks: all(el, ".rollback-mark").length,
    vlines: all(el, ".rollback-line").map(l => l.getAttribute("x1")),
    labels: all(el, ".point-label").map(t => t.textContent),
    empty: el.innerHTML.includes("no data yet"),
  };
};
const badge = document.getElementById("learning");
return {
  text: Object.fromEntries(arguments[0].map(id => [id, text(id)])),
  charts: Object.fromEntries(arguments[1].map(id => [id, svg(id)])),
  learning_class: badge.className,
  learning_colour: getComputedStyle(badge).backgroundColor,
};
"""
TEXTS = (
    "learning",
    "rollback-pending",
    "guard-says",
    "policy-version",
    "newest-version",
    "newest-note",
    "learner-steps",
    "last-reward",
    "req-rate",
    "samples-trained",
    "samples-waiting",
    "dead-letters",
    "rollback-refused",
    "chat-refused",
    "chat-refused-by",
    "feedback-refused",
    "feedback-refused-by",
    "other-counters",
    "guard",
    "served-stage",
    "promoted-version",
    "candidate-version",
    "lineage",
    "stage-counts",
    "decision",
    "decision-detail",
)
CHARTS = ("c-reward", "c-version", "c-version-reward", "c-kept", "c-ev", "c-rps")


def read_page(driver) -> dict:
    """What the dashboard shows once it has refreshed: the texts by element id, the charts, the
    learning badge's class and colour, the console's errors."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "status").text.startswith("updated"))
    snap = driver.execute_script(SNAPSHOT_JS, list(TEXTS), list(CHARTS))
    seen = snap.pop("text") | snap
    seen["errors"] = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    return seen


# Two columns of charts, with or without a scroll bar.
WIDTH = 1280


def screenshot(driver, path: str) -> None:
    """The whole page as a PNG at ``path`` (the window made as tall as the page)."""
    bottom, chrome = driver.execute_script(
        "return [document.body.getBoundingClientRect().bottom + 24, window.outerHeight - window.innerHeight]"
    )
    driver.set_window_size(WIDTH, int(bottom + chrome))
    driver.save_screenshot(path)


def look(driver, url: str, name: str) -> dict:
    driver.set_window_size(WIDTH, 1000)
    driver.get(f"{url}/dashboard")
    seen = read_page(driver)
    screenshot(driver, f"/tmp/dash_{name}.png")
    return seen


@pytest.mark.slow
async def test_dashboard_in_chromium(tmp_path, browser):
    settings = make_settings(tmp_path)
    async with running_server(settings, SimpleNamespace(version=1, adapters=None), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            empty = await asyncio.to_thread(look, browser, url, "empty")
            populate(settings.resolved_database_url)
            await asyncio.to_thread(refuse_some, lambda path, json: httpx.post(url + path, json=json))
            paused = await asyncio.to_thread(look, browser, url, "paused")
            assert (await http.post("/admin/resume", headers=ADMIN)).status_code == 200
            db = make_engine(settings.resolved_database_url)
            set_flag(db, ROLLBACK_TO, None)
            with db.begin() as conn:
                conn.execute(insert(LearnerCounter).values(name="dead_letters", value=5))
                conn.execute(
                    insert(LearnerStep),
                    [
                        dict(
                            run_id="r",
                            step=i,
                            version=1,
                            metrics=STEP | {"reward_mean": i / 40},
                            created_at=utcnow(),
                        )
                        for i in range(2, 41)
                    ],
                )
            db.dispose()
            verdict = add_lineage(settings.resolved_database_url)
            running = await asyncio.to_thread(look, browser, url, "running")

    # Nothing recorded: every chart says so, under its axis labels.
    assert empty["learning"] == "learning running" and empty["rollback-pending"] == ""
    assert (empty["newest-version"], empty["learner-steps"], empty["dead-letters"]) == ("none", "none", "0")
    assert (empty["guard"], empty["promoted-version"], empty["candidate-version"]) == (
        "guard only watches · probation",
        "none",
        "none",
    )
    assert empty["guard-says"] == PROBATION_SAYS
    assert (empty["decision"], empty["decision-detail"], empty["lineage"]) == ("–", "", "")
    assert all(c["empty"] for k, c in empty["charts"].items() if k != "c-rps")
    assert empty["charts"]["c-reward"]["x_label"] == "learner step"

    # Paused, a rollback pending, one learner step.
    assert paused["errors"] == [], paused["errors"]
    assert paused["learning"] == "LEARNING PAUSED" and "paused" in paused["learning_class"]
    assert paused["learning_colour"] != empty["learning_colour"]
    assert paused["rollback-pending"] == (
        "ROLLBACK PENDING: to version 1 (requested, not yet carried out by the learner)"
    )
    assert (paused["policy-version"], paused["newest-version"]) == ("1", "2")
    assert paused["newest-note"] == "a rollback to version 0; not served yet (serving 1)"
    assert (paused["learner-steps"], paused["last-reward"]) == ("1", "0.750")
    # 30 requests in the last 60 s (none in the last 10 s, where the old tile looked).
    assert paused["req-rate"] == "0.50"
    assert (paused["samples-trained"], paused["samples-waiting"]) == ("4", "3")
    # dead_letters: not a counter yet, shown as 0.
    assert (paused["dead-letters"], paused["rollback-refused"]) == ("0", "2")
    assert (paused["chat-refused"], paused["chat-refused-by"]) == ("1", "invalid_request 1")
    assert (paused["feedback-refused"], paused["feedback-refused-by"]) == ("1", "unknown 1")
    assert paused["other-counters"] == "other learner counters: expired 3"
    # The lifecycle: version 1 rejected (and served by this replica until it swaps), 2 promoted.
    assert (paused["guard"], paused["served-stage"], paused["promoted-version"]) == (
        "guard only watches · probation",
        "rejected",
        "2",
    )
    assert (paused["candidate-version"], paused["lineage"], paused["decision"]) == ("none", "", "–")
    assert paused["stage-counts"] == "promoted 2 · canary 0 · candidate 0 · rejected 1"
    reward = paused["charts"]["c-reward"]
    assert (reward["x_label"], reward["y_label"]) == ("learner step", "reward (0–1)")
    # One step: the x range is step 1 ± 1, its point in the middle of the plot (x: 56 + 388/2);
    # y: the reward's own range 0..1, 0.75 at 186 - 172 × 0.75 = 57.
    assert reward["x_ticks"] == ["0", "1", "2"] and reward["points"] == [["250.0", "57.0"]]
    assert reward["y_ticks"] == ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]
    # The rollback (version 2) came after step 1 (version 1): a line at step 1.5, 56 + 388 × 0.75.
    assert reward["vlines"] == ["347.0"] and reward["labels"] == ["↩ v0"]
    ev = paused["charts"]["c-ev"]
    # One value (0.3): its range is 0.3 ± 10 %, so 0.27..0.33.
    assert ev["y_ticks"] == ["0.28", "0.30", "0.32"] and len(ev["points"]) == 1
    version = paused["charts"]["c-version"]
    assert (version["x_label"], version["y_label"]) == ("time (local)", "policy version")
    # Versions 0 and 1 (served) as points, version 2 (the rollback to 0) marked; drawn by stage,
    # promoted (0, 2) before rejected (1).
    assert (
        len(version["points"]) == 2 and version["rollbacks"] == 1 and version["labels"] == ["↩ v0", "served"]
    )
    by_version = paused["charts"]["c-version-reward"]
    assert len(by_version["points"]) == 1 and by_version["rollbacks"] == 1
    assert paused["charts"]["c-rps"]["x_label"] == "seconds before now (bucket end)"

    # Resumed, the rollback carried out, 40 steps, 5 dead letters.
    assert running["errors"] == []
    assert running["learning"] == "learning running" and running["rollback-pending"] == ""
    assert running["dead-letters"] == "5" and running["learner-steps"] == "40"
    assert len(running["charts"]["c-reward"]["points"]) == 40
    # Versions 3 and 4 on probation, the guard off and version 2 pinned, the verdict shown.
    assert running["guard"] == "GUARD OFF · pinned to version 2"
    assert running["guard-says"] == (
        "off: every new version is promoted as it is recorded, with no comparison; pinned to version 2"
    )
    assert (running["candidate-version"], running["lineage"]) == ("4", "lineage: versions 3, 4")
    assert running["stage-counts"] == "promoted 2 · canary 2 · candidate 0 · rejected 1"
    assert running["decision"] == "continue"
    assert running["decision-detail"].startswith(
        f"Δ (lineage − promoted) in [{verdict.lower:.3f}, {verdict.upper:.3f}]; "
        "ratings: lineage 10 (mean 1.000), promoted 30 (mean 1.000); at "
    )
    # Five versions, one point each; the rollback (version 2) as a diamond, the rest circles.
    assert (
        len(running["charts"]["c-version"]["points"]) == 4
        and running["charts"]["c-version"]["rollbacks"] == 1
    )
