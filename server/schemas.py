"""Request bodies of the HTTP API, validated by pydantic (OpenAI chat shapes + extensions)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ROLES = ("system", "user", "assistant", "tool")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of text parts (no images)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``. Extra fields: ``prompt_id``, ``episode_id``, ``turn``.

    Sampling options that would change the distribution the learner must reproduce without
    being logged (penalties, logit bias, several choices) are refused rather than ignored.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    prompt_id: str | None = Field(None, min_length=1, max_length=128)
    episode_id: str | None = Field(None, min_length=1, max_length=128)
    turn: int | None = Field(None, ge=0)

    @field_validator("n")
    @classmethod
    def _one_rollout(cls, v: int) -> int:
        if v != 1:
            raise ValueError("n must be 1: one rollout per request is the contract")
        return v

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not supported")
        if not any(m.text().strip() for m in self.messages if m.role == "user"):
            raise ValueError("messages need at least one non-empty user message")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class FeedbackRequest(BaseModel):
    """``POST /v1/feedback``: a reward in [0, 1] or a thumb for a completion or an episode."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=True)

    id: str | None = Field(None, min_length=1, max_length=64)
    episode_id: str | None = Field(None, min_length=1, max_length=128)
    feedback_token: str = Field(min_length=1, max_length=128)
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


class LoadPolicyRequest(BaseModel):
    """``POST /admin/load_policy``: serve the weights in ``path`` as ``version``."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
    path: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class RollbackRequest(BaseModel):
    """``POST /admin/rollback``: the learner publishes a new version with these weights."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0)
