"""Log transports on real back ends: SQLite, PostgreSQL, and a tansu Kafka broker (the
shared one, or one of the test's own that it pauses, kills and restarts)."""

from __future__ import annotations

import threading
import time

import pytest

from core.breaker import Breaker
from core.db import migrate
from core.logbus import KafkaLog, LogUnavailable, SqlLog, open_log
from testing.dependencies import TansuBroker
from testing.logs import read_topic


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


def test_sql_log_without_schema_isunavailable(tmp_path):
    log = open_log(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(LogUnavailable, match="SQL log append failed"):
        log.append("feedback", "k", b"{}")


def test_kafka_log_broker_down_isunavailable():
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


def _values(log, topic: str) -> list[bytes]:
    return [e.value for e in sorted(read_topic(log, topic), key=lambda e: (e.partition, e.offset))]


@pytest.mark.kafka
def test_kafka_log_paused_broker_refuses_with_nothing_sent():
    """Issue 13 item 3: a refused record (the broker paused, idle before) never appears later."""
    broker = TansuBroker()
    broker.start()
    log = KafkaLog(broker.url, ack_timeout_s=20.0)
    try:
        assert log.append("feedback", "k", b"first") == (0, 0)
        time.sleep(log.breaker.fresh_s + 0.1)  # idle: the next append probes first
        broker.pause()
        with pytest.raises(LogUnavailable):
            log.check()  # a caller that may refuse checks first; nothing is sent
        with pytest.raises(LogUnavailable, match="the Kafka log is unavailable"):
            log.check()  # open: refused without a probe
        broker.resume()
        time.sleep(log.breaker.cooldown_s + 0.1)
        log.append("feedback", "k", b"retried")
        assert _values(log, "feedback") == [b"first", b"retried"]
    finally:
        broker.kill()
        log.close()


@pytest.mark.kafka
def test_kafka_log_record_sent_before_a_pause_gets_the_brokers_answer():
    """A record already sent when the broker pauses is not refused at a timeout (it would be
    appended on resume): its append waits and returns the broker's offset."""
    broker = TansuBroker()
    broker.start()
    log = KafkaLog(broker.url, ack_timeout_s=20.0)
    try:
        log.append("feedback", "k", b"first")
        broker.pause()  # within fresh_s of the last answer: no probe, the record is sent
        timer = threading.Timer(2.0, broker.resume)
        timer.start()
        assert log.append("feedback", "k", b"in-flight") == (0, 1)
        timer.join()
        assert _values(log, "feedback") == [b"first", b"in-flight"]
    finally:
        broker.kill()
        log.close()


@pytest.mark.kafka
def test_kafka_log_rebuilds_producer_and_topics_after_broker_restart():
    """Issue 13 item 3: after a kill and restart (memory storage: topics and producer ids
    lost) appends work again without a new KafkaLog."""
    broker = TansuBroker()
    broker.start()
    log = KafkaLog(broker.url)
    try:
        log.append("trajectories", "p", b"before")
        broker.kill()
        time.sleep(log.breaker.fresh_s + 0.1)
        with pytest.raises(LogUnavailable):
            log.check()
        broker.start()
        time.sleep(log.breaker.cooldown_s + 0.1)
        log.check()  # finds the topics gone: recreates them and drops the old producer
        placed = [log.append("trajectories", "p", f"after-{i}".encode()) for i in range(3)]
        assert [off for _, off in placed] == [0, 1, 2]
        assert _values(log, "trajectories") == [b"after-0", b"after-1", b"after-2"]
        assert sorted(log.partitions("feedback")) == list(range(log.num_partitions))
        # Restarted again, with no check in between: the old producer's id is unknown to the
        # new broker (a fatal state); that append fails, and the next one has a new producer.
        broker.kill()
        broker.start()
        with pytest.raises(LogUnavailable, match="UnknownProducerId"):
            log.append("trajectories", "p", b"refused")
        assert log.append("trajectories", "p", b"rebuilt")[1] == 0  # the first record there
        assert _values(log, "trajectories") == [b"rebuilt"]
        assert log.partitions("policy") == [0]  # one partition: policy events have one order
    finally:
        broker.kill()
        log.close()
