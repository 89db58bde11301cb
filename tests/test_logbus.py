"""Log transports on real back ends: SQLite, PostgreSQL, and a tansu Kafka broker."""

from __future__ import annotations

import pytest

from core.db import migrate
from core.logbus import KafkaLog, LogUnavailable, SqlLog, open_log
from tests.logutil import read_topic


def _exercise(log):
    placed = [log.append("trajectories", f"p{i % 3}", f'{{"n": {i}}}'.encode()) for i in range(12)]
    entries = read_topic(log, "trajectories")
    assert sorted(int(e.value.decode()[6:-1]) for e in entries) == list(range(12))
    # One key → one partition, in append order.
    by_key: dict[str, list[int]] = {}
    parts: dict[str, set[int]] = {}
    for e in sorted(entries, key=lambda e: (e.partition, e.offset)):
        by_key.setdefault(e.key, []).append(int(e.value.decode()[6:-1]))
        parts.setdefault(e.key, set()).add(e.partition)
    assert by_key["p0"] == [0, 3, 6, 9] and all(len(p) == 1 for p in parts.values())
    # Reading from an offset returns that record first.
    part, off = placed[4]
    assert log.read("trajectories", part, off, 1)[0].value == b'{"n": 4}'
    with pytest.raises(ValueError, match="unknown topic"):
        log.append("nope", "k", b"{}")


def test_sql_log_sqlite(tmp_path):
    url = f"sqlite:///{tmp_path / 'log.db'}"
    migrate(url)
    log = open_log(url)
    assert isinstance(log, SqlLog)
    _exercise(log)
    assert log.read("trajectories", 0, 10_000, 5, 0.05) == []
    log.close()


@pytest.mark.postgres
def test_sql_log_postgres(pg_url):
    migrate(pg_url)
    log = open_log(pg_url)
    _exercise(log)
    log.close()


@pytest.mark.kafka
def test_kafka_log_tansu(tansu):
    log = open_log(tansu)
    assert isinstance(log, KafkaLog)
    _exercise(log)
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
