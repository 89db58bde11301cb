"""The chat family's shapes (``POST /v1/chat/completions``, ``server.chat.api_router``): the
request (``ChatCompletionRequest``: OpenAI's chat shape and this server's extensions, every field
bounded at the edge by ``server.schemas.EdgeModel``, docs/design.md §8), and the answers
(``server.chat.serving.ChatHandler``): OpenAI's ``chat.completion`` and ``chat.completion.chunk``
with this server's extension fields, which the OpenAPI document gives as the 200 body.

A field that OpenAI's answer leaves out in some cases (``logprobs`` of a chunk when none were
asked, the episode token outside an episode) is ``exclude_if`` None, so the body has the key
only when it has a value.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from core.limits import EPISODE_ID_CHARS, MAX_EPISODE_TURNS, PROMPT_ID_CHARS
from server.schemas import MAX_INT32, MAX_NAME_CHARS, NO_NUL, NULL, EdgeModel, StoredStr

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 4096


# vLLM takes any int64 seed; 2^63 - 1 is not a float64, and a client (or a fuzzer) that reads the
# bound as one gets 2^63, which is refused. 2^63 - 1024 is the largest int64 a float64 holds.
MAX_SEED = 2**63 - 1024


# An undeclared field is accepted only when it asks for nothing: null, [] or {}.
EMPTY_VALUE = {"anyOf": [NULL, {"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}]}


TOOLS_WHY = "the model would answer in plain text and call no tool (no tool calling here)"


UNSUPPORTED_WHY = {
    "response_format": "the answer would be plain text, not JSON (no JSON mode or structured output here)",
    **dict.fromkeys(
        ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "tool_calls"), TOOLS_WHY
    ),
    **dict.fromkeys(
        ("presence_penalty", "frequency_penalty", "logit_bias"),
        "it would change the distribution the learner reproduces (only its neutral value is accepted)",
    ),
}


UNKNOWN_WHY = "a field that may change the answer is refused rather than ignored (null, [] or {} is accepted)"


def unsupported(field: str) -> PydanticCustomError:
    """``unsupported_parameter`` naming ``field`` (the error handler adds it to the location)."""
    why = UNSUPPORTED_WHY.get(field, UNKNOWN_WHY)
    name = field.encode("utf-8", "backslashreplace").decode()
    return PydanticCustomError(
        "unsupported_parameter", f"{name} is not supported by this server: {why}", {"field": field}
    )


def refuse_unknown_fields(extra: dict[str, Any] | None) -> None:
    """Raise ``unsupported_parameter`` for the first undeclared field that asks for something
    (a value other than null, [] or {}): ignoring it would answer another question than the
    one asked (JSON mode answered in free text, tools never called)."""
    for name, value in (extra or {}).items():
        if not (value is None or (isinstance(value, list | dict) and not value)):
            raise unsupported(name)


class ContentPart(BaseModel):
    """A text part of a message (checked by the enclosing ``ChatMessage``)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(EdgeModel):
    """One chat message; content is a string or a list of text parts (no images). Any other
    field (``tool_calls``, ``audio``...) only when empty (``refuse_unknown_fields``)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": EMPTY_VALUE})
    text_fields: ClassVar[frozenset[str]] = frozenset({"content"})
    # ``developer`` is OpenAI's newer name for the system role: rendered as ``system``.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: StoredStr | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_call_id: StoredStr | None = Field(None, max_length=MAX_NAME_CHARS)

    @model_validator(mode="after")
    def _no_unknown_fields(self) -> ChatMessage:
        refuse_unknown_fields(self.model_extra)
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


# The one-of rules in JSON Schema, so the OpenAPI document says what the validators enforce.
NON_BLANK = {"type": "string", "pattern": r"\S"}


AT_LEAST_ONE_USER_MESSAGE = {
    "contains": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "user"},
            "content": {
                "anyOf": [
                    NON_BLANK,
                    {"type": "array", "contains": {"type": "object", "properties": {"text": NON_BLANK}}},
                ]
            },
        },
    }
}


# The cross-field rules of ChatCompletionRequest._checks: each holds when the field it
# constrains is absent (or null, or 0), or when the field it needs is given.
CHAT_RULES = {
    "allOf": [
        {
            "anyOf": [
                {"properties": {"episode_token": NULL}},
                {"required": ["episode_id"], "properties": {"episode_id": {"type": "string"}}},
            ]
        },
        {
            "anyOf": [
                {"properties": {"top_logprobs": {"enum": [None, 0]}}},
                {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
            ]
        },
        {
            "anyOf": [
                {"properties": {"turn": NULL}},
                {"required": ["episode_id"], "properties": {"episode_id": {"type": "string"}}},
            ]
        },
        {
            "anyOf": [
                {"properties": {"stream_options": NULL}},
                {"required": ["stream"], "properties": {"stream": {"const": True}}},
            ]
        },
    ],
    "additionalProperties": EMPTY_VALUE,
}


STREAM_OPTIONS = ("include_usage", "include_obfuscation")
"""OpenAI's stream options; ``include_obfuscation`` asks for nothing here (no padding is sent)."""


STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}


class ChatCompletionRequest(EdgeModel):
    """``POST /v1/chat/completions``. Extra fields: ``prompt_id``, ``episode_id``, ``turn``,
    ``episode_token``.

    Sampling options that would change the distribution the learner must reproduce without
    being logged (penalties, logit bias, several choices) are refused rather than ignored, and
    so is every field this model does not declare unless it asks for nothing (null, [] or {}):
    ``response_format``, ``tools``, ``min_tokens``... are 400 ``unsupported_parameter`` naming
    the field. ``store: false`` opts the answer out of training: it is logged, marked
    ``train: false``, and never trained (docs/privacy.md); ``user`` is kept with the answer, for
    ``saoserve admin forget``. ``metadata`` and ``service_tier`` are accepted and change nothing.

    ``turn`` numbers an episode's turns 0, 1, 2... (``server.store.ServerStore.start_episode_turn``
    checks the order); without it the server gives the turn the next number.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, json_schema_extra=CHAT_RULES)
    text_fields: ClassVar[frozenset[str]] = frozenset({"stop"})

    model: StoredStr | None = Field(None, max_length=MAX_NAME_CHARS)
    messages: list[ChatMessage] = Field(
        min_length=1,
        max_length=MAX_MESSAGES,
        description="At least one user message with non-blank content.",
        json_schema_extra=AT_LEAST_ONE_USER_MESSAGE,
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_INT32, description="0 or -1: off; a value >= the vocabulary is off.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    n: int = Field(1, json_schema_extra={"minimum": 1, "maximum": 1})
    stream: bool = False
    stream_options: dict[str, Any] | None = Field(
        None,
        description="With stream: true only. include_usage: a last chunk carries the usage.",
        json_schema_extra={
            "anyOf": [
                {
                    "type": "object",
                    "properties": {k: {"type": "boolean"} for k in STREAM_OPTIONS},
                    "additionalProperties": False,
                },
                {"type": "null"},
            ]
        },
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(
        None,
        description=f"At most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters.",
        json_schema_extra={
            "anyOf": [
                STOP_STRING,
                {"type": "array", "items": STOP_STRING, "maxItems": MAX_STOP_STRINGS},
                NULL,
            ]
        },
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="0..20 (vLLM's max_logprobs).")
    # Accepted only at their neutral values (refused otherwise by ``_checks``, with its message).
    presence_penalty: float = Field(0.0, json_schema_extra={"const": 0})
    frequency_penalty: float = Field(0.0, json_schema_extra={"const": 0})
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})
    user: StoredStr | None = Field(
        None,
        max_length=MAX_NAME_CHARS,
        description="Who the end user is; kept with the answer, so `saoserve admin forget USER` finds it.",
    )
    store: bool | None = Field(
        None,
        description="false: the answer is logged but never trained on (an opt-out of training, "
        "docs/privacy.md); true or absent: trained.",
    )
    metadata: dict[str, StoredStr] | None = Field(
        None, json_schema_extra={"propertyNames": {"pattern": NO_NUL}}
    )
    service_tier: StoredStr | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt_id: StoredStr | None = Field(None, min_length=1, max_length=PROMPT_ID_CHARS)
    episode_id: StoredStr | None = Field(None, min_length=1, max_length=EPISODE_ID_CHARS)
    turn: int | None = Field(
        None,
        ge=0,
        lt=MAX_EPISODE_TURNS,
        description="The turn's number in its episode (needs episode_id): 0 for the first, then each "
        "in order once the previous one is answered; omitted, the next number.",
    )
    episode_token: StoredStr | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="Later turns of an episode: the episode_feedback_token its first turn returned. "
        "Without it, only a new episode_id is accepted (403 otherwise).",
    )

    @field_validator("n")
    @classmethod
    def _one_rollout(cls, v: int) -> int:
        if v != 1:
            raise ValueError("n must be 1: one rollout per request is the contract")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Only OpenAI's options, each a JSON boolean (``"false"`` is not false)."""
        for key, value in (v or {}).items():
            if key not in STREAM_OPTIONS:
                raise ValueError(f"stream_options takes {' and '.join(STREAM_OPTIONS)}, not {key!r}")
            if not isinstance(value, bool):
                raise ValueError(f"stream_options.{key} must be true or false")
        return v

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias")
    @classmethod
    def _neutral(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise unsupported(info.field_name)
        return v

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        refuse_unknown_fields(self.model_extra)
        if self.turn is not None and self.episode_id is None:
            raise PydanticCustomError(
                "invalid_value",
                "turn needs episode_id: a turn number belongs to an episode",
                {"field": "turn"},
            )
        if not any(m.text().strip() for m in self.messages if m.role == "user"):
            raise ValueError("messages need at least one non-empty user message")
        if self.episode_token is not None and self.episode_id is None:
            raise ValueError("episode_token needs episode_id")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# The answers.
CompletionId = Annotated[str, Field(description="The completion's id, also its trajectory's id.")]
Created = Annotated[int, Field(description="Unix time (s) of the dispatch.")]
PolicyVersion = Annotated[int, Field(description="The policy version the request was dispatched at.")]
PromptId = Annotated[
    str, Field(description="The task identity: the request's prompt_id, or a hash of its messages.")
]
FeedbackToken = Annotated[
    str, Field(description="The token POST /v1/feedback takes with this id (HMAC-SHA256 of the id).")
]
EpisodeFeedbackToken = Annotated[
    str | None,
    Field(
        None,
        exclude_if=lambda v: v is None,
        description="Only for an episode's turns: the token that rates the episode and extends it "
        "(episode_token).",
    ),
]
FinishReason = Annotated[
    str,
    Field(
        description="Why the engine ended the answer: stop (end of sequence or a stop string), length (max_tokens)."
    ),
]


class TopLogprob(BaseModel):
    """One token in OpenAI's logprob shape (``server.chat.serving.token_entry``): ``token`` its text, or
    ``bytes:\\x..`` for a token that ends inside a character; ``logprob`` in nats, -inf clamped
    to -9999; ``bytes`` its UTF-8 bytes (the bytes of consecutive tokens join into the answer)."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """A sampled token with its processed logprob (the one logged for the learner) and the most
    likely tokens at its position by rank (empty unless ``top_logprobs`` was asked)."""

    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """``choices[].logprobs``: one entry per sampled token (``server.chat.serving.logprobs_body``)."""

    content: list[TokenLogprob]


class Usage(BaseModel):
    """Token counts of one answer: the rendered prompt's and the sampled ones (end-of-sequence
    token included)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    """The one choice of an answer (``n`` is 1); ``logprobs`` null unless the request asked."""

    index: Literal[0] = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None


