"""Size bounds at the edge: the request body (413 before parsing) and the message text (400
before tokenising), both derived from the context length (DESIGN §8).

A prompt that fits the context is at most ``max_model_len`` tokens, and a token is at most
``MAX_TOKEN_BYTES`` bytes of UTF-8 (SmolLM2's longest token is 81 bytes; a test checks the
served vocabulary), so its text is at most ``max_model_len × MAX_TOKEN_BYTES`` characters. In
JSON a byte takes at most 6 bytes (``\\u00XX``), so such a body is at most ``max_model_len ×
MAX_TOKEN_BYTES × 6`` bytes plus the other fields (``BODY_SLACK_BYTES``). A larger request
cannot be served, and is refused before any work.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_TOKEN_BYTES = 128
JSON_BYTES_PER_BYTE = 6
BODY_SLACK_BYTES = 64 * 1024
# A refused body is read and dropped up to this size before the 413, so that a client still
# writing it receives the answer instead of a reset connection; a larger one is cut off.
DRAIN_MAX_BYTES = 64 * 1024 * 1024


def max_message_chars(max_model_len: int) -> int:
    """The most characters of message text a request that fits the context can hold."""
    return max_model_len * MAX_TOKEN_BYTES


def max_body_bytes(max_model_len: int) -> int:
    """The largest request body (bytes) the server reads; 2048 tokens → 1,638,400 bytes."""
    return max_model_len * MAX_TOKEN_BYTES * JSON_BYTES_PER_BYTE + BODY_SLACK_BYTES


class BodySizeLimit:
    """ASGI middleware: a body over ``max_bytes`` is answered 413 (OpenAI error shape) before
    any route parses it; only bodies within the bound are kept in memory and passed on."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > DRAIN_MAX_BYTES:
            await self._refuse(send)
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left before sending its body
            size += len(msg.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False) or size > DRAIN_MAX_BYTES:
                break
        if size > self.max_bytes:
            await self._refuse(send)
            return
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"request body is larger than {self.max_bytes} bytes, more than the "
                    "model's context can hold",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
