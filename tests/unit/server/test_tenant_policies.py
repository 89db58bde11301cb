"""A policy per tenant, server side (issue 20, "Tenants"; docs/tenants.md, "A policy per tenant").

Unit tests (no vLLM): the caller's policy (``server.auth.policy_of``); the admin routes'
``?policy=`` (404 ``unknown_policy``), ``GET /admin/policies`` and the dashboard's rows;
feedback found only in its own policy's namespace; ``/v1/models`` per key; a tenant watcher's
swaps on the ``saoserve_tenant_*`` series, never the global ones; ``/readyz`` over every
policy. The real app and lifespan run on a fake engine whose ``view(policy)`` gives each
policy a ``FakeEngine`` of its own.

Integration (``engine``): one LoRA engine with the tenant policies acme and beta: trajectories,
feedback, episodes and evidence stay in their namespace; a version published in acme's
namespace serves acme's next request and not beta's; a revoked key is refused on its
episode's next turn; forget covers every namespace.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert, select
from starlette.testclient import TestClient

from core.db import LearnerStep, PolicyVersion, TrajectoryIndex, make_engine
from core.evidence_store import EvidenceStore
from core.logbus import open_log
from core.policies import GLOBAL
from core.policy_store import version_dir
from core.records import (
    POLICY_KEY,
    TOPIC_FEEDBACK,
    TOPIC_POLICY,
    TOPIC_TRAJECTORIES,
    PolicyEvent,
    feedback_token,
    utcnow,
)
from core.settings import AdapterServing
from core.weights import weights_sha256
from server.auth import policy_of
from testing.fakes import FakeEngine, index_answer
from testing.servers import ADMIN, make_settings, running_server
from testing.tenants import (
    TENANTS,
    RefusingEngine,
    SharedFakeEngine,
    bearer,
    make_key,
    namespaces,
    publish,
    row,
    tenant_settings,
)

UNKNOWN = "no policy named 'nope' (policies: global, acme, beta)"


def logged(settings, topic: str) -> list[dict]:
    """Every record of ``topic`` in the log of ``settings``' namespace, as JSON."""
    lt = open_log(settings.resolved_log_url)
    try:
        out = []
        for p in lt.partitions(topic):
            out += [json.loads(e.value) for e in lt.read(topic, p, 0, 1000, 0.2)]
        return out
    finally:
        lt.close()


def gauge(text: str, name: str, **labels) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


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

PROMPT = [{"role": "user", "content": "Write two sentences about the sea."}]


@pytest.fixture(scope="module")
async def tenant_engine(model_dir, tmp_path_factory):
    """One LoRA engine serving the global policy and the tenant policies acme and beta
    (9 adapter slots, 2 per batch, rank ≤ 16)."""
    from core.settings import Settings
    from server.engine import PolicyEngine

    settings = Settings(
        home=tmp_path_factory.mktemp("tenant-engine"),
        model_dir=model_dir,
        kv_cache_gib=1.0,
        adapter_serving=AdapterServing.ADAPTER,
        max_loras=2,
        max_lora_rank=16,
        max_cpu_loras=9,
        tenant_policies=TENANTS,
    )
    engine = await PolicyEngine.start(settings, model_dir)
    yield engine
    engine.shutdown()


async def new_key(http, tenant: str) -> tuple[str, str]:
    r = await http.post("/admin/keys", json={"tenant": tenant}, headers=ADMIN)
    assert r.status_code == 201
    return r.json()["key"], r.json()["id"]


