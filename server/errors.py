"""The server's one error type (OpenAI's error shape), its OpenAPI description, and the
exception handlers that turn every refusal into it.

Handlers: ``ApiError`` as raised; a storage failure anywhere is 503 with ``Retry-After``
(nothing was recorded); FastAPI's HTTP errors and validation errors in the same shape: a body
that is not a JSON object 400 on every route, a bad field 400 (OpenAI's status) except on
feedback, 422 (the feedback contract).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.logbus import LogUnavailable
from server.health import RETRY_AFTER_S, STORAGE_ERROR_TYPES, is_storage_error
from server.schemas import ErrorBody, ErrorResponse

CHAT_PATH = "/v1/chat/completions"
FEEDBACK_PATH = "/v1/feedback"


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


ERROR_TEXT = {
    400: "Invalid request (OpenAI answers 400 for a bad body or parameter; `param` names it): "
    "invalid_json (a body that is not a JSON object), invalid_value, unsupported_parameter",
    401: "Missing or wrong admin key",
    403: "Forbidden: wrong token, an episode started by another party, or admin routes disabled",
    404: "Unknown model, completion, episode, trajectory or policy version",
    408: "Request headers or body not received in time (request_timeout); the connection is closed",
    409: "Conflict: feedback already given, not a whole answer, episode in progress or rated, a turn "
    "number taken or out of order, a turn of an episode rated by its id (rate_the_episode)",
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


def printable(part: object) -> str:
    """A validation error's location or message as text that can be encoded (a dict key or an
    unknown field's name may hold a lone surrogate)."""
    return str(part).encode("utf-8", "backslashreplace").decode()


async def api_error(_: Request, exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def storage_error(request: Request, exc: Exception) -> JSONResponse:
    """A storage failure anywhere is a 503 (nothing was recorded); anything else stays a 500."""
    if not is_storage_error(exc):
        raise exc
    if request.url.path == CHAT_PATH:
        request.app.state.s.metrics.failed_before_generation.labels("storage_unavailable").inc()
    what = "the log" if isinstance(exc, LogUnavailable) else "the database"
    err = ApiError(
        503,
        f"storage unavailable ({what}): the request was not recorded and will not be; retry later "
        f"({exc.__class__.__name__})",
        "server_error",
        code="storage_unavailable",
    )
    return JSONResponse(err.body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = ApiError(exc.status_code, str(exc.detail), "invalid_request_error")
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


# Errors on the whole body (its location is just ``body``): absent, or not a JSON object.
NOT_AN_OBJECT = frozenset({"missing", "model_type", "model_attributes_type", "dict_type"})


def where(err: dict) -> str:
    """A validation error's field as a dotted path without ``body`` ("" for the whole body); a
    model-level check names its field in ``ctx.field`` (``server.schemas.unsupported``)."""
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
    field is 422 (its contract, DESIGN §4).
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
    return JSONResponse(err.body(), status_code=err.status)


def install_error_handlers(app: FastAPI) -> None:
    """Register every handler above on ``app``."""
    app.add_exception_handler(ApiError, api_error)
    for exc_type in STORAGE_ERROR_TYPES:
        app.add_exception_handler(exc_type, storage_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
