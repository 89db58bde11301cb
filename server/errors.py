"""The server's one error type (OpenAI's error shape), its OpenAPI description, and the
exception handlers that turn every refusal into it.

Handlers: ``ApiError`` as raised; a storage failure anywhere is 503 with ``Retry-After``
(nothing was recorded); FastAPI's HTTP errors and validation errors in the same shape: a body
that is not a JSON object 400 on every route, a bad field 400 (OpenAI's status) except on
feedback, 422 (the feedback contract); any other exception 500 ``internal_error``
(``InternalErrors``).

An error names its class, never its internals: no SQL, bound parameters or exception text of
one request reaches any client (they go to the server's log). A refusal a retry cannot change
says so (``x-should-retry: false``, which the openai SDK obeys instead of sending it again).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.logbus import LogUnavailable
from server.health import RETRY_AFTER_S, STORAGE_ERROR_TYPES, is_storage_error
from server.policy_watch import CatchingUp
from server.schemas import ErrorBody, ErrorResponse

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
FEEDBACK_PATH = "/v1/feedback"
# 4xx a retry of the same request may turn into a success: a body that came too late (408), a
# turn or an episode still being answered (409 ``episode_in_progress``). Every other 4xx is
# final, and says so: the openai SDK retries 408, 409 and 429 unless told not to.
RETRYABLE_STATUSES = frozenset({408, 429})
RETRYABLE_CODES = frozenset({"episode_in_progress"})


def refusal_headers(status: int, code: str | None = None) -> dict[str, str]:
    """Headers of an error answer: ``Retry-After`` on a 503, ``x-should-retry: false`` on a
    final 4xx (every 4xx but ``RETRYABLE_STATUSES`` and ``RETRYABLE_CODES``)."""
    if status == 503:
        return {"Retry-After": str(RETRY_AFTER_S)}
    if 400 <= status < 500 and status not in RETRYABLE_STATUSES and code not in RETRYABLE_CODES:
        return {"x-should-retry": "false"}
    return {}


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, and the offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        """``{"error": {message, type, param, code}}`` (``ErrorResponse``)."""
        err = ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=err).model_dump()

    def response(self) -> JSONResponse:
        """The answer: this body, its status and ``refusal_headers``."""
        return JSONResponse(
            self.body(), status_code=self.status, headers=refusal_headers(self.status, self.code)
        )


ERROR_TEXT = {
    400: "Invalid request (OpenAI answers 400 for a bad body or parameter; `param` names it): "
    "invalid_json (a body that is not a JSON object), invalid_value, unsupported_parameter",
    401: "Missing or wrong admin key; on the API: a missing (keys required), invalid or revoked API "
    "key (invalid_api_key)",
    403: "Forbidden: wrong token, an episode started by another party, or admin routes disabled",
    404: "Unknown model, completion, episode, trajectory or policy version",
    408: "Request headers or body not received in time (request_timeout); the connection is closed",
    409: "Conflict: feedback already given, not a whole answer, episode in progress or rated, a turn "
    "number taken or out of order, a turn of an episode rated by its id (rate_the_episode), a policy "
    "version older than the one served (version_behind)",
    413: "Request body larger than the model's context can hold",
    422: "Invalid feedback body or reward; a refused weights directory",
    429: "Over a rate or concurrency limit of the API key, its tenant or anonymous traffic "
    "(rate_limit_exceeded), or the engine's queue is full (engine_queue_full): nothing was "
    "recorded; retry after Retry-After seconds",
    500: "Generation failed, or an internal error (internal_error); the details are in the server's log",
    503: "Storage unavailable: nothing was recorded; retry after Retry-After seconds",
}


def errors(*statuses: int) -> dict:
    """OpenAPI ``responses`` for these error statuses, all in the OpenAI error shape; ``default``
    keeps FastAPI from documenting its own 422 shape, which this server does not answer."""
    out: dict = {st: {"model": ErrorResponse, "description": ERROR_TEXT[st]} for st in statuses}
    out["default"] = {"model": ErrorResponse, "description": "Any other error, same shape"}
    return out


def printable(part: object) -> str:
    """A validation error's location or message as text that can be encoded (a dict key or an
    unknown field's name may hold a lone surrogate)."""
    return str(part).encode("utf-8", "backslashreplace").decode()