async def chat(http, key: str | None, seed: int, **extra) -> httpx.Response:
    body = {"messages": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": seed, **extra}
    return await http.post("/v1/chat/completions", json=body, headers=bearer(key) if key else {})


def indexed(settings) -> set[str]:
    db = make_engine(settings.resolved_database_url)
    try:
        with db.connect() as conn:
            return set(conn.execute(select(TrajectoryIndex.id)).scalars())
    finally:
        db.dispose()


@pytest.mark.engine
async def test_each_tenants_answers_feedback_and_episodes_stay_in_its_namespace(tenant_engine, tmp_path):
    settings = tenant_settings(tmp_path)
    ns = namespaces(settings)
    async with (
        running_server(settings, tenant_engine) as url,
        httpx.AsyncClient(base_url=url, timeout=120) as http,
    ):
        (acme, _), (beta, _) = await new_key(http, "acme"), await new_key(http, "beta")
        # acme's evidence of the prompt "sea": 3 successes at version 0 on the prior (4, 4).
        db = make_engine(ns["acme"].resolved_database_url)
        with db.begin() as conn:
            EvidenceStore(db).add_results(conn, [("sea", 1.0, 0)] * 3)
        db.dispose()
        answers = {}
        for who, key in (("acme", acme), ("beta", beta)):
            r = await chat(http, key, seed=1, prompt_id="sea", user="alice")
            assert r.status_code == 200 and r.json()["policy_version"] == 0
            answers[who] = r.json()
        ids = {who: a["id"] for who, a in answers.items()}
        # Rating acme's answer needs a key of acme: beta's finds no such completion.
        body = {"id": ids["acme"], "feedback_token": answers["acme"]["feedback_token"], "reward": 1.0}
        assert (await http.post("/v1/feedback", json=body, headers=bearer(beta))).status_code == 404
        assert (await http.post("/v1/feedback", json=body, headers=bearer(acme))).status_code == 202
        body = {"id": ids["beta"], "feedback_token": answers["beta"]["feedback_token"], "reward": 0.0}
        assert (await http.post("/v1/feedback", json=body, headers=bearer(beta))).status_code == 202
        # Each record in its namespace, read through the admin route's ?policy=.
        recs = {}
        for who in ("acme", "beta"):
            r = await http.get(f"/admin/trajectories/{ids[who]}", params={"policy": who}, headers=ADMIN)
            assert r.status_code == 200
            recs[who] = r.json()
            assert (await http.get(f"/admin/trajectories/{ids[who]}", headers=ADMIN)).status_code == 404
        evidence = await http.get("/admin/evidence/sea", params={"policy": "acme"}, headers=ADMIN)
        versions = await http.get("/admin/policy_versions", params={"policy": "acme"}, headers=ADMIN)
        logs = {
            topic: {p: await asyncio.to_thread(logged, s, topic) for p, s in ns.items()}
            for topic in (TOPIC_TRAJECTORIES, TOPIC_FEEDBACK)
        }
        forgotten = await http.post("/admin/forget", json={"user": "alice"}, headers=ADMIN)
    # The dispatch froze each namespace's own evidence: acme's (4 + 3, 4 + 0), beta's the prior.
    assert (recs["acme"]["baseline"]["alpha"], recs["acme"]["baseline"]["beta"]) == (7.0, 4.0)
    assert (recs["beta"]["baseline"]["alpha"], recs["beta"]["baseline"]["beta"]) == (4.0, 4.0)
    assert (recs["acme"]["tenant"], recs["beta"]["tenant"]) == ("acme", "beta")
    assert evidence.json()["n_results"] == 3 and versions.json() == {"serving": 0, "versions": []}
    trajectories = {p: [r["id"] for r in recs] for p, recs in logs[TOPIC_TRAJECTORIES].items()}
    assert trajectories == {GLOBAL: [], "acme": [ids["acme"]], "beta": [ids["beta"]]}
    feedback = {
        p: [(r["trajectory_id"], r["reward"]) for r in recs] for p, recs in logs[TOPIC_FEEDBACK].items()
    }
    assert feedback == {GLOBAL: [], "acme": [(ids["acme"], 1.0)], "beta": [(ids["beta"], 0.0)]}
    # forget ran in every namespace: alice's two answers, one in each tenant's, gone from both.
    assert forgotten.status_code == 200 and forgotten.json()["trajectories"] == 2
    assert all(logged(s, TOPIC_TRAJECTORIES) == [] for s in ns.values())
    assert {p: indexed(s) for p, s in ns.items()} == {GLOBAL: set(), "acme": set(), "beta": set()}


@pytest.mark.engine
async def test_a_version_published_for_acme_serves_acme_only_and_a_revoked_key_ends_its_episode(
    tenant_engine, model_dir, tmp_path
):
    from testing.adapters import write_adapters

    settings = tenant_settings(tmp_path)
    ns = namespaces(settings)
    eng = tenant_engine
    v = eng.view("acme").version + 1
    folder = version_dir(ns["acme"].resolved_policy_dir, v)
    write_adapters(model_dir, [folder], seed=3)
    sha = weights_sha256(folder)
    async with running_server(settings, eng) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        (acme, acme_id), (beta, _) = await new_key(http, "acme"), await new_key(http, "beta")
        event = PolicyEvent(
            version=v, path=str(folder), sha256=sha, created_at=utcnow(), parent_version=v - 1
        )
        lt = open_log(ns["acme"].resolved_log_url)
        await asyncio.to_thread(lt.append, TOPIC_POLICY, POLICY_KEY, event.to_json())
        lt.close()
        for _ in range(400):
            card = (await http.get("/v1/models", headers=bearer(acme))).json()["data"][0]
            if card["version"] == v:
                break
            await asyncio.sleep(0.05)
        assert card["version"] == v
        served = {}
        for who, key in (("acme", acme), ("beta", beta), (GLOBAL, None)):
            r = await chat(http, key, seed=2)
            assert r.status_code == 200
            rec = await http.get(
                f"/admin/trajectories/{r.json()['id']}", params={"policy": who}, headers=ADMIN
            )
            served[who] = (r.json()["policy_version"], rec.json()["token_versions"])
        text = (await http.get("/metrics")).text
        rows = (await http.get("/admin/policies", headers=ADMIN)).json()["policies"]
        # An episode of acme: its key revoked after turn 0, turn 1 is refused.
        first = await chat(http, acme, seed=3, episode_id="ep-acme")
        assert first.status_code == 200
        await http.post(f"/admin/keys/{acme_id}/revoke", headers=ADMIN)
        token = first.json()["episode_feedback_token"]
        nxt = await chat(http, acme, seed=4, episode_id="ep-acme", episode_token=token)
    assert served == {"acme": (v, [[v, 4]]), "beta": (0, [[0, 4]]), GLOBAL: (0, [[0, 4]])}
    assert gauge(text, "saoserve_tenant_policy_version", tenant="acme") == float(v)
    assert gauge(text, "saoserve_tenant_policy_version", tenant="beta") == 0.0
    assert gauge(text, "saoserve_policy_version") == 0.0
    assert [(r["policy"], r["version"]) for r in rows] == [(GLOBAL, 0), ("acme", v), ("beta", 0)]
    assert nxt.status_code == 401
    assert nxt.json()["error"]["message"] == f"API key {acme_id} is revoked"
