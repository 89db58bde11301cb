"""``POST /v1/feedback``: a reward for a completion or an episode (``server.feedback``), in the
namespace of the policy that serves the caller."""

from __future__ import annotations

from fastapi import APIRouter, Request

from core import logs, telemetry
from core.claims import episode_key
from server.auth import caller_of, served_state
from server.errors import FEEDBACK_PATH, errors
from server.feedback.protocol import FeedbackAccepted, FeedbackRequest
from server.feedback.serving import accept_feedback

router = APIRouter()


@router.post(FEEDBACK_PATH, status_code=202, responses=errors(400, 401, 403, 404, 408, 409, 413, 422, 503))
async def feedback(body: FeedbackRequest, request: Request) -> FeedbackAccepted:
    """Feedback in the namespace of the policy that serves the caller (``server.auth.served_state``):
    a completion or episode of another policy is not found there (404)."""
    s = served_state(request)
    logs.bind_here(trajectory_id=body.id)
    # In the rated trajectory's trace, an episode's in the trace of its sample's id (core.telemetry).
    with telemetry.trajectory_span("feedback", body.id or episode_key(body.episode_id), reward=body.reward):
        accepted = await accept_feedback(s, body)
    s.metrics.tenant_feedback.labels(s.metrics.tenant_label(caller_of(request).tenant)).inc()
    return accepted
