"""Slowloris (the edge's contracts, finding 6; docs/reliability.md): headers or a body trickled
in are 408 after ``header_read_timeout_s`` / ``body_read_timeout_s`` and the connection is
closed, on a real uvicorn driven by a raw socket client, as ``saoserve serve`` runs it."""

from __future__ import annotations

import asyncio
import json
import re
import time
from types import SimpleNamespace

import httpx
import pytest

from server.limits import header_timeout_protocol
from testing.servers import make_settings, running_server


@pytest.fixture
async def slow_server(tmp_path):
    """The real app under uvicorn as ``saoserve serve`` runs it (header deadline 1 s), with a 2 s
    body deadline; no engine (no route here generates)."""
    settings = make_settings(tmp_path, body_read_timeout_s=2.0)
    http = header_timeout_protocol(1.0)
    async with running_server(settings, SimpleNamespace(version=0), http=http, watch_policy=False) as url:
        yield url


async def trickle(url: str, head: bytes, pieces: list[bytes], every_s: float) -> tuple[bytes, float]:
    """Send ``head`` then each piece ``every_s`` apart on a raw connection; return everything the
    server sent until it closed the connection (or 10 s), and the seconds until its first byte."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    writer.write(head)

    async def send_slowly() -> None:
        for piece in pieces:
            await asyncio.sleep(every_s)
            if writer.is_closing():
                return
            writer.write(piece)
            try:
                await writer.drain()
            except ConnectionError:
                return

    sender = asyncio.create_task(send_slowly())
    first = await asyncio.wait_for(reader.read(1), 10)
    waited = time.monotonic() - t0
    rest = await asyncio.wait_for(reader.read(), 10)  # b"" once the server closed it
    sender.cancel()
    writer.close()
    return first + rest, waited


def response_of(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


TRICKLE_MESSAGE = re.compile(
    r"request body not received within 2 s of the headers \((\d+) bytes came\); send the whole body at once"
)


# The slowloris tests wait out real deadlines on real sockets (2-3 s each): the full suite's.
@pytest.mark.slow
@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_trickled_in_is_408_and_the_connection_closed(slow_server, chunked):
    """The tester's input: headers, then the body one byte every few seconds (0.4 s here, with a
    2 s deadline): 408 about 2 s after the headers, the connection closed by the server, and the
    server answering others meanwhile."""
    body = b'{"id": "c", "feedback_token": "t", "reward": 1}'
    framing = b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}".encode()
    head = (
        b"POST /v1/feedback HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + framing + b"\r\n\r\n"
    )
    pieces = [(b"1\r\n" + bytes([c]) + b"\r\n") if chunked else bytes([c]) for c in body]
    other = asyncio.create_task(asyncio.to_thread(httpx.get, f"{slow_server}/healthz", timeout=10))
    raw, waited = await trickle(slow_server, head, pieces, 0.4)
    status, headers, answer = response_of(raw)
    assert (status, headers["connection"], answer["error"]["code"]) == (408, "close", "request_timeout")
    came = int(TRICKLE_MESSAGE.fullmatch(answer["error"]["message"]).group(1))
    assert 3 <= came <= 6  # a byte every 0.4 s for 2 s: 4 or 5, give or take the scheduler
    assert 1.9 <= waited < 4.0, waited
    assert (await other).status_code == 200


HEADERS_LATE = {
    "message": "request headers not received within 1 s",
    "type": "invalid_request_error",
    "param": None,
    "code": "request_timeout",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("head", "pieces"),
    [
        (b"", []),  # connects and sends nothing
        (b"P", list(b"OST /v1/feedback HTTP/1.1\r\nHost: t\r\n\r\n")),  # headers a byte every 0.3 s
    ],
    ids=["nothing", "headers-trickled"],
)
async def test_headers_not_in_within_the_deadline_are_408(slow_server, head, pieces):
    raw, waited = await trickle(slow_server, head, [bytes([c]) for c in pieces], 0.3)
    status, headers, answer = response_of(raw)
    assert (status, headers["connection"], answer) == (408, "close", {"error": HEADERS_LATE})
    assert 0.9 <= waited < 3.0, waited


@pytest.mark.slow
async def test_a_kept_alive_connection_gets_the_deadline_for_its_next_headers(slow_server):
    first = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
    raw, waited = await trickle(slow_server, first + b"GET /hea", [], 0)
    ok, _, late = raw.partition(b'{"status":"ok"}')
    assert ok.startswith(b"HTTP/1.1 200") and waited < 1.0
    assert response_of(late)[::2] == (408, {"error": HEADERS_LATE})


@pytest.mark.slow
async def test_a_body_sent_in_time_in_pieces_is_answered(slow_server):
    """Headers in at once, body in pieces over 1.5 s: past the header deadline (1 s), within
    the body's (2 s), so answered by the route."""
    body = b'{"id": "c-none", "feedback_token": "t", "reward": 1}'
    head = f"POST /v1/feedback HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
    raw, _ = await trickle(slow_server, head, [body[:10], body[10:30], body[30:]], 0.5)
    status, _, answer = response_of(raw)
    assert (status, answer["error"]["message"]) == (404, "no completion with id 'c-none'")
