"""A replica that starts or restarts is not ready until it serves the current version, and a
version never goes backwards on any replica or in any record (issue 23, docs/reliability.md
"Replicas that restart").

Before this, a replica read the policy topic and swapped to its newest version inside the app's
start-up, before it listened: ``/readyz`` could not say what it waited for, a replica whose log
was down at start did not start at all, and a read cut by an outage after its first batch lost
the events of that batch. The fast tier runs the real app (uvicorn, SQLite, the SQL log) on a
stand-in engine whose swap the test releases; tests/system/test_replica_readiness.py restarts a
real ``saoserve serve`` process (testing/replicas.py) on the shared model after two versions were
published.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from core.db import migrate
from core.logbus import LogEntry, LogUnavailable, SqlLog, open_log
from core.records import TOPIC_POLICY, PolicyEvent
from server.engine import SwapRefused, SwapResult
from server.metrics import ServerMetrics
from server.policy_watch import PolicyWatcher
from testing.fakes import FakeEngine
from testing.servers import make_settings, running_server

SHA = "ab" * 32
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def event(version: int) -> PolicyEvent:
    return PolicyEvent(
        version=version,
        path=f"/policies/v{version}",
        sha256=SHA,
        created_at=T0 + timedelta(seconds=version),
        parent_version=version - 1,
        metrics={},
    )


class GatedEngine(FakeEngine):
    """A FakeEngine whose swaps wait for ``release``; it renders any chat as three tokens, so a
    chat reaches the dispatch checks (and no further: it cannot generate)."""

    def __init__(self, version: int = 0):
        super().__init__(version=version)
        self.release = asyncio.Event()
        self.tokenizer = list(range(100))

    def render(self, messages: list[dict]) -> list[int]:
        return [1, 2, 3]

    async def swap(self, version: int, path: Path, sha256: str) -> SwapResult:
        await self.release.wait()
        return await super().swap(version, path, sha256)


class ListLog:
    """A policy topic in memory (one partition, offsets = list positions); ``fail_reads`` makes
    that many of the next reads raise LogUnavailable, ``fail_after`` lets reads pass first."""

    url = "memory://policy"

    def __init__(self, events: list[PolicyEvent] = ()):
        self.entries: list[LogEntry] = []
        self.fail_reads = 0
        self.fail_after = 0
        for e in events:
            self.add(e)

    def add(self, e: PolicyEvent) -> None:
        self.entries.append(LogEntry(TOPIC_POLICY, 0, len(self.entries), "policy", e.to_json()))

    def partitions(self, topic: str) -> list[int]:
        return [0]

    def read(self, topic, partition, offset, max_records=500, timeout_s=0.5) -> list[LogEntry]:
        if self.fail_reads:
            if self.fail_after:
                self.fail_after -= 1
            else:
                self.fail_reads -= 1
                raise LogUnavailable("the Kafka log is unavailable: KafkaConnectionError: broker down")
        return self.entries[offset : offset + max_records]


class DownSqlLog(SqlLog):
    """The SQL log, refusing every call while ``down`` (a log that is not up yet at start)."""

    down = True

    def _refuse(self) -> None:
        if self.down:
            raise LogUnavailable("the SQL log is unavailable: OperationalError: connection refused")

    def partitions(self, topic: str) -> list[int]:
        self._refuse()
        return super().partitions(topic)

    def read(self, *args, **kwargs):
        self._refuse()
        return super().read(*args, **kwargs)

    def check(self) -> None:
        self._refuse()
        super().check()


def published(settings, versions: list[int]) -> None:
    """Policy events for ``versions`` in the log of ``settings`` (the SQL log)."""
    migrate(settings.resolved_database_url)
    log = open_log(settings.resolved_log_url)
    for v in versions:
        log.append(TOPIC_POLICY, "policy", event(v).to_json())
    log.close()


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = f"{name}{{{want}}} " if want else f"{name} "
    return next((float(r.split()[-1]) for r in text.splitlines() if r.startswith(line)), 0.0)


async def wait_ready(http: httpx.AsyncClient, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = await http.get("/readyz")
        if r.status_code == 200:
            return r.json()
        assert time.monotonic() < deadline, r.text
        await asyncio.sleep(0.05)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_a_replica_that_starts_behind_is_503_naming_the_gap_then_serves_the_newest(tmp_path):
    """The topic holds versions 1 and 2 when the replica starts at 0: it listens at once, is
    503 naming the gap and refuses chats (not_ready) while it loads version 2 (straight to the
    newest, not through 1); once loaded, 200 at version 2."""
    settings = make_settings(tmp_path)
    published(settings, [1, 2])
    engine = GatedEngine()
    async with running_server(settings, engine) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.get("/readyz")
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json() == {
            "ready": False,
            "policy_version": 0,
            "database": "ok",
            "log": "ok",
            "engine": "ok",
            "policy": "catching up: serves version 0, the policy topic's newest is 2",
        }
        chat = await http.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 503 and chat.headers["retry-after"] == "2"
        assert chat.json()["error"] == {
            "message": "this replica is catching up: serves version 0, the policy topic's newest is 2; retry later",
            "type": "server_error",
            "param": None,
            "code": "not_ready",
        }
        engine.release.set()
        ready = await wait_ready(http)
        assert (ready["policy_version"], ready["policy"]) == (2, "ok")
        assert engine.swaps == [(2, Path("/policies/v2"), SHA)]
        m = (await http.get("/metrics")).text
    assert sample(m, "saoserve_requests_failed_before_generation_total", reason="not_ready") == 1
    assert sample(m, "saoserve_policy_swaps_total", result="ok") == 1
    assert sample(m, "saoserve_policy_version") == 2


async def test_a_replica_started_while_the_log_is_down_starts_and_catches_up_when_it_returns(tmp_path):
    """Before, the start-up read of the policy topic raised and the replica never started."""
    settings = make_settings(tmp_path)
    published(settings, [1, 2])
    log = DownSqlLog(settings.resolved_log_url)
    engine = GatedEngine()
    engine.release.set()
    async with (
        running_server(settings, engine, log_transport=log) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as http,
    ):
        r = await http.get("/readyz")
        assert r.status_code == 503
        body = r.json()
        assert body["log"] == "the SQL log is unavailable (LogUnavailable)"
        assert body["policy"] == "catching up: the policy topic has not been read yet (serves version 0)"
        chat = await http.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "storage_unavailable"
        log.down = False
        # The watcher's next read comes after its back-off (0.5 s after the first failure).
        ready = await wait_ready(http)
        assert (ready["policy_version"], ready["policy"]) == (2, "ok")
        assert engine.swaps == [(2, Path("/policies/v2"), SHA)]
    log.close()


async def test_stale_and_out_of_order_events_never_take_a_version_back(caplog):
    """The start-up read holds 1, 3, 2 (out of order): the watcher loads 3 and nothing else.
    Later events below the version served are stale: ignored, each counted, each version logged
    once; a higher version is loaded."""
    caplog.set_level(logging.WARNING, logger="server.policy_watch")
    log = ListLog([event(1), event(3), event(2)])
    engine, metrics = FakeEngine(), ServerMetrics()
    watcher = PolicyWatcher(log, engine, metrics, poll_s=0.25)
    await watcher.catch_up()
    assert (watcher.caught_up, watcher.newest, engine.swaps) == (False, 3, [])
    assert watcher.readiness() == "catching up: serves version 0, the policy topic's newest is 3"
    await watcher.poll()
    assert [v for v, _, _ in engine.swaps] == [3] and watcher.caught_up
    assert watcher.readiness() == "ok"
    for v in (2, 1, 2):
        log.add(event(v))
    await watcher.poll()
    assert [v for v, _, _ in engine.swaps] == [3]
    log.add(event(4))
    await watcher.poll()
    assert [v for v, _, _ in engine.swaps] == [3, 4]
    # 2, 1, 2: three stale events, two versions logged (a read is taken in created_at order).
    assert metrics.registry.get_sample_value("saoserve_policy_swaps_total", {"result": "stale"}) == 3
    assert [r.getMessage() for r in caplog.records] == [
        "global: policy event for version 1 ignored: version 3 serves and versions only go forward",
        "global: policy event for version 2 ignored: version 3 serves and versions only go forward",
    ]


class RefusingEngine(GatedEngine):
    """Refuses the versions in ``refuse``; the others wait for ``release`` as in GatedEngine."""

    def __init__(self, version: int, refuse: set[int]):
        super().__init__(version)
        self.refuse = refuse

    async def swap(self, version: int, path: Path, sha256: str) -> SwapResult:
        if version in self.refuse:
            raise SwapRefused(f"checksum mismatch for {path}")
        return await super().swap(version, path, sha256)


async def test_caught_up_a_swap_under_way_stays_ready_and_a_refused_one_is_behind():
    """Every replica swaps at once: a swap under way must not take them all out. A refused
    swap leaves the replica on its version: 503 ``behind`` naming the gap, while its chats
    (from the version it always served) go on."""
    log = ListLog([event(4)])
    engine = RefusingEngine(version=4, refuse={5})
    engine.path = Path("/policies/v4")
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    assert watcher.caught_up and watcher.readiness() == "ok"
    log.add(event(5))
    await watcher.poll()
    assert watcher.readiness() == (
        "behind: serves version 4, the policy topic's newest is 5 (its swap was refused; see the server's log)"
    )
    watcher.require()  # chats still answered
    log.add(event(6))
    poll = asyncio.create_task(watcher.poll())
    await asyncio.sleep(0.05)
    assert watcher.swapping == 6 and watcher.readiness() == "ok"
    engine.release.set()
    await poll
    assert (engine.version, watcher.readiness()) == (6, "ok")


async def test_a_read_cut_by_an_outage_is_read_again():
    """The read after a batch (to see whether more follow) fails: the batch is read again at the
    next poll. Before, the offset had moved past it and version 1 was never served."""
    log = ListLog()
    engine = FakeEngine()
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    log.add(event(1))
    log.fail_reads, log.fail_after = 1, 1  # the first read returns v1, the second fails
    with pytest.raises(LogUnavailable):
        await watcher.poll()
    await watcher.poll()
    assert [v for v, _, _ in engine.swaps] == [1]
