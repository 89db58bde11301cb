"""API keys and tenants (core/keys.py, server/auth.py, server/admin/keys_router.py, saoserve admin keys):
created, listed and revoked through the CLI and the routes; stored as a hash; a revoked key
refused on its next request (also mid-episode, for feedback); ``require_keys`` on and off; the
key's identity and tenant on the trajectory record; the tenant label on /metrics.

The real app under uvicorn with ``testing.fakes.FakeEngine``; where a chat must be answered,
``ScriptedEngine`` below answers every request with the same two tokens (no vLLM engine)."""

from __future__ import annotations

import asyncio
import hashlib
import json

import httpx
import pytest
from sqlalchemy import select, text
from typer.testing import CliRunner

from core.db import ApiKey, make_engine
from core.keys import BadTenant, KeyRevoked, KeyStore, check_tenant, identity_of
from core.records import utcnow
from saoserve.cli import app as cli_app
from testing.fakes import TIMEOUT_S, FakeEngine, ScriptedEngine
from testing.servers import ADMIN, make_settings, running_server

runner = CliRunner()
KEY = "test-admin-key"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def admin(url: str, *args: str):
    return runner.invoke(cli_app, ["admin", *args, "--url", url, "--key", KEY], env={"COLUMNS": "200"})


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def create_key(http: httpx.AsyncClient, tenant: str) -> dict:
    r = await http.post("/admin/keys", json={"tenant": tenant}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()


def refusal(r: httpx.Response) -> tuple[int, str, str, str]:
    err = r.json()["error"]
    return r.status_code, err["type"], err["code"], err["message"]


# ------------------------------------------------------------------ the registry (pure database)
def test_tenant_names(tmp_path):
    assert check_tenant("acme-corp.eu_1") == "acme-corp.eu_1"
    for bad in ("", "Acme", "-acme", "a b", "a\n", "x" * 65, 'tenant="x"'):
        with pytest.raises(BadTenant, match="is not a valid name"):
            check_tenant(bad)


def test_identity_of():
    assert identity_of("k1", "bob") == "key:k1"  # the key wins over the user field
    assert identity_of(None, "bob") == "user:bob"
    assert identity_of(None, None) is None


# ------------------------------------------------------------------ CLI and routes
async def test_keys_created_listed_and_revoked_through_the_cli(tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:

        def run(*args):
            return asyncio.to_thread(admin, url, *args)

        made = await run("keys", "create", "acme", "--json")
        assert made.exit_code == 0, made.output
        key = json.loads(made.output)
        assert key["tenant"] == "acme" and key["revoked_at"] is None
        assert key["key"].startswith(f"sao-{key['id']}.") and len(key["key"]) == 4 + 17 + 1 + 48
        shown = await run("keys", "create", "beta")
        assert shown.exit_code == 0 and "cannot be shown again" in shown.output
        listed = await run("keys", "list", "--json")
        rows = json.loads(listed.output)["keys"]
        assert [(k["id"], k["tenant"]) for k in rows][0] == (key["id"], "acme")
        assert [k["tenant"] for k in rows] == ["acme", "beta"]
        assert all("key" not in k and "key_sha256" not in k for k in rows)
        only = json.loads((await run("keys", "list", "--tenant", "beta", "--json")).output)["keys"]
        assert [k["tenant"] for k in only] == ["beta"]
        table = await run("keys", "list")
        assert key["id"] in table.output and key["key"] not in table.output
        revoked = await run("keys", "revoke", key["id"])
        assert revoked.exit_code == 0 and f"API key {key['id']} of tenant acme revoked" in revoked.output
        again = json.loads((await run("keys", "revoke", key["id"], "--json")).output)
        first = json.loads((await run("keys", "list", "--json")).output)["keys"][0]["revoked_at"]
        assert again["revoked_at"] == first  # idempotent: the first revocation time stays
        unknown = await run("keys", "revoke", "k0000000000000000")
        bad = await run("keys", "create", "Not A Tenant")
    assert unknown.exit_code == 5 and "no API key 'k0000000000000000'" in unknown.output
    assert bad.exit_code == 2 and "refused the request (400)" in bad.output

    # Stored: the sha256 of the key, never the key itself.
    db = make_engine(settings.resolved_database_url)
    with db.connect() as conn:
        stored = conn.execute(select(ApiKey.key_sha256).where(ApiKey.id == key["id"])).scalar_one()
        dump = "\n".join(str(tuple(r)) for r in conn.execute(text("SELECT * FROM api_keys")).all())
    db.dispose()
    assert stored == hashlib.sha256(key["key"].encode()).hexdigest()
    assert key["key"] not in dump and key["key"].split(".")[1] not in dump


async def test_key_routes_need_the_admin_key(tmp_path):
    async with running_server(make_settings(tmp_path), FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            no_admin = await http.post("/admin/keys", json={"tenant": "acme"})
            api_key = (await create_key(http, "acme"))["key"]
            with_api_key = await http.get("/admin/keys", headers=bearer(api_key))
    assert no_admin.status_code == 401 and with_api_key.status_code == 401


async def test_a_405_on_the_keys_path_names_both_of_its_methods(tmp_path):
    """GET and POST /admin/keys are two routes; Starlette's own 405 names only the first one's
    method (schemathesis found ``Allow: POST``); ``server.errors.allowed_methods`` names both."""
    async with running_server(make_settings(tmp_path), FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            r = await http.put("/admin/keys", headers=bearer(KEY))
            single = await http.get("/admin/keys/k1/revoke", headers=bearer(KEY))
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    assert single.status_code == 405 and single.headers["allow"] == "POST"


# ------------------------------------------------------------------ require_keys
async def test_require_keys_refuses_chat_feedback_and_models_without_a_valid_key(tmp_path):
    settings = make_settings(tmp_path, require_keys=True)
    async with running_server(settings, ScriptedEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            key = await create_key(http, "acme")
            missing = {
                "chat": await http.post("/v1/chat/completions", json=CHAT),
                "models": await http.get("/v1/models"),
                "model": await http.get("/v1/models/smollm2-135m-instruct"),
                "feedback": await http.post(
                    "/v1/feedback", json={"id": "chatcmpl-x", "reward": 1.0, "feedback_token": "x"}
                ),
                # An OpenAI client's placeholder key is no key.
                "placeholder": await http.post("/v1/chat/completions", json=CHAT, headers=bearer("EMPTY")),
            }
            wrong = await http.post(
                "/v1/chat/completions", json=CHAT, headers=bearer(key["key"][:-4] + "0000")
            )
            models = await http.get("/v1/models", headers=bearer(key["key"]))
            answered = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(key["key"]))
            health = await http.get("/readyz")
    for name, r in missing.items():
        assert refusal(r)[:3] == (401, "authentication_error", "invalid_api_key"), name
        assert "this server requires an API key" in refusal(r)[3], name
        assert r.headers["x-should-retry"] == "false", name
    assert refusal(wrong) == (
        401,
        "authentication_error",
        "invalid_api_key",
        "invalid API key: not a key of this server",
    )
    # The list shape of today: the served model.
    assert models.status_code == 200
    assert [(m["id"], m["object"]) for m in models.json()["data"]] == [("smollm2-135m-instruct", "model")]
    assert models.json()["object"] == "list"
    assert answered.status_code == 200, answered.text
    assert health.status_code == 200  # operators' pages need no key


async def test_without_require_keys_anonymous_chat_works_and_a_revoked_key_is_still_refused(tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, ScriptedEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            anonymous = await http.post("/v1/chat/completions", json=CHAT)
            placeholder = await http.post("/v1/chat/completions", json=CHAT, headers=bearer("sk-anything"))
            models = await http.get("/v1/models")
            key = await create_key(http, "acme")
            keyed = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(key["key"]))
            await http.post(f"/admin/keys/{key['id']}/revoke", headers=ADMIN)
            after = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(key["key"]))
            made_up = await http.get("/v1/models", headers=bearer("sao-knotakey.123"))
    assert [r.status_code for r in (anonymous, placeholder, models, keyed)] == [200, 200, 200, 200]
    assert refusal(after) == (
        401,
        "authentication_error",
        "invalid_api_key",
        f"API key {key['id']} is revoked",
    )
    assert refusal(made_up)[0] == 401


async def test_a_key_revoked_mid_episode_is_refused_on_its_next_turn_and_its_feedback(tmp_path):
    settings = make_settings(tmp_path, require_keys=True)
    async with running_server(settings, ScriptedEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            key = await create_key(http, "acme")
            turn0 = await http.post(
                "/v1/chat/completions", json=CHAT | {"episode_id": "ep-1"}, headers=bearer(key["key"])
            )
            token = turn0.json()["episode_feedback_token"]
            one = await http.post(
                "/v1/chat/completions",
                json=CHAT | {"episode_id": "ep-1", "episode_token": token},
                headers=bearer(key["key"]),
            )
            assert turn0.status_code == one.status_code == 200, one.text
            revoked = await http.post(f"/admin/keys/{key['id']}/revoke", headers=ADMIN)
            assert revoked.status_code == 200
            turn2 = await http.post(
                "/v1/chat/completions",
                json=CHAT | {"episode_id": "ep-1", "episode_token": token},
                headers=bearer(key["key"]),
            )
            rating = {"episode_id": "ep-1", "reward": 1.0, "feedback_token": token}
            feedback = await http.post("/v1/feedback", json=rating, headers=bearer(key["key"]))
            # The tenant's new key may still rate the episode: the feedback token binds it.
            fresh = await create_key(http, "acme")
            rated = await http.post("/v1/feedback", json=rating, headers=bearer(fresh["key"]))
    revoked_msg = (401, "authentication_error", "invalid_api_key", f"API key {key['id']} is revoked")
    assert refusal(turn2) == revoked_msg
    assert refusal(feedback) == revoked_msg
    assert rated.status_code == 202, rated.text


# ------------------------------------------------------------------ identity, tenant, metrics
async def test_the_record_carries_the_key_id_and_tenant_and_metrics_the_tenant(tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, ScriptedEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            key = await create_key(http, "acme")
            keyed = await http.post(
                "/v1/chat/completions", json=CHAT | {"user": "alice"}, headers=bearer(key["key"])
            )
            user = await http.post("/v1/chat/completions", json=CHAT | {"user": "bob"})
            nobody = await http.post("/v1/chat/completions", json=CHAT)
            records = {}
            for name, r in (("keyed", keyed), ("user", user), ("nobody", nobody)):
                got = await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)
                records[name] = got.json()
            rated = await http.post(
                "/v1/feedback",
                json={
                    "id": keyed.json()["id"],
                    "reward": 1.0,
                    "feedback_token": keyed.json()["feedback_token"],
                },
                headers=bearer(key["key"]),
            )
            assert rated.status_code == 202
            page = (await http.get("/metrics")).text
    assert (records["keyed"]["identity"], records["keyed"]["tenant"]) == (f"key:{key['id']}", "acme")
    assert records["keyed"]["user"] == "alice"  # still what `admin forget` finds
    assert key["key"] not in json.dumps(records["keyed"])
    assert (records["user"]["identity"], records["user"]["tenant"]) == ("user:bob", None)
    assert (records["nobody"]["identity"], records["nobody"]["tenant"]) == (None, None)
    # One keyed answer of 2 tokens for acme; two anonymous answers (4 tokens) under "-".
    assert 'saoserve_tenant_trajectories_logged_total{finish_reason="stop",tenant="acme"} 1.0' in page
    assert 'saoserve_tenant_trajectories_logged_total{finish_reason="stop",tenant="-"} 2.0' in page
    assert 'saoserve_tenant_generated_tokens_total{tenant="acme"} 2.0' in page
    assert 'saoserve_tenant_generated_tokens_total{tenant="-"} 4.0' in page
    assert 'saoserve_tenant_feedback_accepted_total{tenant="acme"} 1.0' in page


def test_the_tenant_label_is_bounded():
    from server.metrics import MAX_TENANT_LABELS, ServerMetrics

    m = ServerMetrics()
    labels = [m.tenant_label(f"t{i}") for i in range(MAX_TENANT_LABELS + 5)]
    assert labels[:MAX_TENANT_LABELS] == [f"t{i}" for i in range(MAX_TENANT_LABELS)]
    assert labels[MAX_TENANT_LABELS:] == ["other"] * 5
    assert m.tenant_label("t0") == "t0" and m.tenant_label(None) == "-"


def test_a_revoked_key_checked_in_the_store(tmp_path):
    """The store alone: the same secret is ok, then revoked; a key of the right shape with a
    wrong secret, or an unknown id, is invalid (the hash compared in constant time)."""
    from core.db import migrate

    url = f"sqlite:///{tmp_path / 'k.db'}"
    migrate(url)
    store = KeyStore(make_engine(url))
    info, key = store.create("acme", utcnow())
    assert store.check(key).outcome == "ok" and store.check(key).key.tenant == "acme"
    wrong = key[:-1] + ("0" if key[-1] != "0" else "1")
    assert store.check(wrong).outcome == "invalid"
    assert store.check("sao-k0000000000000000." + "0" * 48).outcome == "invalid"
    assert store.check("not-a-key").outcome == "invalid"
    store.revoke(info.id, utcnow())
    assert store.check(key).outcome == "revoked"
    assert store.revoke("k-unknown", utcnow()) is None
    store.engine.dispose()


# ------------------------------------------------------------------ a key's training opt-out
def migrated_store(tmp_path) -> KeyStore:
    from core.db import migrate

    url = f"sqlite:///{tmp_path / 'k.db'}"
    migrate(url)
    return KeyStore(make_engine(url))


def test_a_key_is_trained_unless_made_or_set_opted_out(tmp_path):
    store = migrated_store(tmp_path)
    t0 = utcnow()
    trained, trained_key = store.create("acme", t0)
    opted, opted_key = store.create("acme", t0, train=False)
    assert (trained.train, opted.train) == (True, False)
    assert opted.to_json() == {
        "id": opted.id,
        "tenant": "acme",
        "created_at": t0.isoformat(),
        "revoked_at": None,
        "train": False,
        "trusted": False,
    }
    # The check hands the setting to the server with the key (server.auth.Caller.train).
    assert (store.check(trained_key).key.train, store.check(opted_key).key.train) == (True, False)
    assert [(k.id, k.train) for k in store.listed("acme")] == sorted(
        [(trained.id, True), (opted.id, False)], key=lambda kv: kv[0]
    )

    assert store.set_train(trained.id, False).train is False
    assert store.check(trained_key).key.train is False  # nothing cached: the next check sees it
    assert store.set_train(trained.id, False).train is False  # idempotent
    assert store.set_train(opted.id, True).train is True
    assert [k.train for k in store.listed() if k.id == opted.id] == [True]
    store.engine.dispose()


def test_set_train_of_an_unknown_key_is_none_and_of_a_revoked_key_is_refused(tmp_path):
    store = migrated_store(tmp_path)
    info, key = store.create("acme", utcnow())
    assert store.set_train("k0000000000000000", False) is None
    store.revoke(info.id, utcnow())
    # A revocation is final: the setting is refused and stays as it was; the key stays revoked.
    with pytest.raises(KeyRevoked, match=f"API key {info.id} is revoked") as refused:
        store.set_train(info.id, False)
    assert (refused.value.key.train, refused.value.key.revoked) == (True, True)
    assert [(k.train, k.revoked) for k in store.listed()] == [(True, True)]
    assert store.check(key).outcome == "revoked"
    store.engine.dispose()


def test_a_key_is_untrusted_unless_made_or_set_trusted(tmp_path):
    """``trusted`` is a setting of its own: made with the key or set later, alone or with
    ``train`` in one update, idempotent; ``core.keys.trusted_keys`` names the trusted ones not
    revoked (a revoked key's answers can still be rated by whoever holds their tokens, so its
    trust ends with it)."""
    from core.keys import trusted_keys

    store = migrated_store(tmp_path)
    plain, _ = store.create("acme", utcnow())
    backend, _ = store.create("acme", utcnow(), trusted=True)
    assert (plain.trusted, backend.trusted, backend.train) == (False, True, True)
    both = store.configure(plain.id, train=False, trusted=True)
    assert (both.train, both.trusted) == (False, True)
    assert store.configure(plain.id, trusted=True).trusted is True  # idempotent
    assert store.configure(plain.id, trusted=False).train is False  # the other setting stays
    assert store.configure("k0000000000000000", trusted=True) is None
    with pytest.raises(ValueError, match="give train, trusted or both"):
        store.configure(plain.id)
    with store.engine.connect() as conn:
        assert trusted_keys(conn) == {f"key:{backend.id}"}
    store.revoke(backend.id, utcnow())
    with pytest.raises(KeyRevoked):
        store.configure(backend.id, trusted=False)
    with store.engine.connect() as conn:
        assert trusted_keys(conn) == frozenset()
    store.engine.dispose()


async def test_a_key_trusted_through_the_route_and_the_cli(tmp_path):
    async with running_server(make_settings(tmp_path), FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, headers=ADMIN) as http:
            made = (await http.post("/admin/keys", json={"tenant": "acme", "trusted": True})).json()
            plain = await create_key(http, "beta")
            on = await http.patch(f"/admin/keys/{plain['id']}", json={"trusted": True})
            off = await asyncio.to_thread(admin, url, "keys", "trust", plain["id"], "off")
            table = await asyncio.to_thread(admin, url, "keys", "list")
            cli_made = await asyncio.to_thread(
                admin, url, "keys", "create", "gamma", "--trusted", "--no-train"
            )
            bad = await asyncio.to_thread(admin, url, "keys", "trust", plain["id"], "yes")
            listed = (await http.get("/admin/keys")).json()["keys"]
    assert (made["trusted"], made["train"]) == (True, True)
    assert (on.status_code, on.json()["trusted"], on.json()["train"]) == (200, True, True)
    assert off.exit_code == 0 and off.output == (
        f"API key {plain['id']} of tenant beta: not trusted: the identity caps bound it\n"
    )
    rows = {line.split()[0]: " ".join(line.split()) for line in table.output.splitlines() if line.strip()}
    assert rows[made["id"]].startswith(f"{made['id']} acme yes yes ")
    assert rows[plain["id"]].startswith(f"{plain['id']} beta yes no ")
    assert cli_made.exit_code == 0 and "of tenant gamma (opted out of training, trusted):" in cli_made.output
    assert bad.exit_code == 2 and "expected on or off, got 'yes'" in bad.output
    assert [(k["tenant"], k["train"], k["trusted"]) for k in listed] == [
        ("acme", True, True),
        ("beta", True, False),
        ("gamma", False, True),
    ]


def test_keys_made_before_revision_0014_keep_training(tmp_path):
    from core.db import migrate

    url = f"sqlite:///{tmp_path / 'k.db'}"
    migrate(url, "0013")
    db = make_engine(url)
    with db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO api_keys (id, tenant, key_sha256, created_at)"
                " VALUES ('k00000000000000aa', 'acme', :h, :at)"
            ),
            {"h": "0" * 64, "at": utcnow()},
        )
    migrate(url)
    assert [(k.id, k.train) for k in KeyStore(db).listed()] == [("k00000000000000aa", True)]
    db.dispose()


async def test_the_key_routes_create_and_set_the_opt_out(tmp_path):
    async with running_server(make_settings(tmp_path), FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, headers=ADMIN) as http:
            plain = await create_key(http, "acme")
            r = await http.post("/admin/keys", json={"tenant": "acme", "train": False})
            opted = r.json()
            off = await http.patch(f"/admin/keys/{plain['id']}", json={"train": False})
            on = await http.patch(f"/admin/keys/{opted['id']}", json={"train": True})
            listed = (await http.get("/admin/keys")).json()["keys"]
            unknown = await http.patch("/admin/keys/k0000000000000000", json={"train": False})
    assert (plain["train"], r.status_code, opted["train"]) == (True, 201, False)
    assert (off.status_code, off.json()["id"], off.json()["train"]) == (200, plain["id"], False)
    assert (on.status_code, on.json()["train"]) == (200, True)
    assert {k["id"]: k["train"] for k in listed} == {plain["id"]: False, opted["id"]: True}
    assert "key" not in off.json() and "key_sha256" not in off.json()
    # Every time carries its zone, as the creation's answer does (SQLite gives back naive UTC).
    assert off.json()["created_at"] == plain["created_at"] and plain["created_at"].endswith("+00:00")
    assert all(k["created_at"].endswith("+00:00") for k in listed)
    err = unknown.json()["error"]
    assert (unknown.status_code, err["code"], err["param"], err["message"]) == (
        404,
        "not_found",
        "key_id",
        "no API key 'k0000000000000000'",
    )


async def test_a_revoked_key_is_final_409_and_nothing_changes(tmp_path):
    """A revocation is final: PATCH on a revoked key is 409 ``key_revoked`` with the key's
    setting and times unchanged, whatever the body asks (the same setting too); revoking it
    again changes nothing either (idempotent, its first time stays). The CLI shows the error."""
    async with running_server(make_settings(tmp_path), FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, headers=ADMIN) as http:
            key = await create_key(http, "acme")
            revoked = (await http.post(f"/admin/keys/{key['id']}/revoke")).json()
            patches = [await http.patch(f"/admin/keys/{key['id']}", json={"train": t}) for t in (False, True)]
            again = (await http.post(f"/admin/keys/{key['id']}/revoke")).json()
            cli = await asyncio.to_thread(admin, url, "keys", "train", key["id"], "off")
            cli_json = await asyncio.to_thread(admin, url, "keys", "train", key["id"], "on", "--json")
            listed = (await http.get("/admin/keys")).json()["keys"]
    message = (
        f"API key {key['id']} is revoked (at {revoked['revoked_at']}): a revoked key is final and its "
        "settings no longer change; create a new key instead"
    )
    for r in patches:
        err = r.json()["error"]
        assert (r.status_code, err["type"], err["code"], err["param"], err["message"]) == (
            409,
            "invalid_request_error",
            "key_revoked",
            "key_id",
            message,
        )
        assert r.headers["x-should-retry"] == "false"
    assert again == revoked and listed == [revoked] and revoked["train"] is True
    for run in (cli, cli_json):
        assert run.exit_code == 5 and run.stdout == ""
        assert f"unavailable (409): {message}" in " ".join(run.output.split())


@pytest.mark.parametrize(
    "method, body, param, message",
    [
        # A string, a number or null is no setting: pydantic's lax mode would take "false" and 0.
        ("patch", {"train": "false"}, "train", "train: Value error, must be true or false"),
        ("patch", {"train": 0}, "train", "train: Value error, must be true or false"),
        ("patch", {"trusted": "yes"}, "trusted", "trusted: Value error, must be true or false"),
        # PATCH sets a key's settings: a body with none of them changes nothing, so it is refused.
        ("patch", {"train": None}, None, "body: Value error, give train, trusted or both"),
        ("patch", {}, None, "body: Value error, give train, trusted or both"),
        # PATCH sets the settings only.
        ("patch", {"train": True, "tenant": "beta"}, "tenant", "tenant: Extra inputs are not permitted"),
        ("post", {"tenant": "acme", "train": "no"}, "train", "train: Value error, must be true or false"),
        ("post", {"tenant": "acme", "train": 1}, "train", "train: Value error, must be true or false"),
        ("post", {"tenant": "acme", "trusted": None}, "trusted", "trusted: Input should be a valid boolean"),
    ],
)
async def test_a_bad_training_setting_is_400_naming_the_field(tmp_path, method, body, param, message):
    async with running_server(make_settings(tmp_path), FakeEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, headers=ADMIN) as http:
            key = await create_key(http, "acme")
            path = f"/admin/keys/{key['id']}" if method == "patch" else "/admin/keys"
            r = await http.request(method.upper(), path, json=body)
            after = (await http.get("/admin/keys")).json()["keys"]
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"], err["message"]) == (
        400,
        "invalid_value",
        param,
        message,
    )
    # Nothing changed or made.
    assert [(k["id"], k["train"], k["trusted"]) for k in after] == [(key["id"], True, False)]


async def test_the_opt_out_through_the_cli(tmp_path):
    async with running_server(make_settings(tmp_path), FakeEngine(), watch_policy=False) as url:

        def run(*args):
            return asyncio.to_thread(admin, url, *args)

        made = await run("keys", "create", "acme", "--no-train")
        plain = json.loads((await run("keys", "create", "beta", "--json")).output)
        opted_id = made.output.split()[2]
        table = await run("keys", "list")
        off = await run("keys", "train", plain["id"], "off")
        listed = json.loads((await run("keys", "list", "--json")).output)["keys"]
        on = json.loads((await run("keys", "train", opted_id, "on", "--json")).output)
        unknown = await run("keys", "train", "k0000000000000000", "off")
        bad_state = await run("keys", "train", plain["id"], "maybe")
    assert (
        made.exit_code == 0 and f"API key {opted_id} of tenant acme (opted out of training):" in made.output
    )
    assert plain["train"] is True
    rows = {line.split()[0]: " ".join(line.split()) for line in table.output.splitlines() if line.strip()}
    assert rows[opted_id].startswith(f"{opted_id} acme no (opted out) ")
    assert rows[plain["id"]].startswith(f"{plain['id']} beta yes ")
    assert off.exit_code == 0 and off.output == (
        f"API key {plain['id']} of tenant beta: opted out of training: its answers are never trained\n"
    )
    assert {k["id"]: k["train"] for k in listed} == {opted_id: False, plain["id"]: False}
    assert (on["id"], on["train"]) == (opted_id, True)
    assert unknown.exit_code == 5 and "no API key 'k0000000000000000'" in unknown.output
    assert bad_state.exit_code == 2 and "expected on or off, got 'maybe'" in bad_state.output


async def test_a_key_opted_out_logs_every_answer_train_false_from_its_next_request(tmp_path):
    """The scripted engine: the key's setting joins the request's ``store`` (server.chat.serving.trains),
    read on each request. The real engine and the learner's join: tests/unit/server/test_privacy.py."""
    settings = make_settings(tmp_path)
    async with running_server(settings, ScriptedEngine(), watch_policy=False) as url:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
            opted = (
                await http.post("/admin/keys", json={"tenant": "acme", "train": False}, headers=ADMIN)
            ).json()
            plain = await create_key(http, "acme")

            async def train_of(key: dict | None, **extra) -> bool:
                headers = bearer(key["key"]) if key else {}
                r = await http.post("/v1/chat/completions", json=CHAT | extra, headers=headers)
                assert r.status_code == 200, r.text
                got = await http.get(f"/admin/trajectories/{r.json()['id']}", headers=ADMIN)
                return got.json()["train"]

            before = [
                await train_of(opted),
                await train_of(opted, store=True),  # the request cannot opt a key back in
                await train_of(plain),
                await train_of(plain, store=False),
                await train_of(None),
            ]
            await http.patch(f"/admin/keys/{plain['id']}", json={"train": False}, headers=ADMIN)
            await http.patch(f"/admin/keys/{opted['id']}", json={"train": True}, headers=ADMIN)
            after = [await train_of(plain), await train_of(opted), await train_of(opted, store=False)]
    assert before == [False, False, True, False, True]
    assert after == [False, True, False]
