"""Request bodies of the HTTP API, validated by pydantic (OpenAI chat shapes + extensions), and
the error shape every route answers with (``ErrorResponse``); the chat answers' shapes are
``server.answers``'.

Every field is bounded at the edge (docs/design.md §8), before any work, generation or write:
integers within what the database's INTEGER columns and vLLM's sampling tensors hold, strings
with a length bound, and every string (also inside lists, dicts and content parts) valid UTF-8
(a lone surrogate cannot be encoded, tokenised or stored) by one validator, ``EdgeModel``'s.
NUL (U+0000) is refused in every string except free text for the model (message content and
stop strings): PostgreSQL cannot store a NUL in a text column, and those two are never stored
in a column as text (the log holds the messages as token ids, and the stop strings inside the
trajectory's JSON, where a NUL is written ``\\u0000``), while a NUL is a character a prompt may
legitimately hold.
"""

from __future__ import annotations

import functools
import math
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from core.limits import EPISODE_ID_CHARS, ID_CHARS, MAX_EPISODE_TURNS, PROMPT_ID_CHARS

# PostgreSQL INTEGER columns (policy versions) and vLLM's int32 sampling tensors.
MAX_INT32 = 2**31 - 1
MAX_NAME_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 4096
# vLLM takes any int64 seed; 2^63 - 1 is not a float64, and a client (or a fuzzer) that reads the
# bound as one gets 2^63, which is refused. 2^63 - 1024 is the largest int64 a float64 holds.
MAX_SEED = 2**63 - 1024


def check_strings(value: Any, nul_allowed: bool, where: str = "") -> None:
    """Raise ``invalid_value`` if any string in ``value`` (str, or nested in lists, tuples, dict
    keys and values, and plain pydantic models) is not encodable as UTF-8, or holds a NUL where
    ``nul_allowed`` is False. ``where`` names the position inside the field, for the message."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            cp = ord(value[exc.start])
            raise PydanticCustomError(
                "invalid_value",
                f"{where}is not valid UTF-8 text: lone surrogate U+{cp:04X} at character {exc.start}",
            ) from None
        if not nul_allowed and "\x00" in value:
            raise PydanticCustomError(
                "invalid_value", f"{where}contains a NUL character (U+0000), which cannot be stored"
            )
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_strings(item, nul_allowed, f"{where}item {i}: ")
    elif isinstance(value, dict):
        for k, item in value.items():
            check_strings(k, False, f"{where}a key: ")
            check_strings(item, nul_allowed, f"{where}key {k!r}: ")
    elif isinstance(value, BaseModel) and not isinstance(value, EdgeModel):
        for name in type(value).model_fields:
            check_strings(getattr(value, name), nul_allowed, f"{where}{name}: ")


class _StoredText:
    """JSON Schema of a string refused when it holds a NUL (``EdgeModel``'s check): the pattern
    says so in the OpenAPI document; the check itself stays ``check_strings``'s, with its message."""

    def __get_pydantic_json_schema__(
        self, core: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core)
        schema["pattern"] = NO_NUL
        return schema


NO_NUL = "^[^\\u0000]*$"
# Every string field except free text for the model (message content, stop strings).
StoredStr = Annotated[str, _StoredText()]


@functools.cache
def scalar_kinds(annotation: Any) -> frozenset[type]:
    """The plain types a field's annotation admits at its top level (``int | None`` → {int, NoneType})."""
    args = get_args(annotation)
    if not args:
        return frozenset({annotation}) if isinstance(annotation, type) else frozenset()
    return frozenset().union(*(scalar_kinds(a) for a in args))


class EdgeModel(BaseModel):
    """Base of every request body: one check on every string of every field
    (``check_strings``); NUL is allowed only in the fields named in ``text_fields``.

    Scalars keep their JSON type: ``true`` is not the number 1 and ``"1"`` is not a version
    (pydantic's lax mode would coerce both), ``0`` is not ``false``. An integral number such as
    ``1.0`` still fills an integer field, as JSON Schema's ``integer`` allows.
    """

    text_fields: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="before")
    @classmethod
    def _raw_string(cls, v: Any, info: ValidationInfo) -> Any:
        # Before the type's own checks: a length-bounded string with a lone surrogate would
        # otherwise fail there with a less clear message.
        if isinstance(v, str):
            check_strings(v, nul_allowed=info.field_name in cls.text_fields)
        kinds = scalar_kinds(cls.model_fields[info.field_name].annotation)
        numeric = bool(kinds & {int, float})
        if isinstance(v, bool) and numeric and bool not in kinds:
            raise ValueError("must be a number, not true or false")
        if isinstance(v, str) and numeric and str not in kinds:
            raise ValueError("must be a number, not a string")
        if bool in kinds and not numeric and not isinstance(v, bool) and v is not None:
            raise ValueError("must be true or false")
        return v

    @field_validator("*", mode="after")
    @classmethod
    def _strings_at_the_edge(cls, v: Any, info: ValidationInfo) -> Any:
        if not isinstance(v, str):
            check_strings(v, nul_allowed=info.field_name in cls.text_fields)
        return v


