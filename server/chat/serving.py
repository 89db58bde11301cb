"""The chat completion path (docs/design.md §3): ``ChatHandler`` checks a request against the
model, renders its prompt, freezes its dispatch (policy version, canary arm, evidence),
generates, and answers in OpenAI's shapes (``server.chat.protocol.ChatCompletion``, or server-sent
``ChatCompletionChunk`` events). Each request's one trajectory is written by its
``server.fate.Fate``. The module functions are the parts that need no state."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from core.claims import episode_token_subject
from core.evidence_store import stored_prompt_id
from core.keys import identity_of
from core.lifecycle import Arm, arm_key
from core.logbus import LogUnavailable
from core.records import SamplingRecord, check_feedback_token, feedback_token, prompt_id_for, utcnow
from core.settings import Settings
from server.auth import Caller
from server.chat.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    Usage,
)
from server.engine import GenerationDelta, InvalidSampling, PolicyEngine, vllm_sampling
from server.errors import ApiError, internal_error
from server.fate import Fate
from server.limits import max_message_chars
from server.metrics import ServerMetrics
from server.rollout import Rollout
from server.state import BaselineReader
from server.store import ServerStore, TurnStart

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


def stop_strings(req: ChatCompletionRequest) -> list[str] | None:
    """The request's stop strings as a list (one string is a list of one), None for none."""
    stops = [req.stop] if isinstance(req.stop, str) else req.stop
    return list(stops) if stops else None


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
    engine: PolicyEngine,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[list[tuple[int, float]]] | None = None,
) -> dict:
    """``choices[].logprobs`` for these tokens: each sampled token with its processed logprob
    (the one logged for the learner) and, when asked, the most likely tokens by rank; the
    tokens' bytes are ``engine.token_bytes``'.

    One entry per sampled token, the end-of-sequence token included (its text is empty: the
    engine skips special tokens in the answer). With a stop string the entries still hold every
    sampled token (the ones that spelled it too), while the content ends before it.
    """
    top_logprobs = top_logprobs or [[] for _ in token_ids]
    alt_ids = sorted({t for alts in top_logprobs for t, _ in alts})
    alt_bytes = dict(zip(alt_ids, engine.token_bytes(alt_ids), strict=True))
    content = []
    for b, lp, alts in zip(engine.token_bytes(token_ids), logprobs, top_logprobs, strict=True):
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


def turn_refused(ep: str, got: TurnStart) -> ApiError:
    """The refusal of an episode turn ``got`` did not start (its outcome is not ``ok``;
    ``ChatHandler.start_episode_turn``): 403 ``episode_not_yours``, else 409."""
    if got.outcome == "not_yours":
        return ApiError(
            403,
            f"episode {ep!r} was started by another request; later turns must send its "
            "episode_feedback_token as episode_token (a new episode needs a new episode_id)",
            "permission_error",
            "episode_id",
            "episode_not_yours",
        )
    if got.outcome == "rated":
        return ApiError(
            409, f"episode {ep!r} is rated and takes no more turns", param="episode_id", code="episode_rated"
        )
    if got.outcome == "taken":
        state = "in progress" if got.in_flight == got.turn else "answered"
        return ApiError(
            409,
            f"turn {got.turn} of episode {ep!r} is already {state}: each turn number is used once "
            f"(the next turn is {got.next_turn})",
            param="turn",
            code="duplicate_turn",
        )
    if got.outcome == "in_progress":
        return ApiError(
            409,
            f"episode {ep!r} has turn {got.in_flight} in progress: send turn {got.turn} once its answer "
            "is complete",
            param="turn",
            code="episode_in_progress",
        )
    if got.outcome == "out_of_order":
        return ApiError(
            409,
            f"turn {got.turn} of episode {ep!r} is out of order: turns are numbered 0, 1, 2... in "
            f"order, and the next turn is {got.next_turn}",
            param="turn",
            code="turn_out_of_order",
        )
    return ApiError(
        409,
        f"episode {ep!r} has {got.turn} turns, the most an episode may have",
        param="episode_id",
        code="episode_full",
    )


# Status of the answer to a client that left before it (nginx's "client closed request"):
# nobody reads it; it names the outcome in the access log.
CLIENT_GONE = 499


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


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ChatStream(StreamingResponse):
    """A streamed answer (``ChatHandler.chunks``) that settles its request when it ends: the
    generator is closed as soon as the response ends (a client that left has its abort written
    now, not when the generator is collected), then ``Fate.left`` settles a stream that never
    began."""

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


