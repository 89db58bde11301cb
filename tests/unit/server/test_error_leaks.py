"""What an error tells a client (issue 23 findings 5 and 10): the class of the failure, never its
internals; whether a retry can help; and every refusal counted.

The real app, database and SQL log under uvicorn, with ``testing.fakes.FakeEngine`` (no
answer is generated here; the chat path's own 503 is in tests/system/test_real_clients.py).

- A failed SQL INSERT quotes its statement and bound parameters (another request's prompt id
  and record). Neither the request's own 503 nor the unauthenticated ``/readyz`` that other
  clients poll shows them: ``/readyz`` names the dependency and the exception's class.
- An exception no handler knows is a 500 in the OpenAI error shape, without its text, and the
  connection carries the next request (Starlette's last resort answers plain text and uvicorn
  then closes the connection).
- A final 4xx says ``x-should-retry: false`` (the openai SDK sent a 409 three times), a 503
  keeps ``Retry-After``, a 409 a retry can fix (``episode_in_progress``) says nothing.
- Feedback refused with 503 is counted in ``saoserve_feedback_total``.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest
from sqlalchemy import text

from core.db import make_engine
from core.logbus import SqlLog
from core.records import feedback_token
from server.store import ServerStore
from testing.fakes import FakeEngine, index_answer
from testing.metrics import metric
from testing.servers import ADMIN, make_settings, running_server

SECRET = "test-feedback-secret"  # make_settings' feedback secret
VICTIM_PROMPT = "victim-prompt-7f3a"


async def test_a_failed_insert_reaches_no_client(tmp_path):
    """The log's table is gone (a stand-in for a locked or broken database): the victim's
    feedback append fails with the SQL and its parameters; its 503 and the next /readyz (while
    the breaker it tripped is open, 1 s) name only the class. The server's log has the details."""
    settings = make_settings(tmp_path)
    broken_log = SqlLog(f"sqlite:///{tmp_path / 'log-without-schema.db'}")
    async with running_server(settings, FakeEngine(), log_transport=broken_log, watch_policy=False) as url:
        index_answer(settings, "chatcmpl-victim", VICTIM_PROMPT)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            token = feedback_token(SECRET, "chatcmpl-victim")
            r = await http.post(
                "/v1/feedback", json={"id": "chatcmpl-victim", "feedback_token": token, "reward": 1}
            )
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert "x-should-retry" not in r.headers
            assert r.json()["error"] == {
                "message": "feedback log unavailable, the feedback was not recorded (LogUnavailable); retry later",
                "type": "server_error",
                "param": None,
                "code": "storage_unavailable",
            }
            ready = await http.get("/readyz")
            assert ready.status_code == 503
            assert ready.json()["log"] == "the SQL log is unavailable (LogUnavailable)"
            for body in (r.text, ready.text):
                for internal in ("INSERT", "log_records", "parameters", VICTIM_PROMPT, "sqlite3"):
                    assert internal not in body, (internal, body)
            m = (await http.get("/metrics")).text
    assert metric(m, "saoserve_feedback_total", result="log_unavailable") == 1
    assert metric(m, "saoserve_log_failures_total", topic="feedback") == 1


