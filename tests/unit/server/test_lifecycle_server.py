"""Operators' lifecycle actions (server/admin/lifecycle_router.py, saoserve admin promote|reject|pin|unpin|
guard|canary|quarantine|versions), each recorded with who and when; servers never serve a
rejected version (server/policy_watch.py, POST /admin/load_policy and /admin/rollback). The real
app with ``testing.fakes.FakeEngine``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from core.control import CANARY_SHARE, GUARD_OFF, GUARD_PIN, get_flag
from core.db import PolicyVersion, VersionStatusEvent, make_engine
from core.logbus import open_log
from core.records import TOPIC_POLICY, PolicyEvent
from saoserve.cli import app as cli_app
from server.metrics import ServerMetrics
from server.policy_watch import PolicyWatcher
from testing.fakes import FakeEngine, OutageLog, event
from testing.guard import seed
from testing.logs import read_topic
from testing.servers import ADMIN, make_settings, running_server

runner = CliRunner()
KEY = "test-admin-key"
JSON = {"content-type": "application/json"}


def stage_events(url: str) -> list[tuple]:
    engine = make_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                VersionStatusEvent.version,
                VersionStatusEvent.from_status,
                VersionStatusEvent.to_status,
                VersionStatusEvent.actor,
                VersionStatusEvent.reason,
            ).order_by(VersionStatusEvent.id)
        ).all()
        stages = dict(conn.execute(select(PolicyVersion.version, PolicyVersion.lifecycle)).all())
    engine.dispose()
    return [tuple(r) for r in rows], stages


def admin(url: str, *args: str):
    return runner.invoke(cli_app, ["admin", *args, "--url", url, "--key", KEY], env={"COLUMNS": "200"})


async def test_operator_overrides_are_recorded_with_who_and_why(tmp_path):
    settings = make_settings(tmp_path)
    db = settings.resolved_database_url
    seed(db)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:

        def run(*args):
            return asyncio.to_thread(admin, url, *args)

        promoted = await run("promote", "2", "--as", "alice", "--reason", "read its answers")
        again = await run("promote", "2", "--as", "alice")
        rejected = await run("reject", "3", "--as", "bob")
        final = await run("reject", "4")
        base = await run("reject", "0")
        unknown = await run("promote", "9")
        pinned = await run("pin", "2", "--as", "carol")
        pin_flag = get_flag(make_engine(db), GUARD_PIN)
        unpinned = await run("unpin", "--as", "carol")
        off = await run("guard", "off", "--as", "dan")
        bad_state = await run("guard", "maybe")
        share = await run("canary", "0.1", "--as", "erin")
        bad_share = await run("canary", "1.5")
        tiny_share = await run("canary", "5e-324")
        versions = await run("versions")
        listed = await run("quarantine", "--json")
        table = await run("quarantine")
        async with httpx.AsyncClient(base_url=url) as http:
            nameless = await http.post(
                "/admin/lifecycle/promote", json={"version": 1}, headers=ADMIN | {"X-Operator": "x" * 65}
            )
            back = await http.post("/admin/rollback", json={"version": 4}, headers=ADMIN)
            refused_shares = [
                await http.post("/admin/lifecycle/canary", content=body, headers=ADMIN | JSON)
                for body in ('{"share": 5e-324}', '{"share": 1.0}', '{"share": NaN}', '{"share": 0.0099}')
            ]
            state = (await http.get("/admin/lifecycle", headers=ADMIN)).json()
    assert promoted.exit_code == 0 and "versions [2] promoted by alice" in promoted.stdout
    assert again.exit_code == 5 and "version 2 cannot go from promoted to promoted" not in again.output
    assert "already promoted" in again.output
    assert rejected.exit_code == 0 and "versions [3] rejected by bob" in rejected.stdout
    assert final.exit_code == 5 and "cannot go from rejected to rejected" not in final.output
    assert "already rejected" in final.output
    assert base.exit_code == 5 and "version 0 (the base model) cannot be rejected" in base.output
    assert unknown.exit_code == 5 and "no policy version 9" in unknown.output
    assert pinned.exit_code == 0 and pin_flag == "2" and unpinned.exit_code == 0
    assert off.exit_code == 0 and "guard off (by dan)" in off.stdout
    assert bad_state.exit_code == 2 and "expected on or off" in bad_state.output
    assert share.exit_code == 0 and "no canary share" in share.stdout
    for bad in (bad_share, tiny_share):
        assert bad.exit_code == 2 and "SHARE must be a number in [0.01, 0.99]" in " ".join(bad.output.split())
    for r in refused_shares:  # 400 naming the field and the bound; the flag stays 0.1
        err = r.json()["error"]
        assert (r.status_code, err["param"], err["code"]) == (400, "share", "invalid_value")
        assert "share must be a number in [0.01, 0.99]" in err["message"]
    assert get_flag(make_engine(db), GUARD_OFF) == "1" and get_flag(make_engine(db), CANARY_SHARE) == "0.1"
    flat = " ".join(versions.stdout.split())
    assert "lifecycle" in flat and "2 published promoted 1" in flat and "4 published rejected 3" in flat
    q = json.loads(listed.stdout)
    assert q["total"] == 2 and {s["sample_id"] for s in q["samples"]} == {"t00001", "t00002"}
    assert "quarantined samples (2)" in table.stdout
    assert nameless.status_code == 400 and "X-Operator" in nameless.json()["error"]["message"]
    assert back.status_code == 409 and back.json()["error"]["code"] == "version_rejected"
    assert (state["promoted"], state["lineage"], state["guard"], state["pinned"]) == (2, [], "off", None)
    assert state["canary_share"] == 0.1 and state["mode"] == "probation"
    assert state["events"] and all(e["at"].endswith("+00:00") for e in state["events"])
    events, stages = stage_events(db)
    assert stages == {0: "promoted", 1: "promoted", 2: "promoted", 3: "rejected", 4: "rejected"}
    assert events == [
        (2, "canary", "promoted", "alice", "read its answers"),
        (3, "canary", "rejected", "bob", "by bob"),
        (2, "promoted", "promoted", "carol", "pinned: the guard decides nothing by itself"),
        (2, "promoted", "promoted", "carol", "unpinned: the guard decides again"),
        (2, "promoted", "promoted", "dan", "guard turned off"),
        (2, "promoted", "promoted", "erin", "canary share set to 0.1 (stored; probation mode has no share)"),
    ]
    # Each move is also a stage notice on the policy topic (servers log it, never load it).
    log = open_log(settings.resolved_log_url)
    notices = [PolicyEvent.model_validate_json(e.value) for e in read_topic(log, TOPIC_POLICY)]
    log.close()
    assert [(e.kind, e.version, e.lifecycle, e.actor) for e in notices] == [
        ("stage", 2, "promoted", "alice"),
        ("stage", 3, "rejected", "bob"),
    ]


async def test_a_server_never_serves_a_rejected_version():
    engine = FakeEngine(version=1)
    watcher = PolicyWatcher(OutageLog(0), engine, ServerMetrics(), poll_s=0.25)
    rejected = event(2).model_copy(update={"lifecycle": "rejected"})
    assert await watcher.apply(rejected) is False and engine.swaps == []
    canary = event(3).model_copy(update={"lifecycle": "canary"})
    assert await watcher.apply(canary) is True
    assert engine.swaps == [(3, Path("/policies/v3"), "0" * 64)]


async def test_load_policy_refuses_a_rejected_version(tmp_path):
    settings = make_settings(tmp_path)
    seed(settings.resolved_database_url)
    async with (
        running_server(settings, FakeEngine(), watch_policy=False) as url,
        httpx.AsyncClient(base_url=url) as http,
    ):
        r = await http.post(
            "/admin/load_policy", json={"version": 4, "path": "/p/v4", "sha256": "0" * 64}, headers=ADMIN
        )
    assert r.status_code == 409 and r.json()["error"]["code"] == "version_rejected"


@pytest.mark.parametrize("name", ["Jöhn", "a\nb", "eve\x1b[31m", " ", "x" * 65])
def test_the_cli_refuses_an_operator_name_no_header_can_carry(name):
    # Checked before any request (no server runs): a usage error, exit 2, the name escaped.
    got = runner.invoke(cli_app, ["admin", "promote", "2", "--as", name, "--url", "http://127.0.0.1:9"])
    assert got.exit_code == 2
    assert "NAME must be 1 to 64 printable ASCII characters" in got.output
    assert "\x1b" not in got.output
