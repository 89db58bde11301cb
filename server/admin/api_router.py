"""``/admin/*``: routes behind the admin key (``Authorization: Bearer <SAOSERVE_ADMIN_KEY>``;
403 for all of them while no key is set: ``require_admin``). ``saoserve admin`` (saoserve/admin/)
is their client. The version lifecycle's routes are ``server.admin.lifecycle_router``'s, the API keys'
``server.admin.keys_router``'; both take ``require_admin`` and the errors from here."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import Response

from core.control import PAUSED, ROLLBACK_TO, get_flag, set_flag
from core.dead_letters import KINDS as DEAD_LETTER_KINDS
from core.dead_letters import recent as recent_dead_letters
from core.evidence_store import EvidenceStore
from core.forget import ForgetKind, ForgetTarget, forget, new_request_id, receipt_of, record_request
from core.lifecycle import Stage
from core.limits import ID_CHARS, NAME_CHARS, PROMPT_ID_CHARS
from core.records import TOPIC_TRAJECTORIES, TrajectoryRecord, utcnow
from core.retention import sql_log_engine
from core.sealing import Shredded
from server.admin.protocol import (
    DeadLetters,
    ForgetRequest,
    Forgotten,
    LearnerStatus,
    LearningState,
    LoadPolicyRequest,
    PolicyList,
    PolicyLoaded,
    PolicyVersions,
    PromptEvidence,
    RollbackRequest,
    RollbackRequested,
    UncertainPrompts,
)
from server.admin.serving import (
    check_loadable,
    policy_rows,
    receipt_body,
    unserved_namespaces,
    weights_present,
)
from server.auth import admin_key_given
from server.engine import SwapRefused
from server.errors import ApiError, errors
from server.schemas import EdgeStr, ErrorResponse
from server.scope import PolicyState, all_states, state_of


def require_admin(request: Request) -> None:
    """Raise ApiError 403 while admin routes are disabled, 401 without the right key (compared
    in constant time: ``server.auth.admin_key_given``)."""
    if not state_of(request).settings.admin_key:
        raise ApiError(403, "admin routes are disabled: SAOSERVE_ADMIN_KEY is not set", "permission_error")
    if not admin_key_given(request):
        raise ApiError(401, "admin routes need 'Authorization: Bearer <admin key>'", "authentication_error")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
ADMIN_ERRORS = errors(400, 401, 403, 503)
# The routes in one policy's namespace: 404 ``unknown_policy`` as well (``namespace``).
POLICY_ERRORS = ADMIN_ERRORS | errors(404)


@router.get(
    "/trajectories/{trajectory_id}", response_model=TrajectoryRecord, responses=ADMIN_ERRORS | errors(404)
)
async def admin_trajectory(
    trajectory_id: Annotated[EdgeStr, PathParam(max_length=ID_CHARS)], s: PolicyState
) -> Response:
    """The trajectory's record as the log holds it (its bytes, not re-serialised; opened when a
    Kafka log holds it sealed, ``core.sealing``): 404 for an id not indexed, indexed but gone
    from the log, or whose data key a forget destroyed."""
    traj = await asyncio.to_thread(s.store.find_trajectory, trajectory_id)
    if traj is None:
        raise ApiError(404, f"no trajectory {trajectory_id!r}", code="not_found")
    entries = await asyncio.to_thread(
        s.log.read, TOPIC_TRAJECTORIES, traj.log_partition, traj.log_offset, 1, 5.0
    )
    if not entries or entries[0].offset != traj.log_offset:
        raise ApiError(404, f"trajectory {trajectory_id!r} is indexed but not in the log", code="not_found")
    try:
        value = await asyncio.to_thread(s.store.open_logged, entries[0].value)
    except Shredded:
        raise ApiError(404, f"trajectory {trajectory_id!r} was forgotten", code="not_found") from None
    return Response(value, media_type="application/json")


@router.post("/load_policy", responses=ADMIN_ERRORS | errors(404, 409, 413, 422))
async def admin_load_policy(body: LoadPolicyRequest, s: PolicyState) -> PolicyLoaded:
    """Serve a recorded version's weights on this replica (``check_loadable``: 404 for a version
    not recorded, 409 ``version_behind`` for one older than served, 422 for a checksum that is
    not the recorded one or weights the engine refuses)."""
    recorded = await asyncio.to_thread(s.store.policy_version, body.version)
    check_loadable(body, recorded, s.engine.version)
    try:
        res = await s.engine.swap(body.version, Path(body.path), body.sha256)
    except SwapRefused as exc:
        s.metrics.swaps.labels("refused").inc()
        raise ApiError(422, str(exc), code="swap_refused") from exc
    s.metrics.swapped(res)
    return PolicyLoaded(policy_version=res.version, seconds=res.seconds, paused_seconds=res.paused_seconds)


@router.post("/pause", responses=POLICY_ERRORS)
async def admin_pause(s: PolicyState) -> LearningState:
    await asyncio.to_thread(set_flag, s.store.engine, PAUSED, "1")
    return LearningState(learning="paused")


@router.post("/resume", responses=POLICY_ERRORS)
async def admin_resume(s: PolicyState) -> LearningState:
    await asyncio.to_thread(set_flag, s.store.engine, PAUSED, None)
    return LearningState(learning="running")


VERSION_UNAVAILABLE = {
    409: {"model": ErrorResponse, "description": "The version's weights were pruned from the policy folder"}
}


@router.post("/rollback", responses=ADMIN_ERRORS | errors(404, 413) | VERSION_UNAVAILABLE)
async def admin_rollback(body: RollbackRequest, s: PolicyState) -> RollbackRequested:
    """Ask the learner to publish ``version``'s weights as a new version: 404 for a version the
    database does not know, 409 ``version_unavailable`` for one whose folder was pruned (the
    learner would refuse it). A prune between this check and the learner's turn is still
    refused there, in its log and its ``rollback_refused`` counter."""
    versions = await asyncio.to_thread(s.store.policy_versions)
    row = next((v for v in versions if v["version"] == body.version), None)
    if row is None:
        raise ApiError(404, f"no policy version {body.version}", code="not_found", param="version")
    if row.get("lifecycle") == Stage.REJECTED:
        raise ApiError(
            409,
            f"policy version {body.version} is rejected: it never serves again",
            code="version_rejected",
            param="version",
        )
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


@router.get("/policy_versions", responses=POLICY_ERRORS)
async def admin_versions(s: PolicyState) -> PolicyVersions:
    """Every version, each with ``available``: whether its weights are still there to roll back to."""

    def read() -> list[dict]:
        return [v | {"available": weights_present(v["path"])} for v in s.store.policy_versions()]

    return PolicyVersions(serving=s.engine.version, versions=await asyncio.to_thread(read))


@router.get("/learner", response_model=LearnerStatus, responses=POLICY_ERRORS)
async def admin_learner(s: PolicyState, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict:
    """The last ``limit`` learner steps (their metrics as the learner stored them), counters,
    ``learning`` (``running`` | ``paused``) and ``rollback_to`` (a requested rollback the learner
    has not carried out yet, or null)."""

    def read() -> dict:
        flags = {"learning": "paused" if get_flag(s.store.engine, PAUSED) == "1" else "running"}
        target = get_flag(s.store.engine, ROLLBACK_TO)
        flags["rollback_to"] = None if target is None else int(target)
        return s.store.learner_status(limit) | flags

    return await asyncio.to_thread(read)


@router.get(
    "/dead_letters", response_model=DeadLetters, response_model_exclude_unset=True, responses=POLICY_ERRORS
)
async def admin_dead_letters(
    s: PolicyState,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    kind: Annotated[Literal[DEAD_LETTER_KINDS] | None, Query()] = None,
    payload: bool = False,
) -> dict:
    """What the learner set aside instead of joining or training it (``core/dead_letters.py``):
    the newest ``limit`` (of ``kind``, if given) with their reasons and log positions, the
    records themselves only with ``payload=true``; ``total``: how many there are."""
    return await asyncio.to_thread(recent_dead_letters, s.store.engine, limit, kind, payload)


@router.get("/evidence/{prompt_id:path}", responses=POLICY_ERRORS)
async def admin_evidence(
    prompt_id: Annotated[EdgeStr, PathParam(min_length=1, max_length=PROMPT_ID_CHARS)], s: PolicyState
) -> PromptEvidence:
    """A prompt's evidence at the served version. The rest of the path is the prompt id, ``/``
    included (a chat's ``prompt_id`` may hold any character; percent-encode the id): the id a
    client sent (looked up by its keyed hash), or a stored id (``p-…``, ``h-…``)."""
    ev = EvidenceStore(s.store.engine)
    stored, row = await asyncio.to_thread(ev.find, s.settings.feedback_secret, prompt_id)
    base = await asyncio.to_thread(ev.read, stored, s.engine.version)
    return PromptEvidence(
        prompt_id=prompt_id,
        stored_as=stored,
        known=row is not None,
        at_version=base.model_dump(),
        n_results=row.n_results if row else 0,
        reward_sum=row.reward_sum if row else 0.0,
    )


@router.get("/evidence", responses=POLICY_ERRORS)
async def admin_uncertain(s: PolicyState, top: Annotated[int, Query(ge=1, le=1000)] = 10) -> UncertainPrompts:
    rows = await asyncio.to_thread(EvidenceStore(s.store.engine).top_uncertain, top, s.engine.version)
    return UncertainPrompts(
        version=s.engine.version, prompts=[{"prompt_id": p, **b.model_dump()} for p, b in rows]
    )


@router.get("/policies", response_model=PolicyList, responses=ADMIN_ERRORS)
async def admin_policies(request: Request) -> dict:
    """Every policy this server serves, the global one first, then the tenant policies in the
    order of ``tenant_policies``: the version each serves, its stage, whether its learner is
    paused, and its newest learner step (``server.admin.protocol.PolicyRow``)."""
    return {"policies": await policy_rows(all_states(request))}


@router.post("/forget", responses=ADMIN_ERRORS | errors(413))
async def admin_forget(body: ForgetRequest, request: Request) -> Forgotten:
    """Forget a ``user`` or an API ``key`` (docs/privacy.md): their trajectories (and every turn
    of their episodes) and feedback are removed from the database and the SQL-table log, the
    learner never reads them again, and their data keys are destroyed, so a Kafka log's copies
    can no longer be read. The request is recorded in every policy's namespace (the global one,
    each tenant policy's, and those of tenant policies removed since or not served by this
    replica, ``server.admin.serving.unserved_namespaces``; ``?policy=`` is not read) before
    anything is removed, then carried out in each; one that a crash interrupts is finished by
    the next forget or retention run.
    The answer is its receipt (``GET /admin/forget/{id}`` reads it again). Idempotent: a subject
    with nothing left gets zeros."""
    target = (
        ForgetTarget(ForgetKind.USER, body.user)
        if body.user is not None
        else ForgetTarget(ForgetKind.KEY, str(body.key))
    )
    now, rid, states = utcnow(), new_request_id(), all_states(request)
    settings = state_of(request).settings
    async with unserved_namespaces(settings, [s.policy for s in states]) as others:
        stores = [(s.store.engine, sql_log_engine(s.log), s.log.keeps_records) for s in states]
        stores += [(u.db, u.log_db, u.keeps_records) for u in others]
        for db, _, _ in stores:
            await asyncio.to_thread(record_request, db, rid, target, now)
        receipts = [
            await asyncio.to_thread(forget, db, log_db, target, settings.feedback_secret, now, rid)
            for db, log_db, _ in stores
        ]
    for s in states:
        s.store.subject_keys.drop_cached()
    return receipt_body(receipts, [keeps for _, _, keeps in stores], target)


@router.get("/forget/{request_id}", responses=ADMIN_ERRORS | errors(404))
async def admin_forget_receipt(
    request_id: Annotated[EdgeStr, PathParam(max_length=NAME_CHARS)], request: Request
) -> Forgotten:
    """The receipt of a past forget (the ``id`` its answer gave): 404 for an unknown id."""
    states = all_states(request)
    async with unserved_namespaces(state_of(request).settings, [s.policy for s in states]) as others:
        stores = [(s.store.engine, s.log.keeps_records) for s in states] + [
            (u.db, u.keeps_records) for u in others
        ]
        found = [(await asyncio.to_thread(receipt_of, db, request_id), keeps) for db, keeps in stores]
    found = [(r, keeps) for r, keeps in found if r is not None]
    if not found:
        raise ApiError(404, f"no forget request {request_id!r}", code="not_found")
    return receipt_body([r for r, _ in found], [keeps for _, keeps in found], None)
