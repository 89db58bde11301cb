"""Follow the ``policy`` topic and hot-swap to each newly published version.

Every server replica reads the whole topic itself (no consumer group), so N replicas all
swap. Versions only go forward: a rollback is a new version with an old version's weights, so
each read serves the highest version it holds, and an event below the version served is stale:
ignored, counted (``saoserve_policy_swaps_total{result="stale"}``) and logged once per version.
Policy events share one key, so they share one partition and have one order.

Readiness (``readiness``, part ``policy`` of ``/readyz``): a replica that starts or restarts
reads the whole topic before it listens (``catch_up``), then loads the newest version in the
background, so ``/readyz`` can say what it waits for: 503 ``catching up: serves version 0, the
policy topic's newest is 5`` until the swap ends, and chats are refused (``require``) until
then, so no answer comes from a version older than one this deployment already served. A
replica that could not read the topic at start (the log down) starts anyway and catches up
when the log answers. Once caught up, a swap under way keeps the replica ready (every replica
swaps at once, and taking them all out would be an outage); a swap refused leaves it 503
``behind`` until a later version loads, or, for a version refused only because its policy's
adapter slots were all taken (``server.engine.types.SlotsTaken``), until that version loads: it is
tried again at every poll, so the replica is ready again by itself once a slot frees (issue 40).
docs/reliability.md, "Replicas that restart".

While the log is down, each failed read is one warning line (its traceback only on the
first failure of an outage), and the watcher waits longer between reads, doubling from
``poll_s`` up to ``MAX_BACKOFF_S``; the first read that works logs the recovery and resets it.

Stage events (``PolicyEvent.kind == "stage"``: a version promoted or rejected after it was
announced) are never loaded: once caught up, each is logged (version, stage, actor) and counted
(``saoserve_policy_stage_events_total{stage}``); those read at start are history, not logged.
Every ``rejected`` notice, at start or later, takes its version out of what this replica will
load: a replica that restarts after an operator rejected the newest version (and before the
learner published the restore) catches up to the newest version not rejected, never to it.
Version 0, the base, is never rejected (``core.lifecycle``): a notice saying so is ignored.

A replica of full weights (or merged adapters) serving a version when its rejection arrives
leaves it at once by the same rule (issue 40, item 3): it swaps back to the newest published
version below it not rejected, the next one down when a swap is refused (a folder pruned), else
the base weights (version 0), without waiting for the learner's restore version, so an
operator's reject works with the learner down, and running and restarting replicas agree. When
the whole lineage is rejected (the guard's verdict, or an operator's reject of its first
version, which takes its descendants) that is the promoted version, the control; a rejection of
a later member leaves the lineage's older versions, which serve on probation as before. This is
the one exception to "versions only go forward", and the next version published (the learner's
restore) is served as usual. Its requests meanwhile: those in flight finish under the weights
swapped in (a second version span), new ones are served by them once the swap ends, a poll
(``policy_poll_s``) plus a swap after the notice. A replica that cannot leave (every version
below refused, the base weights unreadable) serves on, logs an error once and answers 503
``serves rejected version N`` at ``/readyz``. An engine serving adapters as LoRA leaves a
rejected version by its router instead (``server.canary``: each request sent to the promoted
version held beside it). docs/guard.md, "Rejecting a version".

Each swap sets ``saoserve_policy_version`` and ``saoserve_policy_swapped_at_seconds`` (Unix
time the version started serving) together, so the delay from a policy event's ``created_at``
to each replica serving it can be read from the replicas' ``/metrics``
(tests/system/test_replicas.py, bench/bench_replica_swap.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from core import logs, telemetry
from core.breaker import Unavailable
from core.lifecycle import Stage
from core.logbus import LogTransport
from core.policies import GLOBAL
from core.records import TOPIC_POLICY, PolicyEvent, utcnow
from core.weights import weights_sha256
from server.engine import PolicyEngine, SlotsTaken, SwapRefused
from server.metrics import ServerMetrics, TenantPolicyMetrics
from server.policy_log import PolicyLog

log = logging.getLogger(__name__)

# Longest wait (s) between reads of a policy topic that keeps failing.
MAX_BACKOFF_S = 10.0
# How long (s) a partition's first read of a turn waits for a new event (it returns on one).
READ_WAIT_S = 0.2


class CatchingUp(Unavailable):
    """This replica has not yet served the newest version of the policy topic it found at start
    (503 ``not_ready``: another replica, or this one in a moment, answers)."""


class PolicyWatcher:
    """The watcher of one policy's topic: ``policy`` (``core.policies.GLOBAL`` or a tenant)
    starts each of its log lines (``acme: policy version 3 refused: ...``)."""

    def __init__(
        self,
        log_transport: LogTransport,
        engine: PolicyEngine,
        metrics: ServerMetrics | TenantPolicyMetrics,
        poll_s: float,
        policy: str = GLOBAL,
    ):
        self.log = log_transport
        self.logger = PolicyLog(log, policy)
        self.policy = policy
        self.engine = engine
        self.metrics = metrics
        self.poll_s = poll_s
        self.offsets: dict[int, int] = {}
        self.failures = 0  # consecutive failed reads (0: the log answers)
        self._ignored: set[int] = set()  # older versions already logged as ignored
        self.published: dict[int, PolicyEvent] = {}  # every version the topic announced
        self.read_once = False  # the topic was read to its end at least once
        self.caught_up = False  # ...and the newest version found then (or a later one) serves
        self.swapping: int | None = None  # the version being loaded now
        self.refused: int | None = None  # the last version whose swap was refused
        self._pending: PolicyEvent | None = None  # found by catch_up, loaded by run
        self.rejected: set[int] = set()  # versions a stage notice said are rejected
        self._waiting: PolicyEvent | None = None  # refused for lack of a slot: tried again each poll
        self.stranded: int | None = None  # a rejected version served that could not be left

    @property
    def newest(self) -> int | None:
        """The highest version the topic announced that is not rejected (None: none)."""
        return max((v for v in self.published if v not in self.rejected), default=None)

    async def _read_new(self) -> list[PolicyEvent]:
        """The events after the last read, oldest first; the offsets move only when the whole
        read succeeds (a read cut by an outage is read again, not lost)."""
        events: list[tuple[object, PolicyEvent]] = []
        offsets = dict(self.offsets)
        parts = await asyncio.to_thread(self.log.partitions, TOPIC_POLICY)
        for p in parts:
            wait_s = READ_WAIT_S
            while True:
                batch = await asyncio.to_thread(
                    self.log.read, TOPIC_POLICY, p, offsets.get(p, 0), 500, wait_s
                )
                if not batch:
                    break
                # The rest of what is there, without waiting for more: a read that waited for
                # nothing would delay the swap of the version just found.
                wait_s = 0.0
                for e in batch:
                    try:
                        events.append((e.offset, PolicyEvent.model_validate_json(e.value)))
                    except ValueError:
                        self.logger.error("ignoring malformed policy event at %s/%d", p, e.offset)
                offsets[p] = batch[-1].offset + 1
        self.offsets = offsets
        return [ev for _, ev in sorted(events, key=lambda x: (x[1].created_at, x[0]))]

    def _publishes(self, events: list[PolicyEvent], live: bool) -> list[PolicyEvent]:
        """The events of a read that publish a version; the stage events among them are logged
        and counted when ``live`` (after the start's catch-up), never served."""
        out = []
        for e in events:
            if e.kind == "publish":
                self.published[e.version] = e
                if e.lifecycle == Stage.REJECTED and e.version != 0:
                    # Never announced so by the learner (a bug or a forgery): out of ``newest``,
                    # so catch_up does not wait for a version apply refuses.
                    self.rejected.add(e.version)
                out.append(e)
                continue
            if e.lifecycle == Stage.REJECTED and e.version != 0:
                self.rejected.add(e.version)
            if live:
                stage = e.lifecycle if e.lifecycle in set(Stage) else "other"
                self.metrics.stage_events.labels(stage).inc()
                self.logger.info(
                    "policy version %d is now %s (by %s)", e.version, stage, e.actor or "unknown"
                )
        return [e for e in out if e.version not in self.rejected]

    def _ignore(self, event: PolicyEvent) -> None:
        """Count a stale event (below the version served); log it once per version."""
        self.metrics.swaps.labels("stale").inc()
        if event.version not in self._ignored:
            self._ignored.add(event.version)
            self.logger.warning(
                "policy event for version %d ignored: version %d serves and versions only go forward",
                event.version,
                self.engine.version,
            )

    def _select(self, events: list[PolicyEvent]) -> PolicyEvent | None:
        """The event of one read to serve: the highest version, if it is not served already.
        Every event below the version served is ignored as stale."""
        for e in events:
            if e.version < self.engine.version:
                self._ignore(e)
        best = max(events, key=lambda e: (e.version, e.created_at), default=None)
        if best is None:
            return None
        if best.version < self.engine.version:
            return None
        if best.version == self.engine.version and Path(best.path) == self.engine.path:
            return None
        return best

    async def apply(self, event: PolicyEvent, measure: bool = True, retry: bool = False) -> bool:
        """Swap to ``event``'s version unless it serves already; True if swapped. ``measure``
        starts feedback→served for it (not at start-up, which would measure the start).
        ``retry``: a version refused for lack of a slot, tried again (its refusal was counted and
        logged once)."""
        if event.lifecycle == "rejected" or event.version in self.rejected:
            # A rejected version never serves (core/lifecycle.py); the learner never announces
            # one as rejected, so such an event is a bug, a forgery, or one rejected since.
            self.logger.error("policy event for version %d ignored: it is rejected", event.version)
            return False
        if event.version == self.engine.version and Path(event.path) == self.engine.path:
            return False
        if event.version < self.engine.version:
            self._ignore(event)
            return False
        self.swapping = event.version
        # In the version's trace, beside the learner's step that made it (core.telemetry).
        with (
            telemetry.version_span("server.swap", event.version, self.policy),
            logs.bind(version=event.version, policy=self.policy),
        ):
            try:
                res = await self.engine.swap(event.version, Path(event.path), event.sha256)
            except SwapRefused as exc:
                self.refused = event.version
                # Refused for a slot: tried again at each poll until a slot frees (issue 40).
                self._waiting = event if isinstance(exc, SlotsTaken) else None
                if not retry:
                    self.metrics.swaps.labels("refused").inc()
                    later = " (tried again when a slot frees)" if self._waiting is not None else ""
                    self.logger.error("policy version %d refused%s: %s", event.version, later, exc)
                telemetry.note(result="refused")
                return False
            finally:
                self.swapping = None
            telemetry.note(result="ok", paused_s=res.paused_seconds, seconds=res.seconds)
        self._waiting = None
        if self.refused == event.version:
            self.refused = None
            self.logger.info("policy version %d loaded after its refusal", event.version)
        self.metrics.swapped(res)
        if measure:
            self.metrics.awaiting_answer(res.version, event.metrics.get("batch_completed_at"))
        return True

    async def catch_up(self) -> None:
        """At start, before the server listens: read every published event. If none is newer
        than the version served, the replica is caught up (and
        ``saoserve_policy_swapped_at_seconds`` is now); else ``run`` loads the newest first,
        while ``/readyz`` says so. A read that fails is retried by ``run``."""
        try:
            events = await self._read_new()
        except Exception as exc:
            self.failed(exc)
            return
        self._read_through()
        self._pending = self._select(self._publishes(events, live=False))
        if self._pending is None:
            self.caught_up = True
            self.metrics.serving(self.engine.version)

    def _read_through(self) -> None:
        self.read_once = True
        if self.failures:
            self.logger.info(
                "policy watcher: the policy topic answers again after %d failed reads", self.failures
            )
            self.failures = 0

    async def poll(self) -> None:
        """One turn of ``run``: read the new events (or take the one ``catch_up`` found) and
        serve the highest version. Raises what the read raises."""
        if self._pending is not None:
            target, self._pending = self._pending, None
        else:
            events = await self._read_new()
            first = not self.read_once
            self._read_through()
            target = self._select(self._publishes(events, live=not first))
            if first and target is None:
                self.caught_up = True
                self.metrics.serving(self.engine.version)
        retry = False
        if target is None and self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            if waiting.version > self.engine.version and waiting.version not in self.rejected:
                target, retry = waiting, True
        if target is not None and await self.apply(target, measure=self.caught_up, retry=retry):
            self.caught_up = True
        if self.read_once:
            await self.leave_rejected()

    async def _restore_target(self, refused: dict[int, str]) -> tuple[PolicyEvent | None, str]:
        """Where a replica serving a rejected version goes: the newest published version below
        it that is not rejected and not in ``refused`` (version → why its swap was refused), else
        the base weights (version 0, ``model_dir``, checksummed here); else None and why (every
        refusal, then the base's)."""
        served = self.engine.version
        below = [v for v in self.published if v < served and v not in self.rejected and v not in refused]
        if below:
            return self.published[max(below)], ""
        tried = "".join(f"version {v} was refused: {why}; " for v, why in refused.items())
        if 0 in refused:
            return None, tried.removesuffix("; ")
        base = Path(self.engine.model_dir)
        try:
            sha = await asyncio.to_thread(weights_sha256, base)
        except OSError as exc:
            return None, f"{tried}the base weights cannot be read: {exc}"
        return PolicyEvent(version=0, path=str(base), sha256=sha, created_at=utcnow()), ""

    async def leave_rejected(self) -> None:
        """Swap a replica of full weights (or merged adapters) off a rejected version it serves
        (module docstring) to ``_restore_target``'s version, logged as a warning, trying the next
        one down when a swap is refused (a folder pruned); when none is left, an error logged
        once and ``/readyz`` 503 until a version not rejected serves."""
        served = self.engine.version
        if self.engine.adapters is not None or served not in self.rejected or self.stranded == served:
            return
        refused: dict[int, str] = {}
        while True:
            target, why = await self._restore_target(refused)
            if target is None:
                break
            self.logger.warning(
                "policy version %d is rejected: swapping back to version %d (the newest not rejected) "
                "until a newer version is published",
                served,
                target.version,
            )
            self.swapping = target.version
            try:
                res = await self.engine.swap(target.version, Path(target.path), target.sha256)
            except SwapRefused as exc:
                refused[target.version] = str(exc)
            else:
                self.metrics.swapped(res)
                return
            finally:
                self.swapping = None
        self.stranded = served
        self.metrics.swaps.labels("refused").inc()
        self.logger.error("policy version %d is rejected and still serves: %s", served, why)

    def readiness(self) -> str:
        """``"ok"``, or why this replica must not take traffic (``/readyz``'s ``policy``)."""
        served = self.engine.version
        if self.stranded is not None and self.stranded == served:
            return f"serves rejected version {served}: nothing else could be loaded (see the server's log)"
        if not self.read_once:
            return f"catching up: the policy topic has not been read yet (serves version {served})"
        behind = self.newest is not None and self.newest > served
        if self.caught_up and (not behind or self.swapping == self.newest):
            return "ok"
        gap = f"serves version {served}, the policy topic's newest is {self.newest}"
        refused = " (its swap was refused; see the server's log)" if self.refused == self.newest else ""
        return f"{'behind' if self.caught_up else 'catching up'}: {gap}{refused}"

    def require(self) -> None:
        """Raise CatchingUp until the newest version found at start serves (a chat then would
        be answered by an older version than the deployment already served)."""
        if not self.caught_up:
            raise CatchingUp(f"this replica is {self.readiness()}")

    def delay_s(self) -> float:
        """Seconds until the next read: ``poll_s``, doubled for each consecutive failure up to
        ``MAX_BACKOFF_S`` (never below ``poll_s``)."""
        if not self.failures:
            return self.poll_s
        return max(self.poll_s, min(MAX_BACKOFF_S, self.poll_s * 2.0 ** min(self.failures, 32)))

    def failed(self, exc: Exception) -> None:
        """Count a failed read and log it: one line, the traceback only on an outage's first."""
        self.failures += 1
        self.logger.warning(
            "policy watcher: reading the policy topic failed (%d in a row; next try in %.1f s): %s: %s",
            self.failures,
            self.delay_s(),
            exc.__class__.__name__,
            exc,
            exc_info=exc if self.failures == 1 else None,
        )

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failed(exc)
            await asyncio.sleep(self.delay_s())
