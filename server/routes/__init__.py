"""The HTTP routes, one router per API family (as vLLM's server is organised): ``chat``
(OpenAI chat completions), ``feedback``, ``admin`` (admin key), ``ops`` (operators' pages:
health, readiness, metrics, models, dashboard)."""

from __future__ import annotations

from fastapi import Request

from server.state import ServerState


def state_of(request: Request) -> ServerState:
    """The app's ``ServerState`` (built in the lifespan)."""
    return request.app.state.s
