"""``saoserve admin`` (saoserve/admin/): each subcommand against the real server, and the exit
codes a script reads: 0 ok, 2 usage, 3 unreachable, 4 key, 5 not found or pruned, 6 not ready.

The server tests seed the rows a learner would write (policy versions, a step, a counter, prompt
evidence) straight into the server's SQLite database; no learner runs, so a rollback stays a
request (the ``rollback_to`` flag). Without a real server: tests/unit/saoserve/test_admin_cli.py.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import insert

from core.control import PAUSED, ROLLBACK_TO, get_flag
from core.db import LearnerCounter, LearnerStep, PolicyVersion, make_engine
from core.evidence_store import EvidenceStore
from saoserve.admin.client import (
    EXIT_AUTH,
    EXIT_NOT_FOUND,
    EXIT_SERVER,
)
from saoserve.cli import app
from testing.cli import KEY, flat, runner
from testing.servers import make_settings, running_server


# ------------------------------------------------------------------ against the server
async def cli(*args: str) -> object:
    """``saoserve admin ARGS`` in a thread: the server runs on this test's event loop."""
    return await asyncio.to_thread(runner.invoke, app, ["admin", *args])


def seed(settings, model_dir, serving: int) -> dict:
    """What a learner leaves behind: versions 0 (the base model), 1 (weights present) and 2
    (folder pruned), one step, a counter, and evidence of two prompts read at ``serving``."""
    db = make_engine(settings.resolved_database_url)
    v1 = settings.home / "policies" / "v000001"
    v1.mkdir(parents=True)
    (v1 / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    pruned = settings.home / "policies" / "v000002"
    now = datetime(2025, 6, 1, 12, 0, 3, tzinfo=UTC)
    rows = [(0, model_dir, None), (1, v1, 0), (2, pruned, 1)]
    metrics = {
        "reward_mean": 0.625,
        "kept_fraction": 0.9,
        "policy_loss": -0.0123,
        "staleness_mean": 1.5,
        "step_time_s": 3.21,
    }
    with db.begin() as conn:
        for version, path, parent in rows:
            conn.execute(
                insert(PolicyVersion).values(
                    version=version,
                    path=str(path),
                    sha256="0" * 64,
                    status="published",
                    parent_version=parent,
                    metrics={},
                    created_at=now,
                )
            )
        conn.execute(
            insert(LearnerStep).values(run_id="r", step=2, version=2, metrics=metrics, created_at=now)
        )
        conn.execute(insert(LearnerCounter).values(name="rollback_refused", value=2))
    store = EvidenceStore(db)
    # p-init: 3 of 3 offline → α0 = 8·3.5/4 = 7, β0 = 1; p-known: prior (4, 4) + one reward 1 → (5, 4).
    store.init_from_rollouts([("p-init", 3, 3)], version=serving)
    with db.begin() as conn:
        store.add_results(conn, [("p-known", 1.0, serving)])
    return {"db": db, "pruned": pruned}


@pytest.fixture
async def admin_server(policy_engine, model_dir, tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, policy_engine, watch_policy=False) as url:
        seeded = seed(settings, model_dir, policy_engine.version)
        yield url, policy_engine.version, seeded
        seeded["db"].dispose()


async def test_status_and_versions(admin_server):
    url, serving, _ = admin_server
    result = await cli("status", "--url", url, "--key", KEY)
    assert result.exit_code == 0, result.output
    out = flat(result.stdout)
    assert f"server {url}: ready (database ok, log ok, engine ok, policy ok)" in out
    assert f"serving version {serving}; newest version 2 (published)" in out
    assert "learning running" in out and "counters rollback_refused 2" in out
    assert "last 1 learner steps" in out
    assert "2 2 0.625 0.900 -0.0123 1.50 3.2 12:00:03" in out and "…" not in result.stdout

    result = await cli("status", "--url", url, "--key", KEY, "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["ready"] is True and report["serving"] == serving
    assert report["readiness"]["database"] == "ok" and report["newest_version"]["version"] == 2
    assert (report["learning"], report["rollback_to"], report["counters"]) == (
        "running",
        None,
        {"rollback_refused": 2},
    )
    assert [(s["step"], s["reward_mean"]) for s in report["steps"]] == [(2, 0.625)]

    result = await cli("versions", "--url", url, "--key", KEY)
    assert result.exit_code == 0, result.output
    out = flat(result.stdout)
    assert f"policy versions (serving {serving})" in out
    # The lifecycle stage column (docs/guard.md) is checked by the lifecycle tests; drop it here.
    stages = (" promoted ", " canary ", " candidate ", " rejected ")
    rows = [flat(line) for line in result.stdout.splitlines() if " published " in line]
    for stage in stages:
        rows = [row.replace(stage, " ") for row in rows]
    expected = [(0, "-", "present"), (1, "0", "present"), (2, "1", "pruned")]
    assert rows == [
        f"{'* ' if v == serving else ''}{v} published {parent} {weights} 2025-06-01 12:00:03"
        for v, parent, weights in expected
    ]

    result = await cli("versions", "--url", url, "--key", KEY, "--json", "--last", "2")
    body = json.loads(result.stdout)
    assert body["serving"] == serving
    assert [(v["version"], v["available"]) for v in body["versions"]] == [(1, True), (2, False)]
    result = await cli("versions", "--url", url, "--key", KEY, "--last", "1")
    assert "newest 1 of 3; --last 0 shows all" in flat(result.stdout)


async def test_pause_resume_and_rollback(admin_server):
    url, _, seeded = admin_server
    db = seeded["db"]
    result = await cli("pause", "--url", url, "--key", KEY)
    assert (result.exit_code, result.stdout) == (0, "learning paused\n")
    assert get_flag(db, PAUSED) == "1"
    report = json.loads((await cli("status", "--url", url, "--key", KEY, "--json")).stdout)
    assert report["learning"] == "paused"
    result = await cli("resume", "--url", url, "--key", KEY, "--json")
    assert (result.exit_code, json.loads(result.stdout)) == (0, {"learning": "running"})
    assert get_flag(db, PAUSED) is None

    result = await cli("rollback", "9", "--url", url, "--key", KEY)
    assert result.exit_code == EXIT_NOT_FOUND
    assert result.stderr == "error: not found (404): no policy version 9\n"
    result = await cli("rollback", "2", "--url", url, "--key", KEY)
    assert result.exit_code == EXIT_NOT_FOUND
    assert flat(result.stderr) == (
        f"error: unavailable (409): policy version 2 cannot be restored: its weights are gone from "
        f"{seeded['pruned']} (the learner keeps only the newest keep_versions folders)"
    )
    assert get_flag(db, ROLLBACK_TO) is None

    result = await cli("rollback", "1", "--url", url, "--key", KEY)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("rollback to version 1 requested")
    assert get_flag(db, ROLLBACK_TO) == "1"
    result = await cli("status", "--url", url, "--key", KEY)
    assert "learning running; rollback to version 1 requested, not yet carried out" in flat(result.stdout)
    assert json.loads((await cli("status", "--url", url, "--key", KEY, "--json")).stdout)["rollback_to"] == 1


async def test_rollback_route_answers_409_for_a_pruned_version(admin_server):
    url, _, seeded = admin_server
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.post(
            "/admin/rollback", json={"version": 2}, headers={"Authorization": f"Bearer {KEY}"}
        )
    assert r.status_code == 409
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("version_unavailable", "version")
    assert str(seeded["pruned"]) in err["message"]


async def test_evidence(admin_server):
    url, serving, _ = admin_server
    # An unknown prompt is a 200 with the default prior: the baseline its next request gets.
    result = await cli("evidence", "never-seen", "--url", url, "--key", KEY, "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert (body["known"], body["n_results"], body["reward_sum"]) == (False, 0, 0.0)
    b = body["at_version"]
    assert (b["alpha"], b["beta"], b["value"], b["version"]) == (4.0, 4.0, 0.5, serving)
    result = await cli("evidence", "never-seen", "--url", url, "--key", KEY)
    assert "known no: no results yet, the default prior" in flat(result.stdout)

    result = await cli("evidence", "p-known", "--url", url, "--key", KEY)
    assert result.exit_code == 0, result.output
    out = flat(result.stdout)
    assert "known yes: 1 results, reward sum 1.000" in out
    assert f"at version {serving} value 0.556 alpha, beta 5.000, 4.000" in out

    result = await cli("evidence", "--top", "2", "--url", url, "--key", KEY)
    assert result.exit_code == 0, result.output
    # Weights sqrt(v(1-v) + 0.05): p-known sqrt(20/81 + 0.05) = 0.545, p-init sqrt(7/64 + 0.05) = 0.399.
    out = flat(result.stdout)
    assert f"most uncertain prompts at version {serving}" in out
    assert "p-known 0.556 5.000 4.000 0.545 p-init 0.875 7.000 1.000 0.399" in out
    top1 = json.loads((await cli("evidence", "--top", "1", "--url", url, "--key", KEY, "--json")).stdout)
    assert [p["prompt_id"] for p in top1["prompts"]] == ["p-known"]


async def test_wrong_key_is_exit_4(admin_server):
    url, _, _ = admin_server
    for args in (["status"], ["versions"], ["pause"], ["rollback", "1"], ["evidence", "p"]):
        result = await cli(*args, "--url", url, "--key", "wrong")
        assert result.exit_code == EXIT_AUTH, (args, result.output)
        assert result.stderr == "error: the admin key was refused (401): check SAOSERVE_ADMIN_KEY or --key\n"


async def test_admin_disabled_is_exit_4(policy_engine, tmp_path):
    async with running_server(
        make_settings(tmp_path, admin_key=""), policy_engine, watch_policy=False
    ) as url:
        result = await cli("versions", "--url", url, "--key", KEY)
    assert result.exit_code == EXIT_AUTH
    assert result.stderr == (
        "error: permission denied (403): admin routes are disabled: SAOSERVE_ADMIN_KEY is not set\n"
    )


async def test_status_of_a_server_not_ready_prints_then_exits_6(policy_engine, tmp_path):
    from core.logbus import KafkaLog

    # The log is a broker nobody runs: /readyz is 503 naming it; the admin routes (SQLite) answer.
    settings = make_settings(tmp_path, log_url="kafka://127.0.0.1:9")
    log = KafkaLog("kafka://127.0.0.1:9", send_timeout_s=1)
    async with running_server(settings, policy_engine, log_transport=log, watch_policy=False) as url:
        result = await cli("status", "--url", url, "--key", KEY)
    assert result.exit_code == EXIT_SERVER, result.output
    assert f"server {url}: NOT READY (database ok, log: " in flat(result.stdout)
    assert result.stderr.startswith(f"error: the server at {url} is not ready (503): log: ")
