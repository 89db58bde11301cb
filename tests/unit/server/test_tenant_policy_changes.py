"""Tenant policies added and removed at run time (issue 39 item 3; docs/tenants.md, "Adding and
removing a tenant policy"): ``/admin/tenant_policies`` (list, add, remove; 400 for a name that
is not a tenant policy's, 404 for removing one not listed, 409 past the adapter slots), each
replica following the database's list (``server.app.TenantPolicySync``: a new tenant's keys
served by its own policy, a removed one's by the global policy), and ``saoserve admin tenants``.

The real app and lifespan on a fake engine whose ``view(policy)`` gives each policy a
``FakeEngine`` of its own (testing.tenants).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from sqlalchemy import func, select
from starlette.testclient import TestClient
from typer.testing import CliRunner

import server.app
from core import tenant_store
from core.db import TrajectoryIndex, make_engine
from core.policies import GLOBAL
from core.records import utcnow
from saoserve.cli import app as cli_app
from server.app import create_app
from server.policy_watch import PolicyWatcher
from testing.cli import KEY
from testing.guard import add_rated
from testing.servers import ADMIN, make_settings, running_server
from testing.tenants import SharedFakeEngine, bearer, make_key, tenant_settings

PATH = "/admin/tenant_policies"
BAD_NAME = (
    "tenant 'Acme!' is not a valid name: 1 to 64 characters of a-z, 0-9, '.', '_', '-', beginning with a "
    "letter or digit"
)


def owner(client, key: str) -> str:
    """The policy ``/v1/models`` says serves ``key`` (its ``owned_by``)."""
    return client.get("/v1/models", headers=bearer(key)).json()["data"][0]["owned_by"]


def until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the replica did not follow the list in time"
        time.sleep(0.05)


def error(r) -> tuple[int, str, str]:
    return r.status_code, r.json()["error"]["code"], r.json()["error"]["message"]


def test_the_list_starts_from_the_setting_and_the_slots_bound_it(tmp_path):
    settings = tenant_settings(tmp_path, tenant_poll_s=0.05)
    with TestClient(create_app(settings, engine=SharedFakeEngine(), watch_policy=False)) as client:
        # 9 slots asked, 3 · (1 + 2 + 2) = 15 given (the default headroom of 2): 15 // 3 − 1 = 4.
        listing = client.get(PATH, headers=ADMIN).json()
        assert listing == {"tenant_policies": ["acme", "beta"], "served": ["acme", "beta"], "limit": 4}
        added = client.post(PATH, json={"tenant": "zeta"}, headers=ADMIN)
        assert added.status_code == 200
        assert added.json() == {
            "tenant": "zeta",
            "changed": True,
            "tenant_policies": ["acme", "beta", "zeta"],
        }
        again = client.post(PATH, json={"tenant": "zeta"}, headers=ADMIN).json()
        assert again["changed"] is False and again["tenant_policies"] == ["acme", "beta", "zeta"]
        assert client.post(PATH, json={"tenant": "eta"}, headers=ADMIN).json()["changed"] is True
        full = client.post(PATH, json={"tenant": "theta"}, headers=ADMIN)
        assert error(full) == (
            409,
            "no_tenant_slots",
            "no adapter slots for another tenant policy: this server's 15 slots serve the global "
            "policy and 4 tenant policies; restart the servers with more slots "
            "(SAOSERVE_TENANT_POLICY_HEADROOM or SAOSERVE_MAX_CPU_LORAS) to add one",
        )
        # A name the list holds is answered whatever the count.
        assert client.post(PATH, json={"tenant": "eta"}, headers=ADMIN).json()["changed"] is False


def test_bad_names_are_400_and_an_unknown_one_removed_is_404(tmp_path):
    settings = tenant_settings(tmp_path)
    with TestClient(create_app(settings, engine=SharedFakeEngine(), watch_policy=False)) as client:
        assert error(client.post(PATH, json={"tenant": "Acme!"}, headers=ADMIN)) == (
            400,
            "invalid_value",
            BAD_NAME,
        )
        assert error(client.post(PATH, json={"tenant": "global"}, headers=ADMIN)) == (
            400,
            "invalid_value",
            "'global' names the shared policy; a tenant policy needs another name",
        )
        assert client.post(PATH, json={}, headers=ADMIN).status_code == 400
        assert client.post(PATH, json={"tenant": "x" * 65}, headers=ADMIN).status_code == 400
        assert error(client.delete(f"{PATH}/Acme!", headers=ADMIN)) == (400, "invalid_value", BAD_NAME)
        assert error(client.delete(f"{PATH}/nope", headers=ADMIN)) == (
            404,
            "not_found",
            "no tenant policy 'nope'",
        )
        removed = client.delete(f"{PATH}/beta", headers=ADMIN)
        assert removed.json() == {"tenant": "beta", "changed": True, "tenant_policies": ["acme"]}
        assert client.delete(f"{PATH}/beta", headers=ADMIN).status_code == 404
        # Behind the admin key, as every /admin route.
        assert client.get(PATH).status_code == 401
        assert client.post(PATH, json={"tenant": "zeta"}).status_code == 401


def test_without_adapter_serving_no_tenant_policy_can_be_added(tmp_path):
    with TestClient(
        create_app(make_settings(tmp_path), engine=SharedFakeEngine(), watch_policy=False)
    ) as client:
        assert client.get(PATH, headers=ADMIN).json() == {"tenant_policies": [], "served": [], "limit": 0}
        assert error(client.post(PATH, json={"tenant": "acme"}, headers=ADMIN)) == (
            409,
            "no_tenant_slots",
            "this server serves no tenant policy: tenant policies need SAOSERVE_ADAPTER_SERVING=adapter; "
            "restart the servers with it",
        )


def test_a_replica_serves_an_added_tenant_and_falls_back_to_the_global_policy_for_a_removed_one(tmp_path):
    settings = tenant_settings(tmp_path, tenant_poll_s=0.05)
    engine = SharedFakeEngine()
    with TestClient(create_app(settings, engine=engine, watch_policy=False)) as client:
        zeta, beta = make_key(client, "zeta"), make_key(client, "beta")
        assert (owner(client, zeta), owner(client, beta)) == ("saoserve", "saoserve/beta")
        client.post(PATH, json={"tenant": "zeta"}, headers=ADMIN)
        client.delete(f"{PATH}/beta", headers=ADMIN)
        until(lambda: client.get(PATH, headers=ADMIN).json()["served"] == ["acme", "zeta"])
        assert (owner(client, zeta), owner(client, beta)) == ("saoserve/zeta", "saoserve")
        assert set(engine.views) == {"acme", "zeta"}
        # zeta's namespace was made (its database, a SQLite file under the tenants folder) and
        # its admin routes answer; beta's are gone from this replica.
        assert (tmp_path / "tenants" / "zeta" / "saoserve.db").is_file()
        assert client.get("/admin/learner", params={"policy": "zeta"}, headers=ADMIN).status_code == 200
        gone = client.get("/admin/learner", params={"policy": "beta"}, headers=ADMIN)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_policy"
        rows = [r["policy"] for r in client.get("/admin/policies", headers=ADMIN).json()["policies"]]
        assert rows == [GLOBAL, "acme", "zeta"]
    db = make_engine(settings.resolved_database_url)
    try:
        assert tenant_store.read(db) == ["acme", "zeta"]
    finally:
        db.dispose()


def indexed(url: str) -> int:
    """Trajectories indexed in the namespace database at ``url``."""
    db = make_engine(url)
    try:
        with db.connect() as conn:
            return conn.execute(select(func.count()).select_from(TrajectoryIndex)).scalar_one()
    finally:
        db.dispose()


def test_a_forget_reaches_the_namespace_of_a_removed_tenant_policy(tmp_path):
    """A removed tenant policy's namespace keeps its records (docs/tenants.md); the forget runs
    over it too (``core.tenant_store.ever``), on a replica that no longer serves it."""
    settings = tenant_settings(tmp_path, tenant_poll_s=0.05)
    with TestClient(create_app(settings, engine=SharedFakeEngine(), watch_policy=False)) as client:
        key_id = make_key(client, "beta").removeprefix("sao-").split(".")[0]
        # The replica's settings follow the list (beta leaves them): its URL taken now.
        url = settings.for_tenant("beta").resolved_database_url
        beta = make_engine(url)
        try:
            with beta.begin() as conn:  # one answer to the key, in beta's namespace
                add_rated(conn, "t1", 0, None, utcnow(), state=None, identity=f"key:{key_id}")
        finally:
            beta.dispose()
        assert indexed(url) == 1
        assert client.delete(f"{PATH}/beta", headers=ADMIN).status_code == 200
        until(lambda: client.get(PATH, headers=ADMIN).json()["served"] == ["acme"])
        # The key's one trajectory, in beta's namespace only: the global and acme's hold none.
        r = client.post("/admin/forget", json={"key": key_id}, headers=ADMIN)
        assert r.status_code == 200, r.text
        receipt = r.json()
        assert (receipt["trajectories"], receipt["completed"]) == (1, True)
        assert indexed(url) == 0
        assert client.get(f"/admin/forget/{receipt['id']}", headers=ADMIN).json()["trajectories"] == 1


def test_a_tenant_added_again_after_a_restart_with_the_setting_comes_back(tmp_path):
    """The setting seeds the list at each start: a name removed by the route but left in
    SAOSERVE_TENANT_POLICIES is back after the next start (docs/tenants.md)."""
    settings = tenant_settings(tmp_path)
    with TestClient(create_app(settings, engine=SharedFakeEngine(), watch_policy=False)) as client:
        client.delete(f"{PATH}/beta", headers=ADMIN)
    settings = tenant_settings(tmp_path)
    with TestClient(create_app(settings, engine=SharedFakeEngine(), watch_policy=False)) as client:
        assert client.get(PATH, headers=ADMIN).json()["tenant_policies"] == ["acme", "beta"]


async def test_saoserve_admin_tenants(tmp_path):
    runner = CliRunner()

    async def cli(*args: str):
        return await asyncio.to_thread(
            runner.invoke, cli_app, ["admin", "tenants", *args, "--url", url, "--key", KEY]
        )

    settings = tenant_settings(tmp_path)
    async with running_server(settings, SharedFakeEngine(), watch_policy=False) as url:
        added = await cli("add", "zeta")
        assert added.exit_code == 0, added.output
        assert added.stdout == "tenant zeta: added (tenant policies: acme, beta, zeta)\n"
        listed = await cli("list", "--json")
        assert json.loads(listed.stdout)["tenant_policies"] == ["acme", "beta", "zeta"]
        removed = await cli("remove", "zeta")
        assert removed.stdout == "tenant zeta: removed (tenant policies: acme, beta)\n"
        unknown = await cli("remove", "zeta")
        assert (unknown.exit_code, unknown.stderr) == (5, "error: not found (404): no tenant policy 'zeta'\n")
        bad = await cli("add", "global")
        assert bad.exit_code == 2
        assert bad.stderr == (
            "error: the server refused the request (400): 'global' names the shared policy; a tenant "
            "policy needs another name\n"
        )


def test_a_close_that_fails_still_frees_the_engine_and_the_replica_follows_on(tmp_path, monkeypatch, caplog):
    """Review item 3: a removal whose close raised ended the sync task, silently, and the engine
    kept the tenant. Now beta's log failing to close is logged and its database engine is
    disposed all the same; acme's whole close failing is logged and the engine still drops
    acme; zeta, added with it, is served in the same pass: the replica still follows the list."""
    settings = tenant_settings(tmp_path, tenant_poll_s=0.05)
    engine = SharedFakeEngine()
    app = create_app(settings, engine=engine, watch_policy=False)
    with TestClient(app) as client:
        beta = app.state.tenants["beta"]
        disposed = []
        real_dispose = beta.store.engine.dispose

        def broken_close() -> None:
            raise RuntimeError("the broker is gone")

        def dispose() -> None:
            disposed.append("beta")
            real_dispose()

        monkeypatch.setattr(beta.log, "close", broken_close)
        monkeypatch.setattr(beta.store.engine, "dispose", dispose)
        client.delete(f"{PATH}/beta", headers=ADMIN)
        until(lambda: client.get(PATH, headers=ADMIN).json()["served"] == ["acme"])
        until(lambda: set(engine.views) == {"acme"})
        assert disposed == ["beta"]
        assert "beta: closing its log failed" in caplog.text

        async def failing_close_policy(state, own_log):
            raise RuntimeError("close failed")

        monkeypatch.setattr(server.app, "close_policy", failing_close_policy)
        client.delete(f"{PATH}/acme", headers=ADMIN)
        client.post(PATH, json={"tenant": "zeta"}, headers=ADMIN)
        until(lambda: client.get(PATH, headers=ADMIN).json()["served"] == ["zeta"])
        assert set(engine.views) == {"zeta"}
        assert "acme: closing its state failed" in caplog.text
        monkeypatch.undo()  # the shutdown closes zeta's state


def test_the_sync_task_outlives_a_pass_that_raises(tmp_path, monkeypatch, caplog):
    """Whatever a pass raises, the next runs: the first pass fails, the second adds zeta."""
    settings = tenant_settings(tmp_path, tenant_poll_s=0.05)
    app = create_app(settings, engine=SharedFakeEngine(), watch_policy=False)
    with TestClient(app) as client:
        sync = app.state.tenant_sync
        real_sync, passes = sync.sync, []

        async def first_fails() -> None:
            passes.append(len(passes) + 1)
            if passes == [1]:
                raise RuntimeError("pass 1 failed")
            await real_sync()

        monkeypatch.setattr(sync, "sync", first_fails)
        client.post(PATH, json={"tenant": "zeta"}, headers=ADMIN)
        until(lambda: client.get(PATH, headers=ADMIN).json()["served"] == ["acme", "beta", "zeta"])
        assert passes[:2] == [1, 2]
        assert "tenant policies: a pass over the list failed; the next in 0.05 s" in caplog.text
        assert "RuntimeError: pass 1 failed" in caplog.text


def test_an_open_that_fails_closes_everything_it_opened(tmp_path, monkeypatch):
    """Review item 4: zeta's catch-up fails at every try; before the fix each try leaked its
    database engine, its log and its log threads. Three passes (called by hand: the poll is an
    hour) open three of each and close all three; the engine no longer serves zeta."""
    settings = tenant_settings(tmp_path, tenant_poll_s=3600)
    engine = SharedFakeEngine()
    made, disposed, opened, closed, pools_shut = [], [], [], [], []
    real_make_engine, real_open_log, real_open_policy = (
        server.app.make_engine,
        server.app.open_log,
        server.app.open_policy,
    )
    real_catch_up = PolicyWatcher.catch_up

    def noted(obj, method: str, calls: list, item) -> None:
        """``obj.method`` appends ``item`` to ``calls``, then does what it did."""
        real = getattr(obj, method)
        monkeypatch.setattr(obj, method, lambda *a, **kw: (calls.append(item), real(*a, **kw))[1])

    def make_engine(url):
        db = real_make_engine(url)
        if "zeta" in url:
            made.append(db)
            noted(db, "dispose", disposed, db)
        return db

    def open_log(url):
        lt = real_open_log(url)
        if "zeta" in url:
            opened.append(lt)
            noted(lt, "close", closed, lt)
        return lt

    def open_policy(policy, *args, **kwargs):
        state = real_open_policy(policy, *args, **kwargs)
        if policy == "zeta":
            noted(state.log_pool, "shutdown", pools_shut, state)
        return state

    async def catch_up(self):
        if self.policy == "zeta":
            raise RuntimeError("zeta's policy topic cannot be read")
        await real_catch_up(self)

    monkeypatch.setattr(server.app, "make_engine", make_engine)
    monkeypatch.setattr(server.app, "open_log", open_log)
    monkeypatch.setattr(server.app, "open_policy", open_policy)
    monkeypatch.setattr(PolicyWatcher, "catch_up", catch_up)
    app = create_app(settings, engine=engine, watch_policy=True)
    with TestClient(app) as client:
        client.post(PATH, json={"tenant": "zeta"}, headers=ADMIN)
        for _ in range(3):
            client.portal.call(app.state.tenant_sync.sync)
        assert client.get(PATH, headers=ADMIN).json()["served"] == ["acme", "beta"]
        assert (len(made), len(opened), len(pools_shut)) == (3, 3, 3)
        assert disposed == made and closed == opened
        assert set(engine.views) == {"acme", "beta"} and "zeta" not in app.state.tasks


def test_a_tenant_policy_listed_at_start_opens_as_one_added_and_one_that_fails_fails_the_start(
    tmp_path, monkeypatch
):
    """The start opens each listed tenant policy through ``TenantPolicySync.open`` (the engine
    told, ``add_policy``), awaiting each before the app takes requests. Beta's catch-up failing
    fails the start with its error, as a failure to open at start always did; what was opened
    is closed: beta's state by ``discard`` (the engine no longer serves it), then the global
    policy's and acme's by the shutdown."""
    settings = tenant_settings(tmp_path)
    engine = SharedFakeEngine()
    added, closed = [], []
    real_add_policy, real_close_policy = engine.add_policy, server.app.close_policy
    real_catch_up = PolicyWatcher.catch_up

    async def add_policy(policy):
        added.append(policy)
        await real_add_policy(policy)

    async def close_policy(state, own_log):
        closed.append(state.policy)
        await real_close_policy(state, own_log)

    async def catch_up(self):
        if self.policy == "beta":
            raise RuntimeError("beta's policy topic cannot be read")
        await real_catch_up(self)

    monkeypatch.setattr(engine, "add_policy", add_policy)
    monkeypatch.setattr(server.app, "close_policy", close_policy)
    monkeypatch.setattr(PolicyWatcher, "catch_up", catch_up)
    app = create_app(settings, engine=engine, watch_policy=True)
    with pytest.raises(RuntimeError, match="beta's policy topic cannot be read"), TestClient(app):
        pass
    assert added == ["acme", "beta"]
    assert closed == ["beta", GLOBAL, "acme"]
    assert set(engine.views) == {"acme"} and settings.tenant_policies == ["acme"]


WHY = "the global policy serves the full weights of its version 5"


def test_no_tenant_policy_is_added_while_the_global_policy_serves_full_weights(tmp_path, caplog):
    """Review item 8: an add while the global policy serves full weights is 409
    ``full_weights_served`` saying what to do (a name listed already is answered as before); a
    replica that finds a name listed in that state does not serve it, logs why, and serves it
    once the engine is at the base weights again."""
    settings = tenant_settings(tmp_path, tenant_poll_s=0.05)
    engine = SharedFakeEngine()
    with TestClient(create_app(settings, engine=engine, watch_policy=False)) as client:
        # Full weights swapped in after the start (an engine starts at the base weights).
        engine.refusal = WHY
        assert error(client.post(PATH, json={"tenant": "zeta"}, headers=ADMIN)) == (
            409,
            "full_weights_served",
            f"no tenant policy can be added now: {WHY}",
        )
        again = client.post(PATH, json={"tenant": "acme"}, headers=ADMIN)
        assert again.status_code == 200 and again.json()["changed"] is False
        db = make_engine(settings.resolved_database_url)
        try:
            assert tenant_store.read(db) == ["acme", "beta"]
            tenant_store.add(db, "zeta", 4)  # another replica's add
        finally:
            db.dispose()
        until(lambda: f"zeta: tenant policy not served: {WHY}" in caplog.text)
        assert client.get(PATH, headers=ADMIN).json()["served"] == ["acme", "beta"]
        assert set(engine.views) == {"acme", "beta"}
        engine.refusal = None
        until(lambda: client.get(PATH, headers=ADMIN).json()["served"] == ["acme", "beta", "zeta"])
