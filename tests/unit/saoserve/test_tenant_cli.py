"""The CLI of a policy per tenant (docs/tenants.md, "A policy per tenant"): ``--tenant`` on the
jobs (``learn``, ``migrate``, ``pretrain-critic``, ``evidence-init``) and on the policy commands of
``saoserve admin`` (sent as ``?policy=``), ``saoserve admin policies``, and ``saoserve retention``
over every namespace.

The admin commands run against a stub HTTP server that records each request and answers the
shapes of server/admin/protocol.py, refusing an unknown ``policy`` as the server does (404
``unknown_policy``); no engine, no learner (``run_learner`` is replaced).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import pytest
from typer.testing import CliRunner

from core.db import LogRecord, TrajectoryIndex, make_engine
from core.evidence_store import EvidenceStore, stored_prompt_id
from core.logbus import SqlLog
from core.records import utcnow
from saoserve.admin.client import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, takes_policy
from saoserve.cli import app
from server.store import ServerStore
from testing.builders import traj
from testing.rows import backdate, count, logged

runner = CliRunner()
KEY = "test-admin-key"
POLICIES = ("global", "acme", "beta")


def flat(text: str) -> str:
    """The output with runs of whitespace (table padding) as one space."""
    return " ".join(text.split())


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The process settings re-read from a clean environment with two tenant policies, acme and
    beta (adapter serving, the 3 × 3 CPU adapter slots three policies need)."""
    from core.settings import get_settings

    for name in (
        "SAOSERVE_DATABASE_URL",
        "SAOSERVE_LOG_URL",
        "SAOSERVE_RETENTION_DAYS",
        "SAOSERVE_ADMIN_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("SAOSERVE_ADAPTER_SERVING", "adapter")
    monkeypatch.setenv("SAOSERVE_TENANT_POLICIES", "acme,beta")
    monkeypatch.setenv("SAOSERVE_MAX_CPU_LORAS", "9")
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


# ------------------------------------------------------------------ a stub server
LEARNER = {"learning": "running", "rollback_to": None, "counters": {}, "steps": []}
GUARD = {
    "on": True,
    "pinned": None,
    "promoted": 0,
    "lineage": [],
    "stages": {},
    "verdict": None,
    "mode": "canary",
    "can": "decide",
    "says": "can decide: nothing under watch now",
}
ANSWERS = {
    ("GET", "/readyz"): {"database": "ok", "log": "ok", "engine": "ok", "policy": "ok"},
    ("GET", "/admin/policy_versions"): {"serving": 0, "versions": []},
    ("GET", "/admin/learner"): LEARNER,
    ("GET", "/dashboard/state"): {"guard": GUARD},
    ("POST", "/admin/pause"): {"learning": "paused"},
    ("POST", "/admin/resume"): {"learning": "running"},
    ("POST", "/admin/rollback"): {"rollback_to": 1},
    ("POST", "/admin/lifecycle/promote"): {"versions": [2], "actor": "operator"},
    ("POST", "/admin/lifecycle/reject"): {"versions": [2], "actor": "operator"},
    ("POST", "/admin/lifecycle/pin"): {"pinned": 2, "actor": "operator"},
    ("POST", "/admin/lifecycle/unpin"): {"actor": "operator"},
    ("POST", "/admin/lifecycle/guard"): {"guard": "off", "actor": "operator"},
    ("POST", "/admin/lifecycle/canary"): {"message": "canary share 0.3", "actor": "operator"},
    ("GET", "/admin/evidence/p1"): {"prompt_id": "p1", "known": False},
    ("GET", "/admin/evidence"): {"version": 0, "prompts": []},
    ("GET", "/admin/dead_letters"): {"total": 0, "dead_letters": []},
    ("GET", "/admin/quarantine"): {"total": 0, "samples": []},
    ("GET", "/admin/keys"): {"keys": []},
    ("POST", "/admin/forget"): {"user": "u"},
}


class Stub:
    """A threaded HTTP server on a free port: ``requests`` records ``(method, path, query,
    body)`` of each request; ``answers`` maps ``(method, path)`` to the JSON answered with 200.
    A ``policy`` outside ``POLICIES`` is answered 404 ``unknown_policy`` with the server's
    message."""

    def __init__(self, answers: dict):
        self.answers = answers
        self.requests: list[tuple[str, str, dict, object]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                parts = urlsplit(self.path)
                query = dict(parse_qsl(parts.query))
                size = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(size)) if size else None
                stub.requests.append((self.command, parts.path, query, body))
                policy = query.get("policy", "global")
                if policy not in POLICIES:
                    message = f"no policy named {policy!r} (policies: {', '.join(POLICIES)})"
                    status, answer = 404, {"error": {"message": message, "code": "unknown_policy"}}
                elif (self.command, parts.path) in stub.answers:
                    status, answer = 200, stub.answers[(self.command, parts.path)]
                else:
                    status, answer = 404, {"error": {"message": "no such route", "code": None}}
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)