@dataclass
class ChatHandler:
    """``POST /v1/chat/completions``, in the shape of vLLM's ``OpenAIServingChat``: built once in
    the app's lifespan (``server.app``), called by ``server.chat.api_router``. ``open_fate(rollout,
    stream)``: the ``Fate`` that writes a prepared rollout's one trajectory; ``dispatch`` and
    ``require_storage``: ``ServerState``'s; ``read_baseline``: the prompt's evidence at a version
    (SPO++ dispatch freeze), None for none."""

    settings: Settings
    engine: PolicyEngine
    store: ServerStore
    metrics: ServerMetrics
    open_fate: Callable[[Rollout, bool], Fate]
    dispatch: Callable[[str | None], tuple[int, Arm | None]]
    require_storage: Callable[[], Awaitable[None]]
    read_baseline: BaselineReader | None = None

    async def answer(
        self, req: ChatCompletionRequest, caller: Caller, client_gone: Callable[[], Awaitable[None]]
    ) -> Response:
        """The answer to ``req`` from ``caller`` (``server.auth``), whole or streamed;
        ``client_gone()`` returns once the client has disconnected. Every request that passes
        ``prepare`` has a ``Fate`` and leaves through ``Fate.left`` (here, or when its stream
        ends). Raises ApiError, and ``require_storage``'s errors (503)."""
        fate = self.open_fate(await self.prepare(req, caller), req.stream)
        if req.stream:
            return self.stream(req, fate)
        try:
            return await self.complete(req, fate, client_gone())
        finally:
            fate.left()

    async def prepare(self, req: ChatCompletionRequest, caller: Caller) -> Rollout:
        """The rollout of ``req``: checked against the model, rendered, its sampling checked
        (by vLLM too), and only then its dispatch frozen (storage up, prompt id, version and arm,
        baseline, episode turn). ``caller``'s key names the sender and joins ``trains``.

        Raises ApiError before anything is stored or dispatched (404 ``model_not_found``, the
        400s of ``render`` and ``sampling_of``, the refusals of ``start_episode_turn``), counted
        in ``failed_before_generation`` by its code.
        """
        try:
            return await self._prepare(req, caller)
        except ApiError as exc:
            self.metrics.failed_before_generation.labels(exc.code or "invalid").inc()
            raise

    async def _prepare(self, req: ChatCompletionRequest, caller: Caller) -> Rollout:
        st = self.settings
        if req.model is not None and req.model != st.served_model_name:
            raise ApiError(
                404,
                f"model {req.model!r} does not exist; this server serves {st.served_model_name!r}",
                param="model",
                code="model_not_found",
            )
        msgs = messages_of(req)
        prompt_ids = await self.render(msgs)
        sampling = self.sampling_of(req, len(prompt_ids))
        # Storage known down: refuse now (503) rather than generate an answer that cannot be recorded.
        await self.require_storage()
        # A client's own prompt id is stored as a keyed hash only (core.evidence_store).
        prompt_id = (
            stored_prompt_id(st.feedback_secret, req.prompt_id)
            if req.prompt_id
            else prompt_id_for(task_messages(msgs, req.episode_id is not None))
        )
        version, arm = self.dispatch(arm_key(caller.key_id, req.user, caller.address))
        baseline = await self.read_baseline(prompt_id, version) if self.read_baseline else None
        rollout_id = f"chatcmpl-{uuid.uuid4().hex}"
        turn = await self.start_episode_turn(req, rollout_id) if req.episode_id is not None else None
        return Rollout(
            id=rollout_id,
            prompt_id=prompt_id,
            model=st.served_model_name,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            dispatch_version=version,
            created_at=utcnow(),
            baseline=baseline,
            episode_id=req.episode_id,
            turn=turn,
            train=trains(req, caller),
            user=req.user,
            identity=identity_of(caller.key_id, req.user),
            tenant=caller.tenant,
            arm=arm,
        )

    async def render(self, msgs: list[dict]) -> list[int]:
        """The prompt's token ids under the chat template. Raises ApiError 400
        ``context_length_exceeded`` (too many characters, refused without tokenising, or tokens)
        or ``invalid_messages`` (the template refuses them)."""
        from jinja2 import TemplateError

        st = self.settings
        n_chars = sum(len(m["content"]) for m in msgs)
        if n_chars > max_message_chars(st.max_model_len):
            raise ApiError(
                400,
                f"the messages hold {n_chars} characters, more than a context of {st.max_model_len} "
                f"tokens can hold ({max_message_chars(st.max_model_len)})",
                param="messages",
                code="context_length_exceeded",
            )
        try:
            prompt_ids = await asyncio.to_thread(self.engine.render, msgs)
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
        if len(prompt_ids) >= st.max_model_len:
            raise ApiError(
                400,
                f"the prompt is {len(prompt_ids)} tokens; this model's context is {st.max_model_len} tokens",
                param="messages",
                code="context_length_exceeded",
            )
        return prompt_ids

    def sampling_of(self, req: ChatCompletionRequest, n_prompt: int) -> SamplingRecord:
        """The sampling record of ``req`` after a prompt of ``n_prompt`` tokens, checked by vLLM
        as the engine will build it (``server.engine.sampling.vllm_sampling``). Raises ApiError 400
        ``invalid_value`` (max_tokens over the limit, ``invalid sampling parameters: …``) or
        ``context_length_exceeded`` (prompt + max_tokens)."""
        st = self.settings
        max_tokens = req.requested_max_tokens
        if max_tokens is None:
            max_tokens = min(st.default_max_tokens, st.max_model_len - n_prompt)
        elif max_tokens > st.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens must be at most {st.max_tokens_limit}",
                param="max_tokens",
                code="invalid_value",
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
        top_k = req.top_k if 0 < req.top_k < len(self.engine.tokenizer) else 0
        sampling = SamplingRecord(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            seed=req.seed,
            stop=stop_strings(req),
        )
        try:
            params = vllm_sampling(sampling, top_logprobs_of(req))
        except InvalidSampling as exc:
            raise ApiError(400, f"invalid sampling parameters: {exc}", code="invalid_value") from exc
        # The record holds what vLLM samples with, which the learner reproduces: vLLM raises a
        # temperature in (0, 0.01) to 0.01, and at temperature 0 (greedy) turns top-p/top-k off.
        return sampling.model_copy(
            update={"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        )

    async def start_episode_turn(self, req: ChatCompletionRequest, rollout_id: str) -> int:
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
        if token_ok and not check_feedback_token(self.settings.feedback_secret, subject, req.episode_token):
            raise ApiError(
                403,
                "episode_token does not match this episode",
                "permission_error",
                "episode_token",
                "bad_token",
            )
        got = await asyncio.to_thread(self.store.start_episode_turn, ep, rollout_id, token_ok, req.turn)
        if got.outcome != "ok":
            raise turn_refused(ep, got)
        return got.turn

    def extension_fields(self, rollout: Rollout) -> dict:
        """The documented response extension: policy version at dispatch and feedback tokens."""
        secret = self.settings.feedback_secret
        out = {
            "policy_version": rollout.dispatch_version,
            "prompt_id": rollout.prompt_id,
            "feedback_token": feedback_token(secret, rollout.id),
        }
        if rollout.episode_id is not None:
            out["episode_feedback_token"] = feedback_token(secret, episode_token_subject(rollout.episode_id))
        return out

    def answer_head(self, rollout: Rollout) -> dict:
        """The fields an answer and each of its chunks have besides the choices and usage: id,
        creation time (s), model and the extension fields."""
        created = int(rollout.created_at.timestamp())
        return {
            "id": rollout.id,
            "created": created,
            "model": rollout.model,
            **self.extension_fields(rollout),
        }

    def extension_headers(self, rollout: Rollout) -> dict[str, str]:
        """The extension fields as response headers, for clients that return the message but drop
        unknown body fields (LangChain's ``ChatOpenAI`` with ``include_response_headers=True``,
        LiteLLM's ``_hidden_params``). Known at dispatch, so a stream sends them too."""
        ext = self.extension_fields(rollout)
        out = {
            "x-completion-id": rollout.id,
            "x-policy-version": str(ext["policy_version"]),
            "x-feedback-token": ext["feedback_token"],
        }
        if "episode_feedback_token" in ext:
            out["x-episode-feedback-token"] = ext["episode_feedback_token"]
        return out

    def generation(self, rollout: Rollout, n_top: int):
        """The engine's stream of deltas for ``rollout`` (sampled as its record says, at its
        dispatch version, with ``n_top`` top logprobs per token), closed when the caller's
        ``async with`` ends (an abort then reaches the engine)."""
        return contextlib.aclosing(
            self.engine.generate(
                rollout.prompt_token_ids,
                rollout.sampling,
                rollout.id,
                top_logprobs=n_top,
                version=rollout.dispatch_version,
            )
        )

    async def complete(
        self, req: ChatCompletionRequest, fate: Fate, client_gone: Awaitable[None] | None = None
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
            async with self.generation(rollout, n_top) as gen:
                async for d in gen:
                    rollout.add(d)
                    text_parts.append(d.text)
                    tops.extend(d.top_logprobs)

        self.metrics.in_flight.inc()
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
            self.metrics.in_flight.dec()
        if not finished:
            fate.aborted()
            return Response(status_code=CLIENT_GONE)
        try:
            rec = await fate.answered()
        except LogUnavailable as exc:
            raise not_recorded(exc) from exc
        logprobs = (
            logprobs_body(self.engine, rec.response_token_ids, rec.rollout_logprobs, tops if n_top else None)
            if req.logprobs
            else None
        )
        body = ChatCompletion(
            **self.answer_head(rollout),
            choices=[
                Choice(
                    message=AssistantMessage(content="".join(text_parts)),
                    finish_reason=rec.finish_reason,
                    logprobs=logprobs,
                )
            ],
            usage=usage_of(rollout),
        )
        return JSONResponse(body.model_dump(mode="json"), headers=self.extension_headers(rollout))

    def stream(self, req: ChatCompletionRequest, fate: Fate) -> ChatStream:
        """The answer as server-sent events (``chunks``), with the extension headers."""
        headers = {"Cache-Control": "no-cache", **self.extension_headers(fate.rollout)}
        return ChatStream(fate, self.chunks(req, fate), headers)

    async def chunks(self, req: ChatCompletionRequest, fate: Fate) -> AsyncGenerator[str, None]:
        """SSE events of ``ChatCompletionChunk`` in OpenAI's shape, then ``data: [DONE]``.

        With ``stream_options.include_usage`` a last chunk with empty ``choices`` carries the
        usage, and every chunk before it has ``usage: null`` (the OpenAI spec).

        Settles ``fate``: a client that disconnects cancels or closes this generator, which aborts
        the engine request and the fate. An error ends the stream with one event in the OpenAI error
        shape: ``generation_failed`` (the fate failed), ``not_recorded`` (the log refused the whole
        answer) or ``internal_error`` (after the answer was recorded).
        """
        rollout = fate.rollout
        head = self.answer_head(rollout)
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        def event(choices: list[ChunkChoice], usage: Usage | None = None) -> str:
            chunk = ChatCompletionChunk(**head, usage=usage, choices=choices)
            return sse(chunk.model_dump(mode="json", exclude=None if include_usage else {"usage"}))

        def logprobs_of(d: GenerationDelta) -> dict:
            return logprobs_body(self.engine, d.token_ids, d.logprobs, d.top_logprobs)

        n_top = top_logprobs_of(req)
        last = None
        self.metrics.in_flight.inc()
        try:
            yield event([ChunkChoice(delta=Delta(role="assistant", content=""), finish_reason=None)])
            async with self.generation(rollout, n_top) as gen:
                async for d in gen:
                    rollout.add(d)
                    last = d
                    if d.finish_reason is not None:
                        break
                    if d.text or (req.logprobs and d.token_ids):
                        lps = logprobs_of(d) if req.logprobs else None
                        yield event(
                            [ChunkChoice(delta=Delta(content=d.text), finish_reason=None, logprobs=lps)]
                        )
            try:
                rec = await fate.answered()
            except LogUnavailable as exc:
                yield sse(not_recorded(exc).body())
                return
            tail = last if last is not None and last.finish_reason is not None else None
            text = tail.text if tail is not None and tail.text else None
            lps = logprobs_of(tail) if req.logprobs and tail is not None and tail.token_ids else None
            yield event(
                [ChunkChoice(delta=Delta(content=text), finish_reason=rec.finish_reason, logprobs=lps)]
            )
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
            self.metrics.in_flight.dec()
