"""``POST /v1/chat/completions``: OpenAI's chat completions, plain or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from core.keys import identity_of
from server.auth import caller_of
from server.chat import complete_chat, extension_headers, prepare_rollout, stream_chat
from server.errors import CHAT_PATH, ApiError, errors
from server.routes import state_of
from server.schemas import ChatCompletionRequest

router = APIRouter()

CHAT_200 = {
    200: {
        "description": "A chat.completion; with stream: true, chat.completion.chunk server-sent events",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected: the body has been read, so the next ASGI
    message is ``http.disconnect`` (the server sends it when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post(CHAT_PATH, responses=CHAT_200 | errors(400, 401, 403, 404, 408, 409, 413, 500, 503))
async def chat(req: ChatCompletionRequest, request: Request):
    s, caller = state_of(request), caller_of(request)
    try:
        rollout, sampling = await prepare_rollout(s, req, caller)
    except ApiError as exc:
        s.metrics.failed_before_generation.labels(exc.code or "invalid").inc()
        raise
    rollout.identity, rollout.tenant = identity_of(caller.key_id, req.user), caller.tenant
    if req.stream:
        return StreamingResponse(
            stream_chat(s, req, rollout, sampling),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **extension_headers(s, rollout)},
        )
    return await complete_chat(s, req, rollout, sampling, client_gone(request))
