"""``/admin/*``: routes behind the admin key (``Authorization: Bearer <SAOSERVE_ADMIN_KEY>``;
403 for all of them while no key is set). ``saoserve admin`` (saoserve/admin.py) is their client."""

from __future__ import annotations

import asyncio
import hmac
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import Response

from core.control import PAUSED, ROLLBACK_TO, get_flag, set_flag
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
from server.schemas import EdgeStr, ErrorResponse, LoadPolicyRequest, RollbackRequest

# The file the learner loads a version's weights from (learner.process.WEIGHTS_FILE, which the
# server cannot import). The learner prunes whole version folders (keep_versions), so a version
# whose folder lacks it can never be restored.
WEIGHTS_FILE = "model.safetensors"


def weights_present(path: str) -> bool:
    """Whether the version folder ``path`` still holds the weights a rollback loads."""
    return (Path(path) / WEIGHTS_FILE).is_file()


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
    s.metrics.swapped(res)
    return PolicyLoaded(policy_version=res.version, seconds=res.seconds, paused_seconds=res.paused_seconds)


@router.post("/pause", responses=ADMIN_ERRORS)
async def admin_pause(request: Request) -> LearningState:
    await asyncio.to_thread(set_flag, state_of(request).store.engine, PAUSED, "1")
    return LearningState(learning="paused")


@router.post("/resume", responses=ADMIN_ERRORS)
async def admin_resume(request: Request) -> LearningState:
    await asyncio.to_thread(set_flag, state_of(request).store.engine, PAUSED, None)
    return LearningState(learning="running")


VERSION_UNAVAILABLE = {
    409: {"model": ErrorResponse, "description": "The version's weights were pruned from the policy folder"}
}


@router.post("/rollback", responses=ADMIN_ERRORS | errors(404, 413) | VERSION_UNAVAILABLE)
async def admin_rollback(body: RollbackRequest, request: Request) -> RollbackRequested:
    """Ask the learner to publish ``version``'s weights as a new version: 404 for a version the
    database does not know, 409 ``version_unavailable`` for one whose folder was pruned (the
    learner would refuse it). A prune between this check and the learner's turn is still
    refused there, in its log and its ``rollback_refused`` counter."""
    s = state_of(request)
    versions = await asyncio.to_thread(s.store.policy_versions)
    row = next((v for v in versions if v["version"] == body.version), None)
    if row is None:
        raise ApiError(404, f"no policy version {body.version}", code="not_found", param="version")
    if not await asyncio.to_thread(weights_present, row["path"]):
        raise ApiError(
            409,
            f"policy version {body.version} cannot be restored: its weights are gone from {row['path']} "
            "(the learner keeps only the newest keep_versions folders)",
            code="version_unavailable",
            param="version",
        )
    await asyncio.to_thread(set_flag, s.store.engine, ROLLBACK_TO, str(body.version))
    return RollbackRequested(rollback_to=body.version)


@router.get("/policy_versions", responses=ADMIN_ERRORS)
async def admin_versions(request: Request) -> PolicyVersions:
    """Every version, each with ``available``: whether its weights are still there to roll back to."""
    s = state_of(request)

    def read() -> list[dict]:
        return [v | {"available": weights_present(v["path"])} for v in s.store.policy_versions()]

    return PolicyVersions(serving=s.engine.version, versions=await asyncio.to_thread(read))


@router.get("/learner", responses=ADMIN_ERRORS)
async def admin_learner(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict:
    """The last ``limit`` learner steps (their metrics as the learner stored them), counters,
    ``learning`` (``running`` | ``paused``) and ``rollback_to`` (a requested rollback the learner
    has not carried out yet, or null)."""
    s = state_of(request)

    def read() -> dict:
        flags = {"learning": "paused" if get_flag(s.store.engine, PAUSED) == "1" else "running"}
        target = get_flag(s.store.engine, ROLLBACK_TO)
        flags["rollback_to"] = None if target is None else int(target)
        return s.store.learner_status(limit) | flags

    return await asyncio.to_thread(read)


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
