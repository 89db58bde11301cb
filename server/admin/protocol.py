"""The admin family's shapes (``server.admin``: the admin routes, the version lifecycle's, the
API keys'), the one home of their request and answer models: what operators send (``CreateKey``,
``VersionAction``, ``LoadPolicyRequest``...) and the 200 bodies. Each route names its answer's
model, as its return type or as ``response_model=``, so ``/openapi.json`` states the shape
(``tests/unit/server/test_openapi_spec.py`` checks that every JSON route has one).

Several routes return the dicts ``core`` builds; their model only states them. So each such
model lists every key in the order the dict has it, and no field has a default a dict could lack
(pydantic would add it; the one optional key, a dead letter's ``payload``, is left out by its
route's ``response_model_exclude_unset``): the body a client reads is the one it read before
the models. Times are ISO 8601 strings with their offset (``core.records.as_utc``), as the dicts
hold them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.keys import TENANT_REGEX
from core.lifecycle import CANARY_SHARE_MAX, CANARY_SHARE_MIN, check_canary_share
from core.limits import NAME_CHARS
from core.policies import POLICY_TENANT_REGEX
from server.schemas import MAX_INT32, MAX_NAME_CHARS, EdgeModel, StoredStr, exactly_one

# Every key a route's dict holds is a field: a key core adds without its field here fails the
# route's answer (500) in the tests, instead of going missing from the body unseen.
_CLOSED = ConfigDict(extra="forbid")

# ------------------------------------------------------------------ API keys


_TRUSTED = (
    "The operator vouches that the key's traffic is many people's (a backend relaying its users) or "
    "a judge's: the identity caps on training batches and on the guard's votes do not bound it "
    '(docs/guard.md, "Who votes").'
)


class CreateKey(EdgeModel):
    """``POST /admin/keys``: the tenant the new key belongs to (``core.keys.TENANT_PATTERN``),
    whether the answers it is sent may be trained (false: the key opts out), and whether it is
    trusted (``core.keys.KeyInfo``)."""

    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(pattern=TENANT_REGEX, max_length=NAME_CHARS)
    train: bool = True
    trusted: bool = Field(False, description=_TRUSTED)


class KeySettings(EdgeModel):
    """``PATCH /admin/keys/{key_id}``: the key's training setting (false: opted out), whether it
    is trusted, or both; a setting left out is left as it is."""

    # The schema says what the validator checks: at least one setting given, not null.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "anyOf": [
                {"required": [name], "properties": {name: {"type": "boolean"}}}
                for name in ("train", "trusted")
            ]
        },
    )
    train: bool | None = None
    trusted: bool | None = Field(None, description=_TRUSTED)

    @model_validator(mode="after")
    def _some_setting(self) -> KeySettings:
        if self.train is None and self.trusted is None:
            raise ValueError("give train, trusted or both")
        return self


class ApiKeyInfo(BaseModel):
    """An API key as listed (``core.keys.KeyInfo.to_json``): never its secret or its hash.
    ``revoked_at`` null while the key is valid; ``train`` false: the key opts out of training;
    ``trusted`` true: the identity caps do not bound it."""

    model_config = _CLOSED
    id: str
    tenant: str
    created_at: str
    revoked_at: str | None
    train: bool
    trusted: bool


class ApiKeyCreated(ApiKeyInfo):
    """``POST /admin/keys`` (201): the new key's listing and ``key``, the key itself, shown this
    once (only its hash is stored)."""

    key: str


class ApiKeyList(BaseModel):
    """``GET /admin/keys``: every key (of the tenant asked for), oldest first, revoked ones
    included."""

    model_config = _CLOSED
    keys: list[ApiKeyInfo]


# ------------------------------------------------------------------ tenant policies


class AddTenantPolicy(EdgeModel):
    """``POST /admin/tenant_policies``: the tenant to give a policy of its own (a tenant name,
    not ``global``: ``core.policies.check_policy_tenant``, whose message a refusal carries)."""

    model_config = ConfigDict(extra="forbid")
    # The pattern is the spec's; the route checks the name itself, to say what is wrong with it.
    tenant: str = Field(max_length=NAME_CHARS, json_schema_extra={"pattern": POLICY_TENANT_REGEX})


class TenantPolicyList(BaseModel):
    """``GET /admin/tenant_policies``: ``tenant_policies``, the database's list (oldest first),
    which every replica follows; ``served``, the tenant policies this replica serves now (the
    list as of its last read, every ``SAOSERVE_TENANT_POLL_S``); ``limit``, the most tenant
    policies this replica's adapter slots serve (0: it serves none, adapter serving is off)."""

    model_config = _CLOSED
    tenant_policies: list[str]
    served: list[str]
    limit: int


