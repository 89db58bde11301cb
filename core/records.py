"""The records that cross the log (docs/design.md §4): trajectory, feedback, policy event.

Each record is JSON with a ``schema`` field so readers can refuse what they do not know.
Every record is keyed by ``prompt_id`` so that a prompt's trajectories and feedback share a
partition.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.lifecycle import Arm
from core.limits import (
    EPISODE_ID_CHARS,
    ID_CHARS,
    IDENTITY_CHARS,
    MAX_EPISODE_TURNS,
    NAME_CHARS,
    PROMPT_ID_CHARS,
    USER_CHARS,
)

TRAJECTORY_SCHEMA = "saoserve.trajectory/1"
FEEDBACK_SCHEMA = "saoserve.feedback/1"
POLICY_SCHEMA = "saoserve.policy/1"

TOPIC_TRAJECTORIES = "trajectories"
TOPIC_FEEDBACK = "feedback"
TOPIC_POLICY = "policy"
TOPICS = (TOPIC_TRAJECTORIES, TOPIC_FEEDBACK, TOPIC_POLICY)
# The key of every policy event: one key, one partition, one order for all of them.
POLICY_KEY = "policy"


def utcnow() -> datetime:
    """Timezone-aware UTC now (records carry ISO-8601 times with offset)."""
    return datetime.now(UTC)


def as_utc(t: datetime) -> datetime:
    """``t`` as an aware UTC time: SQLite gives back the naive UTC datetimes it stored, PostgreSQL
    aware ones; every time read from the database goes through this before it is compared or
    shown (an ISO string then always carries its ``+00:00``)."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


class SamplingRecord(BaseModel):
    """The sampling parameters a rollout was drawn with: the one description of a request's
    sampling, logged with its trajectory (what the learner must reproduce, ``core.learnable``)
    and what the engine builds vLLM's parameters from (``server.engine.vllm_sampling``).

    ``temperature`` in [0, 2]; ``top_p`` in (0, 1]; ``top_k`` 0 for off, else the number of
    most likely tokens kept; ``max_tokens`` the answer's token budget; ``seed`` None for an
    unseeded draw. ``stop``: the request's stop strings (None: none), which end the answer with
    finish reason ``stop`` (the tokens that spelled one are still logged); the learner does not
    read them. Left out of the JSON when None, so a record without them reads as before.
    """

    model_config = ConfigDict(extra="forbid")

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int
    seed: int | None = None
    stop: list[str] | None = Field(None, exclude_if=lambda v: v is None)

    @property
    def truncated(self) -> bool:
        """True when top-p/top-k truncated the distribution (excluded from learning, docs/design.md §5.1)."""
        return self.top_p < 1.0 or self.top_k > 0


class FrozenBaseline(BaseModel):
    """Prompt-level evidence read at dispatch (SPO++ write-up §2.2, dispatch freeze).

    ``alpha``/``beta`` are success/failure evidence expressed at ``version`` (a policy
    version); ``value`` = alpha / (alpha + beta); ``z`` = −version · log ρ.
    """

    model_config = ConfigDict(extra="forbid")

    alpha: float
    beta: float
    value: float
    version: int
    z: float


class TrajectoryRecord(BaseModel):
    """One request's rollout: exactly one per served request (docs/design.md §4).

    ``rollout_logprobs[i]`` is the processed (post-temperature) log-probability vLLM sampled
    ``response_token_ids[i]`` with, in nats. ``token_versions`` is a run-length list of
    ``(policy_version, token_count)`` covering the response tokens in order.
    """

    model_config = ConfigDict(extra="forbid")

    schema_: Literal["saoserve.trajectory/1"] = Field(TRAJECTORY_SCHEMA, alias="schema")
    # Ids within the columns that hold them (core/limits.py): a longer one is malformed here,
    # set aside by the learner, instead of failing every commit of its join.
    id: str = Field(max_length=ID_CHARS)
    prompt_id: str = Field(max_length=PROMPT_ID_CHARS)
    episode_id: str | None = Field(None, max_length=EPISODE_ID_CHARS)
    turn: int | None = None
    created_at: datetime
    model: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    rollout_logprobs: list[float]
    token_versions: list[tuple[int, int]]
    dispatch_version: int
    sampling: SamplingRecord
    baseline: FrozenBaseline | None = None
    finish_reason: str
    # False: the request opted out of training (``store: false``, or its API key's ``train``
    # setting): logged for audit and metrics, never trained, never evidence (docs/privacy.md).
    # Records logged before this field have none and are trained as before.
    train: bool = True
    # The request's OpenAI ``user`` field: whose record it is, for ``saoserve admin forget``.
    user: str | None = Field(None, max_length=USER_CHARS)
    # Who sent it (core.keys.identity_of): ``key:<key id>`` when an API key authenticated the
    # request (the id, never the key), else ``user:<user field>``, else None; what the learner's
    # identity cap counts (docs/tenants.md). ``tenant``: the key's tenant, from the key registry.
    # Both None on records logged before them.
    identity: str | None = Field(None, max_length=IDENTITY_CHARS)
    tenant: str | None = Field(None, max_length=NAME_CHARS)
    # The canary arm the request was routed to (core.lifecycle.route) while a canary share
    # split the traffic; None otherwise and on records logged before the field.
    arm: Arm | None = None

    @model_validator(mode="after")
    def _aligned(self) -> TrajectoryRecord:
        n = len(self.response_token_ids)
        if len(self.rollout_logprobs) != n:
            raise ValueError(f"{len(self.rollout_logprobs)} logprobs for {n} response tokens")
        covered = sum(c for _, c in self.token_versions)
        if covered != n:
            raise ValueError(f"token_versions cover {covered} tokens, response has {n}")
        return self

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


