"""Follow the ``policy`` topic and hot-swap to each newly published version.

Every server replica reads the whole topic itself (no consumer group), so N replicas all
swap; the latest event in log order wins, which is also how a rollback (an event naming an
older version) takes effect. Policy events share one key, so they share one partition and
have one order.

Each swap sets ``saoserve_policy_version`` and ``saoserve_policy_swapped_at_seconds`` (Unix
time the version started serving) together, so the delay from a policy event's ``created_at``
to each replica serving it can be read from the replicas' ``/metrics``
(tests/test_replicas.py, bench/bench_replica_swap.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from core.logbus import LogTransport
from core.records import TOPIC_POLICY, PolicyEvent
from server.engine import PolicyEngine, SwapRefused
from server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class PolicyWatcher:
    def __init__(
        self, log_transport: LogTransport, engine: PolicyEngine, metrics: ServerMetrics, poll_s: float
    ):
        self.log = log_transport
        self.engine = engine
        self.metrics = metrics
        self.poll_s = poll_s
        self.offsets: dict[int, int] = {}

    async def _read_new(self) -> list[PolicyEvent]:
        events: list[tuple[object, PolicyEvent]] = []
        parts = await asyncio.to_thread(self.log.partitions, TOPIC_POLICY)
        for p in parts:
            while True:
                batch = await asyncio.to_thread(
                    self.log.read, TOPIC_POLICY, p, self.offsets.get(p, 0), 500, 0.2
                )
                if not batch:
                    break
                for e in batch:
                    try:
                        events.append((e.offset, PolicyEvent.model_validate_json(e.value)))
                    except ValueError:
                        log.error("ignoring malformed policy event at %s/%d", p, e.offset)
                self.offsets[p] = batch[-1].offset + 1
        return [ev for _, ev in sorted(events, key=lambda x: (x[1].created_at, x[0]))]

    async def apply(self, event: PolicyEvent, measure: bool = True) -> bool:
        """Swap to ``event``'s version unless it serves already; True if swapped. ``measure``
        starts feedback→served for it (not at start-up, which would measure the start)."""
        if event.version == self.engine.version and Path(event.path) == self.engine.path:
            return False
        try:
            res = await self.engine.swap(event.version, Path(event.path), event.sha256)
        except SwapRefused as exc:
            self.metrics.swaps.labels("refused").inc()
            log.error("policy version %d refused: %s", event.version, exc)
            return False
        self.metrics.swapped(res)
        if measure:
            self.metrics.awaiting_answer(res.version, event.metrics.get("batch_completed_at"))
        return True

    async def catch_up(self) -> None:
        """At start: read all published events and serve the latest one.

        ``saoserve_policy_swapped_at_seconds`` then says since when this replica serves its
        version: the swap's end, or now when it keeps the version it started with.
        """
        events = await self._read_new()
        if not (events and await self.apply(events[-1], measure=False)):
            self.metrics.serving(self.engine.version)

    async def run(self) -> None:
        while True:
            try:
                events = await self._read_new()
                if events:
                    await self.apply(events[-1])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("policy watcher: log read failed; retrying")
            await asyncio.sleep(self.poll_s)