async def test_feedback_refused_while_the_database_is_down_is_counted(tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        db = make_engine(settings.resolved_database_url)
        with db.begin() as conn:
            conn.execute(text("DROP TABLE trajectory_index"))  # every read of it fails
        db.dispose()
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            token = feedback_token(SECRET, "chatcmpl-x")
            r = await http.post(
                "/v1/feedback", json={"id": "chatcmpl-x", "feedback_token": token, "reward": 0}
            )
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["message"] == (
                "storage unavailable (the database): the request was not recorded and will not be; "
                "retry later (OperationalError)"
            )
            m = (await http.get("/metrics")).text
    assert metric(m, "saoserve_feedback_total", result="storage_unavailable") == 1


def two_requests(port: int, first: bytes, second: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``first``, read its answer, then ``second`` on the same TCP connection; each
    answer's status, headers (lower-case names) and body. Raises ConnectionError when the
    server closed the connection in between."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock, sock.makefile("rb") as f:
        for request in (first, second):
            sock.sendall(request)
            status_line = f.readline()
            if not status_line:
                raise ConnectionError("the server closed the connection")
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            body = f.read(int(headers.get("content-length", "0")))
            out.append((int(status_line.split()[1]), headers, body))
    return out


async def test_an_unknown_exception_is_a_500_in_the_openai_shape(tmp_path, monkeypatch):
    def failing(self, limit):
        raise RuntimeError("SELECT secret FROM users WHERE id = 7")

    monkeypatch.setattr(ServerStore, "learner_status", failing)
    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        port = int(url.rsplit(":", 1)[1])
        auth = ADMIN["Authorization"]
        first = f"GET /admin/learner HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n\r\n".encode()
        second = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        (s1, h1, b1), (s2, _, b2) = await asyncio.to_thread(two_requests, port, first, second)
    assert s1 == 500 and h1["content-type"] == "application/json"
    assert httpx.Response(500, content=b1).json() == {
        "error": {
            "message": "internal error (RuntimeError); the details are in the server's log",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert (s2, b2) == (200, b'{"status":"ok"}')


@pytest.fixture
async def feedback_server(tmp_path):
    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        index_answer(settings, "chatcmpl-a", "p")
        index_answer(settings, "chatcmpl-cut", "p", finish_reason="length")
        yield url


@pytest.mark.parametrize(
    ("body", "status", "retry"),
    [
        # Unknown completion: 404, final.
        ({"id": "chatcmpl-none", "feedback_token": "t", "reward": 1}, 404, "false"),
        # Wrong token: 403, final.
        ({"id": "chatcmpl-a", "feedback_token": "t", "reward": 1}, 403, "false"),
        # A reward outside [0, 1]: 422, final.
        ({"id": "chatcmpl-a", "feedback_token": "t", "reward": 2}, 422, "false"),
        # Not JSON at all: 400, final.
        (b"{", 400, "false"),
    ],
)
async def test_final_refusals_say_no_retry(feedback_server, body, status, retry):
    async with httpx.AsyncClient(base_url=feedback_server, timeout=30) as http:
        if isinstance(body, bytes):
            r = await http.post("/v1/feedback", content=body, headers={"content-type": "application/json"})
        else:
            r = await http.post("/v1/feedback", json=body)
        assert r.status_code == status, r.text
        assert r.headers.get("x-should-retry") == retry
        # Routes and methods the server does not have are final too (Starlette's 404 and 405).
        assert (await http.get("/v1/nothing")).headers["x-should-retry"] == "false"
        assert (await http.delete("/v1/feedback")).headers["x-should-retry"] == "false"


async def test_the_openai_sdk_sends_a_final_409_once(feedback_server):
    """The SDK (max_retries 2, its default) retries a 409 unless told not to: before issue 23 a
    duplicate feedback reached the server 3 times. Counted by the server: 1 accepted, 1 duplicate."""
    token = feedback_token(SECRET, "chatcmpl-a")
    body = {"id": "chatcmpl-a", "feedback_token": token, "reward": 1}
    client = openai.AsyncOpenAI(base_url=f"{feedback_server}/v1", api_key="unused")
    await client.post("/feedback", body=body, cast_to=object)
    with pytest.raises(openai.ConflictError) as e:
        await client.post("/feedback", body=body, cast_to=object)
    assert e.value.body["code"] == "conflict"
    async with httpx.AsyncClient(base_url=feedback_server, timeout=30) as http:
        m = (await http.get("/metrics")).text
    assert metric(m, "saoserve_feedback_total", result="accepted") == 1
    assert metric(m, "saoserve_feedback_total", result="duplicate") == 1


async def test_a_409_a_retry_can_fix_does_not_say_no_retry(tmp_path):
    """Episode feedback while a turn is still being answered: 409 ``episode_in_progress``, which
    the same request sent again once the turn is logged turns into a 202."""
    from core.claims import episode_token_subject
    from core.db import make_engine as db_engine

    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        db = db_engine(settings.resolved_database_url)
        store = ServerStore(db)
        assert store.start_episode_turn("ep", "chatcmpl-t0", token_ok=False).outcome == "ok"
        index_answer(settings, "chatcmpl-t0", "p", episode_id="ep", turn=0)
        assert store.start_episode_turn("ep", "chatcmpl-t1", token_ok=True).outcome == "ok"
        token = feedback_token(SECRET, episode_token_subject("ep"))
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"episode_id": "ep", "feedback_token": token, "reward": 1}
            r = await http.post("/v1/feedback", json=body)
            assert r.status_code == 409 and r.json()["error"]["code"] == "episode_in_progress"
            assert "x-should-retry" not in r.headers
            index_answer(settings, "chatcmpl-t1", "p", episode_id="ep", turn=1)
            assert (await http.post("/v1/feedback", json=body)).status_code == 202
        db.dispose()
