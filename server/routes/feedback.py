"""``POST /v1/feedback``: a reward for a completion or an episode (``server.feedback``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.auth import caller_of
from server.errors import FEEDBACK_PATH, errors
from server.feedback import accept_feedback
from server.responses import FeedbackAccepted
from server.routes import state_of
from server.schemas import FeedbackRequest

router = APIRouter()


@router.post(FEEDBACK_PATH, status_code=202, responses=errors(400, 401, 403, 404, 408, 409, 413, 422, 503))
async def feedback(body: FeedbackRequest, request: Request) -> FeedbackAccepted:
    s = state_of(request)
    accepted = await accept_feedback(s, body)
    s.metrics.tenant_feedback.labels(s.metrics.tenant_label(caller_of(request).tenant)).inc()
    return accepted
