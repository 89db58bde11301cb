"""The chat completion path: validate, render, dispatch (freeze version and evidence),
generate, answer in OpenAI's shapes (``server.schemas.ChatCompletion``, or SSE of
``ChatCompletionChunk``). Each request's one trajectory is written by its ``server.fate.Fate``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from core.claims import episode_token_subject
from core.logbus import LogUnavailable
from core.records import (
    SamplingRecord,
    check_feedback_token,
    feedback_token,
    prompt_id_for,
    utcnow,
)
from server.auth import Caller
from server.engine import GenerationDelta
from server.errors import ApiError, internal_error
from server.fate import Fate
from server.limits import max_message_chars
from server.rollout import Rollout
from server.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    Usage,
)
from server.state import ServerState

log = logging.getLogger(__name__)


# OpenAI's ``developer`` role is what its newer models call the system message; the chat
# template (and the prompt id) sees it as ``system``.
TEMPLATE_ROLE = {"developer": "system"}


def messages_of(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template takes them (``developer`` rendered as ``system``)."""
    return [{"role": TEMPLATE_ROLE.get(m.role, m.role), "content": m.text()} for m in req.messages]


def task_messages(msgs: list[dict], episodic: bool) -> list[dict]:
    """The messages that identify the task: all of them, or for an episode, up to its first
    user message (so every turn of an episode shares one prompt id and one partition)."""
    if not episodic:
        return msgs
    for i, m in enumerate(msgs):
        if m["role"] == "user":
            return msgs[: i + 1]
    return msgs


def trains(req: ChatCompletionRequest, caller: Caller) -> bool:
    """Whether the learner may train on this request's answer: ``store: false`` (OpenAI's
    field) opts out, and so does the caller's API key when its ``train`` setting is off; the
    answer is still logged, marked ``train: false`` (docs/privacy.md). The one place that decides."""
    return req.store is not False and caller.train


async def prepare_rollout(s: ServerState, req: ChatCompletionRequest, caller: Caller):
    """Validate against the model, render the prompt, freeze the dispatch state; ``caller``: the
    authenticated key (``server.auth``), whose training setting joins the request's."""
    from jinja2 import TemplateError
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    st = s.settings
    if req.model is not None and req.model != st.served_model_name:
        raise ApiError(
            404,
            f"model {req.model!r} does not exist; this server serves {st.served_model_name!r}",
            param="model",
            code="model_not_found",
        )
    msgs = messages_of(req)
    n_chars = sum(len(m["content"]) for m in msgs)
    if n_chars > max_message_chars(st.max_model_len):
        # Cannot fit the context whatever the tokenizer does: refused without tokenising.
        raise ApiError(
            400,
            f"the messages hold {n_chars} characters, more than a context of {st.max_model_len} "
            f"tokens can hold ({max_message_chars(st.max_model_len)})",
            param="messages",
            code="context_length_exceeded",
        )
    try:
        prompt_ids = await asyncio.to_thread(s.engine.render, msgs)
    except Exception as exc:  # the chat template rejects an ordering it cannot render
        # A template's own refusal (raise_exception) is about these messages; any other
        # exception's text is the server's, named by its class only.
        why = exc.message if isinstance(exc, TemplateError) and exc.message else exc.__class__.__name__
        log.info("chat template refused the messages: %r", exc)
        raise ApiError(
            400,
            f"messages cannot be rendered by the chat template: {why}",
            param="messages",
            code="invalid_messages",
        ) from exc
    n_prompt = len(prompt_ids)
    if n_prompt >= st.max_model_len:
        raise ApiError(
            400,
            f"the prompt is {n_prompt} tokens; this model's context is {st.max_model_len} tokens",
            param="messages",
            code="context_length_exceeded",
        )
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = min(st.default_max_tokens, st.max_model_len - n_prompt)
    elif max_tokens > st.max_tokens_limit:
        raise ApiError(
            400, f"max_tokens must be at most {st.max_tokens_limit}", param="max_tokens", code="invalid_value"
        )
    elif n_prompt + max_tokens > st.max_model_len:
        raise ApiError(
            400,
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of "
            f"{st.max_model_len} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    # -1, 0 and any value >= the vocabulary all leave top-k off; recorded as 0.
    top_k = req.top_k if 0 < req.top_k < len(s.engine.tokenizer) else 0
    try:
        sampling = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            seed=req.seed,
            stop=req.stop,
        )
    except (ValueError, VLLMValidationError) as exc:  # vLLM's own parameter checks
        raise ApiError(400, f"invalid sampling parameters: {exc}", code="invalid_value") from exc
    # Storage known down: refuse now (503) rather than generate an answer that cannot be recorded.
    await s.require_storage()
    prompt_id = req.prompt_id or prompt_id_for(task_messages(msgs, req.episode_id is not None))
    version, arm = s.dispatch()
    baseline = await s.read_baseline(prompt_id, version) if s.read_baseline else None
    rollout_id = f"chatcmpl-{uuid.uuid4().hex}"
    turn = await start_episode_turn(s, req, rollout_id) if req.episode_id is not None else None
    rollout = Rollout(
        id=rollout_id,
        prompt_id=prompt_id,
        model=st.served_model_name,
        prompt_token_ids=prompt_ids,
        sampling=SamplingRecord(
            temperature=req.temperature, top_p=req.top_p, top_k=top_k, max_tokens=max_tokens, seed=req.seed
        ),
        dispatch_version=version,
        created_at=utcnow(),
        baseline=baseline,
        episode_id=req.episode_id,
        turn=turn,
        train=trains(req, caller),
        user=req.user,
        arm=arm,
    )
    return rollout, sampling