class ChatCompletion(BaseModel):
    """``POST /v1/chat/completions`` answered whole (``stream`` false): OpenAI's
    ``chat.completion``, then this server's extension fields (also sent as ``x-`` headers,
    ``server.chat.serving.ChatHandler.extension_headers``)."""

    id: CompletionId
    object: Literal["chat.completion"] = "chat.completion"
    created: Created
    model: str
    choices: list[Choice]
    usage: Usage
    policy_version: PolicyVersion
    prompt_id: PromptId
    feedback_token: FeedbackToken
    episode_feedback_token: EpisodeFeedbackToken


class Delta(BaseModel):
    """What a chunk adds to the message: the first chunk the role (and empty content), then
    text; the last chunk's delta may be empty."""

    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)


class ChunkChoice(BaseModel):
    """The choice of a chunk: ``finish_reason`` null until the last one; ``logprobs`` (for this
    chunk's tokens) only when the request asked."""

    index: Literal[0] = 0
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed answer: OpenAI's ``chat.completion.chunk``, every one
    with the extension fields (the openai SDK builds a streamed completion's fields from the first
    chunk, LangChain from the last). With ``stream_options.include_usage`` every chunk has
    ``usage``: null, and a last chunk with no choices has the counts; without, no chunk has the
    key (``server.chat.serving.ChatHandler.chunks`` leaves it out)."""

    id: CompletionId
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: Created
    model: str
    policy_version: PolicyVersion
    prompt_id: PromptId
    feedback_token: FeedbackToken
    episode_feedback_token: EpisodeFeedbackToken
    usage: Usage | None = None
    choices: list[ChunkChoice]
