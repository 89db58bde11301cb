"""A policy per tenant on one LoRA engine with the tenant policies acme and beta (issue 20,
"Tenants"; docs/tenants.md): trajectories, feedback, episodes and evidence stay in their
namespace; a version published in acme's namespace serves acme's next request and not beta's; a
revoked key is refused on its episode's next turn; forget covers every namespace; a tenant policy
added at run time serves its own version, and removed falls back to the global policy. Without vLLM:
tests/unit/server/test_tenant_policies.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from sqlalchemy import select

from core.db import TrajectoryIndex, make_engine
from core.evidence_store import EvidenceStore, stored_prompt_id
from core.logbus import open_log
from core.policies import GLOBAL
from core.policy_store import version_dir
from core.records import (
    POLICY_KEY,
    TOPIC_FEEDBACK,
    TOPIC_POLICY,
    TOPIC_TRAJECTORIES,
    PolicyEvent,
    utcnow,
)
from core.settings import AdapterServing
from core.weights import weights_sha256
from testing.servers import ADMIN, running_server
from testing.tenants import (
    TENANTS,
    bearer,
    gauge,
    logged,
    namespaces,
    tenant_settings,
)

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
            # Under the hash of the client's id, as the server stores it (docs/privacy.md).
            sea = stored_prompt_id(ns["acme"].feedback_secret, "sea")
            EvidenceStore(db).add_results(conn, [(sea, 1.0, 0)] * 3)
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


@pytest.mark.engine
async def test_a_tenant_policy_added_at_run_time_serves_its_version_and_removed_falls_back_to_global(
    tenant_engine, model_dir, tmp_path
):
    """``/admin/tenant_policies`` on the LoRA engine (docs/tenants.md, "Adding and removing a
    tenant policy"): zeta, added while the server runs, gets its namespace and serves the
    version published there; removed, its key is served by the global policy and its adapter
    leaves vLLM."""
    from testing.adapters import write_adapters

    settings = tenant_settings(tmp_path, tenant_poll_s=0.1)
    eng = tenant_engine
    async with running_server(settings, eng) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def zeta_served() -> bool:
            return "zeta" in (await http.get("/admin/tenant_policies", headers=ADMIN)).json()["served"]

        async def zeta_gone() -> bool:
            return not await zeta_served()

        async def until(check) -> None:
            for _ in range(400):
                if await check():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the server did not follow the list in time")

        zeta, _ = await new_key(http, "zeta")
        added = await http.post("/admin/tenant_policies", json={"tenant": "zeta"}, headers=ADMIN)
        assert added.json() == {
            "tenant": "zeta",
            "changed": True,
            "tenant_policies": ["acme", "beta", "zeta"],
        }
        await until(zeta_served)
        ns = settings.for_tenant("zeta")
        folder = version_dir(ns.resolved_policy_dir, 1)
        write_adapters(model_dir, [folder], seed=5)
        event = PolicyEvent(
            version=1, path=str(folder), sha256=weights_sha256(folder), created_at=utcnow(), parent_version=0
        )
        lt = open_log(ns.resolved_log_url)
        await asyncio.to_thread(lt.append, TOPIC_POLICY, POLICY_KEY, event.to_json())
        lt.close()

        async def zeta_at_1() -> bool:
            return (await http.get("/v1/models", headers=bearer(zeta))).json()["data"][0]["version"] == 1

        await until(zeta_at_1)
        r = await chat(http, zeta, seed=2)
        rec = await http.get(
            f"/admin/trajectories/{r.json()['id']}", params={"policy": "zeta"}, headers=ADMIN
        )
        on_zeta = (r.json()["policy_version"], rec.json()["token_versions"])
        removed = await http.delete("/admin/tenant_policies/zeta", headers=ADMIN)
        assert removed.json() == {"tenant": "zeta", "changed": True, "tenant_policies": ["acme", "beta"]}
        await until(zeta_gone)
        r = await chat(http, zeta, seed=2)
        on_global = (r.json()["policy_version"], r.json()["id"])
        in_global = await http.get(f"/admin/trajectories/{on_global[1]}", headers=ADMIN)
    await eng.removals_done()
    assert on_zeta == (1, [[1, 4]])
    assert on_global[0] == 0 and in_global.status_code == 200 and in_global.json()["tenant"] == "zeta"
    assert eng.policies == [GLOBAL, "acme", "beta"]
    assert not [a for a in eng.adapters.adapters.values() if a.policy == "zeta"]