async def start_episode_turn(s: ServerState, req: ChatCompletionRequest, rollout_id: str) -> int:
    """Only the party that started an episode extends it (docs/design.md §8), and its turns come in
    order: 0, 1, 2..., each number once, each once the one before is answered.

    A chat with a new ``episode_id`` starts it (at turn 0); a later turn presents
    ``episode_token`` (the ``episode_feedback_token`` its first turn returned). Returns the
    turn's number (``req.turn``, or the next one when the request gave none). Raises ApiError
    403 for someone else's episode, 409 once the episode is rated, for a number already taken
    (``duplicate_turn``), out of order (``turn_out_of_order``) or sent while the previous turn
    is still being answered (``episode_in_progress``); nothing has been generated or logged then.
    """
    ep = req.episode_id
    subject = episode_token_subject(ep)
    token_ok = req.episode_token is not None
    if token_ok and not check_feedback_token(s.settings.feedback_secret, subject, req.episode_token):
        raise ApiError(
            403, "episode_token does not match this episode", "permission_error", "episode_token", "bad_token"
        )
    got = await asyncio.to_thread(s.store.start_episode_turn, ep, rollout_id, token_ok, req.turn)
    if got.outcome == "ok":
        return got.turn
    if got.outcome == "not_yours":
        raise ApiError(
            403,
            f"episode {ep!r} was started by another request; later turns must send its "
            "episode_feedback_token as episode_token (a new episode needs a new episode_id)",
            "permission_error",
            "episode_id",
            "episode_not_yours",
        )
    if got.outcome == "rated":
        raise ApiError(
            409, f"episode {ep!r} is rated and takes no more turns", param="episode_id", code="episode_rated"
        )
    if got.outcome == "taken":
        state = "in progress" if got.in_flight == got.turn else "answered"
        raise ApiError(
            409,
            f"turn {got.turn} of episode {ep!r} is already {state}: each turn number is used once "
            f"(the next turn is {got.next_turn})",
            param="turn",
            code="duplicate_turn",
        )
    if got.outcome == "in_progress":
        raise ApiError(
            409,
            f"episode {ep!r} has turn {got.in_flight} in progress: send turn {got.turn} once its answer "
            "is complete",
            param="turn",
            code="episode_in_progress",
        )
    if got.outcome == "out_of_order":
        raise ApiError(
            409,
            f"turn {got.turn} of episode {ep!r} is out of order: turns are numbered 0, 1, 2... in "
            f"order, and the next turn is {got.next_turn}",
            param="turn",
            code="turn_out_of_order",
        )
    raise ApiError(
        409,
        f"episode {ep!r} has {got.turn} turns, the most an episode may have",
        param="episode_id",
        code="episode_full",
    )


