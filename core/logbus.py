"""Log transport: append-only topics of JSON records, behind one interface (docs/design.md §3).

Two implementations, chosen by URL (``open_log``):

- ``KafkaLog`` (``kafka://host:port[,host:port]``): kafka-python, topics ``trajectories``,
  ``feedback``, ``policy`` keyed by ``prompt_id`` (the default murmur2 partitioner puts one
  prompt's records in one partition), idempotent producer with ``acks="all"``. Readers
  ``assign()`` partitions and ``seek()``; offsets live in the database, never in the broker,
  and end offsets are never relied on (tansu reports them wrong, docs/design.md §7).
- ``SqlLog`` (any SQLAlchemy URL; the embedded default): one table ``log_records``; one
  partition per topic; offsets are row ids.

``append`` returns only once the record is durable (acknowledged by all in-sync replicas, or
committed); a failure raises ``LogUnavailable`` and nothing is half-written. A transport
remembers recent failures (``core.breaker``): ``check`` refuses while its back end is known to
be down, so callers can refuse a request before doing any work for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from urllib.parse import parse_qsl

from sqlalchemy import insert, select, text
from sqlalchemy.exc import InterfaceError, OperationalError

from core.breaker import Breaker, Unavailable
from core.db import LogRecord, make_engine
from core.records import TOPIC_POLICY, TOPICS, utcnow


class LogUnavailable(Unavailable):
    """The log could not durably accept or serve records (broker or database down)."""


@dataclass(frozen=True)
class LogEntry:
    """One record read back: ``offset`` is the position within (topic, partition)."""

    topic: str
    partition: int
    offset: int
    key: str
    value: bytes


class LogTransport(ABC):
    """Append-only, partitioned, replayable topics.

    ``keeps_records``: True when a forget cannot delete one record from it (Kafka), so the
    server seals each subject's trajectory records under a key a forget destroys
    (``core.sealing``); False when a forget deletes its rows (the SQL-table log)."""

    url: str
    keeps_records: bool = False

    @abstractmethod
    def append(self, topic: str, key: str, value: bytes) -> tuple[int, int]:
        """Durably append ``value`` under ``key``; returns (partition, offset).

        Raises LogUnavailable if the record could not be made durable.
        """

    @abstractmethod
    def partitions(self, topic: str) -> list[int]:
        """The partition numbers of ``topic``."""

    @abstractmethod
    def read(
        self, topic: str, partition: int, offset: int, max_records: int = 500, timeout_s: float = 0.5
    ) -> list[LogEntry]:
        """Records of (topic, partition) from ``offset`` on, in order; [] if none yet."""

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raise LogUnavailable if the log is known to be down or does not answer a probe now.

        ``append`` itself does not probe: a caller that must not leave a record behind when
        it refuses checks first, then appends."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class SqlLog(LogTransport):
    """The SQL-table log (embedded default). Offsets are ``log_records.id``.

    PostgreSQL hands out sequence values before commit, so two concurrent appends may commit
    out of id order and a reader could skip the smaller one; appends there take a table lock
    so ids commit in order. SQLite has one writer at a time, so order holds by itself.
    """

    def __init__(self, url: str, wait_s: float = 30.0):
        self.url = url
        self.engine = make_engine(url)
        self._serialize = self.engine.dialect.name == "postgresql"
        # A database server that is down refuses the connection before anything is written,
        # so an append waits up to ``wait_s`` for it (an answer already generated is kept if
        # the outage is short); SQLite's errors are not outages and fail at once.
        self.wait_s = wait_s if self.engine.dialect.name != "sqlite" else 0.0
        self.breaker = Breaker("the SQL log", self._probe, LogUnavailable)

    def _probe(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def check(self) -> None:
        self.breaker.check()

    def append(self, topic: str, key: str, value: bytes) -> tuple[int, int]:
        if topic not in TOPICS:
            raise ValueError(f"unknown topic {topic!r}")
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return self._append_once(topic, key, value)
            except LogUnavailable as exc:
                if not isinstance(exc.__cause__, OperationalError | InterfaceError):
                    raise
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.5)

    def _append_once(self, topic: str, key: str, value: bytes) -> tuple[int, int]:
        try:
            with self.engine.begin() as conn:
                if self._serialize:
                    conn.execute(text("LOCK TABLE log_records IN SHARE ROW EXCLUSIVE MODE"))
                res = conn.execute(
                    insert(LogRecord).values(
                        topic=topic, key=key, payload=value.decode(), created_at=utcnow()
                    )
                )
                offset = int(res.inserted_primary_key[0])
        except Exception as exc:  # any driver error means "not durable"
            self.breaker.trip(str(exc))
            raise LogUnavailable(f"SQL log append failed: {exc}") from exc
        self.breaker.ok()
        return 0, offset

    def partitions(self, topic: str) -> list[int]:
        return [0]

    def read(
        self, topic: str, partition: int, offset: int, max_records: int = 500, timeout_s: float = 0.5
    ) -> list[LogEntry]:
        if partition != 0:
            raise ValueError(f"the SQL log has one partition per topic, not {partition}")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.engine.connect() as conn:
                    rows = conn.execute(
                        select(LogRecord.offset, LogRecord.key, LogRecord.payload)
                        .where(LogRecord.topic == topic, LogRecord.offset >= offset)
                        .order_by(LogRecord.offset)
                        .limit(max_records)
                    ).all()
            except Exception as exc:
                raise LogUnavailable(f"SQL log read failed: {exc}") from exc
            if rows or time.monotonic() >= deadline:
                return [LogEntry(topic, 0, r[0], r[1], r[2].encode()) for r in rows]
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        self.engine.dispose()


class KafkaLog(LogTransport):
    """Kafka topics through kafka-python (tansu in tests, Apache Kafka in production).

    A refused append must never appear later (docs/design.md §8), but a produce request already
    written to a paused broker's socket is appended when the broker resumes, whatever the
    client does. So callers that can refuse call ``check`` first: it probes the broker unless
    it answered less than ``probe_after_s`` ago, and a paused or dead broker is refused with
    nothing sent. A record once sent is waited for up to ``ack_timeout_s``, long enough to
    outlast short pauses, so its answer is the broker's. After any failure the producer is
    closed without delivering its buffer and rebuilt on the next append (a producer whose
    broker restarted is in a fatal state for good: its producer id is unknown there), and
    missing topics are recreated (a tansu broker with memory storage restarts empty).
    """

    keeps_records = True

    def __init__(
        self,
        url: str,
        num_partitions: int = 4,
        send_timeout_s: float = 5.0,
        ack_timeout_s: float = 30.0,
        probe_timeout_s: float = 1.0,
        probe_after_s: float = 0.5,
    ):
        self.url = url
        hosts, _, query = url.removeprefix("kafka://").partition("?")
        self.bootstrap = hosts.split(",")
        # A tenant namespace's topics (core.policies.tenant_log_url): callers name the logical
        # topics of core.records; the broker holds them as ``<topic_prefix><topic>``.
        self.topic_prefix = dict(parse_qsl(query)).get("topic_prefix", "")
        self.num_partitions = num_partitions
        self.send_timeout_s = send_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self._producer = None
        self._producer_topic_ids: dict[str, str] = {}
        self._admin = None
        self._consumers: dict = {}
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self.breaker = Breaker("the Kafka log", self._probe, LogUnavailable, fresh_s=probe_after_s)

    def broker_topic(self, topic: str) -> str:
        """The broker's name of the logical ``topic``: ``topic_prefix`` + ``topic``."""
        return f"{self.topic_prefix}{topic}"

    def partitions_of(self, topic: str) -> int:
        """Partitions a topic is created with: ``num_partitions``, but one for ``policy``, whose
        events share one key and one order anyway (each replica polls every partition of it,
        and an empty one still costs a fetch wait per poll)."""
        return 1 if topic == TOPIC_POLICY else self.num_partitions

    def _new_admin(self, timeout_s: float):
        from kafka.admin import KafkaAdminClient

        timeout_ms = int(timeout_s * 1000)
        return KafkaAdminClient(
            bootstrap_servers=self.bootstrap, request_timeout_ms=timeout_ms, bootstrap_timeout_ms=timeout_ms
        )

    def _ensure(self, admin) -> dict[str, str]:
        """Create the topics ``admin``'s broker lacks; returns each topic's id.

        Topic ids tell a restarted broker apart: tansu with memory storage restarts empty, and
        whoever comes first (this log, a reader) creates the topics again with new ids."""
        from kafka.admin import NewTopic
        from kafka.errors import TopicAlreadyExistsError

        existing = set(admin.list_topics())
        new = [
            NewTopic(self.broker_topic(t), num_partitions=self.partitions_of(t), replication_factor=1)
            for t in TOPICS
            if self.broker_topic(t) not in existing
        ]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
        described = admin.describe_topics([self.broker_topic(t) for t in TOPICS])
        return {t["name"]: t.get("topic_id") for t in described}

    def ensure_topics(self) -> dict[str, str]:
        """Create the three topics if missing (idempotent); returns their ids."""
        admin = self._new_admin(self.send_timeout_s)
        try:
            return self._ensure(admin)
        finally:
            admin.close()

    def _probe(self) -> None:
        # A client whose request timed out can take the connection's full reconnect time on
        # its next call: a failed probe drops its admin client and the next one starts fresh.
        try:
            if self._admin is None:
                self._admin = self._new_admin(self.probe_timeout_s)
            topic_ids = self._ensure(self._admin)
        except Exception:
            admin, self._admin = self._admin, None
            if admin is not None:
                with contextlib.suppress(Exception):
                    admin.close()
            raise
        producer = self._producer
        if producer is not None and topic_ids != self._producer_topic_ids:
            # Not the topics the producer was made for: the broker restarted and has
            # forgotten the producer's id, so the producer would fail its next send.
            self._discard_producer(producer, None)

    def check(self) -> None:
        self.breaker.check()

    def _get_producer(self):
        with self._lock:
            if self._producer is None:
                from kafka import KafkaProducer

                try:
                    # First the topics: a broker that restarted empty would auto-create them
                    # with its own partition count.
                    self._producer_topic_ids = self.ensure_topics()
                    self._producer = KafkaProducer(
                        bootstrap_servers=self.bootstrap,
                        acks="all",
                        enable_idempotence=True,
                        linger_ms=2,
                        max_block_ms=int(self.send_timeout_s * 1000),
                        bootstrap_timeout_ms=int(self.send_timeout_s * 1000),
                        # Longer than our wait: the client must not give up on a request (and
                        # resend it) while we still wait for the broker's answer.
                        request_timeout_ms=int((self.ack_timeout_s + 5) * 1000),
                        delivery_timeout_ms=int((self.ack_timeout_s + 10) * 1000),
                    )
                except Exception as exc:
                    self.breaker.trip(str(exc))
                    raise LogUnavailable(f"Kafka producer unavailable: {exc}") from exc
            return self._producer

    def _discard_producer(self, producer, reason: str | None) -> None:
        """Close ``producer`` without delivering what it still buffers; the next append builds
        a new one. kafka-python's ``close(timeout=0)`` first flushes (and raises when the
        flush cannot finish), so its sender is force-closed first: that fails every buffered
        batch instead of sending it. A ``reason`` opens the breaker."""
        if reason is not None:
            self.breaker.trip(reason)
        with self._lock:
            if self._producer is producer:
                self._producer = None
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
            sender.join(5)
        with contextlib.suppress(Exception):
            producer.close(timeout=0)

    def append(self, topic: str, key: str, value: bytes) -> tuple[int, int]:
        if topic not in TOPICS:
            raise ValueError(f"unknown topic {topic!r}")
        producer = self._get_producer()
        try:
            future = producer.send(self.broker_topic(topic), key=key.encode(), value=value)
        except Exception as exc:  # no metadata or no buffer space in time: nothing was sent
            self._discard_producer(producer, str(exc))
            raise LogUnavailable(f"Kafka append failed: {exc}") from exc
        try:
            meta = future.get(timeout=self.ack_timeout_s)
        except Exception as exc:
            self._discard_producer(producer, str(exc))
            raise LogUnavailable(f"Kafka append failed: {exc}") from exc
        self.breaker.ok()
        return meta.partition, meta.offset

    def partitions(self, topic: str) -> list[int]:
        from kafka import KafkaConsumer

        try:
            consumer = KafkaConsumer(
                bootstrap_servers=self.bootstrap, bootstrap_timeout_ms=int(self.send_timeout_s * 1000)
            )
        except Exception as exc:
            raise LogUnavailable(f"Kafka unavailable: {exc}") from exc
        try:
            parts = consumer.partitions_for_topic(self.broker_topic(topic))
        finally:
            consumer.close()
        if not parts:
            self.ensure_topics()
            return list(range(self.partitions_of(topic)))
        return sorted(parts)

    def read(
        self, topic: str, partition: int, offset: int, max_records: int = 500, timeout_s: float = 0.5
    ) -> list[LogEntry]:
        from kafka import KafkaConsumer, TopicPartition

        tp = TopicPartition(self.broker_topic(topic), partition)
        with self._read_lock:
            # One consumer per partition: reassigning one consumer between partitions drops
            # its fetch positions and returns nothing until the next metadata round.
            c = self._consumers.get(tp)
            if c is None:
                try:
                    c = KafkaConsumer(
                        bootstrap_servers=self.bootstrap,
                        enable_auto_commit=False,
                        group_id=None,
                        bootstrap_timeout_ms=int(self.send_timeout_s * 1000),
                    )
                except Exception as exc:
                    raise LogUnavailable(f"Kafka consumer unavailable: {exc}") from exc
                c.assign([tp])
                self._consumers[tp] = c
            c.seek(tp, offset)
            try:
                batch = c.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
            except Exception as exc:
                # A consumer that failed is rebuilt on the next read (its broker may be new).
                del self._consumers[tp]
                with contextlib.suppress(Exception):
                    c.close()
                raise LogUnavailable(f"Kafka read failed: {exc}") from exc
            msgs = batch.get(tp, [])
            return [LogEntry(topic, partition, m.offset, (m.key or b"").decode(), m.value) for m in msgs]

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.close(timeout=5)
                self._producer = None
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        with self._read_lock:
            for c in self._consumers.values():
                c.close()
            self._consumers.clear()


def open_log(url: str) -> LogTransport:
    """The transport for ``url``: ``kafka://…`` or a SQLAlchemy database URL."""
    if url.startswith("kafka://"):
        return KafkaLog(url)
    if "://" in url:
        return SqlLog(url)
    raise ValueError(f"log URL {url!r} is neither kafka://host:port nor a database URL")
