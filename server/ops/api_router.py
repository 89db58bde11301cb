"""Operators' pages: liveness, readiness, Prometheus metrics, the model list, the dashboard;
and the chat page, where a person tries the learning loop by hand.

Readiness and the dashboard need no key, so they name a tenant policy, or give its figures, only
to a request that may see it (``server.auth.visible_policies``); ``/metrics``, scraped from
inside the deployment, keeps its ``tenant`` labels."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from core.policies import GLOBAL
from server.admin.protocol import PolicyRow
from server.admin.serving import policy_rows
from server.auth import authenticate, served_state, visible_policies, visible_state
from server.errors import ApiError, errors
from server.health import RETRY_AFTER_S
from server.ops.protocol import (
    DashboardData,
    DashboardState,
    Liveness,
    ModelCard,
    ModelList,
    Readiness,
)
from server.ops.serving import learner_overview
from server.scope import PolicyQuery, all_states, policy_state, state_of

router = APIRouter()

DASHBOARD_HTML = (Path(__file__).parent.parent / "dashboard.html").read_text()
CHAT_HTML = (Path(__file__).parent.parent / "chat.html").read_text()
# The chat page's and the dashboard's scripts and styles are inline and they talk only to this
# server; the browser enforces that (no script, style, image or connection from anywhere else),
# which matters most where a page keeps a key (the dashboard's, in sessionStorage).
PAGE_CSP = (
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
# The newest policy versions the dashboard's version chart shows.
DASHBOARD_VERSIONS = 500


@router.get("/healthz")
async def healthz() -> Liveness:
    return Liveness()


@router.get(
    "/readyz", response_model=Readiness, responses={503: {"model": Readiness, "description": "Not ready"}}
)
async def readyz(request: Request) -> JSONResponse:
    """200 when the engine runs and the global policy's database and log answer and its watcher is
    caught up; 503 naming what is down. Each part is "ok" when it is for every policy, else what
    is wrong, a tenant policy's prefixed with its name when the request may see that policy
    (``server.auth.visible_policies``: the admin key, or the tenant's own key:
    ``acme: catching up: ...``); the others' only as ``HIDDEN_NOT_READY``, once, with no detail
    (``combined``). A tenant policy's problems (its database or log down, its
    watcher catching up or behind) are reported but keep the replica ready: taking every replica
    out of service would stop the global policy and the other tenants too, while the tenant's
    own requests get their 503 from its state (its health and ``PolicyWatcher.require``)."""
    s = state_of(request)
    states = all_states(request)
    visible, *reports = await asyncio.gather(
        readiness_viewer(request), *(st.health.report(READY_PROBE_S) for st in states)
    )
    deps = {
        part: combined({st.policy: r[part] for st, r in zip(states, reports, strict=True)}, visible)
        for part in reports[0]
    }
    engine = "ok" if s.engine.engine is not None else "not running"
    ok = engine == "ok" and all(state == "ok" for state in reports[0].values())
    body = Readiness(ready=ok, policy_version=s.engine.version, engine=engine, **deps).model_dump()
    if ok:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


# Seconds /readyz waits for each probe, and for the key lookup of ``readiness_viewer``.
READY_PROBE_S = 2.0


async def readiness_viewer(request: Request) -> list[str]:
    """``server.auth.visible_policies`` for ``/readyz``, cut off after ``READY_PROBE_S`` as the
    probes are: a global database that does not answer (it holds the keys) must not hold the
    answer back, and then the request sees what no key sees (``GLOBAL``)."""
    try:
        return await asyncio.wait_for(visible_policies(request), READY_PROBE_S)
    except TimeoutError:
        return [GLOBAL]


# What /readyz says for the tenant policies a request may not see, when any of them is not "ok":
# one line, however many, and none of their details (versions, counts), which a tenant's own
# answers could be matched against.
HIDDEN_NOT_READY = "a tenant policy is not ready (the admin key's /readyz and /admin/policies say which)"


def combined(parts: dict[str, str], named: list[str]) -> str:
    """One readiness part over every policy (``{policy: "ok" | what is wrong}``): "ok" when all
    are, else what is wrong joined with ``; ``: the global policy's, each tenant policy's of
    ``named`` (those the request may see) prefixed with its name, and ``HIDDEN_NOT_READY`` once
    for all the others."""
    wrong = [
        state if p == GLOBAL else f"{p}: {state}"
        for p, state in parts.items()
        if state != "ok" and (p == GLOBAL or p in named)
    ]
    if any(state != "ok" for p, state in parts.items() if p != GLOBAL and p not in named):
        wrong.append(HIDDEN_NOT_READY)
    return "; ".join(wrong) or "ok"


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    s = state_of(request)
    # Each policy's learner counters and lifecycle are in its namespace's database: read them
    # for this scrape, every namespace at once, waiting no longer than a readiness probe (one
    # that does not answer keeps its last figures).
    await s.metrics.read_for_scrape({st.policy: st.store.engine for st in all_states(request)}, READY_PROBE_S)
    return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def model_card(request: Request) -> ModelCard:
    """The served model as the caller is served: by its policy (``server.auth.served_state``)."""
    s = served_state(request)
    version = s.engine.version
    return ModelCard(
        id=s.settings.served_model_name,
        owned_by="saoserve" if s.policy == GLOBAL else f"saoserve/{s.policy}",
        policy_version=version,
        max_model_len=s.settings.max_model_len,
        policy=s.policy,
        version=version,
    )


@router.get("/v1/models", dependencies=[Depends(authenticate)], responses=errors(401))
async def models(request: Request) -> ModelList:
    return ModelList(data=[model_card(request)])


@router.get("/v1/models/{model:path}", dependencies=[Depends(authenticate)], responses=errors(401, 404))
async def model(model: str, request: Request) -> ModelCard:
    """OpenAI's ``models.retrieve``: the served model's card; 404 ``model_not_found`` for any
    other name (a model name may hold ``/``, as ``org/name`` does)."""
    card = model_card(request)
    if model != card.id:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {card.id!r}",
            param="model",
            code="model_not_found",
        )
    return card


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """The operators' dashboard: its figures from ``/dashboard/data`` and ``/dashboard/state``."""
    return HTMLResponse(DASHBOARD_HTML, headers={"Content-Security-Policy": PAGE_CSP})


