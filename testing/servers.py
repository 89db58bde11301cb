"""The real app under uvicorn for a test or a benchmark: its settings (``make_settings``), the
server on a free loopback port (``running_server``), the admin key's header (``ADMIN``), and the
openai SDK's client on it (``sdk``, with the served model's name ``MODEL``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from saoserve.ports import free_port

if TYPE_CHECKING:
    import openai


def make_settings(tmp: Path, **overrides):
    """Settings under ``tmp`` with the test secrets (``ADMIN``'s key), a 1 GiB KV cache and at
    most 512 tokens an answer; ``overrides`` set any other field."""
    from core.settings import Settings

    base = dict(
        home=tmp,
        feedback_secret="test-feedback-secret",
        admin_key="test-admin-key",
        kv_cache_gib=1.0,
        max_tokens_limit=512,
    )
    base.update(overrides)
    return Settings(**base)


@contextlib.asynccontextmanager
async def running_server(settings, engine, http: type | str = "auto", **app_kwargs) -> AsyncIterator[str]:
    """The real app under uvicorn on a free loopback port, in this event loop; yields its URL.
    ``http``: uvicorn's HTTP protocol (``saoserve serve`` uses ``server.limits.header_timeout_protocol``)."""
    import uvicorn

    from server.app import create_app

    port = free_port()
    app = create_app(settings, engine=engine, **app_kwargs)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", http=http)
    )
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 60
    while not server.started:
        if task.done():
            task.result()
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 60)


ADMIN = {"Authorization": "Bearer test-admin-key"}


MODEL = "smollm2-135m-instruct"  # Settings.served_model_name


def sdk(url: str, **kw) -> openai.AsyncOpenAI:
    """The openai SDK's async client on the server at ``url``, unchanged."""
    import openai

    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", **kw)
