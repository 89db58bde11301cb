"""The alert rules and the Grafana board of deploy/ (issue 42), checked without Prometheus, Grafana
or Docker running:

- ``promtool check rules`` accepts deploy/prometheus/alerts.yml and ``promtool test rules`` passes
  deploy/prometheus/alerts.test.yml, which holds a firing and a quiet case for every alert;
  ``promtool check config`` accepts prometheus.yml. promtool is Debian's ``prometheus`` package
  (``.ci/run`` installs it): a failure under CI when it is missing, a skip elsewhere.
- Every metric the rules and the board read is one the server's ``/metrics`` (or the simulation's,
  ``judge.sim_metrics``) exports.
- The board loads under a JSON Schema of Grafana's dashboard model (the fields it uses, as Grafana
  documents them), its panels tile the 24-column grid without overlapping, and each panel's
  query parses as PromQL (promtool, as a recording rule).
- The compose file provisions them: Prometheus reads alerts.yml at the path prometheus.yml names
  and scrapes the servers' port, and Grafana reads the board where its dashboard provider looks
  and the data source at the prometheus service.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator
from prometheus_client import generate_latest

from core.policies import GLOBAL
from judge.sim_metrics import SimulationCollector
from server.db_figures import IDENTITY_GAUGES, STEP_GAUGES, LearnerFigures, LifecycleState
from server.metrics import ServerMetrics
from testing.dependencies import IN_CI

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts.test.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
BOARD = DEPLOY / "grafana" / "saoserve.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
COMPOSE = DEPLOY / "compose.yaml"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if IN_CI:
            pytest.fail("promtool not installed (apt-get install prometheus)", pytrace=False)
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def board() -> dict:
    return json.loads(BOARD.read_text())


def panel_queries(doc: dict) -> list[str]:
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


# ------------------------------------------------------------------ promtool


def test_promtool_checks_the_rules():
    run = run_promtool("check", "rules", str(ALERTS))
    assert run.returncode == 0, run.stdout + run.stderr
    # 7 alerts and the 2 recording rules of feedback→served and its target.
    assert "SUCCESS: 10 rules found" in run.stdout


def test_promtool_passes_each_alerts_cases():
    run = run_promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_every_alert_has_a_firing_and_a_quiet_case():
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts == {
        "SaoserveLearnerStalled",
        "SaoserveSwapsRefused",
        "SaoserveDeadLettersGrowing",
        "SaoserveFeedbackToServedAboveTarget",
        "SaoserveReplicaBehind",
        "SaoserveGuardRejectingInALoop",
        "SaoserveGuardVotesHeldByOneSender",
        "SaoserveGuardVotesHeldBack",
    }
    firing, quiet = set(), set()
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    assert firing == alerts and quiet == alerts


def test_a_broken_rule_is_refused_by_promtool(tmp_path):
    """The check is real: a rule with a PromQL error, or an unknown field, fails it."""
    for rule in (
        {"alert": "X", "expr": "max(saoserve_policy_version"},
        {"alert": "X", "expr": "up", "for": "5 minutes"},
        {"alert": "X", "expr": "up", "severity": "warning"},
    ):
        bad = tmp_path / "bad.yml"
        bad.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [rule]}]}))
        assert run_promtool("check", "rules", str(bad)).returncode != 0, rule


def test_promtool_checks_the_prometheus_config(tmp_path):
    """prometheus.yml as the container reads it, its rule file's path mapped to the repository."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    config["rule_files"] = [str(ALERTS)]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    run = run_promtool("check", "config", str(local))
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_boards_queries_parse_as_promql(tmp_path):
    """Each panel's query, with Grafana's variables given values, as a recording rule."""
    queries = panel_queries(board())
    as_rules = [
        {"record": f"board:q{i}", "expr": q.replace("$__rate_interval", "5m").replace("$tenant", ".*")}
        for i, q in enumerate(queries)
    ]
    path = tmp_path / "board_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "board", "rules": as_rules}]}))
    run = run_promtool("check", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(queries)} rules found" in run.stdout


# ------------------------------------------------------------------ the metrics they read