NULL = {"type": "null"}
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


def _exactly_one(a: str, b: str, types: tuple[dict, dict]) -> dict:
    """``a`` given (not null) and ``b`` absent or null, or the other way round."""
    return {
        "oneOf": [
            {"required": [a], "properties": {a: types[0], b: NULL}},
            {"required": [b], "properties": {b: types[1], a: NULL}},
        ]
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


class FeedbackRequest(EdgeModel):
    """``POST /v1/feedback``: a reward in [0, 1] or a thumb for a completion or an episode."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=True,
        json_schema_extra={
            "allOf": [
                _exactly_one("id", "episode_id", types=({"type": "string"}, {"type": "string"})),
                _exactly_one(
                    "reward",
                    "thumbs",
                    types=({"type": "number", "minimum": 0, "maximum": 1}, {"enum": ["up", "down"]}),
                ),
            ]
        },
    )

    id: StoredStr | None = Field(None, min_length=1, max_length=ID_CHARS)
    episode_id: StoredStr | None = Field(None, min_length=1, max_length=EPISODE_ID_CHARS)
    feedback_token: StoredStr = Field(min_length=1, max_length=128)
    reward: float | None = Field(None, strict=True)
    thumbs: Literal["up", "down"] | None = None
    source: Literal["user", "judge"] = "user"

    @model_validator(mode="after")
    def _checks(self) -> FeedbackRequest:
        if (self.id is None) == (self.episode_id is None):
            raise ValueError("give exactly one of id and episode_id")
        if (self.reward is None) == (self.thumbs is None):
            raise ValueError("give exactly one of reward and thumbs")
        if self.reward is not None and (not math.isfinite(self.reward) or not 0.0 <= self.reward <= 1.0):
            raise ValueError("reward must be a finite number in [0, 1]")
        return self

    @property
    def value(self) -> float:
        if self.reward is not None:
            return float(self.reward)
        return 1.0 if self.thumbs == "up" else 0.0


class LoadPolicyRequest(EdgeModel):
    """``POST /admin/load_policy``: serve the weights in ``path`` as ``version``."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0, le=MAX_INT32)
    path: StoredStr = Field(min_length=1, max_length=4096)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class RollbackRequest(EdgeModel):
    """``POST /admin/rollback``: the learner publishes a new version with these weights."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0, le=MAX_INT32)


class ForgetRequest(EdgeModel):
    """``POST /admin/forget``: remove one subject's trajectories and feedback (docs/privacy.md,
    "Who is forgotten"): a ``user`` (the chat requests' ``user`` field) or an API ``key`` (its
    id, ``k`` + 16 hex digits: every request it authenticated); exactly one."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra=_exactly_one("user", "key", types=({"type": "string"}, {"type": "string"})),
    )
    user: StoredStr | None = Field(
        None, min_length=1, max_length=MAX_NAME_CHARS, description="The `user` field the chat requests sent."
    )
    key: str | None = Field(
        None,
        pattern=r"^k[0-9a-f]{16}$",
        description="An API key's id (`saoserve admin keys list`): every request the key authenticated.",
    )

    @model_validator(mode="after")
    def _one_subject(self) -> ForgetRequest:
        if (self.user is None) == (self.key is None):
            raise ValueError("give exactly one of user and key")
        return self


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the server answers, in OpenAI's shape (``server.errors.ApiError``)."""

    error: ErrorBody


def _edge_string(v: str) -> str:
    check_strings(v, nul_allowed=False)
    return v


# A path or query string parameter, checked like the fields of a body.
EdgeStr = Annotated[str, AfterValidator(_edge_string), _StoredText()]
