"""The operators' pages' shapes (``server.ops``: health, readiness, models, the dashboard's
data): one pydantic model per answer, so the OpenAPI document states them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from server.admin.protocol import PolicyRow


class Liveness(BaseModel):
    """``GET /healthz``: the process answers."""

    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """``GET /readyz`` (200 ready, 503 not): each dependency "ok" or why it is down; ``policy``:
    "ok" or how far this replica is from the policy topic's newest version (a replica that just
    started: ``catching up: serves version 0, the policy topic's newest is 5``)."""

    ready: bool
    policy_version: int
    database: str
    log: str
    engine: str
    policy: str = "ok"


class ModelCard(BaseModel):
    """The served model as the caller's key is served (OpenAI's model object): ``policy`` the
    policy that serves the key (``global``, or its tenant's own; docs/tenants.md), ``version``
    (and ``policy_version``, the older name) the version of it served now; ``owned_by``
    ``saoserve``, or ``saoserve/<tenant>`` for a tenant policy."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "saoserve"
    policy_version: int
    max_model_len: int
    policy: str = "global"
    version: int


class ModelList(BaseModel):
    """``GET /v1/models``: the one served model, with the policy and version that serve the caller."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class DashboardData(BaseModel):
    """``GET /dashboard/data``: aggregates only (no prompts or texts)."""

    policy_version: int
    steps: list[dict[str, Any]]
    requests_per_s: list[float]
    counters: dict[str, Any]


class VersionPoint(BaseModel):
    """A policy version; ``lifecycle``: its stage (candidate, canary, promoted, rejected);
    ``rollback_to``: the version whose weights this one republished (a rollback), else None.
    ``created_at``: ISO 8601 with offset."""

    version: int
    parent_version: int | None
    status: str
    lifecycle: str
    rollback_to: int | None
    created_at: str


class VersionReward(BaseModel):
    """The received completion feedback on answers a version began: mean reward in [0, 1], count."""

    version: int
    reward_mean: float
    n: int


GuardCan = Literal["decide", "watch", "off", "pinned"]


class GuardState(BaseModel):
    """The lifecycle's state (``server.db_figures.LifecycleState``): versions per stage, the
    promoted version, the lineage under watch, the operators' switches, the learner's last
    verdict on this lineage (bounds on Δ, each arm's ratings and mean, the decision; None until
    it judged it); and what the guard can do on this replica (``guard_capability``: ``can``,
    the sentence ``says``), from its ``mode`` (``canary``: its engine serves adapters, else
    ``probation``) and its canary split."""

    on: bool
    pinned: int | None
    promoted: int | None
    lineage: list[int]
    stages: dict[str, int]
    verdict: dict | None
    mode: Literal["canary", "probation"]
    can: GuardCan
    says: str


class DashboardState(BaseModel):
    """``GET /dashboard/state``: aggregates only (no prompts or texts) of one policy (``?policy=``),
    and ``policies``: one row per policy served (``server.admin.protocol.PolicyRow``, as
    ``GET /admin/policies``)."""

    serving: int
    newest_version: int | None
    learning: Literal["running", "paused"]
    rollback_to: int | None
    versions: list[VersionPoint]
    samples_trained: int
    samples_waiting: int
    reward_by_version: list[VersionReward]
    requests_per_s_last_minute: float
    outcomes: dict[str, dict[str, int]]
    guard: GuardState
    policies: list[PolicyRow]
