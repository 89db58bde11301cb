"""The request at the edge, before any route (docs/design.md §8): the time its headers take to arrive
(``header_timeout_protocol``, under uvicorn), and its body's size (413 before parsing), the time
it takes to arrive (408) and its syntax (400 unless a JSON object); and the message text's size
(400 before tokenising). Both sizes derive from the context length.

A prompt that fits the context is at most ``max_model_len`` tokens, and a token is at most
``MAX_TOKEN_BYTES`` bytes of UTF-8 (SmolLM2's longest token is 81 bytes; a test checks the
served vocabulary), so its text is at most ``max_model_len × MAX_TOKEN_BYTES`` characters. In
JSON a byte takes at most 6 bytes (``\\u00XX``), so such a body is at most ``max_model_len ×
MAX_TOKEN_BYTES × 6`` bytes plus the other fields (``BODY_SLACK_BYTES``). A larger request
cannot be served, and is refused before any work.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_TOKEN_BYTES = 128
JSON_BYTES_PER_BYTE = 6
BODY_SLACK_BYTES = 64 * 1024
# A refused body is read and dropped up to this size before the 413, so that a client still
# writing it receives the answer instead of a reset connection; a larger one is cut off.
DRAIN_MAX_BYTES = 64 * 1024 * 1024
# Seconds a client has, once its headers are in, to send its whole body (``Settings``'
# ``body_read_timeout_s``): a client that trickles it (slowloris) is answered 408 and cut off
# instead of holding a connection and a task for ever.
DEFAULT_BODY_READ_TIMEOUT_S = 30.0


def max_message_chars(max_model_len: int) -> int:
    """The most characters of message text a request that fits the context can hold."""
    return max_model_len * MAX_TOKEN_BYTES


def max_body_bytes(max_model_len: int) -> int:
    """The largest request body (bytes) the server reads; 2048 tokens → 1,638,400 bytes."""
    return max_model_len * MAX_TOKEN_BYTES * JSON_BYTES_PER_BYTE + BODY_SLACK_BYTES


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP protocol (``uvicorn.run(..., http=...)``) with a deadline for each request's
    headers: ``timeout_s`` from the connection's start, or from the previous response's end on a
    kept-alive connection. uvicorn has none, so a client that connects and sends nothing, or its
    headers a byte at a time, would hold the connection for ever; past the deadline it is
    answered 408 and closed. The body's deadline is ``BodySizeLimit``'s.
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    body = json.dumps(
        {
            "error": {
                "message": f"request headers not received within {timeout_s:g} s",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    late = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
        + body
    )

    class HeaderTimeout(AutoHTTPProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = asyncio.get_running_loop().call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.write(late)
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete: its cycle started
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Waiting for the next request's headers (a pipelined one has started already).
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeout


def is_json(content_type: bytes | None) -> bool:
    """Whether a body sent with this Content-Type is parsed as JSON by the routes (FastAPI's
    rule: no Content-Type, ``application/json`` or ``application/*+json``)."""
    if not content_type:
        return True
    mime = content_type.split(b";")[0].strip().lower()
    return mime == b"application/json" or (mime.startswith(b"application/") and mime.endswith(b"+json"))


def json_problem(body: bytes) -> str | None:
    """Why ``body`` is not a JSON object (None if it is one)."""
    try:
        doc = json.loads(body)
    except RecursionError:
        return "request body is not valid JSON: nested too deeply"
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8/16/32
        return "request body is not valid JSON"
    return None if isinstance(doc, dict) else "request body is not a JSON object"


class BodySizeLimit:
    """ASGI middleware for POST, PUT and PATCH bodies, before any route: a body over
    ``max_bytes`` is 413, one not received in full within ``read_timeout_s`` of the headers is
    408 (the connection is then closed), and one sent as JSON that is not a JSON object is 400
    ``invalid_json`` (the same rule for every route, including those that take no body); all
    in the OpenAI error shape. Only bodies within the bound are kept in memory and passed on."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > DRAIN_MAX_BYTES:
            await self._refuse(send, 413, self._too_large(), "request_too_large")
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        chunks, size = [], 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                await self._refuse(
                    send,
                    408,
                    f"request body not received within {self.read_timeout_s:g} s of the headers "
                    f"({size} bytes came); send the whole body at once",
                    "request_timeout",
                )
                return
            if msg["type"] != "http.request":
                return  # the client left before sending its body
            size += len(msg.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False) or size > DRAIN_MAX_BYTES:
                break
        if size > self.max_bytes:
            await self._refuse(send, 413, self._too_large(), "request_too_large")
            return
        body, replayed = b"".join(chunks), False
        problem = json_problem(body) if body and is_json(headers.get(b"content-type")) else None
        if problem is not None:
            await self._refuse(send, 400, problem, "invalid_json", close=False)
            return

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes, more than the model's context can hold"

    async def _refuse(self, send: Send, status: int, message: str, code: str, close: bool = True) -> None:
        """Answer ``status`` in the OpenAI error shape; ``close``: the body was not read to its
        end, so the connection cannot carry another request."""
        err = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
        body = json.dumps({"error": err}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status != 408:  # the same body sent again is refused again (server.errors.refusal_headers)
            headers.append((b"x-should-retry", b"false"))
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else []),
            }
        )
        await send({"type": "http.response.body", "body": body})
