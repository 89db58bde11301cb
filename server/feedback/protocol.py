"""The feedback family's shapes (``POST /v1/feedback``, ``server.feedback.api_router``): the
request (a reward or a thumb for a completion or an episode, bounded at the edge by
``server.schemas.EdgeModel``) and its 202 answer."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.limits import EPISODE_ID_CHARS, ID_CHARS
from server.schemas import EdgeModel, StoredStr, exactly_one


class FeedbackRequest(EdgeModel):
    """``POST /v1/feedback``: a reward in [0, 1] or a thumb for a completion or an episode."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=True,
        json_schema_extra={
            "allOf": [
                exactly_one("id", "episode_id", types=({"type": "string"}, {"type": "string"})),
                exactly_one(
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


class FeedbackAccepted(BaseModel):
    """``POST /v1/feedback`` (202): the feedback is in the log; ``target`` is ``t:<completion
    id>`` or ``e:<episode id>``, ``reward`` the value in [0, 1] that will be trained."""

    status: Literal["accepted"] = "accepted"
    target: str
    reward: float
