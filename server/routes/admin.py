"""``/admin/*``: routes behind the admin key (``Authorization: Bearer <SAOSERVE_ADMIN_KEY>``;
403 for all of them while no key is set)."""

from __future__ import annotations

import asyncio
import hmac
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import Response

from core.control import PAUSED, ROLLBACK_TO, set_flag
from core.evidence_store import EvidenceStore
from core.records import TOPIC_TRAJECTORIES
from server.engine import SwapRefused
from server.errors import ApiError, errors
from server.responses import (
    LearningState,
    PolicyLoaded,
    PolicyVersions,
    PromptEvidence,
    RollbackRequested,
    UncertainPrompts,
)
from server.routes import state_of
from server.schemas import EdgeStr, LoadPolicyRequest, RollbackRequest


def require_admin(request: Request) -> None:
    """Raise ApiError 403 while admin routes are disabled, 401 without the right key (compared
    in constant time)."""
    key = state_of(request).settings.admin_key
    given = request.headers.get("authorization", "")
    if not key:
        raise ApiError(403, "admin routes are disabled: SAOSERVE_ADMIN_KEY is not set", "permission_error")
    if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), key.encode()):
        raise ApiError(401, "admin routes need 'Authorization: Bearer <admin key>'", "authentication_error")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
ADMIN_ERRORS = errors(400, 401, 403, 503)


@router.get("/trajectories/{trajectory_id}", responses=ADMIN_ERRORS | errors(404))
async def admin_trajectory(
    trajectory_id: Annotated[EdgeStr, PathParam(max_length=64)], request: Request
) -> Response:
    s = state_of(request)
    traj = await asyncio.to_thread(s.store.find_trajectory, trajectory_id)
    if traj is None:
        raise ApiError(404, f"no trajectory {trajectory_id!r}", code="not_found")
    entries = await asyncio.to_thread(
        s.log.read, TOPIC_TRAJECTORIES, traj.log_partition, traj.log_offset, 1, 5.0
    )
    if not entries or entries[0].offset != traj.log_offset:
        raise ApiError(404, f"trajectory {trajectory_id!r} is indexed but not in the log", code="not_found")
    return Response(entries[0].value, media_type="application/json")


@router.post("/load_policy", responses=ADMIN_ERRORS | errors(413, 422))
async def admin_load_policy(body: LoadPolicyRequest, request: Request) -> PolicyLoaded:
    s = state_of(request)
    try:
        res = await s.engine.swap(body.version, Path(body.path), body.sha256)
    except SwapRefused as exc:
        s.metrics.swaps.labels("refused").inc()
        raise ApiError(422, str(exc), code="swap_refused") from exc
    s.metrics.swaps.labels("ok").inc()
    s.metrics.swap_seconds.observe(res.seconds)
    s.metrics.policy_version.set(res.version)
    return PolicyLoaded(policy_version=res.version, seconds=res.seconds, paused_seconds=res.paused_seconds)


@router.post("/pause", responses=ADMIN_ERRORS)
async def admin_pause(request: Request) -> LearningState:
    await asyncio.to_thread(set_flag, state_of(request).store.engine, PAUSED, "1")
    return LearningState(learning="paused")


@router.post("/resume", responses=ADMIN_ERRORS)
async def admin_resume(request: Request) -> LearningState:
    await asyncio.to_thread(set_flag, state_of(request).store.engine, PAUSED, None)
    return LearningState(learning="running")


@router.post("/rollback", responses=ADMIN_ERRORS | errors(404, 413))
async def admin_rollback(body: RollbackRequest, request: Request) -> RollbackRequested:
    s = state_of(request)
    versions = await asyncio.to_thread(s.store.policy_versions)
    if body.version not in {v["version"] for v in versions}:
        raise ApiError(404, f"no policy version {body.version}", code="not_found", param="version")
    await asyncio.to_thread(set_flag, s.store.engine, ROLLBACK_TO, str(body.version))
    return RollbackRequested(rollback_to=body.version)


@router.get("/policy_versions", responses=ADMIN_ERRORS)
async def admin_versions(request: Request) -> PolicyVersions:
    s = state_of(request)
    return PolicyVersions(serving=s.engine.version, versions=await asyncio.to_thread(s.store.policy_versions))


@router.get("/learner", responses=ADMIN_ERRORS)
async def admin_learner(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict:
    """The last ``limit`` learner steps (their metrics as the learner stored them) and counters."""
    return await asyncio.to_thread(state_of(request).store.learner_status, limit)


@router.get("/evidence/{prompt_id}", responses=ADMIN_ERRORS)
async def admin_evidence(
    prompt_id: Annotated[EdgeStr, PathParam(max_length=128)], request: Request
) -> PromptEvidence:
    s = state_of(request)
    ev = EvidenceStore(s.store.engine)
    row = await asyncio.to_thread(ev.get, prompt_id)
    base = await asyncio.to_thread(ev.read, prompt_id, s.engine.version)
    return PromptEvidence(
        prompt_id=prompt_id,
        known=row is not None,
        at_version=base.model_dump(),
        n_results=row.n_results if row else 0,
        reward_sum=row.reward_sum if row else 0.0,
    )


@router.get("/evidence", responses=ADMIN_ERRORS)
async def admin_uncertain(
    request: Request, top: Annotated[int, Query(ge=1, le=1000)] = 10
) -> UncertainPrompts:
    s = state_of(request)
    rows = await asyncio.to_thread(EvidenceStore(s.store.engine).top_uncertain, top, s.engine.version)
    return UncertainPrompts(
        version=s.engine.version, prompts=[{"prompt_id": p, **b.model_dump()} for p, b in rows]
    )