@pytest.fixture
def stub(env) -> Iterator[Stub]:
    s = Stub(dict(ANSWERS))
    s.thread.start()
    yield s
    s.server.shutdown()
    s.server.server_close()
    s.thread.join()


def admin(stub: Stub, *args: str):
    return runner.invoke(app, ["admin", *args, "--url", stub.url, "--key", KEY], env={"COLUMNS": "200"})


# ------------------------------------------------------------------ admin --tenant → ?policy=
@pytest.mark.parametrize(
    ("args", "method", "path", "params", "body"),
    [
        (["versions"], "GET", "/admin/policy_versions", {}, None),
        (["pause"], "POST", "/admin/pause", {}, None),
        (["resume"], "POST", "/admin/resume", {}, None),
        (["rollback", "1"], "POST", "/admin/rollback", {}, {"version": 1}),
        (["promote", "2"], "POST", "/admin/lifecycle/promote", {}, {"version": 2, "reason": ""}),
        (
            ["reject", "2", "--reason", "bad"],
            "POST",
            "/admin/lifecycle/reject",
            {},
            {"version": 2, "reason": "bad"},
        ),
        (["pin", "2"], "POST", "/admin/lifecycle/pin", {}, {"version": 2, "reason": ""}),
        (["unpin"], "POST", "/admin/lifecycle/unpin", {}, None),
        (["guard", "off"], "POST", "/admin/lifecycle/guard", {}, {"on": False}),
        (["canary", "0.3"], "POST", "/admin/lifecycle/canary", {}, {"share": 0.3}),
        (["evidence", "p1"], "GET", "/admin/evidence/p1", {}, None),
        (["evidence", "--top", "3"], "GET", "/admin/evidence", {"top": "3"}, None),
        (["dead-letters"], "GET", "/admin/dead_letters", {"limit": "20", "payload": "false"}, None),
        (["quarantine", "--limit", "5"], "GET", "/admin/quarantine", {"limit": "5"}, None),
    ],
)
def test_tenant_is_sent_as_the_policy_parameter(stub, args, method, path, params, body):
    result = admin(stub, *args, "--tenant", "acme", "--json")
    assert result.exit_code == EXIT_OK, result.output
    assert stub.requests == [(method, path, params | {"policy": "acme"}, body)]
    assert json.loads(result.stdout) == stub.answers[(method, path)]
    # Without --tenant, the global policy: no parameter at all (what a server before tenant
    # policies accepts).
    stub.requests.clear()
    assert admin(stub, *args, "--json").exit_code == EXIT_OK
    assert stub.requests == [(method, path, params, body)]


def test_status_of_a_tenant_policy(stub):
    """Every call about the policy carries it; /readyz answers for every policy at once."""
    result = admin(stub, "status", "--tenant", "beta", "--steps", "3", "--json")
    assert result.exit_code == EXIT_OK, result.output
    assert [(m, p, q) for m, p, q, _ in stub.requests] == [
        ("GET", "/readyz", {}),
        ("GET", "/admin/policy_versions", {"policy": "beta"}),
        ("GET", "/admin/learner", {"limit": "3", "policy": "beta"}),
        ("GET", "/dashboard/state", {"policy": "beta"}),
    ]
    report = json.loads(result.stdout)
    assert (report["policy"], report["serving"], report["guard"]) == ("beta", 0, GUARD)
    result = admin(stub, "status", "--tenant", "beta")
    assert result.exit_code == EXIT_OK, result.output
    assert "policy beta" in flat(result.stdout)
    assert json.loads(admin(stub, "status", "--json").stdout)["policy"] == "global"
    # The global policy's status table reads as it did before tenant policies: no policy row.
    assert "policy global" not in flat(admin(stub, "status").stdout)