def extension_fields(s: ServerState, rollout: Rollout) -> dict:
    """The documented response extension: policy version at dispatch and feedback tokens."""
    secret = s.settings.feedback_secret
    out = {
        "policy_version": rollout.dispatch_version,
        "prompt_id": rollout.prompt_id,
        "feedback_token": feedback_token(secret, rollout.id),
    }
    if rollout.episode_id is not None:
        out["episode_feedback_token"] = feedback_token(secret, episode_token_subject(rollout.episode_id))
    return out


def answer_head(s: ServerState, rollout: Rollout) -> dict:
    """The fields an answer and each of its chunks have besides the choices and usage: id,
    creation time (s), model and the extension fields."""
    created = int(rollout.created_at.timestamp())
    return {"id": rollout.id, "created": created, "model": rollout.model, **extension_fields(s, rollout)}


def extension_headers(s: ServerState, rollout: Rollout) -> dict[str, str]:
    """The extension fields as response headers, for clients that return the message but drop
    unknown body fields (LangChain's ``ChatOpenAI`` with ``include_response_headers=True``,
    LiteLLM's ``_hidden_params``). Known at dispatch, so a stream sends them too."""
    ext = extension_fields(s, rollout)
    out = {
        "x-completion-id": rollout.id,
        "x-policy-version": str(ext["policy_version"]),
        "x-feedback-token": ext["feedback_token"],
    }
    if "episode_feedback_token" in ext:
        out["x-episode-feedback-token"] = ext["episode_feedback_token"]
    return out


# vLLM's server clamps -inf (a token outside top-p/top-k) to this; JSON has no infinities.
MIN_LOGPROB = -9999.0


def token_entry(text: bytes, logprob: float) -> dict:
    """One token in OpenAI's logprob shape: its text, its UTF-8 bytes, its logprob (nats).

    A token that ends inside a character (part of an emoji) is not text by itself: its
    ``token`` is ``bytes:\\xf0\\x9f`` as OpenAI writes it, and ``bytes`` holds the raw bytes, so
    the bytes of consecutive tokens join into the answer's UTF-8.
    """
    try:
        token = text.decode()
    except UnicodeDecodeError:
        token = "bytes:" + "".join(f"\\x{b:02x}" for b in text)
    return {"token": token, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text)}


def logprobs_body(
    s: ServerState,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[list[tuple[int, float]]] | None = None,
) -> dict:
    """``choices[].logprobs`` for these tokens: each sampled token with its processed logprob
    (the one logged for the learner) and, when asked, the most likely tokens by rank.

    One entry per sampled token, the end-of-sequence token included (its text is empty: the
    engine skips special tokens in the answer). With a stop string the entries still hold every
    sampled token (the ones that spelled it too), while the content ends before it.
    """
    top_logprobs = top_logprobs or [[] for _ in token_ids]
    alt_ids = sorted({t for alts in top_logprobs for t, _ in alts})
    alt_bytes = dict(zip(alt_ids, s.engine.token_bytes(alt_ids), strict=True))
    content = []
    for b, lp, alts in zip(s.engine.token_bytes(token_ids), logprobs, top_logprobs, strict=True):
        entry = token_entry(b, lp)
        entry["top_logprobs"] = [token_entry(alt_bytes[t], alp) for t, alp in alts]
        content.append(entry)
    return {"content": content}


