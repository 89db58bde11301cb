"""Log transports without a broker or server: SQLite's SQL table (the checks of
``testing.backends.logbus``) and the Kafka transport's behaviour when no broker answers.
PostgreSQL and a tansu broker: tests/integration/test_logbus.py."""

from __future__ import annotations

import pytest

from core.breaker import Breaker
from core.db import migrate
from core.logbus import KafkaLog, LogUnavailable, SqlLog, open_log
from testing.backends.logbus import exercise_log


def test_sql_log_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'log.db'}"
    migrate(url)
    log = open_log(url)
    assert isinstance(log, SqlLog)
    exercise_log(log)
    assert log.read("trajectories", 0, 10_000, 5, 0.05) == []
    log.close()


def test_sql_log_without_schema_is_unavailable(tmp_path):
    log = open_log(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(LogUnavailable, match="SQL log append failed"):
        log.append("feedback", "k", b"{}")


def test_kafka_log_broker_down_is_unavailable():
    log = KafkaLog("kafka://127.0.0.1:9", send_timeout_s=1.0)
    with pytest.raises(LogUnavailable):
        log.append("feedback", "k", b"{}")


def test_open_log_rejects_garbage():
    with pytest.raises(ValueError, match="neither kafka"):
        open_log("not a url")


class _Probe:
    """A fake dependency for the breaker: answers while ``up``; counts probes."""

    def __init__(self):
        self.up, self.calls = True, 0

    def __call__(self):
        self.calls += 1
        if not self.up:
            raise ConnectionRefusedError("down")


def test_breaker_probes_when_stale_and_refuses_while_open():
    probe = _Probe()
    # fresh_s = 60: one success covers every later check; cooldown_s = 60: one failure refuses.
    b = Breaker("dep", probe, LogUnavailable, fresh_s=60.0, cooldown_s=60.0)
    b.check()
    b.check()
    assert probe.calls == 1
    b.trip("append failed")
    probe.up = True
    with pytest.raises(LogUnavailable, match="dep is unavailable: append failed"):
        b.check()
    assert probe.calls == 1 and b.down


def test_breaker_failed_probe_opens_and_recovers_after_cooldown():
    probe = _Probe()
    probe.up = False
    # fresh_s = 0 and cooldown_s = 0: every check probes, so the state follows the probe.
    b = Breaker("dep", probe, LogUnavailable, fresh_s=0.0, cooldown_s=0.0)
    with pytest.raises(LogUnavailable, match="ConnectionRefusedError: down"):
        b.check()
    probe.up = True
    b.check()
    assert probe.calls == 2 and not b.down


def test_sql_log_failed_append_opens_its_breaker(tmp_path):
    url = f"sqlite:///{tmp_path / 'log.db'}"
    migrate(url)
    healthy = SqlLog(url)
    healthy.check()
    healthy.close()
    broken = SqlLog(f"sqlite:///{tmp_path / 'empty.db'}")  # no schema: every append fails
    broken.check()  # SELECT 1 still answers
    with pytest.raises(LogUnavailable, match="SQL log append failed"):
        broken.append("feedback", "k", b"{}")
    with pytest.raises(LogUnavailable, match="the SQL log is unavailable: .*no such table"):
        broken.check()  # refused without a probe while the breaker is open
    broken.close()