def test_key_registry_and_forget_never_take_a_policy(stub):
    """Keys live in the global database for every policy; forget runs over every namespace.
    ``keys list --tenant`` filters the keys by tenant (``?tenant=``), it names no policy."""
    assert admin(stub, "keys", "list", "--tenant", "acme", "--json").exit_code == EXIT_OK
    assert admin(stub, "forget", "u", "--json").exit_code == EXIT_OK
    assert stub.requests == [
        ("GET", "/admin/keys", {"tenant": "acme"}, None),
        ("POST", "/admin/forget", {}, {"user": "u"}),
    ]
    assert "--tenant" not in runner.invoke(app, ["admin", "forget", "--help"]).output
    assert [takes_policy(p) for p in ("/admin/keys/k1/revoke", "/admin/policies", "/readyz")] == [False] * 3
    assert [takes_policy(p) for p in ("/admin/lifecycle", "/dashboard/state")] == [True, True]


def test_an_unknown_policy_is_the_servers_404(stub):
    result = admin(stub, "versions", "--tenant", "zeta")
    assert result.exit_code == EXIT_NOT_FOUND
    assert result.stderr == "error: not found (404): no policy named 'zeta' (policies: global, acme, beta)\n"
    assert result.stdout == ""


# ------------------------------------------------------------------ admin policies
POLICY_ROWS = {
    "policies": [
        {
            "policy": "global",
            "tenant": None,
            "version": 5,
            "lifecycle": "promoted",
            "paused": False,
            "steps": 12,
            "reward_mean": 0.41,
            "staleness_mean": 0.9,
            "last_step_at": "2025-06-01T12:00:03.123+00:00",
        },
        {
            "policy": "acme",
            "tenant": "acme",
            "version": 2,
            "lifecycle": "candidate",
            "paused": True,
            "steps": 3,
            "reward_mean": 0.6666,
            "staleness_mean": 1.25,
            "last_step_at": "2025-06-01T12:01:00+00:00",
        },
        # A tenant policy no learner has stepped yet: base weights, nothing measured.
        {
            "policy": "beta",
            "tenant": "beta",
            "version": 0,
            "lifecycle": "promoted\x1b[31m",
            "paused": False,
            "steps": 0,
            "reward_mean": None,
            "staleness_mean": None,
            "last_step_at": None,
        },
    ]
}


def test_policies_prints_one_row_per_policy(stub):
    stub.answers[("GET", "/admin/policies")] = POLICY_ROWS
    result = admin(stub, "policies")
    assert result.exit_code == EXIT_OK, result.output
    out = flat(result.stdout)
    assert "policies (3)" in out
    assert "policy tenant version lifecycle paused steps reward mean staleness last step (UTC)" in out
    # Reward to 3 decimals (0.6666 → 0.667), staleness to 2 (1.25), the time to the second.
    assert "global - 5 promoted no 12 0.410 0.90 2025-06-01 12:00:03" in out
    assert "acme acme 2 candidate yes 3 0.667 1.25 2025-06-01 12:01:00" in out
    # The escape a server's text might hold is printed as text, never sent to the terminal.
    assert "beta beta 0 promoted\\x1b[31m no 0 - - -" in out and "\x1b" not in result.stdout
    assert stub.requests == [("GET", "/admin/policies", {}, None)]

    result = admin(stub, "policies", "--json")
    assert result.exit_code == EXIT_OK and json.loads(result.stdout) == POLICY_ROWS
    assert "--tenant" not in runner.invoke(app, ["admin", "policies", "--help"]).output


def test_settings_that_are_not_valid_are_one_line_naming_the_variable(env):
    # Tenant policies with the default merged serving; a slot count the bounds refuse.
    env.setenv("SAOSERVE_ADAPTER_SERVING", "merged")
    result = runner.invoke(app, ["migrate", "--tenant", "acme"])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.startswith(
        "error: invalid settings: tenant_policies needs adapter_serving 'adapter'"
    )
    env.setenv("SAOSERVE_ADAPTER_SERVING", "adapter")
    env.setenv("SAOSERVE_MAX_CPU_LORAS", "0")
    result = runner.invoke(app, ["migrate"])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr == (
        "error: invalid settings: SAOSERVE_MAX_CPU_LORAS: Input should be greater than or equal to 1\n"
    )