def usage_of(rollout: Rollout) -> Usage:
    n_p, n_c = len(rollout.prompt_token_ids), len(rollout.token_ids)
    return Usage(prompt_tokens=n_p, completion_tokens=n_c, total_tokens=n_p + n_c)


def top_logprobs_of(req: ChatCompletionRequest) -> int:
    """How many alternatives per token the request asks the engine for (0 without logprobs)."""
    return (req.top_logprobs or 0) if req.logprobs else 0


def generation_failed(exc: BaseException) -> ApiError:
    """The 500 of a generation the engine broke off: the exception's class, never its text
    (logged by the caller)."""
    return ApiError(
        500,
        f"generation failed ({exc.__class__.__name__}); the details are in the server's log",
        "server_error",
        code="generation_failed",
    )


def not_recorded(exc: BaseException) -> ApiError:
    """The 503 of an answer the trajectory log refused (so it was not given)."""
    return ApiError(
        503,
        f"trajectory log unavailable, the answer was not recorded ({exc.__class__.__name__}); retry later",
        "server_error",
        code="storage_unavailable",
    )


# Status of the answer to a client that left before it (nginx's "client closed request"):
# nobody reads it; it names the outcome in the access log.
CLIENT_GONE = 499


def generation(s: ServerState, rollout: Rollout, sampling, n_top: int):
    """The engine's stream of deltas for ``rollout`` (at its dispatch version, with ``n_top``
    top logprobs per token), closed when the caller's ``async with`` ends (an abort then reaches
    the engine)."""
    return contextlib.aclosing(
        s.engine.generate(
            rollout.prompt_token_ids,
            sampling,
            rollout.id,
            top_logprobs=n_top,
            version=rollout.dispatch_version,
        )
    )


async def until_done_or_gone(work: Awaitable[None], gone: Awaitable[None] | None) -> bool:
    """Run ``work`` to its end and return True; if ``gone`` (the client disconnecting) completes
    first, cancel ``work`` (the engine aborts its request) and return False. Exceptions of
    ``work`` propagate; a cancelled caller cancels both."""
    task = asyncio.ensure_future(work)
    if gone is None:
        await task
        return True
    watcher = asyncio.ensure_future(gone)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def complete_chat(
    s: ServerState,
    req: ChatCompletionRequest,
    fate: Fate,
    sampling,
    client_gone: Awaitable[None] | None = None,
) -> Response:
    """The answer as one ``chat.completion``, generated to its end unless ``client_gone``
    (returns once the client has disconnected) completes first: then the engine request is
    aborted and the answer is status 499. Settles ``fate`` on every path: answered (200, or 503
    when the log refused the record), aborted (the client left, or this handler was cancelled),
    failed (500)."""
    rollout = fate.rollout
    text_parts: list[str] = []
    tops: list[list[tuple[int, float]]] = []
    n_top = top_logprobs_of(req)

    async def generate() -> None:
        async with generation(s, rollout, sampling, n_top) as gen:
            async for d in gen:
                rollout.add(d)
                text_parts.append(d.text)
                tops.extend(d.top_logprobs)

    s.metrics.in_flight.inc()
    try:
        finished = await until_done_or_gone(generate(), client_gone)
    except asyncio.CancelledError:
        fate.aborted()
        raise
    except Exception as exc:
        log.exception("generation of %s failed", rollout.id)
        fate.failed()
        raise generation_failed(exc) from exc
    finally:
        s.metrics.in_flight.dec()
    if not finished:
        fate.aborted()
        return Response(status_code=CLIENT_GONE)
    try:
        rec = await fate.answered()
    except LogUnavailable as exc:
        raise not_recorded(exc) from exc
    logprobs = (
        logprobs_body(s, rec.response_token_ids, rec.rollout_logprobs, tops if n_top else None)
        if req.logprobs
        else None
    )
    body = ChatCompletion(
        **answer_head(s, rollout),
        choices=[
            Choice(
                message=AssistantMessage(content="".join(text_parts)),
                finish_reason=rec.finish_reason,
                logprobs=logprobs,
            )
        ],
        usage=usage_of(rollout),
    )
    return JSONResponse(body.model_dump(mode="json"), headers=extension_headers(s, rollout))


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChatStream(StreamingResponse):
    """A streamed answer (``chunks``) that settles its request when it ends: the generator is
    closed as soon as the response ends (a client that left has its abort written now, not when
    the generator is collected), then ``Fate.left`` settles a stream that never began."""

    media_type = "text/event-stream"

    def __init__(self, fate: Fate, events: AsyncGenerator[str, None], headers: dict[str, str]):
        super().__init__(events, headers=headers)
        self.fate, self.events = fate, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()
            self.fate.left()


