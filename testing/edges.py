"""The HTTP edge without an engine: the real app over a fake state (``edge_app``, ``post_raw``,
``chat_json``), a server state on SQLite for feedback (``feedback_state``, ``feedback``), the
episode token of an episode (``episode_token``) and a refusal's parts (``refused``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from core.claims import episode_token_subject
from core.db import make_engine, migrate
from core.logbus import SqlLog
from core.records import (
    feedback_token,
)
from server.errors import ApiError
from server.feedback.protocol import FeedbackRequest
from server.metrics import ServerMetrics
from server.state import ServerState
from server.store import ServerStore
from testing.servers import make_settings

USER = [{"role": "user", "content": "Write one sentence about the sea."}]


def edge_app(tmp_path):
    """The real app with a fake state (settings and metrics only): bodies the edge refuses never
    reach the engine, the log or the database, so nothing else is needed."""
    from server.app import create_app

    settings = make_settings(tmp_path)
    app = create_app(settings, engine=SimpleNamespace(), watch_policy=False)
    app.state.s = SimpleNamespace(settings=settings, metrics=ServerMetrics())
    return app


async def post_raw(app, path: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        return await http.post(
            path, content=body, headers={"content-type": "application/json", **(headers or {})}
        )


def chat_json(**extra) -> bytes:
    # ensure_ascii escapes a lone surrogate as \ud83d, exactly what a JSON client sends.
    return json.dumps({"messages": USER, **extra}).encode()


SECRET = "test-feedback-secret"  # make_settings' feedback secret


def episode_token(ep: str) -> str:
    return feedback_token(SECRET, episode_token_subject(ep))


async def refused(coro) -> tuple[int, str | None, str | None, str]:
    with pytest.raises(ApiError) as info:
        await coro
    e = info.value
    return e.status, e.code, e.param, e.message


def feedback_state(tmp_path) -> ServerState:
    """A server's state without an engine: SQLite database and SQL-table log (feedback needs no
    generation)."""
    settings = make_settings(tmp_path)
    url = settings.resolved_database_url
    migrate(url)
    return ServerState(settings, None, SqlLog(url), ServerStore(make_engine(url)), ServerMetrics(), None)


def feedback(**body) -> FeedbackRequest:
    return FeedbackRequest.model_validate({"reward": 1, **body})


CHAT = "/v1/chat/completions"


def error_of(r: httpx.Response) -> tuple[int, str | None, str | None, str]:
    err = r.json()["error"]
    return r.status_code, err["code"], err["param"], err["message"]


NOT_JSON = "request body is not valid JSON"