def test_policies_of_a_server_without_the_route_is_exit_5(stub):
    result = admin(stub, "policies")
    assert result.exit_code == EXIT_NOT_FOUND
    assert result.stderr == "error: not found (404): no such route\n"


# ------------------------------------------------------------------ the jobs' --tenant
NO_POLICY = "tenant 'zeta' has no policy of its own (SAOSERVE_TENANT_POLICIES: acme, beta)"
LORA = "a tenant policy is served as an adapter: run with --policy lora (the config's policy is 'full')"


@pytest.fixture
def learner_runs(env):
    """``run_learner`` replaced: each call's ``(settings, config)``, no model prepared."""
    import learner.process
    import saoserve.model

    seen: list = []
    env.setattr(learner.process, "run_learner", lambda settings, config: seen.append((settings, config)))
    env.setattr(saoserve.model, "prepare_model", lambda path: path)
    return seen


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["learn", "--tenant", "zeta", "--policy", "lora"], NO_POLICY),
        (["learn", "--tenant", "acme"], LORA),  # the cpu preset trains every weight
        (["learn", "--tenant", "acme", "--policy", "full"], LORA),
        (
            ["learn"],  # the global learner beside tenant policies: the engine refuses full weights
            "with tenant policies (acme, beta) the global policy is served as an adapter too: run "
            "with --policy lora (the config's policy is 'full')",
        ),
        (["migrate", "--tenant", "zeta"], NO_POLICY),
        (
            ["migrate", "--tenant", "acme", "--url", "sqlite:///x.db"],
            "--url and --tenant both name the database: give one",
        ),
        (["pretrain-critic", "--tenant", "zeta"], NO_POLICY),
        (["evidence-init", "rollouts.jsonl", "--tenant", "zeta"], NO_POLICY),
    ],
)
def test_job_refusals_name_the_problem(learner_runs, tmp_path, env, args, needle):
    env.chdir(tmp_path)
    (tmp_path / "rollouts.jsonl").write_text('{"prompt_id": "a", "reward": 1}\n')
    result = runner.invoke(app, args)
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr == f"error: {needle}\n"
    assert learner_runs == []


def test_learn_refuses_a_full_weights_config_file_for_a_tenant(learner_runs, tmp_path):
    from learner.config import build_config

    path = tmp_path / "learner.json"
    path.write_text(build_config("demo").to_json())
    result = runner.invoke(app, ["learn", "--config", str(path), "--tenant", "beta"])
    assert result.exit_code == EXIT_USAGE and result.stderr == f"error: {LORA}\n"
    # The same file with the policy overridden: an adapter learner of beta's namespace.
    result = runner.invoke(app, ["learn", "--config", str(path), "--tenant", "beta", "--policy", "lora"])
    assert result.exit_code == EXIT_OK, result.output
    assert [(s.resolved_database_url, c.policy.kind) for s, c in learner_runs] == [
        (f"sqlite:///{tmp_path.resolve()}/tenants/beta/saoserve.db", "lora")
    ]


def test_learn_without_a_tenant_policy_configured_names_none(learner_runs, env):
    from core.settings import get_settings

    env.delenv("SAOSERVE_TENANT_POLICIES")
    get_settings.cache_clear()
    result = runner.invoke(app, ["learn", "--tenant", "acme", "--policy", "lora"])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr == "error: tenant 'acme' has no policy of its own (SAOSERVE_TENANT_POLICIES: none)\n"


def test_learn_runs_the_learner_on_the_tenants_namespace(learner_runs, tmp_path):
    from core.settings import get_settings

    result = runner.invoke(app, ["learn", "--tenant", "acme", "--policy", "lora", "--lora-rank", "4"])
    assert result.exit_code == EXIT_OK, result.output
    [(settings, config)] = learner_runs
    want = get_settings().for_tenant("acme")
    home = tmp_path.resolve()
    assert settings == want and settings.tenant_policies == []
    assert settings.resolved_database_url == f"sqlite:///{home}/tenants/acme/saoserve.db"
    assert settings.resolved_log_url == settings.resolved_database_url  # the SQL log follows
    assert settings.resolved_policy_dir == get_settings().resolved_policy_dir / "tenants" / "acme"
    assert settings.resolved_model_dir == get_settings().resolved_model_dir  # one base for all
    assert (config.policy.kind, config.policy.rank) == ("lora", 4)
    # Without --tenant: the global namespace, as before.
    assert runner.invoke(app, ["learn", "--policy", "lora"]).exit_code == EXIT_OK
    assert learner_runs[1][0] == get_settings()


