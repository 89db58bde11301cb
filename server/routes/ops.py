"""Operators' pages: liveness, readiness, Prometheus metrics, the model list, the dashboard;
and the chat page, where a person tries the learning loop by hand."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from server.errors import errors
from server.health import RETRY_AFTER_S
from server.responses import DashboardData, Liveness, ModelCard, ModelList, Readiness
from server.routes import state_of

router = APIRouter()

DASHBOARD_HTML = (Path(__file__).parent.parent / "dashboard.html").read_text()
CHAT_HTML = (Path(__file__).parent.parent / "chat.html").read_text()
# The chat page's scripts and styles are inline and it talks only to this server; the browser
# enforces that (no script, style, image or connection from anywhere else).
CHAT_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
)
# The learner step metrics the dashboard plots.
DASHBOARD_KEYS = (
    "step",
    "version",
    "reward_mean",
    "kept_fraction",
    "explained_variance",
    "staleness_mean",
    "policy_loss",
    "critic_loss",
    "created_at",
)


@router.get("/healthz")
async def healthz() -> Liveness:
    return Liveness()


@router.get(
    "/readyz", response_model=Readiness, responses={503: {"model": Readiness, "description": "Not ready"}}
)
async def readyz(request: Request) -> JSONResponse:
    """200 when the engine runs and the database and the log answer; 503 naming what is down."""
    s = state_of(request)
    deps = await s.health.report()
    engine = "ok" if s.engine.engine is not None else "not running"
    ok = engine == "ok" and all(v == "ok" for v in deps.values())
    body = Readiness(ready=ok, policy_version=s.engine.version, engine=engine, **deps).model_dump()
    if ok:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    s = state_of(request)
    card = ModelCard(
        id=s.settings.served_model_name,
        policy_version=s.engine.version,
        max_model_len=s.settings.max_model_len,
    )
    return ModelList(data=[card])


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(DASHBOARD_HTML)


@router.get("/chat", response_class=HTMLResponse)
async def chat_page() -> HTMLResponse:
    """A chat that streams its answers with their policy version, and thumbs up/down for each."""
    return HTMLResponse(CHAT_HTML, headers={"Content-Security-Policy": CHAT_CSP})


@router.get("/dashboard/data", responses=errors(503))
async def dashboard_data(request: Request) -> DashboardData:
    """Aggregates only (no prompts or texts), so operators can watch without the admin key."""
    s = state_of(request)
    status = await asyncio.to_thread(s.store.learner_status, 500)
    steps = [{k: st.get(k) for k in DASHBOARD_KEYS} for st in status["steps"]]
    rps = await asyncio.to_thread(s.store.request_rate, 10, 60)
    return DashboardData(
        policy_version=s.engine.version, steps=steps, requests_per_s=rps, counters=status["counters"]
    )
