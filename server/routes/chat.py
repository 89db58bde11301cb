"""``POST /v1/chat/completions``: OpenAI's chat completions, plain or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from core.keys import identity_of
from server.auth import caller_of
from server.chat import complete_chat, prepare_rollout, stream_chat
from server.errors import CHAT_PATH, ApiError, errors
from server.fate import Fate
from server.routes import state_of
from server.schemas import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ErrorResponse

router = APIRouter()


def self_contained(model: type[BaseModel]) -> dict:
    """``model``'s JSON Schema as answered, each reference to its ``$defs`` replaced by the
    definition: a schema that holds outside the document's components (the chat models hold no
    cycle)."""
    schema = model.model_json_schema(mode="serialization")
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return inline(schema)


# One server-sent event of a stream (OpenAPI 3.1 has a text/event-stream schema describe each
# event, as schemathesis reads it): its data a chunk, the error that ends a stream, or [DONE].
CHUNK_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "anyOf": [
                {"const": "[DONE]"},
                {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {
                        "anyOf": [self_contained(ChatCompletionChunk), self_contained(ErrorResponse)]
                    },
                },
            ]
        }
    },
}
CHAT_200 = {
    200: {
        "description": "A chat.completion; with stream: true, chat.completion.chunk server-sent events "
        "ending with data: [DONE] (or with one error event)",
        "content": {"text/event-stream": {"schema": CHUNK_EVENT}},
    }
}


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected: the body has been read, so the next ASGI
    message is ``http.disconnect`` (the server sends it when the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post(
    CHAT_PATH,
    response_model=ChatCompletion,
    responses=CHAT_200 | errors(400, 401, 403, 404, 408, 409, 413, 500, 503),
)
async def chat(req: ChatCompletionRequest, request: Request):
    """Every request that passes ``prepare_rollout`` has a ``Fate``, and leaves through
    ``Fate.left`` (here, or when its stream ends)."""
    s, caller = state_of(request), caller_of(request)
    try:
        rollout, sampling = await prepare_rollout(s, req, caller)
    except ApiError as exc:
        s.metrics.failed_before_generation.labels(exc.code or "invalid").inc()
        raise
    rollout.identity, rollout.tenant = identity_of(caller.key_id, req.user), caller.tenant
    fate = Fate(s, rollout, stream=req.stream)
    if req.stream:
        return stream_chat(s, req, fate, sampling)
    try:
        return await complete_chat(s, req, fate, sampling, client_gone(request))
    finally:
        fate.left()
