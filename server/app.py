"""The HTTP server: OpenAI-compatible chat on the policy engine, feedback, admin routes.

Every chat request that reaches generation yields exactly one trajectory record, durable in
the log before the client receives its last byte (DESIGN §4). FastAPI/pydantic do the HTTP
and validation work; the engine, the log and the database are injected so tests can share
one vLLM engine between apps with different log backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.control import PAUSED, ROLLBACK_TO, set_flag
from core.db import make_engine, migrate
from core.evidence_store import EvidenceStore
from core.logbus import LogTransport, LogUnavailable, open_log
from core.records import (
    TOPIC_FEEDBACK,
    TOPIC_TRAJECTORIES,
    FeedbackRecord,
    FrozenBaseline,
    check_feedback_token,
    utcnow,
)
from core.settings import Settings, get_settings
from server.chat import complete_chat, extension_headers, prepare_rollout, stream_chat
from server.engine import PolicyEngine, SwapRefused
from server.health import RETRY_AFTER_S, STORAGE_ERROR_TYPES, Health, is_storage_error
from server.limits import BodySizeLimit, max_body_bytes
from server.metrics import ServerMetrics
from server.policy_watch import PolicyWatcher
from server.schemas import (
    ChatCompletionRequest,
    EdgeStr,
    ErrorResponse,
    FeedbackRequest,
    LoadPolicyRequest,
    RollbackRequest,
)
from server.spool import Spool
from server.state import ApiError, BaselineReader, ServerState, episode_token_subject
from server.store import NOT_WHOLE, ServerStore

log = logging.getLogger(__name__)

DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_text()

ERROR_TEXT = {
    400: "Invalid request (OpenAI answers 400 for a bad body or parameter; `param` names it)",
    401: "Missing or wrong admin key",
    403: "Forbidden: wrong token, an episode started by another party, or admin routes disabled",
    404: "Unknown model, completion, episode, trajectory or policy version",
    409: "Conflict: feedback already given, not a whole answer, episode in progress or rated",
    413: "Request body larger than the model's context can hold",
    422: "Invalid feedback body or reward; a refused weights directory",
    500: "Generation failed",
    503: "Storage unavailable: nothing was recorded; retry after Retry-After seconds",
}


def errors(*statuses: int) -> dict:
    """OpenAPI ``responses`` for these error statuses, all in the OpenAI error shape; ``default``
    keeps FastAPI from documenting its own 422 shape, which this server does not answer."""
    out: dict = {st: {"model": ErrorResponse, "description": ERROR_TEXT[st]} for st in statuses}
    out["default"] = {"model": ErrorResponse, "description": "Any other error, same shape"}
    return out


ADMIN_ERRORS = errors(400, 401, 403, 503)
CHAT_200 = {
    200: {
        "description": "A chat.completion; with stream: true, chat.completion.chunk server-sent events",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


def create_app(
    settings: Settings | None = None,
    engine: PolicyEngine | None = None,
    log_transport: LogTransport | None = None,
    read_baseline: BaselineReader | None = None,
    watch_policy: bool = True,
) -> FastAPI:
    """The FastAPI app. Without ``engine`` it starts (and stops) its own vLLM engine."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        db_url = settings.resolved_database_url
        await asyncio.to_thread(migrate, db_url)
        db = make_engine(db_url)
        own_engine = engine is None
        eng = engine or await PolicyEngine.start(settings)
        lt = log_transport or open_log(settings.resolved_log_url)
        spool = None if settings.log_required else Spool(settings.home / "spool", lt, ServerStore(db))
        reader = read_baseline or evidence_reader(EvidenceStore(db))
        health = Health(db, lt, settings.log_required)
        state = ServerState(settings, eng, lt, ServerStore(db), ServerMetrics(), spool, reader, health)
        state.metrics.policy_version.set(eng.version)
        app.state.s = state
        watcher = PolicyWatcher(lt, eng, state.metrics) if watch_policy else None
        tasks = []
        if watcher is not None:
            await watcher.catch_up()
            tasks.append(asyncio.create_task(watcher.run()))
        if spool is not None:
            tasks.append(asyncio.create_task(spool.run()))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            if state.background:
                await asyncio.gather(*state.background, return_exceptions=True)
            state.log_pool.shutdown(wait=False)
            if state.deferred_writes:
                log.warning("%d deferred database writes not done at shutdown", len(state.deferred_writes))
                for t in list(state.deferred_writes):
                    t.cancel()
            if log_transport is None:
                lt.close()
            db.dispose()
            if own_engine:
                eng.shutdown()

    app = FastAPI(title="saoserve", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes(settings.max_model_len))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def _storage_error(request: Request, exc: Exception) -> JSONResponse:
        """A storage failure anywhere is a 503 (nothing was recorded); anything else stays a 500."""
        if not is_storage_error(exc):
            raise exc
        s = request.app.state.s
        if request.url.path == "/v1/chat/completions":
            s.metrics.failed_before_generation.labels("storage_unavailable").inc()
        what = "the log" if isinstance(exc, LogUnavailable) else "the database"
        err = ApiError(
            503,
            f"storage unavailable ({what}): the request was not recorded and will not be; retry later "
            f"({exc.__class__.__name__})",
            "server_error",
            code="storage_unavailable",
        )
        return JSONResponse(err.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    for exc_type in STORAGE_ERROR_TYPES:
        app.add_exception_handler(exc_type, _storage_error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [printable(p) for p in first.get("loc", []) if p != "body"]
        if first.get("type") == "json_invalid":
            msg, loc = "request body is not valid JSON", []
        else:
            msg = "; ".join(
                f"{'.'.join(printable(p) for p in e.get('loc', []) if p != 'body') or 'body'}: "
                f"{printable(e.get('msg'))}"
                for e in errs
            )
        # OpenAI answers 400 for a bad chat request; the feedback contract says 422.
        status = 422 if request.url.path == "/v1/feedback" else 400
        if request.url.path == "/v1/chat/completions":
            request.app.state.s.metrics.failed_before_generation.labels("invalid_request").inc()
        err = ApiError(status, msg, param=".".join(loc) or None, code="invalid_value")
        return JSONResponse(err.body(), status_code=status)

    def state_of(request: Request) -> ServerState:
        return request.app.state.s

    def require_admin(request: Request) -> None:
        key = request.app.state.s.settings.admin_key
        given = request.headers.get("authorization", "")
        if not key:
            raise ApiError(
                403, "admin routes are disabled: SAOSERVE_ADMIN_KEY is not set", "permission_error"
            )
        if not given.startswith("Bearer ") or not hmac.compare_digest(given[7:].encode(), key.encode()):
            raise ApiError(
                401, "admin routes need 'Authorization: Bearer <admin key>'", "authentication_error"
            )

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        """200 when the engine runs and the database and the log answer; 503 naming what is down."""
        s = state_of(request)
        deps = await s.health.report()
        deps["engine"] = "ok" if s.engine.engine is not None else "not running"
        ok = all(v == "ok" for v in deps.values())
        body = {"ready": ok, "policy_version": s.engine.version, **deps}
        if ok:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        s = state_of(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": s.settings.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "saoserve",
                    "policy_version": s.engine.version,
                    "max_model_len": s.settings.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions", responses=CHAT_200 | errors(400, 403, 404, 409, 413, 500, 503))
    async def chat(req: ChatCompletionRequest, request: Request):
        s = state_of(request)
        try:
            rollout, sampling = await prepare_rollout(s, req)
        except ApiError as exc:
            s.metrics.failed_before_generation.labels(exc.code or "invalid").inc()
            raise
        if req.stream:
            return StreamingResponse(
                stream_chat(s, req, rollout, sampling),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **extension_headers(s, rollout)},
            )
        return await complete_chat(s, req, rollout, sampling)

    @app.post("/v1/feedback", status_code=202, responses=errors(403, 404, 409, 413, 422, 503))
    async def feedback(body: FeedbackRequest, request: Request) -> JSONResponse:
        s = state_of(request)
        secret = s.settings.feedback_secret
        if body.id is not None:
            traj = await asyncio.to_thread(s.store.find_trajectory, body.id)
            if traj is None:
                s.metrics.feedback.labels("unknown").inc()
                raise ApiError(404, f"no completion with id {body.id!r}", code="not_found", param="id")
            subject, prompt_id, target = body.id, traj.prompt_id, f"t:{body.id}"
            finish_reason = traj.finish_reason
        else:
            prompt_id = await asyncio.to_thread(s.store.episode_prompt_id, body.episode_id)
            if prompt_id is None:
                s.metrics.feedback.labels("unknown").inc()
                raise ApiError(
                    404, f"no episode with id {body.episode_id!r}", code="not_found", param="episode_id"
                )
            subject, target = episode_token_subject(body.episode_id), f"e:{body.episode_id}"
            finish_reason = None
        if not check_feedback_token(secret, subject, body.feedback_token):
            s.metrics.feedback.labels("bad_token").inc()
            raise ApiError(
                403,
                "feedback_token does not match this completion",
                "permission_error",
                param="feedback_token",
            )
        if finish_reason in NOT_WHOLE:
            s.metrics.feedback.labels("not_whole").inc()
            raise not_whole(f"completion {body.id!r} ended with finish_reason {finish_reason!r}")
        if not await asyncio.to_thread(s.store.claim, target):
            s.metrics.feedback.labels("duplicate").inc()
            raise ApiError(
                409, "feedback was already given for this completion (first wins)", code="conflict"
            )
        if body.episode_id is not None:
            # Read after the claim is taken: a turn dispatched from now on sees the claim and is
            # refused, so no turn can join the episode unseen (ServerStore.start_episode_turn).
            ep = await asyncio.to_thread(s.store.episode_state, body.episode_id)
            if ep.turns_in_flight or ep.not_whole_turns:
                await asyncio.to_thread(s.store.release, target)
            if ep.turns_in_flight:
                s.metrics.feedback.labels("episode_in_progress").inc()
                raise ApiError(
                    409,
                    f"episode {body.episode_id!r} has a turn in progress; rate it once its last answer is whole",
                    param="episode_id",
                    code="episode_in_progress",
                )
            if ep.not_whole_turns:
                s.metrics.feedback.labels("not_whole").inc()
                raise not_whole(
                    f"episode {body.episode_id!r} has {ep.not_whole_turns} aborted or failed turn(s)"
                )
        rec = FeedbackRecord(
            trajectory_id=body.id,
            episode_id=body.episode_id if body.id is None else None,
            prompt_id=prompt_id,
            reward=body.value,
            source=body.source,
            received_at=utcnow(),
        )
        try:
            await s.append(TOPIC_FEEDBACK, prompt_id, rec.to_json())
        except LogUnavailable as exc:
            await asyncio.to_thread(s.store.release, target)
            s.metrics.log_failures.labels(TOPIC_FEEDBACK).inc()
            raise ApiError(503, f"feedback log unavailable, retry later: {exc}", "server_error") from exc
        await s.mark_received(target, rec.reward)
        s.metrics.feedback.labels("accepted").inc()
        return JSONResponse({"status": "accepted", "target": target, "reward": rec.reward}, status_code=202)

    @app.get(
        "/admin/trajectories/{trajectory_id}",
        dependencies=[Depends(require_admin)],
        responses=ADMIN_ERRORS | errors(404),
    )
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
            raise ApiError(
                404, f"trajectory {trajectory_id!r} is indexed but not in the log", code="not_found"
            )
        return Response(entries[0].value, media_type="application/json")

    @app.post(
        "/admin/load_policy", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS | errors(413, 422)
    )
    async def admin_load_policy(body: LoadPolicyRequest, request: Request) -> dict:
        s = state_of(request)
        try:
            res = await s.engine.swap(body.version, Path(body.path), body.sha256)
        except SwapRefused as exc:
            s.metrics.swaps.labels("refused").inc()
            raise ApiError(422, str(exc), code="swap_refused") from exc
        s.metrics.swaps.labels("ok").inc()
        s.metrics.swap_seconds.observe(res.seconds)
        s.metrics.policy_version.set(res.version)
        return {"policy_version": res.version, "seconds": res.seconds, "paused_seconds": res.paused_seconds}

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(DASHBOARD_HTML)

    @app.get("/dashboard/data", responses=errors(503))
    async def dashboard_data(request: Request) -> dict:
        """Aggregates only (no prompts or texts), so operators can watch without the admin key."""
        s = state_of(request)
        status = await asyncio.to_thread(s.store.learner_status, 500)
        keys = (
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
        steps = [{k: st.get(k) for k in keys} for st in status["steps"]]
        rps = await asyncio.to_thread(s.store.request_rate, 10, 60)
        return {
            "policy_version": s.engine.version,
            "steps": steps,
            "requests_per_s": rps,
            "counters": status["counters"],
        }

    @app.post("/admin/pause", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS)
    async def admin_pause(request: Request) -> dict:
        await asyncio.to_thread(set_flag, state_of(request).store.engine, PAUSED, "1")
        return {"learning": "paused"}

    @app.post("/admin/resume", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS)
    async def admin_resume(request: Request) -> dict:
        await asyncio.to_thread(set_flag, state_of(request).store.engine, PAUSED, None)
        return {"learning": "running"}

    @app.post(
        "/admin/rollback", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS | errors(404, 413)
    )
    async def admin_rollback(body: RollbackRequest, request: Request) -> dict:
        s = state_of(request)
        versions = await asyncio.to_thread(s.store.policy_versions)
        if body.version not in {v["version"] for v in versions}:
            raise ApiError(404, f"no policy version {body.version}", code="not_found", param="version")
        await asyncio.to_thread(set_flag, s.store.engine, ROLLBACK_TO, str(body.version))
        return {"rollback_to": body.version, "status": "requested"}

    @app.get("/admin/policy_versions", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS)
    async def admin_versions(request: Request) -> dict:
        s = state_of(request)
        return {"serving": s.engine.version, "versions": await asyncio.to_thread(s.store.policy_versions)}

    @app.get("/admin/learner", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS)
    async def admin_learner(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict:
        s = state_of(request)
        return await asyncio.to_thread(s.store.learner_status, limit)

    @app.get("/admin/evidence/{prompt_id}", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS)
    async def admin_evidence(
        prompt_id: Annotated[EdgeStr, PathParam(max_length=128)], request: Request
    ) -> dict:
        s = state_of(request)
        ev = EvidenceStore(s.store.engine)
        row = await asyncio.to_thread(ev.get, prompt_id)
        base = await asyncio.to_thread(ev.read, prompt_id, s.engine.version)
        return {
            "prompt_id": prompt_id,
            "known": row is not None,
            "at_version": base.model_dump(),
            "n_results": row.n_results if row else 0,
            "reward_sum": row.reward_sum if row else 0.0,
        }

    @app.get("/admin/evidence", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS)
    async def admin_uncertain(request: Request, top: Annotated[int, Query(ge=1, le=1000)] = 10) -> dict:
        s = state_of(request)
        ev = EvidenceStore(s.store.engine)
        rows = await asyncio.to_thread(ev.top_uncertain, top, s.engine.version)
        return {"version": s.engine.version, "prompts": [{"prompt_id": p, **b.model_dump()} for p, b in rows]}

    return app


def printable(part: object) -> str:
    """A validation error's location or message as text that can be encoded (a dict key or an
    unknown field's name may hold a lone surrogate)."""
    return str(part).encode("utf-8", "backslashreplace").decode()


def not_whole(what: str) -> ApiError:
    """Feedback on an answer that is not whole: refused, never trained as an answer (DESIGN §8)."""
    return ApiError(409, f"{what}: not a whole answer, feedback refused", code="not_a_whole_answer")


def evidence_reader(store: EvidenceStore) -> BaselineReader:
    """Dispatch freeze (SPO++ §2.2): the prompt's evidence read at the dispatch version."""

    async def read(prompt_id: str, version: int) -> FrozenBaseline:
        return await asyncio.to_thread(store.read, prompt_id, version)

    return read