@router.get("/chat", response_class=HTMLResponse)
async def chat_page() -> HTMLResponse:
    """A chat that streams its answers with their policy version, and thumbs up/down for each."""
    return HTMLResponse(CHAT_HTML, headers={"Content-Security-Policy": PAGE_CSP})


@router.get("/dashboard/data", responses=errors(404, 503))
async def dashboard_data(request: Request, policy: PolicyQuery = None) -> DashboardData:
    """The learner's last 500 steps (``DASHBOARD_KEYS``), its counters, the version served and
    requests/s in 10 s buckets over the last 600 s, of the policy ``?policy=`` names (the global
    one by default). Aggregates only (no prompts or texts), so operators can watch without the
    admin key; a tenant policy only for a request that may see it
    (``server.auth.visible_policies``), else 404 ``unknown_policy`` listing those it may."""
    s = visible_state(request, await visible_policies(request), policy)
    status = await asyncio.to_thread(s.store.learner_status, 500)
    steps = [{k: st.get(k) for k in DASHBOARD_KEYS} for st in status["steps"]]
    rps = await asyncio.to_thread(s.store.request_rate, 10, 60)
    return DashboardData(
        policy_version=s.engine.version, steps=steps, requests_per_s=rps, counters=status["counters"]
    )


@router.get("/dashboard/state", responses=errors(404, 503))
async def dashboard_state(request: Request, policy: PolicyQuery = None) -> DashboardState:
    """Learning running or paused, a pending rollback, the versions (their stages, rollbacks
    marked), the lifecycle (promoted version, lineage, the guard's switches and last verdict),
    sample counts, reward by version, requests/s over the last 60 s and this replica's request
    outcomes; aggregates only, like ``/dashboard/data``. All of it but the outcomes (the whole
    replica's, every policy's requests) for the policy ``?policy=`` names (the global one by
    default); ``policies``: the row of each policy the request may see
    (``server.auth.visible_policies``: the global one; with the admin key every tenant policy,
    with a tenant's key its own). Any other name, a tenant policy not shown included, is 404
    ``unknown_policy`` listing only those rows' policies."""
    visible = await visible_policies(request)
    s = visible_state(request, visible, policy)
    split = s.canary.split if s.canary is not None else None
    overview = await asyncio.to_thread(
        learner_overview, s.store.engine, DASHBOARD_VERSIONS, s.policy, s.engine.adapters is not None, split
    )
    last_minute = await asyncio.to_thread(s.store.request_rate, 60, 1)
    policies = await policy_rows([policy_state(request, p) for p in visible])
    return DashboardState(
        serving=s.engine.version,
        requests_per_s_last_minute=last_minute[0],
        outcomes=s.metrics.outcomes(),
        policies=[PolicyRow(**row) for row in policies],
        **overview,
    )