async def api_error(_: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


async def storage_error(request: Request, exc: Exception) -> JSONResponse:
    """A storage failure anywhere is a 503 (nothing was recorded); anything else stays a 500."""
    if not is_storage_error(exc):
        raise exc
    metrics = request.app.state.s.metrics
    if isinstance(exc, CatchingUp):
        metrics.failed_before_generation.labels("not_ready").inc()
        return ApiError(503, f"{exc}; retry later", "server_error", code="not_ready").response()
    if request.url.path == CHAT_PATH:
        metrics.failed_before_generation.labels("storage_unavailable").inc()
    elif request.url.path == FEEDBACK_PATH:
        metrics.feedback.labels("storage_unavailable").inc()
    what = "the log" if isinstance(exc, LogUnavailable) else "the database"
    log.warning("%s %s: %s unavailable: %s", request.method, request.url.path, what, exc)
    return storage_unavailable(what, exc).response()


def storage_unavailable(what: str, exc: BaseException) -> ApiError:
    """The 503 of a request refused because ``what`` ("the log", "the database") is down: it
    names the exception's class, never its text (a failed statement quotes its SQL and bound
    parameters, another request's data)."""
    return ApiError(
        503,
        f"storage unavailable ({what}): the request was not recorded and will not be; retry later "
        f"({exc.__class__.__name__})",
        "server_error",
        code="storage_unavailable",
    )


def allowed_methods(request: Request) -> str:
    """The ``Allow`` header of a 405: the methods of every route on the request's path. Starlette
    names only the first matching route's, so a path served by two routes (``GET`` and ``POST
    /admin/keys``) would hide one (RFC 9110 §15.5.6 asks for all)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = ApiError(exc.status_code, str(exc.detail), "invalid_request_error")
    headers = refusal_headers(exc.status_code) | (exc.headers or {})
    if exc.status_code == 405:
        headers["Allow"] = allowed_methods(request)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=headers)


# Errors on the whole body (its location is just ``body``): absent, or not a JSON object.
NOT_AN_OBJECT = frozenset({"missing", "model_type", "model_attributes_type", "dict_type"})


def where(err: dict) -> str:
    """A validation error's field as a dotted path without ``body`` ("" for the whole body); a
    model-level check names its field in ``ctx.field`` (``server.chat.protocol.unsupported``)."""
    loc = [printable(p) for p in err.get("loc", []) if p != "body"]
    field = (err.get("ctx") or {}).get("field")
    if field is not None and (not loc or loc[-1] != printable(field)):
        loc.append(printable(field))
    return ".".join(loc)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body or parameter the route's model refuses.

    One rule on every route: a body that is not JSON, or not a JSON object, is 400
    ``invalid_json``. A refused field is named in ``param``: 400 ``invalid_value``, or
    ``unsupported_parameter`` for a field this server does not do; on ``/v1/feedback`` a bad
    field is 422 (its contract, docs/design.md §4).
    """
    errs = exc.errors()
    first = errs[0] if errs else {}
    param = where(first)
    if request.url.path == CHAT_PATH:
        request.app.state.s.metrics.failed_before_generation.labels("invalid_request").inc()
    if first.get("type") == "json_invalid":
        err = ApiError(400, "request body is not valid JSON", code="invalid_json")
    elif not param and first.get("type") in NOT_AN_OBJECT:
        kind = request.headers.get("content-type", "")
        sent_as = (
            f" (sent as {printable(kind)!r}, not application/json)" if kind and "json" not in kind else ""
        )
        err = ApiError(400, f"request body is not a JSON object{sent_as}", code="invalid_json")
    elif first.get("type") == "unsupported_parameter":
        err = ApiError(400, printable(first.get("msg")), param=param, code="unsupported_parameter")
    else:
        msg = "; ".join(f"{where(e) or 'body'}: {printable(e.get('msg'))}" for e in errs)
        status = 422 if request.url.path == FEEDBACK_PATH else 400
        err = ApiError(status, msg, param=param or None, code="invalid_value")
    return err.response()


def internal_error(exc: BaseException) -> ApiError:
    """The 500 of an exception no handler knows: its class, and where its details are."""
    return ApiError(
        500,
        f"internal error ({exc.__class__.__name__}); the details are in the server's log",
        "server_error",
        code="internal_error",
    )


class InternalErrors:
    """ASGI middleware: an exception no handler took becomes a 500 in the OpenAI error shape
    (its traceback goes to the server's log), and the connection stays usable.

    Starlette's own last-resort handler answers plain text and re-raises, and uvicorn then
    closes the connection under the client. An exception after the answer has started cannot
    be answered any more: it is re-raised, and the server closes the connection.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            state = getattr(scope["app"].state, "s", None)
            if scope["path"] == CHAT_PATH and state is not None:
                state.metrics.failed_before_generation.labels("internal_error").inc()
            await internal_error(exc).response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Register every handler above on ``app``; ``InternalErrors`` goes outside every middleware
    added before this call."""
    app.add_exception_handler(ApiError, api_error)
    for exc_type in STORAGE_ERROR_TYPES:
        app.add_exception_handler(exc_type, storage_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_middleware(InternalErrors)