class FeedbackRecord(BaseModel):
    """A reward for one trajectory (or one multi-turn episode), in [0, 1]."""

    model_config = ConfigDict(extra="forbid")

    schema_: Literal["saoserve.feedback/1"] = Field(FEEDBACK_SCHEMA, alias="schema")
    trajectory_id: str | None = Field(None, max_length=ID_CHARS)
    episode_id: str | None = Field(None, max_length=EPISODE_ID_CHARS)
    prompt_id: str = Field(max_length=PROMPT_ID_CHARS)
    reward: float
    source: Literal["user", "judge"] = "user"
    received_at: datetime
    # Made by the server per request and held by the target's feedback claim; the joiner trains
    # only the record whose id a ``received`` claim holds. None: logged before ids.
    feedback_id: str | None = Field(None, max_length=ID_CHARS)
    # Episode feedback: the ids of the episode's turns the server had logged when it accepted the
    # feedback, in turn order; the joiner joins exactly these (a turn answered 503 and appended
    # late by the log is not among them). None: logged before this field, or a completion's.
    turn_ids: list[Annotated[str, Field(max_length=ID_CHARS)]] | None = Field(
        None, max_length=MAX_EPISODE_TURNS
    )

    @field_validator("reward")
    @classmethod
    def _finite_unit(cls, v: float) -> float:
        if not math.isfinite(v) or not 0.0 <= v <= 1.0:
            raise ValueError("reward must be a finite number in [0, 1]")
        return v

    @model_validator(mode="after")
    def _one_target(self) -> FeedbackRecord:
        if (self.trajectory_id is None) == (self.episode_id is None):
            raise ValueError("exactly one of trajectory_id and episode_id")
        if self.turn_ids is not None and self.episode_id is None:
            raise ValueError("turn_ids belong to episode feedback")
        return self

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


class PolicyEvent(BaseModel):
    """A policy version on the policy topic. ``kind`` ``publish``: a version to serve (servers
    load ``path`` after checking ``sha256``); ``stage``: a later move of an announced version in
    the lifecycle (``lifecycle`` is the stage it moved to, ``actor`` who moved it), which servers
    log and count and never load. Stage events are notices: the database holds the lifecycle,
    and an event lost to a crash between the move's commit and its append changes nothing served.
    """

    model_config = ConfigDict(extra="forbid")

    schema_: Literal["saoserve.policy/1"] = Field(POLICY_SCHEMA, alias="schema")
    version: int
    path: str
    sha256: str
    created_at: datetime
    parent_version: int | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    # The version's lifecycle stage when announced (core/lifecycle.py): ``canary`` (on
    # probation) or ``promoted``; a server never serves ``rejected``. None: before the lifecycle.
    lifecycle: str | None = None
    kind: Literal["publish", "stage"] = "publish"
    actor: str | None = Field(None, max_length=NAME_CHARS)

    def to_json(self) -> bytes:
        # A publish event leaves the two stage fields out, so replicas that predate them (and
        # forbid unknown fields) keep reading it during a rolling upgrade.
        omit = {"kind", "actor"} if self.kind == "publish" else None
        return self.model_dump_json(by_alias=True, exclude=omit).encode()


def prompt_id_for(messages: list[dict]) -> str:
    """Stable task identity of a conversation: sha256 of its normalised messages.

    Normalisation: role lower-cased, content whitespace-collapsed; key order fixed.
    """
    norm = [
        {"role": str(m.get("role", "")).lower(), "content": " ".join(str(m.get("content") or "").split())}
        for m in messages
    ]
    blob = json.dumps(norm, sort_keys=True, ensure_ascii=False).encode()
    return "p-" + hashlib.sha256(blob).hexdigest()[:32]


def feedback_token(secret: str, completion_id: str) -> str:
    """HMAC-SHA256 of the completion id under the server secret, hex."""
    return hmac.new(secret.encode(), completion_id.encode(), hashlib.sha256).hexdigest()


def check_feedback_token(secret: str, completion_id: str, token: str) -> bool:
    """Constant-time comparison of a presented token with the expected one."""
    # Bytes, not str: compare_digest refuses non-ASCII strings, and any token is just wrong.
    return hmac.compare_digest(feedback_token(secret, completion_id).encode(), (token or "").encode())


WHOLE_ANSWER_FINISHES = frozenset({"stop", "length"})
"""Finish reasons of a whole answer; any other reason (``abort``, ``error``) excludes the
trajectory from training and from feedback."""


def is_whole_answer(finish_reason: str) -> bool:
    """Whether an answer that ended with ``finish_reason`` is whole (docs/design.md §8): the
    model ended it (``stop``) or its token budget did (``length``). Only a whole answer is rated
    (the server refuses feedback on any other, 409 ``not_a_whole_answer``), trained, or counted
    as evidence; ``abort``, ``error``, vLLM's ``repetition`` and any reason not known here are
    not."""
    return finish_reason in WHOLE_ANSWER_FINISHES


def answer_version(rec: TrajectoryRecord) -> int:
    """The policy version that generated the first response token (SPO++ write-up §2.2: a
    result's event coordinate is that of the version that generated it); a hot swap between
    dispatch and the first token makes it later than ``dispatch_version``. An empty response
    falls back to ``dispatch_version``."""
    for version, count in rec.token_versions:
        if count > 0:
            return version
    return rec.dispatch_version
