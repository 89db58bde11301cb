"""Feedback for a completion or an episode: check it, take its first-wins claim, append it to
the log, mark the claim received (docs/design.md §4). Routing is ``server.feedback.api_router``'s; this is
what happens to the database and the log, in this order."""

from __future__ import annotations

import asyncio
import logging
import uuid

from core.claims import episode_key, episode_token_subject, trajectory_target
from core.logbus import LogUnavailable
from core.records import TOPIC_FEEDBACK, FeedbackRecord, check_feedback_token, is_whole_answer, utcnow
from server.errors import ApiError
from server.feedback.protocol import FeedbackAccepted, FeedbackRequest
from server.state import ServerState

log = logging.getLogger(__name__)


def not_whole(what: str) -> ApiError:
    """Feedback on an answer that is not whole: refused, never trained as an answer (docs/design.md §8)."""
    return ApiError(409, f"{what}: not a whole answer, feedback refused", code="not_a_whole_answer")


async def accept_feedback(s: ServerState, body: FeedbackRequest) -> FeedbackAccepted:
    """Log ``body``'s reward once for its completion or episode.

    Raises ApiError: 404 unknown completion or episode, 403 a token that does not match,
    409 a completion that is a turn of an episode (``rate_the_episode``: an episode is rated as
    a whole, so no turn's reward counts twice), already rated (first wins), not a whole answer,
    or an episode turn still in flight, 503 when the log refused (the claim is released: a
    record the log appends anyway, late, is void, since its claim is never marked received with
    its id). Once the log holds the record the answer is accepted, whatever the database then
    says (``mark_received``). Episode feedback lists the episode's logged turns
    (``FeedbackRecord.turn_ids``), the only ones the learner joins with it.
    """
    if body.id is not None:
        traj = await asyncio.to_thread(s.store.find_trajectory, body.id)
        if traj is None:
            s.metrics.feedback.labels("unknown").inc()
            raise ApiError(404, f"no completion with id {body.id!r}", code="not_found", param="id")
        subject, prompt_id, target = body.id, traj.prompt_id, trajectory_target(body.id)
        what = f"completion {body.id!r}"
    else:
        prompt_id = await asyncio.to_thread(s.store.episode_prompt_id, body.episode_id)
        if prompt_id is None:
            s.metrics.feedback.labels("unknown").inc()
            raise ApiError(
                404, f"no episode with id {body.episode_id!r}", code="not_found", param="episode_id"
            )
        subject, target = episode_token_subject(body.episode_id), episode_key(body.episode_id)
        what = f"episode {body.episode_id!r}"
    if not check_feedback_token(s.settings.feedback_secret, subject, body.feedback_token):
        s.metrics.feedback.labels("bad_token").inc()
        raise ApiError(
            403,
            f"feedback_token does not match {what}"
            + (" (an episode is rated with its episode_feedback_token)" if body.episode_id else ""),
            "permission_error",
            param="feedback_token",
        )
    if body.id is not None and traj.episode_id is not None:
        s.metrics.feedback.labels("episode_turn").inc()
        raise ApiError(
            409,
            f"{what} is turn {traj.turn} of episode {traj.episode_id!r}: an episode is rated as a "
            "whole, with episode_id and its episode_feedback_token, never turn by turn",
            param="id",
            code="rate_the_episode",
        )
    if body.id is not None and not is_whole_answer(traj.finish_reason):
        s.metrics.feedback.labels("not_whole").inc()
        raise not_whole(f"{what} ended with finish_reason {traj.finish_reason!r}")
    feedback_id = str(uuid.uuid4())
    if not await asyncio.to_thread(s.store.claim, target, feedback_id):
        s.metrics.feedback.labels("duplicate").inc()
        raise ApiError(409, f"feedback was already given for {what} (first wins)", code="conflict")
    turn_ids = None
    if body.episode_id is not None:
        # Read after the claim is taken: a turn dispatched from now on sees the claim and is
        # refused, so no turn can join the episode unseen (ServerStore.start_episode_turn).
        ep = await asyncio.to_thread(s.store.episode_state, body.episode_id)
        if ep.turns_in_flight or ep.not_whole_turns:
            await asyncio.to_thread(s.store.release, target, feedback_id)
        if ep.turns_in_flight:
            s.metrics.feedback.labels("episode_in_progress").inc()
            raise ApiError(
                409,
                f"{what} has a turn in progress; rate it once its last answer is whole",
                param="episode_id",
                code="episode_in_progress",
            )
        if ep.not_whole_turns:
            s.metrics.feedback.labels("not_whole").inc()
            raise not_whole(f"{what} has {ep.not_whole_turns} answered turn(s) that did not end whole")
        turn_ids = list(ep.turn_ids)
    rec = FeedbackRecord(
        trajectory_id=body.id,
        episode_id=body.episode_id if body.id is None else None,
        prompt_id=prompt_id,
        reward=body.value,
        source=body.source,
        received_at=utcnow(),
        feedback_id=feedback_id,
        turn_ids=turn_ids,
    )
    try:
        await s.append(TOPIC_FEEDBACK, prompt_id, rec.to_json())
    except LogUnavailable as exc:
        log.warning("feedback for %s not logged: %s", target, exc)
        await asyncio.to_thread(s.store.release, target, feedback_id)
        s.metrics.log_failures.labels(TOPIC_FEEDBACK).inc()
        s.metrics.feedback.labels("log_unavailable").inc()
        raise ApiError(
            503,
            f"feedback log unavailable, the feedback was not recorded ({exc.__class__.__name__}); retry later",
            "server_error",
            code="storage_unavailable",
        ) from exc
    await s.mark_received(target, rec.reward, rec.feedback_id)
    s.metrics.feedback.labels("accepted").inc()
    return FeedbackAccepted(target=target, reward=rec.reward)
