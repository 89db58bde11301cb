"""Tenant policies on the pages that need no key (docs/tenants.md, "What the public pages show";
``server.auth.visible_policies``): ``/dashboard/state``, ``/dashboard/data`` and ``/readyz`` show
the global policy to anyone, every tenant policy to the admin key, and a tenant's own policy to
a valid key of that tenant; a tenant policy not shown is as unknown as one that does not exist.

No vLLM: the real app and lifespan on the fake engine of tests/unit/server/test_tenant_policies.py (a
``FakeEngine`` per policy), acme serving version 3 with one learner step and one answer in its
namespace, beta version 5, the global policy version 1.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime

from sqlalchemy import create_engine, insert
from starlette.testclient import TestClient

from core.db import LearnerStep, make_engine
from core.keys import KeyStore
from core.policies import GLOBAL
from server.ops import api_router as ops
from testing.fakes import FakeEngine, index_answer
from testing.servers import ADMIN, make_settings
from testing.tenants import SharedFakeEngine, bearer, make_key, namespaces, row, tenant_settings

AT = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
# acme's one learner step, as the learner records it (its sample ids are not shown).
ACME_STEP = {
    "reward_mean": 0.5,
    "kept_fraction": 0.75,
    "explained_variance": 0.25,
    "staleness_mean": 1.5,
    "policy_loss": 0.125,
    "critic_loss": 0.0625,
    "sample_ids": ["s1", "s2"],
}


GLOBAL_ROW = row(GLOBAL, 1)
ACME_ROW = row(
    "acme", 3, steps=1, reward_mean=0.5, staleness_mean=1.5, last_step_at="2025-06-01T12:00:00+00:00"
)
BETA_ROW = row("beta", 5)


def unknown(name: str, listed: str) -> dict:
    """The whole 404 body of ``?policy=name`` for a request that sees the policies ``listed``."""
    return {
        "error": {
            "message": f"no policy named {name!r} (policies: {listed})",
            "type": "invalid_request_error",
            "param": "policy",
            "code": "unknown_policy",
        }
    }


def started(tmp_path):
    """The app (not started) and its settings: acme's namespace holds one learner step and one
    answer indexed now."""
    from server.app import create_app

    settings = tenant_settings(tmp_path)
    engine = SharedFakeEngine(version=1, views={"acme": FakeEngine(version=3), "beta": FakeEngine(version=5)})
    return create_app(settings, engine=engine, watch_policy=False), settings


def fill_acme(settings) -> None:
    acme = namespaces(settings)["acme"]
    db = make_engine(acme.resolved_database_url)
    with db.begin() as conn:
        conn.execute(
            insert(LearnerStep).values(run_id="r", step=7, version=3, metrics=ACME_STEP, created_at=AT)
        )
    db.dispose()
    index_answer(acme, "chatcmpl-acme", "p-acme")


def rows_and_misses(client, headers: dict) -> tuple[list[dict], dict[str, tuple[int, dict]]]:
    """``/dashboard/state``'s rows for ``headers``, and (status, body) of ``?policy=`` for
    acme, beta and a name no policy has."""
    rows = client.get("/dashboard/state", headers=headers).json()["policies"]
    asked = {}
    for name in ("acme", "beta", "nope"):
        r = client.get("/dashboard/state", params={"policy": name}, headers=headers)
        asked[name] = (r.status_code, r.json())
    return rows, asked


def test_anonymous_and_other_tokens_see_the_global_policy_alone(tmp_path):
    app, settings = started(tmp_path)
    with TestClient(app) as client:
        fill_acme(settings)
        gamma = make_key(client, "gamma")  # a tenant without a policy of its own: the global one's
        seen = {
            who: rows_and_misses(client, headers)
            for who, headers in (
                ("no key", {}),
                ("not a saoserve key", bearer("EMPTY")),
                ("a wrong saoserve key", bearer("sao-k0000000000000000-wrong")),
                ("gamma's key", bearer(gamma)),
                ("the admin key misspelt", bearer("test-admin-key-")),
            )
        }
        glob = client.get("/dashboard/state", params={"policy": GLOBAL}).json()
    for who, (rows, asked) in seen.items():
        assert rows == [GLOBAL_ROW], who
        # acme and beta exist, but answer exactly as a name no policy has.
        assert asked == {
            "acme": (404, unknown("acme", "global")),
            "beta": (404, unknown("beta", "global")),
            "nope": (404, unknown("nope", "global")),
        }, who
    # The global policy's own figures: serving 1, nothing recorded.
    assert (glob["serving"], glob["newest_version"], glob["samples_trained"], glob["policies"]) == (
        1,
        None,
        0,
        [GLOBAL_ROW],
    )


def test_a_tenants_key_sees_its_own_policy_and_the_admin_key_every_one(tmp_path):
    app, settings = started(tmp_path)
    with TestClient(app) as client:
        fill_acme(settings)
        acme, beta = make_key(client, "acme"), make_key(client, "beta")
        by_acme = rows_and_misses(client, bearer(acme))
        by_beta = rows_and_misses(client, bearer(beta))
        by_admin = rows_and_misses(client, ADMIN)
        admin_rows = client.get("/admin/policies", headers=ADMIN).json()["policies"]
    assert by_acme[0] == [GLOBAL_ROW, ACME_ROW]
    # acme's figures for acme's key: serving 3, its one step of 2 samples; beta as unknown as "nope".
    assert (by_acme[1]["acme"][0], by_acme[1]["acme"][1]["serving"]) == (200, 3)
    assert (by_acme[1]["acme"][1]["samples_trained"], by_acme[1]["acme"][1]["policies"]) == (
        2,
        [GLOBAL_ROW, ACME_ROW],
    )
    assert by_acme[1]["beta"] == (404, unknown("beta", "global, acme"))
    assert by_acme[1]["nope"] == (404, unknown("nope", "global, acme"))
    assert by_beta[0] == [GLOBAL_ROW, BETA_ROW]
    assert by_beta[1]["acme"] == (404, unknown("acme", "global, beta"))
    assert by_beta[1]["beta"][1]["serving"] == 5
    # The admin key: every row, as /admin/policies; the 404 lists every policy.
    assert by_admin[0] == admin_rows == [GLOBAL_ROW, ACME_ROW, BETA_ROW]
    assert [by_admin[1][p][1]["serving"] for p in ("acme", "beta")] == [3, 5]
    assert by_admin[1]["nope"] == (404, unknown("nope", "global, acme, beta"))


def test_a_revoked_key_sees_the_global_policy_alone(tmp_path):
    app, settings = started(tmp_path)
    with TestClient(app) as client:
        r = client.post("/admin/keys", json={"tenant": "acme"}, headers=ADMIN)
        key, key_id = r.json()["key"], r.json()["id"]
        before = client.get("/dashboard/state", headers=bearer(key)).json()["policies"]
        assert client.post(f"/admin/keys/{key_id}/revoke", headers=ADMIN).status_code == 200
        after = rows_and_misses(client, bearer(key))
        data = client.get("/dashboard/data", params={"policy": "acme"}, headers=bearer(key))
    assert [p["policy"] for p in before] == [GLOBAL, "acme"]
    # Revoked: no 401 on a page that needs no key, only the global policy.
    assert after[0] == [GLOBAL_ROW]
    assert after[1]["acme"] == (404, unknown("acme", "global"))
    assert (data.status_code, data.json()) == (404, unknown("acme", "global"))


def test_dashboard_data_takes_the_policy_it_may_see(tmp_path):
    app, settings = started(tmp_path)
    with TestClient(app) as client:
        fill_acme(settings)
        acme = make_key(client, "acme")
        anonymous = client.get("/dashboard/data")
        hidden = client.get("/dashboard/data", params={"policy": "acme"})
        own = client.get("/dashboard/data", params={"policy": "acme"}, headers=bearer(acme))
        admin = client.get("/dashboard/data", params={"policy": "acme"}, headers=ADMIN)
        beta = client.get("/dashboard/data", params={"policy": "beta"}, headers=bearer(acme))
    # The global policy: version 1, no steps, no answers in its 60 buckets of 10 s.
    assert anonymous.json() == {
        "policy_version": 1,
        "steps": [],
        "requests_per_s": [0.0] * 60,
        "counters": {},
    }
    assert (hidden.status_code, hidden.json()) == (404, unknown("acme", "global"))
    assert (beta.status_code, beta.json()) == (404, unknown("beta", "global, acme"))
    # acme's: version 3, its one step's plotted figures (not its sample ids), and its one
    # answer, indexed just now: 1 answer / 10 s = 0.1 requests/s in the newest bucket, or the
    # one before where more than 10 s passed on a loaded machine between the index and the
    # read. The step's time with its UTC offset, though SQLite gives it back without one.
    step = {k: v for k, v in ACME_STEP.items() if k != "sample_ids"}
    newest = ([0.0] * 59 + [0.1], [0.0] * 58 + [0.1, 0.0])
    for body in (own.json(), admin.json()):
        assert body.pop("requests_per_s") in newest
        assert body == {
            "policy_version": 3,
            "steps": [{"step": 7, "version": 3, **step, "created_at": "2025-06-01T12:00:00+00:00"}],
            "counters": {},
        }


def test_readyz_names_a_tenant_only_to_a_request_that_may_see_it(tmp_path):
    app, _ = started(tmp_path)
    with TestClient(app) as client:
        acme, beta = make_key(client, "acme"), make_key(client, "beta")
        # acme's database is a file SQLite cannot open (its folder does not exist).
        app.state.tenants["acme"].health.engine = create_engine(f"sqlite:///{tmp_path}/missing/dir/x.db")
        answers = {
            who: client.get("/readyz", headers=headers)
            for who, headers in (
                ("anonymous", {}),
                ("beta", bearer(beta)),
                ("acme", bearer(acme)),
                ("admin", ADMIN),
            )
        }
        # The key registry (the global database) does not answer: the key cannot be checked,
        # so it sees what no key sees, and readiness still answers.
        app.state.s.store.engine = create_engine(f"sqlite:///{tmp_path}/missing/dir/keys.db")
        unchecked = client.get("/readyz", headers=bearer(acme))
    down = "the database is unavailable (DatabaseUnavailable)"
    ready = {"ready": True, "policy_version": 1, "engine": "ok", "log": "ok", "policy": "ok"}
    # acme's outage keeps the replica ready (only the global policy's parts make it unready).
    assert {who: r.status_code for who, r in answers.items()} == dict.fromkeys(answers, 200)
    assert answers["anonymous"].json() == ready | {"database": ops.HIDDEN_NOT_READY}
    assert "acme" not in answers["anonymous"].text
    assert answers["beta"].json() == answers["anonymous"].json()
    assert answers["acme"].json() == answers["admin"].json() == ready | {"database": f"acme: {down}"}
    assert (unchecked.status_code, unchecked.json()) == (200, answers["anonymous"].json())


def test_readyz_gives_the_hidden_tenants_one_line_without_detail(tmp_path):
    """acme's and beta's databases both down: a request without a key reads one line for both
    (not two: how many tenants are down is not given either); acme's key reads acme's own
    problem by name, then the one line for beta's."""
    app, _ = started(tmp_path)
    with TestClient(app) as client:
        acme = make_key(client, "acme")
        for t in ("acme", "beta"):
            app.state.tenants[t].health.engine = create_engine(f"sqlite:///{tmp_path}/missing/{t}/x.db")
        anonymous = client.get("/readyz").json()
        own = client.get("/readyz", headers=bearer(acme)).json()
        admin = client.get("/readyz", headers=ADMIN).json()
    down = "the database is unavailable (DatabaseUnavailable)"
    assert anonymous["database"] == ops.HIDDEN_NOT_READY
    assert own["database"] == f"acme: {down}; {ops.HIDDEN_NOT_READY}"
    assert admin["database"] == f"acme: {down}; beta: {down}"


