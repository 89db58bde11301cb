"""Storage outages against the real server (issue 13 items 2 and 3, docs/design.md §8).

The promise audited: a request or feedback answered 503 is not in the log and never will be;
every 2xx is in the log exactly once; a 503 carries ``Retry-After``; ``/readyz`` answers 503
while a dependency is down; the server serves again after the dependency returns, without a
restart. Real parts only: the shared vLLM engine, a PostgreSQL cluster and a tansu broker of
the test's own that it stops, pauses, kills and starts (testing/dependencies.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from core.logbus import open_log
from core.records import FeedbackRecord, TrajectoryRecord
from testing.dependencies import PgCluster, TansuBroker, fresh_pg_database
from testing.logs import read_topic
from testing.servers import make_settings, running_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# A breaker trusts a dependency's answer for 0.5 s (core/breaker.py): waiting longer than that
# after stopping one makes the next check probe it.
FRESH_S = 0.6
RECOVERY_LIMIT_S = 30.0
# Under load, half the chats are sent at once (before the outage, which starts 0.3 s in) and
# half this many seconds later (during it).
LATE_S = 1.2  # a guard against hanging, not a speed check (figures: docs/log/2026-12-06-reliability-runs.md)


# Stopping and starting dependencies runs on threads of the test's own, never queued behind
# the server's blocked calls in the loop's default executor.
_OPS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="outage-ops")


async def in_thread(fn) -> None:
    await asyncio.get_running_loop().run_in_executor(_OPS, fn)


@dataclass
class Ledger:
    """What the server answered: completions by id, feedback by (id, reward), 503 counts."""

    completions: dict[str, str] = field(default_factory=dict)  # id -> feedback token
    chats_503: int = 0
    feedback_2xx: dict[str, float] = field(default_factory=dict)
    feedback_503: list[tuple[str, float]] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # messages of the 503s, for failure reports

    async def chat(self, http: httpx.AsyncClient, i: int, stream: bool = False, delay_s: float = 0.0) -> int:
        """One chat, sent after ``delay_s``; returns its status. A 200 stream must end with
        [DONE] and no error event."""
        await asyncio.sleep(delay_s)
        body = {"messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": 4}
        if not stream:
            r = await http.post("/v1/chat/completions", json=body)
            status, payload = r.status_code, r.json()
            if status == 200:
                self.completions[payload["id"]] = payload["feedback_token"]
        else:
            async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                status = r.status_code
                raw = (await r.aread()).decode()
            if status == 200:
                events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
                assert events[-1] == "[DONE]" and all('"error"' not in e for e in events), raw
                last = json.loads(events[-2])
                self.completions[last["id"]] = last["feedback_token"]
            else:
                payload = json.loads(raw)
        if status == 503:
            self.chats_503 += 1
            self.errors.append(payload["error"]["message"])
            assert r.headers["retry-after"] == "2" and payload["error"]["type"] == "server_error"
        assert status in (200, 503), (status, payload)
        return status

    async def feedback(self, http: httpx.AsyncClient, cid: str, reward: float) -> int:
        r = await http.post(
            "/v1/feedback", json={"id": cid, "feedback_token": self.completions[cid], "reward": reward}
        )
        if r.status_code == 202:
            self.feedback_2xx[cid] = reward
        elif r.status_code == 503:
            self.feedback_503.append((cid, reward))
            assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "server_error"
        assert r.status_code in (202, 503), r.text
        return r.status_code

    async def wait_ready(self, http: httpx.AsyncClient, since: float) -> None:
        """Poll /readyz until 200; records the seconds from ``since`` (the dependency's return)."""
        while True:
            r = await http.get("/readyz")
            if r.status_code == 200:
                self.recovery_s.append(time.monotonic() - since)
                return
            assert time.monotonic() - since < RECOVERY_LIMIT_S, r.text
            await asyncio.sleep(0.1)

    def audit(self, log, completions: set[str] | None = None) -> tuple[int, int]:
        """Every 2xx in the log once, nothing else: the trajectory records are exactly the
        completions answered 200 (``completions``: the subset expected in this log), and the
        feedback records exactly the 202s, with the reward that got the 202."""
        expected = set(self.completions) if completions is None else completions
        trajectories = [
            TrajectoryRecord.model_validate_json(e.value).id for e in read_topic(log, "trajectories")
        ]
        assert sorted(trajectories) == sorted(expected)
        feedback = [FeedbackRecord.model_validate_json(e.value) for e in read_topic(log, "feedback")]
        got = sorted((f.trajectory_id, f.reward) for f in feedback)
        assert got == sorted((cid, rw) for cid, rw in self.feedback_2xx.items() if cid in expected)
        return len(trajectories), len(feedback)


async def expect_unready(http: httpx.AsyncClient, dependency: str) -> dict:
    r = await http.get("/readyz")
    body = r.json()
    assert r.status_code == 503 and r.headers["retry-after"] == "2" and body["ready"] is False
    assert body[dependency] != "ok", body
    return body


@pytest.mark.postgres
async def test_database_stopped_and_started(policy_engine, tmp_path):
    """Issue 13 item 2: PostgreSQL stopped under the server (the embedded shape on PostgreSQL:
    database and SQL-table log in one cluster), then started again on the same port."""
    cluster = PgCluster()
    try:
        cluster.init()
        cluster.start()
        settings = make_settings(tmp_path, database_url=cluster.url)
        ledger = Ledger()
        async with running_server(settings, policy_engine) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                assert [await ledger.chat(http, i, stream=i % 2 == 1) for i in range(4)] == [200] * 4
                ids = list(ledger.completions)
                assert await ledger.feedback(http, ids[0], 1.0) == 202

                await in_thread(cluster.stop)
                await asyncio.sleep(FRESH_S)  # past the last probe's answer, which is trusted
                body = await expect_unready(http, "database")
                assert body["log"] != "ok"  # the SQL log lives in the same cluster
                # Every route that needs storage answers 503 (same keep-alive client throughout:
                # a 500 used to reset the connection).
                assert [await ledger.chat(http, 10 + i, stream=i % 2 == 1) for i in range(4)] == [503] * 4
                assert await ledger.feedback(http, ids[1], 0.0) == 503
                assert await ledger.feedback(http, ids[2], 0.5) == 503

                await in_thread(cluster.start)
                await ledger.wait_ready(http, time.monotonic())
                assert [await ledger.chat(http, 20 + i, stream=i % 2 == 1) for i in range(4)] == [200] * 4
                # The client's retry of the refused feedback with another value is accepted.
                assert await ledger.feedback(http, ids[1], 1.0) == 202
                assert await ledger.feedback(http, list(ledger.completions)[-1], 0.25) == 202

                # Stopped under load: answers already generating wait for the database (200,
                # streams included); requests arriving once the outage is seen are refused.
                async def stop_for(seconds: float) -> None:
                    await asyncio.sleep(0.3)
                    await in_thread(cluster.stop)
                    await asyncio.sleep(seconds)
                    await in_thread(cluster.start)

                statuses = await asyncio.gather(
                    *(
                        ledger.chat(http, 40 + i, stream=i % 2 == 1, delay_s=LATE_S * (i >= 6))
                        for i in range(12)
                    ),
                    stop_for(2.0),
                )
                under_load = (statuses[:-1].count(200), statuses[:-1].count(503))
                await ledger.wait_ready(http, time.monotonic())
        log = open_log(cluster.url)
        n_traj, n_fb = ledger.audit(log)
        log.close()
        # 8 chats answered 200 (4 before, 4 after) plus those under load, and 3 feedback
        # answered 202; the refused chats and 2 feedback are nowhere (ids[1] carries only the
        # 1.0 of its retry).
        assert (n_traj, n_fb) == (8 + under_load[0], 3)
        assert (ledger.chats_503, len(ledger.feedback_503)) == (4 + under_load[1], 2)
        assert ledger.feedback_2xx[ids[1]] == 1.0
        print(
            f"database outage: recovery {ledger.recovery_s[0]:.2f} s after start returned; "
            f"under load {under_load[0]} x 200, {under_load[1]} x 503, recovery {ledger.recovery_s[1]:.2f} s"
        )
    finally:
        cluster.remove()


@pytest.mark.kafka
@pytest.mark.postgres
async def test_broker_paused_then_killed_and_restarted(policy_engine, tmp_path):
    """Issue 13 item 3: the broker paused (SIGSTOP) with the server idle and under load, then
    killed and restarted empty on the same port (memory storage: topics and producer ids
    lost); the server recovers each time without a restart."""
    broker = TansuBroker()
    broker.start()
    try:
        with fresh_pg_database() as pg:
            settings = make_settings(tmp_path, database_url=pg, log_url=broker.url)
            ledger = Ledger()
            async with running_server(settings, policy_engine) as url:
                log = open_log(broker.url)
                async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                    assert [await ledger.chat(http, i, stream=i % 2 == 1) for i in range(4)] == [200] * 4
                    ids = list(ledger.completions)
                    assert await ledger.feedback(http, ids[0], 1.0) == 202

                    # Paused while idle: refused before anything is sent.
                    await asyncio.sleep(FRESH_S)
                    broker.pause()
                    assert await ledger.feedback(http, ids[1], 0.0) == 503
                    assert [await ledger.chat(http, 10 + i, stream=i % 2 == 1) for i in range(2)] == [503] * 2
                    await expect_unready(http, "log")
                    broker.resume()
                    await ledger.wait_ready(http, time.monotonic())
                    # The retry with another value is accepted, and only it reaches the log.
                    assert await ledger.feedback(http, ids[1], 1.0) == 202

                    # Paused under load: requests already sent wait for the broker's answer
                    # (200); requests arriving once the pause is seen are refused (503).
                    async def pause_for(seconds: float) -> None:
                        await asyncio.sleep(0.3)
                        broker.pause()
                        await asyncio.sleep(seconds)
                        broker.resume()

                    statuses = await asyncio.gather(
                        *(
                            ledger.chat(http, 30 + i, stream=i % 2 == 1, delay_s=LATE_S * (i >= 6))
                            for i in range(12)
                        ),
                        pause_for(3.0),
                    )
                    assert set(statuses[:-1]) <= {200, 503}
                    await ledger.wait_ready(http, time.monotonic())
                    await asyncio.sleep(1.0)  # anything delivered late would be in the log by now
                    paused_audit = ledger.audit(log)
                    under_load = (statuses[:-1].count(200), statuses[:-1].count(503))

                    # Killed and restarted empty: the producer and the topics are rebuilt.
                    broker.kill()
                    await asyncio.sleep(FRESH_S)
                    assert await ledger.chat(http, 50) == 503
                    await expect_unready(http, "log")
                    before_restart = set(ledger.completions)
                    await in_thread(broker.start)
                    await ledger.wait_ready(http, time.monotonic())
                    statuses = [await ledger.chat(http, 60 + i, stream=i % 2 == 1) for i in range(4)]
                    assert statuses == [200] * 4, ledger.errors[-4:]
                    after = [cid for cid in ledger.completions if cid not in before_restart]
                    assert await ledger.feedback(http, after[0], 0.75) == 202
                log.close()
                log = open_log(broker.url)
                # The restarted broker holds only what was answered after it started.
                restarted_audit = ledger.audit(log, set(after))
                log.close()
        # Before the kill: 4 + the 200s under load; feedback ids[0] 1.0 and ids[1] 1.0 only.
        assert paused_audit == (4 + under_load[0], 2)
        assert restarted_audit == (4, 1)
        assert ledger.feedback_503 == [(ids[1], 0.0)]
        print(
            f"broker outages: under load {under_load[0]} x 200, {under_load[1]} x 503; "
            f"recovery after resume {ledger.recovery_s[0]:.2f} s / {ledger.recovery_s[1]:.2f} s, "
            f"after restart {ledger.recovery_s[2]:.2f} s"
        )
    finally:
        broker.kill()
