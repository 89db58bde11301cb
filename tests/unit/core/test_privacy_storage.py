"""Privacy controls on a real database (docs/privacy.md), the SQLite tier of
tests/unit/server/test_privacy.py (no engine): retention and forget with the SQL log, the joiner
reading before and after (``testing.backends.privacy_storage``, on PostgreSQL in
tests/integration/test_privacy_storage.py); the ``saoserve retention`` command; the Kafka topics'
retention in deploy/.
"""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.db import (
    LogRecord,
    make_engine,
    migrate,
)
from core.forget import ForgetKind, ForgetTarget, concerns
from core.logbus import SqlLog
from core.records import utcnow
from core.retention import retention_cutoff
from saoserve.cli import app
from server.store import ServerStore
from testing import ROOT
from testing.backends.privacy_storage import *  # noqa: F403 (its tests run here on SQLite)
from testing.builders import NOW, traj
from testing.deploy import COMPOSE, environment, interpolate, load, read_env_file
from testing.rows import backdate, count, logged

runner = CliRunner()


def test_retention_needs_a_day_at_least():
    with pytest.raises(ValueError, match="at least 1 day, not 0"):
        retention_cutoff(NOW, 0)
    assert retention_cutoff(NOW, 7) == NOW - timedelta(days=7)


def test_concerns_reads_only_json_objects():
    ids, eps = {"a1"}, {"E"}
    alice = ForgetTarget(ForgetKind.USER, "alice")
    assert concerns('{"id": "a1"}', alice, ids, eps)
    assert concerns('{"trajectory_id": "a1"}', alice, ids, eps)
    assert concerns('{"episode_id": "E"}', alice, ids, eps)
    assert concerns('{"id": "zz", "user": "alice"}', alice, ids, eps)
    assert not concerns('{"id": "zz", "user": "bob"}', alice, ids, eps)
    assert not concerns("[1, 2]", alice, ids, eps)
    assert not concerns("not json", alice, ids, eps)
    assert not concerns(None, alice, ids, eps)
    # A key's forget names the records the key sent, with or without a user.
    key = ForgetTarget(ForgetKind.KEY, "k0123456789abcdef")
    assert concerns('{"id": "zz", "identity": "key:k0123456789abcdef", "user": "bob"}', key, ids, eps)
    assert not concerns('{"id": "zz", "identity": "user:k0123456789abcdef"}', key, ids, eps)


# ------------------------------------------------------------------ the CLI and deploy/
@pytest.fixture
def home(tmp_path, monkeypatch):
    from core.settings import get_settings

    for name in ("SAOSERVE_DATABASE_URL", "SAOSERVE_LOG_URL", "SAOSERVE_RETENTION_DAYS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    get_settings.cache_clear()
    yield tmp_path, monkeypatch
    get_settings.cache_clear()


def test_retention_command_needs_a_period(home):
    r = runner.invoke(app, ["retention"])
    assert (
        r.exit_code == 2 and "no retention period: pass --days N or set SAOSERVE_RETENTION_DAYS" in r.output
    )
    r = runner.invoke(app, ["retention", "--days", "0"])
    assert r.exit_code == 2 and "--days" in r.output


def test_retention_command_deletes_and_warns_of_unread_records(home):
    tmp, env = home
    url = f"sqlite:///{(tmp / 'saoserve.db').resolve()}"
    migrate(url)
    engine, log = make_engine(url), SqlLog(url)
    old = utcnow() - timedelta(days=10)
    off = logged(ServerStore(engine), log, traj("o", created_at=old))
    backdate(engine, LogRecord, LogRecord.offset, [off], old)
    log.close()
    env.setenv("SAOSERVE_RETENTION_DAYS", "30")
    from core.settings import get_settings

    get_settings.cache_clear()
    r = runner.invoke(app, ["retention"])  # 30 days from the setting: nothing that old
    assert r.exit_code == 0 and "(30 days)" in r.output and "log_records.trajectories: 0" in r.output
    r = runner.invoke(app, ["retention", "--days", "7"])
    assert r.exit_code == 0, r.output
    assert "log_records.trajectories: 1" in r.output and "trajectory_index: 1" in r.output
    assert "warning: 1 of the deleted log records had not been read by the learner yet" in r.output
    assert count(engine, LogRecord) == 0
    engine.dispose()


def run_topics_script(tmp_path: Path, env: dict[str, str]) -> list[list[str]]:
    """The kafka-topics service's script as compose runs it, with the Kafka tools replaced by
    stubs that record their arguments; returns each call's arguments."""
    script = interpolate(load(COMPOSE), env)["services"]["kafka-topics"]["command"][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool in ("kafka-topics.sh", "kafka-configs.sh"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/bash\nprintf "%s\\0" {tool} "$@" >> {calls}\nprintf "\\n\\0" >> {calls}\n')
        stub.chmod(0o755)
    subprocess.run(["bash", "-c", script.replace("/opt/kafka/bin/", f"{bin_dir}/")], check=True, timeout=30)
    args = calls.read_text().split("\0")
    out, cur = [], []
    for a in args:
        if a == "\n":
            out.append(cur)
            cur = []
        elif a:
            cur.append(a)
    return out


@pytest.mark.parametrize(
    "hours, retention_ms, segment_ms",
    [
        ("168", 168 * 3_600_000, 86_400_000),  # 7 days; segments roll daily
        ("12", 12 * 3_600_000, 12 * 3_600_000),  # below a day: a segment rolls at the retention
    ],
)
def test_kafka_topics_keep_trajectories_and_feedback_for_the_retention(
    tmp_path, hours, retention_ms, segment_ms
):
    env = read_env_file(ROOT / "deploy" / ".env.example") | {"KAFKA_RETENTION_HOURS": hours}
    calls = run_topics_script(tmp_path, env)
    configs = {
        c[c.index("--entity-name") + 1]: c[c.index("--add-config") + 1]
        for c in calls
        if c[0] == "kafka-configs.sh"
    }
    want = f"retention.ms={retention_ms},segment.ms={segment_ms}"
    assert configs == {"trajectories": want, "feedback": want}
    kafka = environment(interpolate(load(COMPOSE), env)["services"]["kafka"])
    assert (kafka["KAFKA_LOG_RETENTION_HOURS"], kafka["KAFKA_LOG_ROLL_HOURS"]) == (hours, "24")
