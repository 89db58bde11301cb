"""The policy watcher (server/policy_watch.py) through a log outage and with events older than
the version served (issue 23 findings 3 and 10).

During an outage the tester's server printed 113 full tracebacks in 30 s: one per 0.25 s poll.
Now each failed read is one warning line, the traceback only on the outage's first, and the
waits between reads double up to ``MAX_BACKOFF_S``; the first read that works logs the
recovery and goes back to ``poll_s``. The waits are read from the watcher's own sleeps.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import pytest

from core.logbus import LogEntry
from core.records import TOPIC_POLICY, PolicyEvent
from server import policy_watch
from server.metrics import ServerMetrics
from server.policy_watch import MAX_BACKOFF_S, PolicyWatcher
from testing.fakes import FakeEngine, OutageLog, append_events, event, notice


async def run_for(watcher: PolicyWatcher, n_sleeps: int, monkeypatch) -> list[float]:
    """Run the watcher until it has slept ``n_sleeps`` times; the seconds of each sleep."""
    real_sleep = asyncio.sleep
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == n_sleeps:
            raise asyncio.CancelledError
        await real_sleep(0)

    monkeypatch.setattr(policy_watch.asyncio, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await watcher.run()
    monkeypatch.setattr(policy_watch.asyncio, "sleep", real_sleep)
    return slept


async def test_an_outage_is_logged_once_with_backoff(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="server.policy_watch")
    log = OutageLog(down_for=8)
    watcher = PolicyWatcher(log, FakeEngine(), ServerMetrics(), poll_s=0.25)
    slept = await run_for(watcher, 10, monkeypatch)
    # 0.25 s doubled per failure: 0.5, 1, 2, 4, 8, then MAX_BACKOFF_S (10 s); then the ninth read
    # works and the watcher polls every 0.25 s again.
    assert MAX_BACKOFF_S == 10.0
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 0.25, 0.25]
    failures = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failures) == 8
    assert [r.exc_info is not None for r in failures] == [True] + [False] * 7
    assert failures[1].getMessage() == (
        "global: policy watcher: reading the policy topic failed (2 in a row; next try in 1.0 s): "
        "LogUnavailable: the Kafka log is unavailable: KafkaConnectionError: broker down"
    )
    recovered = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert recovered == ["global: policy watcher: the policy topic answers again after 8 failed reads"]
    assert watcher.failures == 0


async def test_an_event_older_than_the_served_version_is_ignored(caplog):
    caplog.set_level(logging.WARNING, logger="server.policy_watch")
    engine = FakeEngine(version=5)
    watcher = PolicyWatcher(OutageLog(0), engine, ServerMetrics(), poll_s=0.25)
    assert await watcher.apply(event(3)) is False
    assert await watcher.apply(event(3)) is False  # logged once
    assert await watcher.apply(event(6)) is True
    assert engine.swaps == [(6, Path("/policies/v6"), "0" * 64)]
    assert [r.getMessage() for r in caplog.records] == [
        "global: policy event for version 3 ignored: version 5 serves and versions only go forward"
    ]


async def test_stage_notices_are_logged_and_counted_once_caught_up_and_never_loaded(caplog):
    caplog.set_level(logging.INFO, logger="server.policy_watch")
    # At start the topic holds version 2 and an old notice (version 1 promoted): history, skipped.
    log = OutageLog(0, [event(1), notice(1, "promoted", 0), event(2)])
    engine, metrics = FakeEngine(version=0), ServerMetrics()
    watcher = PolicyWatcher(log, engine, metrics, poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    assert engine.swaps == [(2, Path("/policies/v2"), "0" * 64)]
    # Then version 2 is rejected (an operator) and version 3 published: the notice is logged and
    # counted, and even a notice of a stage no server serves (``rejected``) is never loaded.
    log.entries += [
        LogEntry(TOPIC_POLICY, 0, 3, "policy", notice(2, "rejected", 1).to_json()),
        LogEntry(TOPIC_POLICY, 0, 4, "policy", notice(3, "bogus", 2).to_json()),
    ]
    await watcher.poll()
    # Version 2 is left at once for version 1, the newest not rejected (test below).
    assert engine.swaps == [(2, Path("/policies/v2"), "0" * 64), (1, Path("/policies/v1"), "0" * 64)]
    assert metrics.stage_events.labels("rejected")._value.get() == 1
    assert metrics.stage_events.labels("other")._value.get() == 1  # a stage that is not one
    assert metrics.stage_events.labels("promoted")._value.get() == 0  # the start's history
    shown = [r.getMessage() for r in caplog.records if "is now" in r.getMessage()]
    assert shown == [
        "global: policy version 2 is now rejected (by guard)",
        "global: policy version 3 is now other (by guard)",
    ]


def test_a_publish_event_leaves_the_stage_fields_out_for_older_replicas():
    body = event(4).to_json().decode()
    assert '"kind"' not in body and '"actor"' not in body
    assert PolicyEvent.model_validate_json(body).kind == "publish"
    staged = notice(4, "promoted", 0).to_json().decode()
    assert '"kind":"stage"' in staged and '"actor":"guard"' in staged


async def test_a_replica_that_restarts_never_catches_up_to_a_rejected_version():
    # An operator rejected version 7 after it was published; the learner has not yet published
    # the restore. A replica starting now catches up to version 6, the newest not rejected.
    log = OutageLog(0, [event(6), event(7), notice(7, "rejected", 0)])
    engine = FakeEngine(version=0)
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    assert engine.swaps == [(6, Path("/policies/v6"), "0" * 64)]
    assert watcher.rejected == {7} and watcher.newest == 6 and watcher.readiness() == "ok"
    # A publish event of a rejected version (re-sent, or forged) is never loaded either.
    assert await watcher.apply(event(7)) is False and engine.version == 6
    # The learner's restore (version 8, version 6's weights) is served as usual.
    log.entries.append(LogEntry(TOPIC_POLICY, 0, 3, "policy", event(8).to_json()))
    await watcher.poll()
    assert engine.version == 8


async def test_a_replica_serving_a_version_when_it_is_rejected_swaps_back_at_once(caplog):
    # Issue 40, item 3: version 3 serves, the lineage [2, 3] is rejected (an operator, the learner
    # down). At the next poll the replica swaps back to version 1, the newest not rejected, without
    # a restore version; the learner's restore (version 4) later serves as usual.
    caplog.set_level(logging.WARNING, logger="server.policy_watch")
    log = OutageLog(0, [event(1), event(2), event(3)])
    engine, metrics = FakeEngine(version=0), ServerMetrics()
    watcher = PolicyWatcher(log, engine, metrics, poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    assert engine.version == 3
    append_events(log, notice(2, "rejected", 1), notice(3, "rejected", 2))
    await watcher.poll()
    assert engine.swaps[-1] == (1, Path("/policies/v1"), "0" * 64) and engine.version == 1
    assert watcher.newest == 1 and watcher.readiness() == "ok"
    assert metrics.swaps.labels("ok")._value.get() == 2  # version 3, then version 1
    assert [r.getMessage() for r in caplog.records] == [
        "global: policy version 3 is rejected: swapping back to version 1 (the newest not rejected) "
        "until a newer version is published"
    ]
    append_events(log, event(4))
    await watcher.poll()
    assert engine.version == 4 and len(engine.swaps) == 3


async def test_with_every_version_rejected_the_base_weights_serve(tmp_path):
    # Versions 1 and 2 published and both rejected: the replica goes back to version 0, the
    # model's own weights, checked by their checksum (the bytes' sha256: one safetensors file).
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    sha = hashlib.sha256(b"weights").hexdigest()
    engine = FakeEngine(version=0, model_dir=tmp_path)
    log = OutageLog(0, [event(1), event(2)])
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    append_events(log, notice(1, "rejected", 1), notice(2, "rejected", 1))
    await watcher.poll()
    assert engine.swaps[-1] == (0, tmp_path, sha) and watcher.readiness() == "ok"


async def test_a_replica_that_cannot_leave_a_rejected_version_says_so_once(caplog, tmp_path):
    # Version 1 serves and is rejected, and the base weights cannot be read (their folder is
    # gone): nothing else can serve. One error line, no swap, /readyz 503 naming the version; a
    # later version clears it.
    caplog.set_level(logging.ERROR, logger="server.policy_watch")
    gone = tmp_path / "gone"
    log = OutageLog(0, [event(1)])
    engine, metrics = FakeEngine(version=0, model_dir=gone), ServerMetrics()
    watcher = PolicyWatcher(log, engine, metrics, poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    append_events(log, notice(1, "rejected", 1))
    await watcher.poll()
    await watcher.poll()
    assert engine.swaps == [(1, Path("/policies/v1"), "0" * 64)]
    assert [r.getMessage() for r in caplog.records] == [
        "global: policy version 1 is rejected and still serves: the base weights cannot be read: "
        f"no *.safetensors in {gone}"
    ]
    assert watcher.readiness() == (
        "serves rejected version 1: nothing else could be loaded (see the server's log)"
    )
    assert metrics.swaps.labels("refused")._value.get() == 1
    append_events(log, event(2))
    await watcher.poll()
    assert engine.version == 2 and watcher.readiness() == "ok"


async def test_a_notice_rejecting_the_base_is_ignored(tmp_path):
    # Version 0 is never rejected (core.lifecycle); a notice saying so (a bug, a forgery) leaves
    # a replica serving the base ready, with nothing to leave.
    log = OutageLog(0, [notice(0, "rejected", 1)])
    engine = FakeEngine(version=0, model_dir=tmp_path)
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.catch_up()
    await watcher.poll()
    assert watcher.rejected == set() and engine.swaps == [] and watcher.readiness() == "ok"


class WaitsLog(OutageLog):
    """``OutageLog`` that records each read's offset and wait, and hands out two events a read."""

    def __init__(self, events: list[PolicyEvent]):
        super().__init__(0, events)
        self.reads: list[tuple[int, float]] = []

    def read(self, topic, partition, offset, max_records=500, timeout_s=0.5) -> list[LogEntry]:
        self.reads.append((offset, timeout_s))
        return self.entries[offset : offset + 2]


async def test_once_a_read_found_events_the_rest_is_read_without_waiting():
    # Three events, two a read: the first read of the turn waits up to READ_WAIT_S (it returns on
    # an event), the reads after an event found wait 0 s, down to the empty one that ends the
    # turn; before, that last read waited 0.2 s more and delayed the swap by as much.
    log = WaitsLog([event(1), event(2), event(3)])
    engine = FakeEngine()
    watcher = PolicyWatcher(log, engine, ServerMetrics(), poll_s=0.25)
    await watcher.poll()
    assert policy_watch.READ_WAIT_S == 0.2
    assert log.reads == [(0, 0.2), (2, 0.0), (3, 0.0)]
    assert engine.swaps == [(3, Path("/policies/v3"), "0" * 64)]
    # The next turn finds nothing: one read, which waits.
    await watcher.poll()
    assert log.reads[3:] == [(3, 0.2)]
