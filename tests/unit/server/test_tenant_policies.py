"""A policy per tenant, server side (issue 20, "Tenants"; docs/tenants.md, "A policy per tenant").

Unit tests (no vLLM): the caller's policy (``server.auth.policy_of``); the admin routes'
``?policy=`` (404 ``unknown_policy``), ``GET /admin/policies`` and the dashboard's rows;
feedback found only in its own policy's namespace; ``/v1/models`` per key; a tenant watcher's
swaps on the ``saoserve_tenant_*`` series, never the global ones; ``/readyz`` over every
policy. The real app and lifespan run on a fake engine whose ``view(policy)`` gives each
policy a ``FakeEngine`` of its own.

On one LoRA engine with the tenant policies acme and beta (namespaces, a version per tenant,
revoked keys, forget): tests/integration/test_tenant_policies.py.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from sqlalchemy import insert
from starlette.testclient import TestClient

from core.db import LearnerStep, PolicyVersion, make_engine
from core.policies import GLOBAL
from core.records import (
    TOPIC_FEEDBACK,
    feedback_token,
)
from server.auth import policy_of
from testing.fakes import FakeEngine, index_answer
from testing.servers import ADMIN, make_settings
from testing.tenants import (
    RefusingEngine,
    SharedFakeEngine,
    bearer,
    gauge,
    logged,
    make_key,
    namespaces,
    publish,
    row,
    tenant_settings,
)

UNKNOWN = "no policy named 'nope' (policies: global, acme, beta)"


# ------------------------------------------------------------------ the caller's policy


def test_a_callers_policy_is_its_keys_tenant_policy_else_the_global_one(tmp_path):
    settings = tenant_settings(tmp_path)
    assert policy_of(settings, "acme") == "acme"
    assert policy_of(settings, "beta") == "beta"
    assert policy_of(settings, "gamma") == GLOBAL  # a tenant without a policy of its own
    assert policy_of(settings, None) == GLOBAL  # no key
    assert policy_of(make_settings(tmp_path), "acme") == GLOBAL  # no tenant policies at all


# ------------------------------------------------------------------ admin routes, no engine


def test_admin_routes_take_a_policy_and_refuse_an_unknown_one(tmp_path):
    settings = tenant_settings(tmp_path)
    from server.app import create_app

    app = create_app(settings, engine=SharedFakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        for path in ("/admin/learner", "/admin/lifecycle", "/admin/policy_versions", "/admin/quarantine"):
            r = client.get(path, params={"policy": "nope"}, headers=ADMIN)
            assert r.status_code == 404, path
            assert r.json()["error"] | {} == {
                "message": UNKNOWN,
                "type": "invalid_request_error",
                "param": "policy",
                "code": "unknown_policy",
            }
        empty = client.get("/admin/learner", params={"policy": ""}, headers=ADMIN)
        assert empty.status_code == 404
        assert empty.json()["error"]["message"] == "no policy named '' (policies: global, acme, beta)"
        # Without the admin key the policy is never looked at: 401 first.
        assert client.get("/admin/learner", params={"policy": "nope"}).status_code == 401
        # The key registry is global: /admin/keys does not read ?policy=.
        assert client.get("/admin/keys", params={"policy": "nope"}, headers=ADMIN).status_code == 200
        assert client.post("/admin/pause", params={"policy": "acme"}, headers=ADMIN).status_code == 200
        learning = {
            p: client.get("/admin/learner", params={"policy": p}, headers=ADMIN).json()["learning"]
            for p in (GLOBAL, "acme", "beta")
        }
        assert learning == {GLOBAL: "running", "acme": "paused", "beta": "running"}
        assert client.get("/admin/learner", headers=ADMIN).json()["learning"] == "running"
        r = client.post(
            "/admin/lifecycle/guard", params={"policy": "beta"}, json={"on": False}, headers=ADMIN
        )
        assert r.status_code == 200
        guards = {
            p: client.get("/admin/lifecycle", params={"policy": p}, headers=ADMIN).json()["guard"]
            for p in (GLOBAL, "acme", "beta")
        }
        assert guards == {GLOBAL: "on", "acme": "on", "beta": "off"}


def test_admin_policies_lists_every_policy_global_first(tmp_path):
    settings = tenant_settings(tmp_path)
    from server.app import create_app

    engine = SharedFakeEngine(views={"acme": FakeEngine(version=3)})
    app = create_app(settings, engine=engine, watch_policy=False)
    with TestClient(app) as client:
        ns = namespaces(settings)
        at = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
        db = make_engine(ns["acme"].resolved_database_url)
        with db.begin() as conn:
            conn.execute(
                insert(PolicyVersion).values(
                    version=3, path="/p/v3", sha256="s", status="published", created_at=at, lifecycle="canary"
                )
            )
        db.dispose()
        db = make_engine(ns["beta"].resolved_database_url)
        with db.begin() as conn:
            for step, reward in ((1, 0.5), (2, 0.25)):
                conn.execute(
                    insert(LearnerStep).values(
                        run_id="r",
                        step=step,
                        version=step,
                        metrics={"reward_mean": reward, "staleness_mean": 1.5},
                        created_at=at,
                    )
                )
        db.dispose()
        client.post("/admin/pause", params={"policy": "beta"}, headers=ADMIN)
        assert client.get("/admin/policies").status_code == 401
        body = client.get("/admin/policies", headers=ADMIN).json()
        # With the admin key the dashboard shows every policy (without it: test_tenant_visibility).
        dashboard = client.get("/dashboard/state", headers=ADMIN).json()["policies"]
        # The dashboard's own fields are one policy's: beta's when asked (paused, serving 0),
        # acme's serving version 3; an unknown name is 404 as on the admin routes.
        beta = client.get("/dashboard/state", params={"policy": "beta"}, headers=ADMIN).json()
        acme = client.get("/dashboard/state", params={"policy": "acme"}, headers=ADMIN).json()
        unknown = client.get("/dashboard/state", params={"policy": "zed"}, headers=ADMIN)
    assert body == {
        "policies": [
            row(GLOBAL, 0),
            row("acme", 3, lifecycle="canary"),
            row(
                "beta",
                0,
                paused=True,
                steps=2,
                reward_mean=0.25,  # the newest step's (step 2), not the mean of the two
                staleness_mean=1.5,
                last_step_at="2025-06-01T12:00:00+00:00",
            ),
        ]
    }
    assert dashboard == body["policies"]
    assert (beta["learning"], beta["serving"], acme["learning"], acme["serving"]) == (
        "paused",
        0,
        "running",
        3,
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_policy"


def test_a_tenant_database_that_does_not_answer_leaves_the_other_rows_and_the_dashboard(tmp_path):
    from sqlalchemy import create_engine

    from server.app import create_app

    app = create_app(tenant_settings(tmp_path), engine=SharedFakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        # Beta's database is a file SQLite cannot open (its folder does not exist).
        app.state.tenants["beta"].store.engine = create_engine(f"sqlite:///{tmp_path}/missing/dir/x.db")
        rows = client.get("/admin/policies", headers=ADMIN).json()["policies"]
        dashboard = client.get("/dashboard/state", headers=ADMIN)
    assert [r["policy"] for r in rows] == [GLOBAL, "acme", "beta"]
    assert rows[1]["unavailable"] is None and rows[1]["paused"] is False
    assert rows[2] == {
        "policy": "beta",
        "tenant": "beta",
        "version": 0,
        "unavailable": "its database does not answer (OperationalError)",
        **dict.fromkeys(("lifecycle", "paused", "steps", "reward_mean", "staleness_mean", "last_step_at")),
    }
    assert dashboard.status_code == 200 and dashboard.json()["policies"] == rows


def test_without_tenant_policies_there_is_one_policy(tmp_path):
    from server.app import create_app

    app = create_app(make_settings(tmp_path), engine=FakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        rows = client.get("/admin/policies", headers=ADMIN).json()["policies"]
        assert [r["policy"] for r in rows] == [GLOBAL]
        r = client.get("/admin/learner", params={"policy": "acme"}, headers=ADMIN)
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "no policy named 'acme' (policies: global)"
        assert client.get("/admin/learner", params={"policy": "global"}, headers=ADMIN).status_code == 200
        card = client.get("/v1/models").json()["data"][0]
        assert (card["policy"], card["version"], card["owned_by"]) == (GLOBAL, 0, "saoserve")


def test_feedback_is_found_only_in_its_own_policys_namespace(tmp_path):
    settings = tenant_settings(tmp_path)
    ns = namespaces(settings)
    from server.app import create_app

    app = create_app(settings, engine=SharedFakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        acme, beta = make_key(client, "acme"), make_key(client, "beta")
        other = make_key(client, "gamma")  # a tenant without a policy of its own: the global one
        index_answer(ns["acme"], "chatcmpl-acme", "p-acme")
        index_answer(ns[GLOBAL], "chatcmpl-global", "p-global")
        secret = settings.feedback_secret

        def rate(completion: str, key: str | None):
            body = {"id": completion, "feedback_token": feedback_token(secret, completion), "reward": 1.0}
            return client.post("/v1/feedback", json=body, headers=bearer(key) if key else {})

        for key in (beta, other, None):
            r = rate("chatcmpl-acme", key)
            assert r.status_code == 404
            assert r.json()["error"]["message"] == "no completion with id 'chatcmpl-acme'"
        assert rate("chatcmpl-global", acme).status_code == 404
        assert rate("chatcmpl-acme", acme).status_code == 202
        assert rate("chatcmpl-global", other).status_code == 202
        text = client.get("/metrics").text
    feedback = {p: [r["trajectory_id"] for r in logged(s, TOPIC_FEEDBACK)] for p, s in ns.items()}
    assert feedback == {GLOBAL: ["chatcmpl-global"], "acme": ["chatcmpl-acme"], "beta": []}
    assert gauge(text, "saoserve_tenant_feedback_accepted_total", tenant="acme") == 1.0
    assert gauge(text, "saoserve_feedback_total", result="unknown") == 4.0  # 3 + 1 refused above


def test_the_model_list_names_the_policy_and_version_that_serve_the_key(tmp_path):
    settings = tenant_settings(tmp_path)
    from server.app import create_app

    engine = SharedFakeEngine(version=2, views={"acme": FakeEngine(version=5)})
    app = create_app(settings, engine=engine, watch_policy=False)
    with TestClient(app) as client:
        acme, beta = make_key(client, "acme"), make_key(client, "beta")
        cards = {
            who: client.get("/v1/models", headers=bearer(key) if key else {}).json()["data"][0]
            for who, key in (("acme", acme), ("beta", beta), ("anonymous", None))
        }
        one = client.get(f"/v1/models/{settings.served_model_name}", headers=bearer(acme)).json()
    picked = {w: (c["policy"], c["version"], c["policy_version"], c["owned_by"]) for w, c in cards.items()}
    assert picked == {
        "acme": ("acme", 5, 5, "saoserve/acme"),
        "beta": ("beta", 0, 0, "saoserve/beta"),
        "anonymous": (GLOBAL, 2, 2, "saoserve"),
    }
    assert one == cards["acme"]


def test_a_tenant_watcher_sets_the_tenant_series_and_readiness_covers_every_policy(tmp_path):
    settings = tenant_settings(tmp_path)
    ns = namespaces(settings)
    publish(ns["acme"], 2, tmp_path / "acme-v2")
    publish(ns["beta"], 4, tmp_path / "beta-v4")
    from server.app import create_app

    engine = SharedFakeEngine(views={"beta": RefusingEngine()})
    app = create_app(settings, engine=engine)
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while engine.views["acme"].version != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        text = client.get("/metrics").text
        # With the admin key, the tenant's name (without it: test_tenant_visibility).
        ready = client.get("/readyz", headers=ADMIN)
        rows = client.get("/admin/policies", headers=ADMIN).json()["policies"]
    assert engine.views["acme"].swaps == [(2, tmp_path / "acme-v2", "0" * 64)]
    assert engine.version == 0 and engine.swaps == []
    assert gauge(text, "saoserve_tenant_policy_version", tenant="acme") == 2.0
    assert gauge(text, "saoserve_tenant_policy_version", tenant="beta") == 0.0
    assert gauge(text, "saoserve_tenant_policy_swaps_total", tenant="acme", result="ok") == 1.0
    assert gauge(text, "saoserve_tenant_policy_swaps_total", tenant="beta", result="refused") >= 1.0
    # The global series are the global policy's alone: version 0, no swap counted.
    assert gauge(text, "saoserve_policy_version") == 0.0
    assert gauge(text, "saoserve_policy_swaps_total", result="ok") is None
    assert [r["version"] for r in rows] == [0, 2, 0]
    # Beta's refused version is reported, and the replica stays ready for the global policy and
    # acme (beta's own chats are refused by its watcher until a version of it loads).
    assert ready.status_code == 200
    assert ready.json() == {
        "ready": True,
        "policy_version": 0,
        "database": "ok",
        "log": "ok",
        "engine": "ok",
        "policy": "beta: catching up: serves version 0, the policy topic's newest is 4 "
        "(its swap was refused; see the server's log)",
    }


# ------------------------------------------------------------------ on the real engine