class TenantPolicyChanged(BaseModel):
    """``POST /admin/tenant_policies`` and ``DELETE /admin/tenant_policies/{tenant}``: the
    ``tenant``, whether this request ``changed`` the list (false: it held the name already, for
    an add), and the list after it."""

    model_config = _CLOSED
    tenant: str
    changed: bool
    tenant_policies: list[str]


# ------------------------------------------------------------------ the version lifecycle


class VersionAction(EdgeModel):
    """``POST /admin/lifecycle/{promote,reject,pin}``: the version and, optionally, why."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=0, le=MAX_INT32)
    # StoredStr: the OpenAPI document says a NUL is refused (400), as the edge check does.
    reason: StoredStr = Field("", max_length=1000)


class GuardSwitch(EdgeModel):
    """``POST /admin/lifecycle/guard``: turn the guard on or off."""

    model_config = ConfigDict(extra="forbid")
    on: bool


class CanaryShare(EdgeModel):
    """``POST /admin/lifecycle/canary``: the share of traffic a canary gets, in
    [``CANARY_SHARE_MIN``, ``CANARY_SHARE_MAX``] (``core.lifecycle.check_canary_share`` says why;
    400 naming ``share`` otherwise)."""

    model_config = ConfigDict(extra="forbid")
    share: float = Field(json_schema_extra={"minimum": CANARY_SHARE_MIN, "maximum": CANARY_SHARE_MAX})

    @field_validator("share")
    @classmethod
    def _bounded(cls, v: float) -> float:
        return check_canary_share(v)


class VersionsMoved(BaseModel):
    """``POST /admin/lifecycle/promote`` and ``/reject``: the versions moved (a promotion moves
    the lineage's versions before it too), their new stage, who moved them, and ``announced``:
    whether the policy topic's stage notices went out."""

    model_config = _CLOSED
    versions: list[int]
    lifecycle: Literal["promoted", "rejected"]
    actor: str
    announced: bool


class VersionPinned(BaseModel):
    """``POST /admin/lifecycle/pin``: the version pinned, who pinned it, the versions promoted
    first (a candidate or canary pinned), and whether their stage notices went out."""

    model_config = _CLOSED
    pinned: int
    actor: str
    promoted: list[int]
    announced: bool


class Unpinned(BaseModel):
    """``POST /admin/lifecycle/unpin``: nothing is pinned any more; who unpinned."""

    model_config = _CLOSED
    pinned: None
    actor: str


class GuardSwitched(BaseModel):
    """``POST /admin/lifecycle/guard``: the guard's new state and who set it."""

    model_config = _CLOSED
    guard: Literal["on", "off"]
    actor: str


class CanaryShareSet(BaseModel):
    """``POST /admin/lifecycle/canary``: the share stored; ``mode``: this replica's
    (``canary``: it serves adapters and applies the share, ``probation``: a full-weight engine,
    the share is only stored); ``applied``: whether this replica applies it; ``message``: that
    said in a sentence; who set it."""

    model_config = _CLOSED
    canary_share: float
    mode: Literal["canary", "probation"]
    applied: bool
    message: str
    actor: str


class LifecycleEvent(BaseModel):
    """One ``version_status_events`` row (``core.lifecycle_store.events``): a transition, or an
    operator's switch recorded on a version with its stage unchanged. ``from_status`` null for
    a version's first stage."""

    model_config = _CLOSED
    version: int
    from_status: str | None
    to_status: str
    actor: str
    reason: str
    at: str


class SplitState(BaseModel):
    """This replica's canary split in effect (``core.lifecycle.CanarySplit``): the lineage's
    versions, the control version held beside them, the share."""

    model_config = _CLOSED
    lineage: list[int]
    control: int
    share: float


class LifecycleState(BaseModel):
    """``GET /admin/lifecycle``: this replica's ``mode``, the guard's switches (``guard``,
    ``pinned``, the ``canary_share`` flag: null when unset), the promoted version (null on a
    database with no version yet), the lineage under watch, this replica's ``split`` (null when
    none is in effect) and the newest transitions, newest first."""

    model_config = _CLOSED
    mode: Literal["canary", "probation"]
    guard: Literal["on", "off"]
    promoted: int | None
    lineage: list[int]
    pinned: int | None
    canary_share: float | None
    split: SplitState | None
    events: list[LifecycleEvent]


class QuarantinedSample(BaseModel):
    """A sample that trained the rejected ``version``, never trained again."""

    model_config = _CLOSED
    sample_id: str
    version: int
    reason: str
    at: str


class Quarantine(BaseModel):
    """``GET /admin/quarantine``: how many samples are quarantined, and the newest of them."""

    model_config = _CLOSED
    total: int
    samples: list[QuarantinedSample]


# ------------------------------------------------------------------ versions, learning, evidence, forget


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
        json_schema_extra=exactly_one("user", "key", types=({"type": "string"}, {"type": "string"})),
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
    (``core.forget.ForgetReceipt``), summed over every policy's namespace.

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


# ------------------------------------------------------------------ the policies


class PolicyRow(BaseModel):
    """One policy this server serves (docs/tenants.md, "A policy per tenant"): ``policy``
    (``global`` or the tenant), ``tenant`` (null for the global policy), the ``version`` it
    serves and that version's ``lifecycle`` stage in its namespace (null while the version is
    not recorded there, as version 0 before its learner first ran), ``paused`` (its learner's
    pause flag), ``steps`` (learner steps recorded), and the newest step's ``reward_mean`` and
    ``staleness_mean`` (versions behind) and time ``last_step_at`` (null before any step).
    ``unavailable``: null, or why a tenant policy's database could not be read (then every
    field after ``version`` is null)."""

    model_config = _CLOSED
    policy: str
    tenant: str | None
    version: int
    unavailable: str | None
    lifecycle: Literal["candidate", "canary", "promoted", "rejected"] | None
    paused: bool | None
    steps: int | None
    reward_mean: float | None
    staleness_mean: float | None
    last_step_at: str | None


class PolicyList(BaseModel):
    """``GET /admin/policies``: the global policy first, then each tenant policy in the order of
    ``tenant_policies``."""

    model_config = _CLOSED
    policies: list[PolicyRow]


# ------------------------------------------------------------------ the learner


class LearnerStepRow(BaseModel):
    """One learner step: its number, the version it published, when, then every metric the
    learner stored with it under the metric's own name (``learner.algo.metrics``; the set grows with
    the learner, so the metrics are not listed here)."""

    model_config = ConfigDict(extra="allow")
    step: int
    version: int
    created_at: str


class LearnerStatus(BaseModel):
    """``GET /admin/learner``: the newest steps (oldest first), the learner's counters,
    ``learning`` (``running`` | ``paused``) and ``rollback_to`` (a requested rollback not carried
    out yet, or null)."""

    model_config = _CLOSED
    steps: list[LearnerStepRow]
    counters: dict[str, int]
    learning: Literal["running", "paused"]
    rollback_to: int | None


class DeadLetterRow(BaseModel):
    """One dead letter (``core.db.DeadLetter``, ``core.dead_letters.recent``): what was set aside,
    why, where it was read (null where unknown) and after how many tries; ``payload`` (the record
    as read) only when asked for (``payload=true``; absent otherwise, not null)."""

    model_config = _CLOSED
    id: int
    kind: str
    reason: str
    key: str | None
    prompt_id: str | None
    topic: str | None
    log_partition: int | None
    log_offset: int | None
    attempts: int
    payload: str | None = Field(None, description="Only with payload=true.")
    created_at: str


class DeadLetters(BaseModel):
    """``GET /admin/dead_letters``: how many there are (of the kind asked for), and the newest."""

    model_config = _CLOSED
    total: int
    dead_letters: list[DeadLetterRow]
