"""JSON bodies the server answers outside the chat path (the chat shapes are OpenAI's, in
``server.schemas``): one pydantic model per answer, so the OpenAPI document states them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


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


class FeedbackAccepted(BaseModel):
    """``POST /v1/feedback`` (202): the feedback is in the log; ``target`` is ``t:<completion
    id>`` or ``e:<episode id>``, ``reward`` the value in [0, 1] that will be trained."""

    status: Literal["accepted"] = "accepted"
    target: str
    reward: float


class PolicyLoaded(BaseModel):
    """``POST /admin/load_policy``: the version now served; seconds the swap took, of which
    generation was paused."""

    policy_version: int
    seconds: float
    paused_seconds: float


class LearningState(BaseModel):
    """``POST /admin/pause`` and ``/admin/resume``."""

    learning: Literal["paused", "running"]


class RollbackRequested(BaseModel):
    """``POST /admin/rollback``: the learner will publish a new version with these weights."""

    rollback_to: int
    status: Literal["requested"] = "requested"


class Forgotten(BaseModel):
    """``POST /admin/forget`` and ``GET /admin/forget/{id}``: the receipt of one forget
    (``core.retention.ForgetReceipt``), summed over every policy's namespace.

    ``id``: the request, to look the receipt up again; ``user`` or ``key``: whom it named (in
    the answer to the POST only: a receipt keeps ``subject_hash``, never the name);
    ``completed``: false while some namespace has not finished it (the next forget or retention
    run does). ``deleted``: rows per store (``log_records.<topic>`` for a SQL-table log,
    ``subject_keys`` for the data keys destroyed). ``log``: ``kafka`` when a Kafka log keeps the
    records, sealed under the destroyed keys.
    """

    id: str
    kind: Literal["user", "key"]
    user: str | None = None
    key: str | None = None
    subject_hash: str
    requested_at: str
    completed_at: str | None
    completed: bool
    trajectories: int
    episodes: int
    tombstones: int
    deleted: dict[str, int]
    log: Literal["sql", "kafka"]


class PolicyVersions(BaseModel):
    """``GET /admin/policy_versions``: the version served and every published one."""

    serving: int
    versions: list[dict[str, Any]]


class PromptEvidence(BaseModel):
    """``GET /admin/evidence/{prompt_id}``: the prompt's evidence as read at the served version.
    ``stored_as``: the id its row is kept under (a client's id is stored as its keyed hash,
    ``core.evidence_store.stored_prompt_id``)."""

    prompt_id: str
    stored_as: str
    known: bool
    at_version: dict[str, Any]
    n_results: int
    reward_sum: float


class UncertainPrompts(BaseModel):
    """``GET /admin/evidence``: the prompts whose baseline is least certain at ``version``."""

    version: int
    prompts: list[dict[str, Any]]


class DashboardData(BaseModel):
    """``GET /dashboard/data``: aggregates only (no prompts or texts)."""

    policy_version: int
    steps: list[dict[str, Any]]
    requests_per_s: list[float]
    counters: dict[str, Any]