def stream_chat(s: ServerState, req: ChatCompletionRequest, fate: Fate, sampling) -> ChatStream:
    """The answer as server-sent events (``chunks``), with the extension headers."""
    headers = {"Cache-Control": "no-cache", **extension_headers(s, fate.rollout)}
    return ChatStream(fate, chunks(s, req, fate, sampling), headers)


async def chunks(
    s: ServerState, req: ChatCompletionRequest, fate: Fate, sampling
) -> AsyncGenerator[str, None]:
    """SSE events of ``ChatCompletionChunk`` in OpenAI's shape, then ``data: [DONE]``.

    With ``stream_options.include_usage`` a last chunk with empty ``choices`` carries the
    usage, and every chunk before it has ``usage: null`` (the OpenAI spec).

    Settles ``fate``: a client that disconnects cancels or closes this generator, which aborts
    the engine request and the fate. An error ends the stream with one event in the OpenAI error
    shape: ``generation_failed`` (the fate failed), ``not_recorded`` (the log refused the whole
    answer) or ``internal_error`` (after the answer was recorded).
    """
    rollout = fate.rollout
    head = answer_head(s, rollout)
    include_usage = bool((req.stream_options or {}).get("include_usage"))

    def event(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(**head, usage=usage, choices=choices)
        return sse(chunk.model_dump(mode="json", exclude=None if include_usage else {"usage"}))

    def logprobs_of(d: GenerationDelta) -> dict:
        return logprobs_body(s, d.token_ids, d.logprobs, d.top_logprobs)

    n_top = top_logprobs_of(req)
    last = None
    s.metrics.in_flight.inc()
    try:
        yield event([ChunkChoice(delta=Delta(role="assistant", content=""), finish_reason=None)])
        async with generation(s, rollout, sampling, n_top) as gen:
            async for d in gen:
                rollout.add(d)
                last = d
                if d.finish_reason is not None:
                    break
                if d.text or (req.logprobs and d.token_ids):
                    lps = logprobs_of(d) if req.logprobs else None
                    yield event([ChunkChoice(delta=Delta(content=d.text), finish_reason=None, logprobs=lps)])
        try:
            rec = await fate.answered()
        except LogUnavailable as exc:
            yield sse(not_recorded(exc).body())
            return
        tail = last if last is not None and last.finish_reason is not None else None
        text = tail.text if tail is not None and tail.text else None
        lps = logprobs_of(tail) if req.logprobs and tail is not None and tail.token_ids else None
        yield event([ChunkChoice(delta=Delta(content=text), finish_reason=rec.finish_reason, logprobs=lps)])
        if include_usage:
            yield event([], usage_of(rollout))
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        if not fate.settled:
            fate.aborted()
        raise
    except Exception as exc:
        log.exception("stream %s failed", rollout.id)
        if fate.settled:
            err = internal_error(exc)
        else:
            fate.failed()
            err = generation_failed(exc)
        yield sse(err.body())
    finally:
        s.metrics.in_flight.dec()
