"""``POST /v1/chat/completions``: OpenAI's chat completions, plain or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel

from server.auth import caller_of
from server.backpressure import THROTTLED, Throttled
from server.chat.protocol import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from server.chat.serving import ChatHandler
from server.errors import CHAT_PATH, errors
from server.schemas import ErrorResponse
from server.scope import state_of

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


def handler_of(request: Request) -> ChatHandler:
    """The ``ChatHandler`` of the policy that serves the caller (``server.auth.Caller.policy``),
    built in the lifespan: the global policy's, or a tenant policy's (``app.state.tenant_chats``).
    A tenant policy removed since the caller was authenticated (``server.app.TenantPolicySync``):
    the global policy's, as for the tenant's next request."""
    policy = caller_of(request).policy
    return request.app.state.tenant_chats.get(policy, request.app.state.chat)


@router.post(
    CHAT_PATH,
    response_model=ChatCompletion,
    responses=CHAT_200 | errors(400, 401, 403, 404, 408, 409, 413, 429, 500, 503),
)
async def chat(req: ChatCompletionRequest, request: Request):
    """OpenAI's chat completion: one ``chat.completion``, or with ``stream: true`` server-sent
    ``chat.completion.chunk`` events; each answer is recorded as one trajectory before its last
    byte (``server.chat.serving.ChatHandler.answer``). A request over a limit is 429 before anything is
    prepared (``server.backpressure``); an admitted one holds its slots until its answer is sent."""
    caller = caller_of(request)
    try:
        lease = request.app.state.backpressure.admit(caller.key_id, caller.tenant)
    except Throttled as exc:
        metrics = state_of(request).metrics
        metrics.throttled.labels(metrics.tenant_label(caller.tenant), exc.limit.value).inc()
        metrics.failed_before_generation.labels(THROTTLED).inc()
        raise
    try:
        answer = await handler_of(request).answer(req, caller, lambda: client_gone(request))
    except BaseException:
        lease.release()
        raise
    return lease.hold(answer)
