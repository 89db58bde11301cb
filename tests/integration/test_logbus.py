"""Log transports on real back ends: PostgreSQL, and a tansu Kafka broker (the shared one, or one
of the test's own that it pauses, kills and restarts). SQLite and the breaker:
tests/unit/core/test_logbus.py."""

from __future__ import annotations

import threading
import time

import pytest

from core.db import migrate
from core.logbus import KafkaLog, LogUnavailable, open_log
from testing.backends.logbus import exercise_log
from testing.dependencies import TansuBroker
from testing.logs import read_topic


@pytest.mark.postgres
def test_sql_log_postgres(pg_url):
    migrate(pg_url)
    log = open_log(pg_url)
    exercise_log(log)
    log.close()


@pytest.mark.kafka
def test_kafka_log_tansu(tansu):
    log = open_log(tansu)
    assert isinstance(log, KafkaLog)
    exercise_log(log)
    log.close()


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
