"""``/metrics`` over every policy (docs/tenants.md, "Metrics"): each tenant policy's lifecycle,
guard, learner counters and identity gauges on the ``saoserve_tenant_*{tenant}`` families, read
from its namespace's database at each scrape, the global families unchanged beside them; a
tenant database that does not answer keeps its last figures and the scrape; a tenant policy
removed at run time leaves none of its series (``ServerMetrics.forget_tenant_policy``); and the
policy watcher's log lines name their policy. The real app and lifespan on the fake engine of
tests/unit/server/test_tenant_policies.py (no vLLM), or ``ServerMetrics`` alone."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from datetime import UTC, datetime

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import create_engine, insert
from sqlalchemy.engine import Engine
from starlette.testclient import TestClient

import server.metrics as metrics_module
from core import logs
from core.control import GUARD_OFF, GUARD_PIN, GUARD_VERDICT, PAUSED, set_flag
from core.db import LearnerCounter, LearnerStep, PolicyVersion, make_engine, migrate
from core.policies import GLOBAL
from server.engine import SwapResult
from server.metrics import ServerMetrics
from testing.servers import ADMIN
from testing.tenants import RefusingEngine, SharedFakeEngine, namespaces, publish, tenant_settings

# The figures the lifecycle and learner collectors export, without the ``saoserve_`` or
# ``saoserve_tenant_`` prefix (``saoserve_policy_version``, the version served, is not one).
LIFECYCLE = (
    "policy_versions",
    "policy_promoted_version",
    "policy_candidate_version",
    "policy_lineage_versions",
)
PREFIXES = ("guard_", "learner_")
AT = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
# 2025-06-01T12:00:00Z: 55 years (1970..2024, 14 leap years) + 151 days (Jan..May) = 20240 days, + 12 h.
AT_UNIX = (55 * 365 + 14 + 151) * 86400 + 12 * 3600
assert AT_UNIX == AT.timestamp() == 1_748_779_200


def scrape(client) -> tuple[dict, dict]:
    """``/metrics``' lifecycle and learner samples: the global ones as {(name, labels): value}
    and the tenant ones as {tenant: {(name without ``_tenant``, other labels): value}}, labels
    as sorted tuples."""
    r = client.get("/metrics")
    assert r.status_code == 200
    global_, tenants = {}, {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.startswith("saoserve_tenant_"):
                short = s.name.removeprefix("saoserve_tenant_")
                if short.startswith(PREFIXES) or short in LIFECYCLE:
                    tenant = labels.pop("tenant")
                    tenants.setdefault(tenant, {})[(f"saoserve_{short}", tuple(sorted(labels.items())))] = (
                        s.value
                    )
            else:
                short = s.name.removeprefix("saoserve_")
                if short.startswith(PREFIXES) or short in LIFECYCLE:
                    assert "tenant" not in labels, s
                    global_[(s.name, tuple(sorted(labels.items())))] = s.value
    return global_, tenants


def write_acme(url: str) -> None:
    """Into acme's namespace: versions 0 and 2 promoted, 1 rejected, 3 and 4 on canary (the
    lineage [3, 4]); the learner's verdict on that lineage; the guard off and version 2 pinned;
    the counters expired 3 and dead_letters 2; two learner steps, the newer with identity and step
    figures; learning paused."""
    db = make_engine(url)
    try:
        with db.begin() as conn:
            for v, stage in ((0, "promoted"), (1, "rejected"), (2, "promoted"), (3, "canary"), (4, "canary")):
                conn.execute(
                    insert(PolicyVersion).values(
                        version=v,
                        path=f"/policies/{v}",
                        sha256="0" * 64,
                        status="published",
                        parent_version=v - 1 if v else None,
                        metrics={},
                        created_at=AT,
                        lifecycle=stage,
                    )
                )
            conn.execute(
                insert(LearnerCounter),
                [{"name": "expired", "value": 3}, {"name": "dead_letters", "value": 2}],
            )
            conn.execute(
                insert(LearnerStep),
                [
                    # The older step's figures are not shown: only the newest step's are.
                    dict(run_id="r", step=1, version=3, metrics={"identity_count": 9}, created_at=AT),
                    dict(
                        run_id="r",
                        step=2,
                        version=4,
                        metrics={
                            "identity_top_share": 0.5,
                            "identity_top_sample_share": 0.25,
                            "identity_count": 4,
                            "identity_deferred": 1,
                            "reward_mean": 0.625,
                            "staleness_mean": 0.5,
                            "step_time_s": 18.5,
                        },
                        created_at=AT,
                    ),
                ],
            )
        verdict = {
            "lineage": [3, 4],
            "at": AT.isoformat(),
            "decision": "continue",
            "lower": -0.25,
            "upper": 0.5,
            "candidate": {"n": 10, "mean": 0.75},
            "promoted": {"n": 30, "mean": 0.625},
            # one key held 4 of the candidate arm's 10 ratings, among 5 identified senders
            "senders": {
                "candidate": {"votes": 10, "identified": 5, "top_share": 0.4, "held_back": 7},
                "promoted": {"votes": 30, "identified": 30, "top_share": 1 / 30},
            },
        }
        set_flag(db, GUARD_VERDICT, json.dumps(verdict))
        set_flag(db, GUARD_OFF, "1")
        set_flag(db, GUARD_PIN, "2")
        set_flag(db, PAUSED, "1")
    finally:
        db.dispose()


def write_global(url: str) -> None:
    """Into the global namespace: version 0 promoted and the counter expired 1."""
    db = make_engine(url)
    try:
        with db.begin() as conn:
            conn.execute(
                insert(PolicyVersion).values(
                    version=0,
                    path="/policies/0",
                    sha256="0" * 64,
                    status="published",
                    created_at=AT,
                    lifecycle="promoted",
                )
            )
            conn.execute(insert(LearnerCounter).values(name="expired", value=1))
    finally:
        db.dispose()


def stages(candidate: int, canary: int, promoted: int, rejected: int) -> dict:
    return {
        ("saoserve_policy_versions", (("stage", s),)): n
        for s, n in (
            ("candidate", candidate),
            ("canary", canary),
            ("promoted", promoted),
            ("rejected", rejected),
        )
    }


# acme, from write_acme: promoted 0 and 2 (2), rejected 1 (1), canary 3 and 4 (2), no candidate;
# the promoted version is the newest promoted one, 2; the candidate version the lineage's newest, 4.
ACME = {
    **stages(candidate=0, canary=2, promoted=2, rejected=1),
    ("saoserve_policy_promoted_version", ()): 2,
    ("saoserve_policy_candidate_version", ()): 4,
    ("saoserve_policy_lineage_versions", ()): 2,
    ("saoserve_guard_enabled", ()): 0,
    ("saoserve_guard_pinned_version", ()): 2,
    ("saoserve_guard_delta_bound", (("bound", "lower"),)): -0.25,
    ("saoserve_guard_delta_bound", (("bound", "upper"),)): 0.5,
    ("saoserve_guard_ratings", (("arm", "candidate"),)): 10,
    ("saoserve_guard_ratings", (("arm", "promoted"),)): 30,
    ("saoserve_guard_arm_mean", (("arm", "candidate"),)): 0.75,
    ("saoserve_guard_arm_mean", (("arm", "promoted"),)): 0.625,
    ("saoserve_guard_decision", (("decision", "continue"),)): 1,
    ("saoserve_guard_decision", (("decision", "promote"),)): 0,
    ("saoserve_guard_decision", (("decision", "reject"),)): 0,
    ("saoserve_guard_verdict_timestamp_seconds", ()): AT_UNIX,
    ("saoserve_guard_top_sender_share", (("arm", "candidate"),)): 0.4,
    ("saoserve_guard_top_sender_share", (("arm", "promoted"),)): 1 / 30,
    ("saoserve_guard_identified_senders", (("arm", "candidate"),)): 5,
    ("saoserve_guard_identified_senders", (("arm", "promoted"),)): 30,
    # The ratings the cap did not count: 7 of the lineage's; none recorded for the promoted arm.
    ("saoserve_guard_votes_held_back", (("arm", "candidate"),)): 7,
    ("saoserve_guard_votes_held_back", (("arm", "promoted"),)): 0,
    ("saoserve_learner_events_total", (("event", "dead_letters"),)): 2,
    ("saoserve_learner_events_total", (("event", "expired"),)): 3,
    ("saoserve_learner_identity_top_share", ()): 0.5,
    ("saoserve_learner_identity_top_sample_share", ()): 0.25,
    ("saoserve_learner_identity_count", ()): 4,
    ("saoserve_learner_identity_deferred", ()): 1,
    # The newest step (version 4, at AT) and its figures (no kept_fraction: none shown); paused.
    ("saoserve_learner_reward_mean", ()): 0.625,
    ("saoserve_learner_staleness_mean", ()): 0.5,
    ("saoserve_learner_step_seconds", ()): 18.5,
    ("saoserve_learner_last_step_timestamp_seconds", ()): AT_UNIX,
    ("saoserve_learner_last_step_version", ()): 4,
    ("saoserve_learner_paused", ()): 1,
}
# A namespace with nothing written (beta): every stage 0, no promoted version, no lineage, the
# guard on, no verdict, no counter (the events family has no sample), no step, not paused.
EMPTY = {
    **stages(0, 0, 0, 0),
    ("saoserve_policy_lineage_versions", ()): 0,
    ("saoserve_guard_enabled", ()): 1,
    ("saoserve_learner_paused", ()): 0,
}
# The global namespace, from write_global: version 0 promoted (1), no lineage; expired 1.
GLOBAL_FIGURES = {
    **stages(candidate=0, canary=0, promoted=1, rejected=0),
    ("saoserve_policy_promoted_version", ()): 0,
    ("saoserve_policy_lineage_versions", ()): 0,
    ("saoserve_guard_enabled", ()): 1,
    ("saoserve_learner_events_total", (("event", "expired"),)): 1,
    ("saoserve_learner_paused", ()): 0,
}


def test_a_tenant_policys_lifecycle_and_learner_are_on_the_tenant_families(tmp_path):
    settings = tenant_settings(tmp_path)
    ns = namespaces(settings)
    from server.app import create_app

    app = create_app(settings, engine=SharedFakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        before, tenants_before = scrape(client)
        write_acme(ns["acme"].resolved_database_url)
        write_global(ns[GLOBAL].resolved_database_url)
        after, tenants = scrape(client)
        text = client.get("/metrics").text
    # Before anything is written every namespace is empty, the global one included.
    assert before == EMPTY and tenants_before == {"acme": EMPTY, "beta": EMPTY}
    assert after == GLOBAL_FIGURES
    assert tenants == {"acme": ACME, "beta": EMPTY}
    # The tenant families carry the tenant label first, and each name is one family of the scrape.
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert [s.labels for s in families["saoserve_tenant_guard_delta_bound"].samples] == [
        {"tenant": "acme", "bound": "lower"},
        {"tenant": "acme", "bound": "upper"},
    ]
    assert [
        line for line in text.splitlines() if line.startswith("# TYPE saoserve_tenant_policy_versions ")
    ] == ["# TYPE saoserve_tenant_policy_versions gauge"]
    assert [
        (s.labels["tenant"], s.labels["stage"]) for s in families["saoserve_tenant_policy_versions"].samples
    ] == [(t, s) for t in ("acme", "beta") for s in ("candidate", "canary", "promoted", "rejected")]


def test_a_tenant_database_that_does_not_answer_keeps_its_last_figures_and_the_scrape(tmp_path, caplog):
    settings = tenant_settings(tmp_path)
    ns = namespaces(settings)
    for policy, write in (("acme", write_acme), (GLOBAL, write_global)):
        migrate(ns[policy].resolved_database_url)  # before the app starts: it would migrate them
        write(ns[policy].resolved_database_url)
    from server.app import create_app

    app = create_app(settings, engine=SharedFakeEngine(), watch_policy=False)
    # A file SQLite cannot open (its folder does not exist).
    missing = create_engine(f"sqlite:///{tmp_path}/missing/dir/x.db")
    # The policy a line is about is a bound id (core.logs.bind): the capture sets it on its
    # records as the server's own handler does.
    caplog.handler.addFilter(logs.BoundIds())
    with caplog.at_level(logging.WARNING, logger="server.db_figures"), TestClient(app) as client:
        acme, beta = app.state.tenants["acme"].store, app.state.tenants["beta"].store
        # Beta's database does not answer from the first scrape: no figures of it to keep.
        beta_db, beta.engine = beta.engine, missing
        _, first = scrape(client)
        # Then acme's stops answering too: its figures of the first scrape stay.
        acme_db, acme.engine = acme.engine, missing
        after, second = scrape(client)
        acme.engine, beta.engine = acme_db, beta_db
    missing.dispose()
    assert first == {"acme": ACME}
    assert second == {"acme": ACME}
    assert after == GLOBAL_FIGURES
    warnings = sorted((r.policy, r.getMessage()) for r in caplog.records)
    # One read a policy and scrape, in one connection: beta's fails at both scrapes, acme's at
    # the second only: 2 + 1 = 3 lines.
    line = "learner counters and lifecycle not read for /metrics: OperationalError"
    assert warnings == [("acme", f"acme: {line}"), *[("beta", f"beta: {line}")] * 2]


def test_a_tenant_database_that_hangs_does_not_hold_the_scrape(tmp_path, caplog, monkeypatch):
    """beta's reads block (a database that never answers): the scrape answers after the
    readiness probe's 2 s (here 0.5 s) with beta's last figures (none yet) and the others'
    fresh ones; the next scrape does not start a second read of beta while the first blocks."""
    settings = tenant_settings(tmp_path)
    ns = namespaces(settings)
    for policy, write in (("acme", write_acme), (GLOBAL, write_global)):
        migrate(ns[policy].resolved_database_url)
        write(ns[policy].resolved_database_url)
    from server.app import create_app
    from server.metrics import ServerMetrics
    from server.ops import api_router as ops

    monkeypatch.setattr(ops, "READY_PROBE_S", 0.5)
    release, started_reads = threading.Event(), []
    read_policy = ServerMetrics.read_policy

    def hanging(self, policy, db):
        if policy == "beta":
            started_reads.append(policy)
            release.wait(30)
            return
        read_policy(self, policy, db)

    monkeypatch.setattr(ServerMetrics, "read_policy", hanging)
    app = create_app(settings, engine=SharedFakeEngine(), watch_policy=False)
    with caplog.at_level(logging.WARNING, logger="server.metrics"), TestClient(app) as client:
        first = scrape(client)
        second = scrape(client)
        release.set()
    assert first == second == (GLOBAL_FIGURES, {"acme": ACME})
    assert started_reads == ["beta"]  # the second scrape waited on the read in flight
    lines = [r.getMessage() for r in caplog.records if r.name == "server.metrics"]
    # Logged only while beta's read still runs: each scrape answered before it ended.
    assert lines == ["beta: learner counters and lifecycle not read within 0.5 s for /metrics"] * 2


def test_a_watchers_log_lines_name_its_policy(tmp_path, caplog):
    settings = tenant_settings(tmp_path)
    ns = namespaces(settings)
    publish(ns["beta"], 4, tmp_path / "beta-v4")
    from server.app import create_app

    engine = SharedFakeEngine(views={"beta": RefusingEngine()})
    app = create_app(settings, engine=engine)
    with caplog.at_level(logging.ERROR, logger="server.policy_watch"), TestClient(app):
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    refused = {(r.policy, r.getMessage()) for r in caplog.records}
    # Beta's watcher tries version 4 at each read and logs each refusal: the same line each time.
    assert refused == {("beta", "beta: policy version 4 refused: version 4 refused")}


# ------------------------------------------------------------------ a tenant policy removed


def by_tenant(text: str) -> dict[str, dict]:
    """The samples of an exposition ``text`` that have a ``tenant`` label, as {tenant: {(sample
    name, other labels sorted): value}}; the ``_created`` ones (a series' creation time) left
    out."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            if "tenant" in labels and not s.name.endswith("_created"):
                tenant = labels.pop("tenant")
                out.setdefault(tenant, {})[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


# A sample of each family a tenant policy's own serving sets (``TenantPolicyMetrics``).
SERVING = {
    "saoserve_tenant_policy_version",
    "saoserve_tenant_policy_swapped_at_seconds",
    "saoserve_tenant_policy_swaps_total",
    "saoserve_tenant_policy_swap_seconds_count",
    "saoserve_tenant_policy_stage_events_total",
    "saoserve_tenant_canary_requests_total",
    "saoserve_tenant_canary_share",
    "saoserve_tenant_feedback_to_swap_seconds_count",
    "saoserve_tenant_feedback_to_served_seconds_count",
}
TOKENS = ("saoserve_tenant_generated_tokens_total", ())


def test_a_forgotten_tenant_policys_series_leave_the_registry_and_the_others_stay(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/ns.db"
    migrate(url)
    db = make_engine(url)
    m = ServerMetrics()
    monkeypatch.setattr(metrics_module.time, "time", lambda: 50.0)
    for tenant, version in (("acme", 3), ("beta", 5)):
        t = m.of_tenant_policy(tenant)
        t.swapped(SwapResult(version=version, seconds=1.5, paused_seconds=0.0))
        t.stage_events.labels("canary").inc()
        t.canary_requests.labels("control").inc()
        t.canary_share.set(0.25)
        t.awaiting_answer(version, 42.5)
        t.answered(version)
        m.read_policy(tenant, db)  # an empty namespace's learner counters and lifecycle
    db.dispose()
    m.tenant_tokens.labels(m.tenant_label("acme")).inc(7)  # acme's API keys' tokens
    before = by_tenant(generate_latest(m.registry).decode())
    acme = before["acme"]
    # Every serving family holds acme's series, with the values set: version 3 swapped in at
    # t = 50 in 1.5 s; feedback→swap and →served of a batch completed at 42.5: 50 − 42.5 = 7.5 s.
    assert SERVING <= names(acme)
    assert acme[("saoserve_tenant_policy_version", ())] == 3
    assert acme[("saoserve_tenant_policy_swapped_at_seconds", ())] == 50
    assert acme[("saoserve_tenant_policy_swaps_total", (("result", "ok"),))] == 1
    assert acme[("saoserve_tenant_policy_swap_seconds_sum", ())] == 1.5
    assert acme[("saoserve_tenant_policy_stage_events_total", (("stage", "canary"),))] == 1
    assert acme[("saoserve_tenant_canary_requests_total", (("arm", "control"),))] == 1
    assert acme[("saoserve_tenant_canary_share", ())] == 0.25
    assert acme[("saoserve_tenant_feedback_to_swap_seconds_sum", ())] == 7.5
    assert acme[("saoserve_tenant_feedback_to_served_seconds_sum", ())] == 7.5
    # The lifecycle figures of its namespace, read: no version at any stage.
    assert acme[("saoserve_tenant_policy_versions", (("stage", "canary"),))] == 0
    assert acme[TOKENS] == 7
    m.forget_tenant_policy("acme")
    after = by_tenant(generate_latest(m.registry).decode())
    # Only acme's keys' series stays (its keys are the global policy's now); beta's are untouched.
    assert after == {"acme": {TOKENS: 7}, "beta": before["beta"]}
    assert SERVING <= names(after["beta"])
    m.forget_tenant_policy("acme")  # again: nothing left to take, nothing raised
    assert by_tenant(generate_latest(m.registry).decode()) == after


def held_reads(tmp_path, monkeypatch) -> tuple[ServerMetrics, Engine, threading.Event]:
    """Metrics whose scrape reads of a migrated namespace database wait for the event before
    they read (at most 30 s): the metrics, the database, the event."""
    url = f"sqlite:///{tmp_path}/ns.db"
    migrate(url)
    read_policy = ServerMetrics.read_policy
    release = threading.Event()

    def held(self, policy, engine):
        release.wait(30)
        read_policy(self, policy, engine)

    monkeypatch.setattr(ServerMetrics, "read_policy", held)
    return ServerMetrics(), make_engine(url), release


async def test_a_read_in_flight_when_a_tenant_policy_is_forgotten_leaves_no_figures(tmp_path, monkeypatch):
    """acme's scrape read is held past the scrape's 0.05 s; forgotten meanwhile, its figures,
    written when the read ends, are dropped then. The same read without the forget leaves them."""
    m, db, release = held_reads(tmp_path, monkeypatch)
    try:
        await m.read_for_scrape({"acme": db}, 0.05)
        running = m._scrape_reads["acme"]  # the read in flight, to wait for its end
        m.forget_tenant_policy("acme")
        release.set()
        await asyncio.wrap_future(running)
        assert "acme" not in by_tenant(generate_latest(m.registry).decode())
        await m.read_for_scrape({"acme": db}, 5.0)
        assert ("saoserve_tenant_policy_versions", (("stage", "canary"),)) in by_tenant(
            generate_latest(m.registry).decode()
        )["acme"]
    finally:
        release.set()
        db.dispose()


async def test_a_scrape_waiting_while_its_tenant_policy_is_forgotten_ends_without_error(
    tmp_path, monkeypatch
):
    """A scrape waits up to its time-out for acme's read; acme is forgotten while it waits (a
    removal at run time): the scrape ends as usual, without acme's read to look at (it raised
    KeyError, and Prometheus saw the replica down for that scrape)."""
    m, db, release = held_reads(tmp_path, monkeypatch)
    try:
        scrape = asyncio.create_task(m.read_for_scrape({"acme": db}, 0.5))
        await asyncio.sleep(0.1)
        m.forget_tenant_policy("acme")
        await scrape
        assert "acme" not in m._scrape_reads
    finally:
        release.set()
        db.dispose()


def test_a_tenant_policy_removed_at_run_time_leaves_no_series_on_metrics(tmp_path):
    settings = tenant_settings(tmp_path, tenant_poll_s=0.05)
    from server.app import create_app

    app = create_app(settings, engine=SharedFakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        _, tenants = scrape(client)
        assert tenants == {"acme": EMPTY, "beta": EMPTY}
        served = by_tenant(client.get("/metrics").text)
        # Each tenant policy serves version 0 (the base weights) since the start.
        assert [served[t][("saoserve_tenant_policy_version", ())] for t in ("acme", "beta")] == [0, 0]
        assert client.delete("/admin/tenant_policies/beta", headers=ADMIN).status_code == 200
        deadline = time.monotonic() + 10
        while client.get("/admin/tenant_policies", headers=ADMIN).json()["served"] != ["acme"]:
            assert time.monotonic() < deadline, "beta was not removed in time"
            time.sleep(0.05)
        _, tenants = scrape(client)
        left = by_tenant(client.get("/metrics").text)
    assert tenants == {"acme": EMPTY}
    assert left == {"acme": served["acme"]}