def exported_names() -> set[str]:
    """Every sample name a server's /metrics can show (each family with a sample: the learner's
    and the lifecycle's read for the global policy and a tenant policy ``acme``, the series the
    server sets given a value), and the simulation's."""
    m = ServerMetrics()
    step = {k: 0.5 for k in STEP_GAUGES} | {"at": 1.0, "version": 3.0}
    figures = LearnerFigures({"dead_letters": 2}, dict.fromkeys(IDENTITY_GAUGES, 1.0), step, False)
    verdict = {
        "lineage": [3],
        "at": datetime(2026, 1, 1, tzinfo=UTC).isoformat(),
        "decision": "continue",
        "lower": -0.1,
        "upper": 0.2,
        "candidate": {"n": 4, "mean": 0.5},
        "promoted": {"n": 8, "mean": 0.5},
        "senders": {
            "candidate": {"votes": 4, "identified": 2, "top_share": 0.5},
            "promoted": {"votes": 8, "identified": 8, "top_share": 0.125},
        },
    }
    state = LifecycleState(
        {"candidate": 0, "canary": 1, "promoted": 1, "rejected": 0}, 2, [3], True, 2, verdict
    )
    for policy in (GLOBAL, "acme"):
        m.learner.readings[policy] = figures
        m.lifecycle.readings[policy] = state
    m.requests.labels("false", "ok").inc()
    m.failed_before_generation.labels("throttled").inc()
    m.throttled.labels("acme", "key_rate").inc()
    m.swaps.labels("refused").inc()
    m.stage_events.labels("rejected").inc()
    for name in ("trajectories", "tenant_trajectories"):
        getattr(m, name).labels(*(["acme"] if name.startswith("tenant") else []), "stop").inc()
    m.feedback.labels("accepted").inc()
    m.tenant_tokens.labels("acme").inc()
    m.tenant_feedback.labels("acme").inc()
    tenant = m.of_tenant_policy("acme")
    tenant.swaps.labels("refused").inc()
    tenant.swap_seconds.observe(1.0)
    tenant.policy_version.set(2)
    text = generate_latest(m.registry).decode()
    names = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    record = {"step": 1, "target_style": "pirate", "detected_style": "pirate", "reward": 1.0}
    names |= {s.name for f in SimulationCollector(lambda: [record]).collect() for s in f.samples}
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (``saoserve_…``), a ``__name__`` regex of the
    form ``saoserve_(tenant_)?x`` expanded to both names; recording rules (``saoserve:…``) left out."""
    names = set(re.findall(r"\b(saoserve_[a-z_]+)\b", expr))
    for opt in re.findall(r'__name__=~"(saoserve_\(tenant_\)\?[a-z_]+)"', expr):
        names |= {opt.replace("(tenant_)?", ""), opt.replace("(tenant_)?", "tenant_")}
    return {n for n in names if n != "saoserve_"} - {"saoserve_(tenant_"}


def test_the_rules_and_the_board_read_metrics_that_exist():
    exported = exported_names()
    read = set()
    for r in rules():
        read |= metric_names(r["expr"])
    for q in panel_queries(board()):
        read |= metric_names(q)
    for a in board()["annotations"]["list"]:
        read |= metric_names(a["expr"])
    assert read - exported == set()
    # Each thing the issue asks the alerts to watch is read.
    for name in (
        "saoserve_learner_last_step_timestamp_seconds",
        "saoserve_policy_swaps_total",
        "saoserve_learner_events_total",
        "saoserve_feedback_to_served_seconds_bucket",
        "saoserve_policy_version",
        "saoserve_policy_versions",
    ):
        assert name in read


def test_metric_names_of_an_expression():
    assert metric_names('sum(increase({__name__=~"saoserve_(tenant_)?policy_swaps_total"}[5m]))') == {
        "saoserve_policy_swaps_total",
        "saoserve_tenant_policy_swaps_total",
    }
    assert metric_names("saoserve:x > on() max(saoserve_learner_paused)") == {"saoserve_learner_paused"}


# ------------------------------------------------------------------ the board's schema

REF = {"type": "object", "required": ["type", "uid"], "properties": {"type": {"const": "prometheus"}}}
GRID = {
    "type": "object",
    "required": ["h", "w", "x", "y"],
    "properties": {
        "h": {"type": "integer", "minimum": 1},
        "w": {"type": "integer", "minimum": 1, "maximum": 24},
        "x": {"type": "integer", "minimum": 0, "maximum": 23},
        "y": {"type": "integer", "minimum": 0},
    },
    "additionalProperties": False,
}
TARGET = {
    "type": "object",
    "required": ["refId", "expr", "datasource"],
    "properties": {
        "refId": {"type": "string", "pattern": "^[A-Z]$"},
        "expr": {"type": "string", "minLength": 1},
        "legendFormat": {"type": "string"},
        "datasource": REF,
    },
    "additionalProperties": False,
}
PANEL = {
    "type": "object",
    "required": ["id", "type", "title", "gridPos"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "type": {"enum": ["row", "timeseries", "stat", "gauge", "table", "bargauge", "state-timeline"]},
        "title": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "gridPos": GRID,
        "datasource": REF,
        "targets": {"type": "array", "items": TARGET, "minItems": 1},
        "fieldConfig": {
            "type": "object",
            "required": ["defaults", "overrides"],
            "properties": {"defaults": {"type": "object"}, "overrides": {"type": "array"}},
        },
        "options": {"type": "object"},
        "collapsed": {"type": "boolean"},
        "panels": {"type": "array"},
    },
    "additionalProperties": False,
    "if": {"properties": {"type": {"const": "row"}}},
    "then": {"required": ["collapsed", "panels"]},
    "else": {"required": ["datasource", "targets", "fieldConfig"]},
}
# Grafana's dashboard JSON model (grafana.com/docs, "JSON model"), the fields this board uses.
DASHBOARD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{8,40}$"},
        "title": {"type": "string", "minLength": 1},
        "description": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "refresh": {"type": "string", "pattern": "^[0-9]+[smhd]$"},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "version": {"type": "integer"},
        "timezone": {"enum": ["browser", "utc", ""]},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {
                "list": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "type"],
                        "properties": {"type": {"enum": ["datasource", "query", "custom", "constant"]}},
                    },
                }
            },
        },
        "annotations": {"type": "object", "properties": {"list": {"type": "array"}}},
        "panels": {"type": "array", "items": PANEL, "minItems": 1},
    },
    "additionalProperties": False,
}


def test_the_board_loads_in_the_schema():
    Draft202012Validator.check_schema(DASHBOARD_SCHEMA)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in Draft202012Validator(DASHBOARD_SCHEMA).iter_errors(board())
    ]
    assert errors == []


@pytest.mark.parametrize(
    ("change", "path"),
    [
        (lambda d: d["panels"][1]["gridPos"].update(w=25), "panels/1/gridPos/w"),
        (lambda d: d["panels"][1].update(titel="x"), "panels/1"),
        (lambda d: d["panels"][1]["targets"][0].pop("expr"), "panels/1/targets/0"),
        (lambda d: d.update(uid="short"), "uid"),
    ],
)
def test_the_schema_refuses_a_broken_board(change, path):
    doc = board()
    change(doc)
    paths = [
        "/".join(map(str, e.absolute_path)) for e in Draft202012Validator(DASHBOARD_SCHEMA).iter_errors(doc)
    ]
    assert path in paths


def test_the_panels_tile_the_grid():
    doc = board()
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for p in doc["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        cells = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
    variables = {v["name"] for v in doc["templating"]["list"]}
    assert variables == {"datasource", "tenant"}
    for p in doc["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
            assert "$tenant" not in t["expr"] or "tenant=~" in t["expr"]


def test_the_board_holds_the_adaptation_view():
    """The issue's list, each by the metric its panel reads."""
    queries = " ".join(panel_queries(board()))
    for metric in (
        "saoserve_learner_reward_mean",  # reward per version
        "saoserve_simulation_target_share",  # the target's share while the simulation runs
        "saoserve_learner_staleness_mean",
        "saoserve_feedback_to_served_seconds_bucket",
        "saoserve_policy_versions",  # the lifecycle
        "saoserve_guard_decision",  # the guard's verdicts
        "saoserve_policy_swaps_total",
        'saoserve_learner_events_total{event="dead_letters"}',
        "saoserve_tenant_trajectories_logged_total",  # per tenant
        "saoserve_requests_throttled_total",
    ):
        assert metric in queries, metric


# ------------------------------------------------------------------ provisioned by compose


def test_compose_provisions_prometheus_and_grafana():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    prom, graf = services["prometheus"], services["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prom["volumes"] if v.startswith("./")}
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert (DEPLOY / mounts["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS_CONFIG
    assert [(DEPLOY / mounts[f]).resolve() for f in config["rule_files"]] == [ALERTS]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "saoserve"]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["server"] and str(sd["port"]) in services["server"]["expose"]
    assert f"--config.file={'/etc/prometheus/prometheus.yml'}" in prom["command"]

    gmounts = {v.split(":")[1]: v.split(":")[0] for v in graf["volumes"] if v.startswith("./")}
    assert (DEPLOY / gmounts["/etc/grafana/provisioning"]).resolve() == PROVISIONING
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards" / "saoserve.yml").read_text())["providers"]
    board_path = f"{provider['options']['path']}/saoserve.json"
    assert (DEPLOY / gmounts[board_path]).resolve() == BOARD
    (source,) = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090" in prom["ports"][0] and prom["ports"][0].startswith("127.0.0.1:")
    assert graf["ports"][0].startswith("127.0.0.1:")