def test_migrate_and_evidence_init_write_the_tenants_database(env, tmp_path):
    from core.settings import get_settings

    rollouts = tmp_path / "rollouts.jsonl"
    # 3 successes of 8 → Jeffreys α0 = 8·3.5/9 ≈ 3.111 (mass 8).
    rollouts.write_text("".join(f'{{"prompt_id": "a", "reward": {int(i < 3)}}}\n' for i in range(8)))
    result = runner.invoke(app, ["migrate", "--tenant", "acme"])
    assert result.exit_code == EXIT_OK and result.stdout == "database at head\n"
    acme = tmp_path / "tenants" / "acme" / "saoserve.db"
    assert acme.is_file() and not (tmp_path / "saoserve.db").exists()
    result = runner.invoke(app, ["evidence-init", str(rollouts), "--tenant", "acme"])
    assert result.exit_code == EXIT_OK and "initialised evidence of 1 prompts" in result.stdout
    assert runner.invoke(app, ["migrate"]).exit_code == EXIT_OK
    tenant_db = make_engine(get_settings().for_tenant("acme").resolved_database_url)
    global_db = make_engine(get_settings().resolved_database_url)
    try:
        # "a" is stored under its keyed hash (core.evidence_store.stored_prompt_id).
        a = stored_prompt_id(get_settings().for_tenant("acme").feedback_secret, "a")
        assert EvidenceStore(tenant_db).read(a, 0).alpha == pytest.approx(8 * 3.5 / 9)
        assert EvidenceStore(global_db).read(a, 0).alpha == 4  # the default prior: nothing here
    finally:
        tenant_db.dispose()
        global_db.dispose()
    # The critic pretrains from the tenant's log, which has no rated trajectory yet.
    result = runner.invoke(app, ["pretrain-critic", "--tenant", "acme"])
    assert result.exit_code == EXIT_USAGE and "no trajectory with feedback" in result.stderr


# ------------------------------------------------------------------ retention over every namespace
def test_retention_covers_the_global_and_each_tenant_namespace(env, tmp_path):
    """An old trajectory in the global namespace and in acme's (database row and SQL-log row);
    a recent one in acme's stays; beta's namespace is empty. Each is reported on its own."""
    from core.settings import get_settings

    for args in (["migrate"], ["migrate", "--tenant", "acme"]):
        assert runner.invoke(app, args).exit_code == EXIT_OK
    settings = get_settings()
    old, recent = utcnow() - timedelta(days=10), utcnow() - timedelta(days=1)
    engines = {}
    for name, space in (("global", settings), ("acme", settings.for_tenant("acme"))):
        url = space.resolved_database_url
        engine, log = make_engine(url), SqlLog(url)
        offsets = [logged(ServerStore(engine), log, traj(f"{name}-old", created_at=old))]
        if name == "acme":
            offsets.append(logged(ServerStore(engine), log, traj("acme-new", created_at=recent)))
        backdate(engine, LogRecord, LogRecord.offset, offsets[:1], old)
        log.close()
        engines[name] = engine
    result = runner.invoke(app, ["retention", "--days", "7"])
    assert result.exit_code == EXIT_OK, result.output
    out = result.stdout
    assert out.startswith("deleted what was created before ") and "(7 days):\n" in out
    for name in ("global", "acme", "beta"):
        section = out.split(f"  policy {name}:\n")[1].split("  policy ")[0]
        n = 0 if name == "beta" else 1
        assert f"    log_records.trajectories: {n}\n" in section and f"    trajectory_index: {n}\n" in section
    # Nothing had been read by a learner: each namespace warns of its own row.
    assert result.stderr == "".join(
        f"warning: 1 of the deleted log records had not been read by the learner yet (policy {name})\n"
        for name in ("global", "acme")
    )
    try:
        assert count(engines["global"], TrajectoryIndex) == 0 and count(engines["global"], LogRecord) == 0
        assert count(engines["acme"], TrajectoryIndex) == 1 and count(engines["acme"], LogRecord) == 1
    finally:
        for engine in engines.values():
            engine.dispose()
    assert (tmp_path / "tenants" / "beta" / "saoserve.db").is_file()  # migrated on the way
