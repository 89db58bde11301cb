"""The fate of one chat request's trajectory, decided in one place.

Every chat request that passed its checks (``server.chat.serving.ChatHandler.prepare``) ends in exactly one
of three ways, and ``Fate`` is the only code that writes its trajectory record or frees its
episode turn (docs/design.md §3 step 3, §8 "a 503 means not recorded and never will be"):

- answered: the whole answer's record is written before the client gets its last byte
  (``requests{outcome=ok}``); a log that refuses it makes the answer a 503 and frees the turn
  (``log_unavailable``);
- aborted: the client left; the tokens so far are written with finish reason ``abort``, in the
  background (``aborted``);
- failed: the engine broke off; the tokens so far are written with finish reason ``error``, or
  with none sampled there is no record (``engine_error``, and
  ``failed_before_generation{engine_error}``).

An aborted or failed request's client got no answer, so its episode turn is freed in every case:
the client may send that turn again, and its retry is the turn the episode's feedback lists and
the learner joins (``FeedbackRecord.turn_ids``). The aborted or failed record is still logged,
exactly once, with its episode id and turn number, but holds no turn of its episode
(``server.store.UNANSWERED_FINISHES``; the learner counts it ``void_episode_turns`` when the
episode joins). The turn is freed before the record is written, so a retry need not wait for the
log; the index of the record frees it too, should the database take that write first.

Records written in the background never raise into a task nobody awaits: a refusal is logged.
"""

from __future__ import annotations

import logging
import time

from core import logs, telemetry
from core.logbus import LogUnavailable
from core.records import TrajectoryRecord
from server.rollout import Rollout
from server.state import ServerState

log = logging.getLogger(__name__)


class Fate:
    """The one settlement of a chat request: ``answered``, ``aborted`` or ``failed``, exactly one
    of them, once (a second raises RuntimeError: two records, or a record and a freed turn, for
    one request). Created once the rollout is prepared (its episode turn taken); ``stream``
    labels the request metrics (``"true"``/``"false"``), and the latency runs from creation.
    ``outcome``: the ``requests`` metric's outcome label, None until settled.

    ``left`` ends every request: one that leaves unsettled is logged and settled as aborted, so
    it still has its one record.
    """

    def __init__(self, s: ServerState, rollout: Rollout, stream: bool) -> None:
        self.s, self.rollout, self.stream_label = s, rollout, "true" if stream else "false"
        self.outcome: str | None = None
        self.t0 = time.perf_counter()
        # The request's lines and its span carry its trajectory id (core.logs, core.telemetry).
        ids = dict(prompt_id=rollout.prompt_id, version=rollout.dispatch_version, tenant=rollout.tenant)
        logs.bind_here(trajectory_id=rollout.id, **ids)
        self.span = telemetry.start_trajectory_span("chat", rollout.id, stream=stream, **ids)

    @property
    def settled(self) -> bool:
        return self.outcome is not None

    def _settle(self, outcome: str) -> None:
        if self.outcome is not None:
            raise RuntimeError(
                f"chat request {self.rollout.id} settled twice: {self.outcome}, then {outcome}"
            )
        self.outcome = outcome

    async def answered(self) -> TrajectoryRecord:
        """Write the whole answer's record and return it; the answer may be given once this
        returns (the record is in the log, or spooled to be). Settled as ``ok`` before the
        write starts: whatever fails after this is no generation failure.

        Raises:
            LogUnavailable: the log refused the record and none is kept locally; counted
                ``log_unavailable`` and the episode turn freed (the answer must be a 503).
            Exception: any other failure of the write propagates uncounted (the record may be in
                the log: the turn is not freed).
        """
        rec = self.rollout.record()
        self._settle("ok")
        try:
            with telemetry.child_span(self.span, "log.append", tokens=len(rec.response_token_ids)):
                await self.s.persist_trajectory(rec)
        except LogUnavailable as exc:
            log.warning("trajectory %s not recorded: %s", rec.id, exc)
            self.outcome = "log_unavailable"
            self._count()
            self._free_turn()
            raise
        self._count()
        self.s.metrics.latency.observe(time.perf_counter() - self.t0)
        return rec

    def aborted(self) -> None:
        """The client left before the answer was whole: its episode turn is freed and the
        tokens so far (maybe none) are written with finish reason ``abort``, in the background."""
        self._settle("aborted")
        log.info("client of %s left after %d tokens: aborted", self.rollout.id, len(self.rollout.token_ids))
        self._count()
        self._write_in_background("abort")

    def failed(self) -> None:
        """The engine broke off the generation (the caller logs why): the episode turn is freed,
        and the tokens so far are written with finish reason ``error``; with none sampled nothing
        is written."""
        self._settle("engine_error")
        self._count()
        if self.rollout.token_ids:
            self._write_in_background("error")
        else:
            self.s.metrics.failed_before_generation.labels("engine_error").inc()
            self._free_turn()

    def left(self) -> None:
        """The request's answer has ended. Unsettled here (a stream whose client left before its
        first chunk, or a handler that missed a path), it is logged and settled as aborted."""
        if self.outcome is None:
            log.warning("chat request %s ended unsettled: recorded as aborted", self.rollout.id)
            self.aborted()
        if self.span is not None:
            self.span.set_attribute("saoserve.outcome", self.outcome)
            self.span.end()
            self.span = None

    def _count(self) -> None:
        self.s.metrics.requests.labels(self.stream_label, self.outcome).inc()

    def _free_turn(self) -> None:
        # In a task of its own: a client that left cannot cancel it.
        if self.rollout.episode_id is not None:
            self.s.spawn(self.s.release_turn(self.rollout.id))

    def _write_in_background(self, finish_reason: str) -> None:
        self.s.spawn(self._free_and_write(self.rollout.record(finish_reason)))

    async def _free_and_write(self, rec: TrajectoryRecord) -> None:
        """Free the episode turn of a record whose client got no answer, then write the record
        (one task: the release goes first, so the turn can be sent again while the log is slow)."""
        if rec.episode_id is not None:
            try:
                await self.s.release_turn(rec.id)
            except Exception:
                # The record is written all the same; its index frees the turn too.
                log.exception("could not free the episode turn of %s", rec.id)
        try:
            await self.s.persist_trajectory(rec)
        except Exception:
            log.exception("could not persist trajectory %s", rec.id)