def test_readyz_does_not_wait_on_a_key_lookup_that_hangs(tmp_path, monkeypatch):
    """The key registry not answering within the probes' time: readiness answers, as for no key."""
    app, _ = started(tmp_path)
    release = threading.Event()
    with TestClient(app) as client:
        acme = make_key(client, "acme")
        app.state.tenants["acme"].health.engine = create_engine(f"sqlite:///{tmp_path}/missing/dir/x.db")
        monkeypatch.setattr(ops, "READY_PROBE_S", 1.0)
        monkeypatch.setattr(KeyStore, "check", lambda self, presented: release.wait(30))
        r = client.get("/readyz", headers=bearer(acme))
        release.set()
    assert r.status_code == 200
    assert r.json()["database"] == ops.HIDDEN_NOT_READY


def test_without_an_admin_key_an_empty_bearer_is_not_the_admin(tmp_path):
    """An unset admin key is never matched, not even by an empty token."""
    from server.app import create_app

    settings = tenant_settings(tmp_path, admin_key="")
    app = create_app(settings, engine=SharedFakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        r = client.get("/dashboard/state", headers={"Authorization": "Bearer "})
        assert [p["policy"] for p in r.json()["policies"]] == [GLOBAL]
        assert client.get("/admin/policies", headers={"Authorization": "Bearer "}).status_code == 403


def test_without_tenant_policies_every_request_sees_the_one_policy(tmp_path):
    from server.app import create_app

    app = create_app(make_settings(tmp_path), engine=FakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        key = make_key(client, "acme")
        for headers in ({}, bearer(key), ADMIN):
            r = client.get("/dashboard/state", params={"policy": "acme"}, headers=headers)
            assert (r.status_code, r.json()) == (404, unknown("acme", "global"))
            assert [
                p["policy"] for p in client.get("/dashboard/state", headers=headers).json()["policies"]
            ] == [GLOBAL]
