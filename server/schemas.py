"""The HTTP edge shared by every API family: the base of every request body (``EdgeModel``), its
string types (``StoredStr``, ``EdgeStr`` for path and query parameters), the one-of rule in JSON
Schema (``exactly_one``) and the error shape every route answers with (``ErrorResponse``). Each
family's own request and answer models are in its ``protocol`` module (``server.chat.protocol``,
``server.feedback.protocol``, ``server.admin.protocol``, ``server.ops.protocol``).

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
from typing import Annotated, Any, ClassVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    GetJsonSchemaHandler,
    ValidationInfo,
    field_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

# PostgreSQL INTEGER columns (policy versions) and vLLM's int32 sampling tensors.
MAX_INT32 = 2**31 - 1
MAX_NAME_CHARS = 256


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


def exactly_one(a: str, b: str, types: tuple[dict, dict]) -> dict:
    """``a`` given (not null) and ``b`` absent or null, or the other way round."""
    return {
        "oneOf": [
            {"required": [a], "properties": {a: types[0], b: NULL}},
            {"required": [b], "properties": {b: types[1], a: NULL}},
        ]
    }


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
