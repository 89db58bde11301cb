"""The state of one policy a server app serves: the global policy's, and one per tenant policy
(``Settings.tenant_policies``; docs/tenants.md, "A policy per tenant")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy.exc import IntegrityError

from core.lifecycle import Arm
from core.logbus import LogTransport, LogUnavailable
from core.policies import GLOBAL
from core.records import (
    TOPIC_TRAJECTORIES,
    FrozenBaseline,
    TrajectoryRecord,
    answer_version,
    is_whole_answer,
)
from core.settings import Settings
from server.canary import CanaryRouter
from server.engine import PolicyEngine
from server.health import Health, is_storage_error
from server.metrics import ServerMetrics, TenantPolicyMetrics
from server.policy_log import PolicyLog
from server.spool import DeferredWrite, Spool, WriteJournal
from server.store import ServerStore

log = logging.getLogger(__name__)

# Seconds between attempts of a deferred database write (index row, feedback claim).
DEFERRED_RETRY_S = 1.0

BaselineReader = Callable[[str, int], Awaitable[FrozenBaseline | None]]


@dataclass
class ServerState:
    """Everything a request handler needs for one policy; built in the lifespan (``server.app``).

    ``policy``: ``core.policies.GLOBAL`` or the tenant. A tenant policy's state has that
    namespace's ``settings`` (``Settings.for_tenant``), database, log, spool and health, the
    engine's view bound to the policy (``PolicyEngine.view``) and the shared metrics as that
    policy sets them (``ServerMetrics.of_tenant_policy``).
    """

    settings: Settings
    engine: PolicyEngine
    log: LogTransport
    store: ServerStore
    metrics: ServerMetrics | TenantPolicyMetrics
    spool: Spool | None
    read_baseline: BaselineReader | None = None
    health: Health | None = None
    # The canary split of an engine serving adapters (None: every request gets the engine's version).
    canary: CanaryRouter | None = None
    policy: str = GLOBAL
    background: set[asyncio.Task] = field(default_factory=set)
    deferred_writes: set[asyncio.Task] = field(default_factory=set)
    # Where deferred writes are kept until done, so a restart does them (None: memory only).
    journal: WriteJournal | None = None
    # Appends wait for the log through short outages (up to 30 s each): they get threads of
    # their own, so waiting appends cannot take every thread of the loop's default executor
    # (rendering, database reads, health probes).
    log_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=64, thread_name_prefix="log-append")
    )
    # This policy's log lines start with its name (``acme: trajectory ... spooled``).
    logger: PolicyLog = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.logger = PolicyLog(log, self.policy)

    async def _in_log_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.log_pool, fn, *args)

    def dispatch(self, key: str | None = None) -> tuple[int, Arm | None]:
        """The version a new request is dispatched at and its canary arm (None: no split);
        ``key``: what the arm is sticky to (``core.lifecycle.arm_key``)."""
        if self.canary is None:
            return self.engine.version, None
        return self.canary.dispatch(key)

    async def require_storage(self) -> None:
        """Refuse (DatabaseUnavailable / LogUnavailable, answered 503) before any work while
        the database or the log is known to be down, or does not answer a probe now."""
        if self.health is not None:
            await asyncio.to_thread(self.health.require)

    def spawn(self, coro: Awaitable) -> None:
        """Run ``coro`` to completion even if the request that started it is cancelled."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _check_and_append(self, topic: str, key: str, payload: bytes) -> tuple[int, int]:
        self.log.check()
        return self.log.append(topic, key, payload)

    async def append(self, topic: str, key: str, payload: bytes) -> tuple[int, int]:
        """Append a record the caller can still refuse (feedback): a log known to be down, or
        not answering a probe, raises LogUnavailable with nothing sent."""
        t0 = time.perf_counter()
        try:
            return await self._in_log_pool(self._check_and_append, topic, key, payload)
        finally:
            self.metrics.log_append.labels(topic).observe(time.perf_counter() - t0)

    def _append(self, rec: TrajectoryRecord) -> tuple[int, int]:
        t0 = time.perf_counter()
        placed = self.log.append(
            TOPIC_TRAJECTORIES, rec.prompt_id, self.store.log_bytes(rec, self.log.keeps_records)
        )
        self.metrics.log_append.labels(TOPIC_TRAJECTORIES).observe(time.perf_counter() - t0)
        return placed

    async def persist_trajectory(self, rec: TrajectoryRecord) -> None:
        """Make ``rec`` durable in the log and index it for feedback.

        Append and index run as one unit in a shielded task: a client that disconnects while
        its record is being written cannot leave a logged record without its index row.
        Raises LogUnavailable when the log refused and records must not be kept locally
        (``log_required``): then the record is not in the log and never will be. Otherwise
        the record goes to the local spool, which re-sends it when the log is back. Once the
        log holds the record the answer stands: an index row the database refuses is written
        by a retrying task when the database is back.
        """
        await asyncio.shield(asyncio.ensure_future(self._persist(rec)))

    async def _persist(self, rec: TrajectoryRecord) -> None:
        try:
            part, off = await self._in_log_pool(self._append, rec)
        except Exception as exc:
            self.metrics.log_failures.labels(TOPIC_TRAJECTORIES).inc()
            if self.spool is None:
                raise LogUnavailable(str(exc)) from exc
            await asyncio.to_thread(self.spool.put, rec)
            self.metrics.spooled.inc()
            self.logger.warning("trajectory %s spooled: %s", rec.id, exc)
        else:
            try:
                await asyncio.to_thread(self.store.index_trajectory, rec, part, off)
            except Exception as exc:
                if not is_storage_error(exc):
                    self.logger.exception("trajectory %s logged but not indexed", rec.id)
                    raise
                self.logger.warning("trajectory %s logged, index row deferred: %s", rec.id, exc)
                await self._retry(DeferredWrite.INDEX_TRAJECTORY, rec.to_json().decode(), part, off)
        self.metrics.trajectories.labels(rec.finish_reason).inc()
        self.metrics.tokens.inc(len(rec.response_token_ids))
        tenant = self.metrics.tenant_label(rec.tenant)
        self.metrics.tenant_trajectories.labels(tenant, rec.finish_reason).inc()
        self.metrics.tenant_tokens.labels(tenant).inc(len(rec.response_token_ids))
        if is_whole_answer(rec.finish_reason):
            self.metrics.answered(answer_version(rec))

    async def mark_received(self, target: str, reward: float, feedback_id: str | None = None) -> None:
        """Record in the database that ``target``'s feedback is in the log. The log already
        holds it, so the answer is 202 whatever the database says: a refused write is kept in
        the journal before the answer and retried by a task until the database takes it, also
        after a restart (``_retry``)."""
        try:
            await asyncio.to_thread(self.store.mark_received, target, reward, feedback_id)
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            self.logger.warning("feedback %s logged, claim update deferred: %s", target, exc)
            await self._retry(DeferredWrite.MARK_RECEIVED, target, reward, feedback_id)

    async def release_turn(self, trajectory_id: str) -> None:
        """Free the number of an episode turn whose request failed before its record was logged
        (``ServerStore.release_turn``): the client was told it failed, so it may send that turn
        again. A refused write is retried by a task; meanwhile the turn counts as in flight
        (until ``server.store.TURN_TIMEOUT``). Whatever the log appends late for it is not one
        of the episode's turns: episode feedback lists the logged ones (``FeedbackRecord.turn_ids``)."""
        try:
            await asyncio.to_thread(self.store.release_turn, trajectory_id)
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            self.logger.warning("episode turn %s not released yet: %s", trajectory_id, exc)
            await self._retry(DeferredWrite.RELEASE_TURN, trajectory_id)

    async def _retry(self, kind: DeferredWrite, *args) -> None:
        """Defer the write ``kind(*args)`` (JSON arguments): kept in the journal first (before
        the caller answers), then retried by a task until the database takes it."""
        path = None
        if self.journal is not None:
            try:
                path = await asyncio.to_thread(self.journal.put, kind, list(args))
            except OSError as exc:
                self.logger.error(
                    "deferred write %s%r not journaled, kept in memory only: %s", kind, args[:1], exc
                )
        self._schedule(kind, list(args), path)

    def resume_deferred(self) -> int:
        """Schedule the journal's writes a restart interrupted (at start); returns how many."""
        if self.journal is None:
            return 0
        pending = self.journal.pending()
        for path, kind, args in pending:
            self._schedule(kind, args, path, wait=False)
        if pending:
            self.logger.warning("%d deferred database writes from before the restart resumed", len(pending))
        return len(pending)

    def _schedule(self, kind: DeferredWrite, args: list, path, wait: bool = True) -> None:
        task = asyncio.ensure_future(self._write_later(kind, args, path, wait))
        self.deferred_writes.add(task)
        task.add_done_callback(self.deferred_writes.discard)

    def _deferred_call(self, kind: DeferredWrite, args: list) -> None:
        """Do the write ``kind(*args)`` on the store (blocking)."""
        if kind is DeferredWrite.INDEX_TRAJECTORY:
            record, part, offset = args
            self.store.index_trajectory(TrajectoryRecord.model_validate_json(record), part, offset)
        elif kind is DeferredWrite.MARK_RECEIVED:
            self.store.mark_received(*args)
        else:
            self.store.release_turn(*args)

    async def _write_later(self, kind: DeferredWrite, args: list, path, wait: bool) -> None:
        """Retry a database write that follows a record already in the log until the database
        takes it, then drop it from the journal (cancelled at shutdown: the journal keeps it for
        the next start). ``wait``: wait ``DEFERRED_RETRY_S`` before the first try."""
        while True:
            if wait:
                await asyncio.sleep(DEFERRED_RETRY_S)
            wait = True
            try:
                await asyncio.to_thread(self._deferred_call, kind, args)
            except IntegrityError:
                break
            except Exception as exc:
                self.logger.debug("deferred write %s%r still refused: %s", kind, args[:1], exc)
                continue
            self.logger.info("deferred write %s%r done", kind, args[:1])
            break
        if path is not None:
            self.journal.done(path)
