"""Database models (SQLAlchemy 2) shared by server and learner, and engine set-up.

The schema is created by Alembic (``migrations/``), never by ``create_all``, so SQLite and
PostgreSQL get the same tables from the same migration scripts.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    false,
    insert,
    make_url,
    text,
    true,
    update,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from core.limits import (
    EPISODE_ID_CHARS,
    FINISH_REASON_CHARS,
    ID_CHARS,
    IDENTITY_CHARS,
    KEY_CHARS,
    NAME_CHARS,
    PROMPT_ID_CHARS,
    SHA256_CHARS,
    STATE_CHARS,
    USER_CHARS,
)

# A naming convention keeps constraint names identical on SQLite (batch mode) and PostgreSQL.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# BIGINT autoincrement is not a rowid alias on SQLite; INTEGER is.
RowId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class TrajectoryIndex(Base):
    """One row per logged trajectory: what feedback needs, and where the record lies in the log."""

    __tablename__ = "trajectory_index"
    id: Mapped[str] = mapped_column(String(ID_CHARS), primary_key=True)
    prompt_id: Mapped[str] = mapped_column(String(PROMPT_ID_CHARS), index=True)
    episode_id: Mapped[str | None] = mapped_column(String(EPISODE_ID_CHARS), index=True)
    turn: Mapped[int | None] = mapped_column(Integer)
    dispatch_version: Mapped[int] = mapped_column(Integer)
    last_version: Mapped[int] = mapped_column(Integer)
    n_response_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(FINISH_REASON_CHARS))
    log_partition: Mapped[int] = mapped_column(Integer)
    log_offset: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The request's ``user`` (TrajectoryRecord.user): what ``saoserve admin forget`` looks up.
    user_id: Mapped[str | None] = mapped_column(String(USER_CHARS), index=True)
    # The canary arm the request was routed to (core/lifecycle.py ``Arm``): ``canary`` or
    # ``control`` while a canary share splits the traffic, NULL otherwise (probation, guard off).
    arm: Mapped[str | None] = mapped_column(String(STATE_CHARS))
    # Who sent it (TrajectoryRecord.identity: ``key:<key id>`` or ``user:<user>``): what
    # ``saoserve admin forget --api-key`` looks up, and what the guard's votes pass the identity
    # cap by (learner/guard/guard_votes.py). NULL for rows indexed before revision 0015.
    identity: Mapped[str | None] = mapped_column(String(IDENTITY_CHARS), index=True)
    # The record's ``train`` flag (revision 0016): opted-out answers never vote. NULL before it.
    train: Mapped[bool | None] = mapped_column(Boolean)


class FeedbackClaim(Base):
    """First-wins feedback per target (``t:<trajectory id>`` or ``e:<episode id>``).

    ``state``: ``claimed`` while the feedback record is being appended to the log, then
    ``received``. ``feedback_id``: the record (request) holding the claim; once ``received``,
    the one record of the target the joiner may train, unless a takeover superseded an earlier
    record that reached the log (``superseded_id``, ``core.claims``). The primary key makes the claim atomic
    on every database; a claim older than the claim timeout (a server that crashed mid-append,
    no 202 sent) may be taken over.
    """

    __tablename__ = "feedback_claims"
    target: Mapped[str] = mapped_column(String(KEY_CHARS), primary_key=True)
    state: Mapped[str] = mapped_column(String(STATE_CHARS))
    reward: Mapped[float | None] = mapped_column(Float)
    claimed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    received_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    feedback_id: Mapped[str | None] = mapped_column(String(ID_CHARS))
    # The first record a takeover took the claim from (migration 0017; core/claims.py).
    superseded_id: Mapped[str | None] = mapped_column(String(ID_CHARS))


class LogRecord(Base):
    """The SQL-table log (embedded default transport): offsets are row ids.

    Ids never go back, also after retention or forget deleted the newest rows: SQLite's
    AUTOINCREMENT (revision 0007) keeps it from reusing them, as PostgreSQL's sequence does, so
    a reader's committed offset never skips a later record.
    """

    __tablename__ = "log_records"
    offset: Mapped[int] = mapped_column("id", RowId, primary_key=True, autoincrement=True)
    topic: Mapped[str] = mapped_column(String(NAME_CHARS))
    key: Mapped[str] = mapped_column(String(PROMPT_ID_CHARS))
    payload: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    __table_args__ = (Index("ix_log_records_topic_id", "topic", "id"), {"sqlite_autoincrement": True})


class PolicyVersion(Base):
    """Every policy version known: 0 is the prepared base model."""

    __tablename__ = "policy_versions"
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(SHA256_CHARS))
    status: Mapped[str] = mapped_column(String(STATE_CHARS))
    parent_version: Mapped[int | None] = mapped_column(Integer)
    metrics: Mapped[dict | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The guard's stage (core/lifecycle.py): candidate | canary | promoted | rejected. ``status``
    # above says only whether the version's policy event is out (committed | published).
    lifecycle: Mapped[str] = mapped_column(String(STATE_CHARS), server_default="promoted")
    # The gate's figures (learner.guard.gate.GateResult as JSON); NULL when no gate ran.
    gate: Mapped[dict | None] = mapped_column(JSON)


class VersionStatusEvent(Base):
    """One lifecycle transition of a policy version: who (``learner``, ``guard`` or an
    operator's name), why and when (``core/lifecycle.py``). ``from_status`` is NULL for the
    stage a version is recorded with."""

    __tablename__ = "version_status_events"
    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(Integer, index=True)
    from_status: Mapped[str | None] = mapped_column(String(STATE_CHARS))
    to_status: Mapped[str] = mapped_column(String(STATE_CHARS))
    actor: Mapped[str] = mapped_column(String(NAME_CHARS))
    reason: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class QuarantinedSample(Base):
    """A sample (its ``learner_samples`` key) that trained the rejected ``version``: the learner
    never trains it again (``core/lifecycle_store.py``)."""

    __tablename__ = "quarantined_samples"
    sample_id: Mapped[str] = mapped_column(String(KEY_CHARS), primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ConsumerOffset(Base):
    """Next offset to read per (consumer, topic, partition), committed with derived state."""

    __tablename__ = "consumer_offsets"
    consumer: Mapped[str] = mapped_column(String(NAME_CHARS), primary_key=True)
    topic: Mapped[str] = mapped_column(String(NAME_CHARS), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    next_offset: Mapped[int] = mapped_column(BigInteger)


class PendingJoin(Base):
    """A trajectory (or feedback) waiting for its partner; committed with the offsets."""

    __tablename__ = "pending_joins"
    key: Mapped[str] = mapped_column(String(KEY_CHARS), primary_key=True)
    kind: Mapped[str] = mapped_column(String(STATE_CHARS), primary_key=True)
    prompt_id: Mapped[str] = mapped_column(String(PROMPT_ID_CHARS))
    payload: Mapped[str] = mapped_column(Text)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class LearnerStep(Base):
    """Metrics of one learner step (also exported to Prometheus)."""

    __tablename__ = "learner_steps"
    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(NAME_CHARS))
    step: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


def make_engine(url: str) -> Engine:
    """An engine with the pragmas SQLite needs for one writer beside readers.

    WAL lets the learner read while the server writes; busy_timeout makes concurrent
    writers wait instead of failing with "database is locked". Other databases get a pool
    that tests each connection before use, so it recovers by itself after an outage.
    """
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    # pre_ping replaces connections that died with the server (the pool recovers without a
    # restart); connect_timeout bounds each attempt while the server does not answer.
    connect_args = {"connect_timeout": 5} if make_url(url).get_backend_name() == "postgresql" else {}
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20, connect_args=connect_args)


SEARCH_PATH = re.compile(r"-c\s*search_path=(\S+)")
# The schema names ``core.policies.schema_name`` makes: the only ones ``migrate`` creates.
TENANT_SCHEMA = re.compile(r"t_[a-z0-9_]{1,40}_[0-9a-f]{8}")
# PostgreSQL advisory lock key held while migrating (any fixed 64-bit number; "saoserve" in ASCII).
MIGRATION_LOCK_KEY = 0x73616F7365727665


def search_path_schema(url: str) -> str | None:
    """The schema a PostgreSQL ``url``'s ``options`` set as its search path (a tenant namespace,
    ``core.policies.tenant_database_url``), or None."""
    u = make_url(url)
    if u.get_backend_name() != "postgresql":
        return None
    options = u.query.get("options", "")
    found = SEARCH_PATH.search(" ".join(options) if isinstance(options, tuple) else options)
    return found.group(1) if found else None


def migrate(url: str, revision: str = "head") -> None:
    """Run Alembic migrations up to ``revision`` on the database at ``url``. A PostgreSQL URL
    whose search path is a tenant namespace's schema (``core.policies.tenant_database_url``) gets
    that schema made first if it is missing, so its tables and Alembic's version table land in
    it; any other search path is the operator's, used as it is."""
    from alembic import command

    schema = search_path_schema(url)
    if schema is not None and TENANT_SCHEMA.fullmatch(schema):
        _make_schema(url, schema)
    command.upgrade(alembic_config(url), revision)


def _make_schema(url: str, schema: str) -> None:
    """Create ``schema`` (a ``TENANT_SCHEMA`` name, so it needs no quoting) unless it exists,
    under the migrations' advisory lock: every replica and learner migrates at start, and two
    ``CREATE SCHEMA IF NOT EXISTS`` at once can both miss the other's and one fail. A role that
    may not create schemas can still migrate a schema an administrator made."""
    engine = create_engine(make_url(url).difference_update_query(["options"]))
    try:
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            found = conn.execute(text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema}).first()
            if found is None:
                conn.execute(text(f"CREATE SCHEMA {schema}"))
    finally:
        engine.dispose()


def downgrade(url: str, revision: str = "base") -> None:
    """Run Alembic migrations down to ``revision``."""
    from alembic import command

    command.downgrade(alembic_config(url), revision)


def alembic_config(url: str):
    """An Alembic config pointing at the project's migrations with ``url``."""
    from alembic.config import Config

    root = Path(__file__).resolve().parent.parent / "migrations"
    cfg = Config()
    cfg.set_main_option("script_location", str(root))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


class PromptEvidence(Base):
    """Event-time value evidence of one prompt (SPO++; arithmetic in ``core/evidence_store.py``).

    Prior: ``alpha0``/``beta0`` at ``prior_version``; set by offline initialisation when
    ``offline_n`` is not NULL, otherwise the default prior, which sits at the prompt's earliest
    result version. Online: Σ ρ^(ref_version − v_i)·R_i (``alpha_ref``) and ·(1 − R_i)
    (``beta_ref``), ``ref_version`` = the newest result version (the prior's version while
    there is no result).
    """

    __tablename__ = "prompt_evidence"
    prompt_id: Mapped[str] = mapped_column(String(PROMPT_ID_CHARS), primary_key=True)
    alpha0: Mapped[float] = mapped_column(Float)
    beta0: Mapped[float] = mapped_column(Float)
    prior_version: Mapped[int] = mapped_column(Integer)
    alpha_ref: Mapped[float] = mapped_column(Float)
    beta_ref: Mapped[float] = mapped_column(Float)
    ref_version: Mapped[int] = mapped_column(Integer)
    n_results: Mapped[int] = mapped_column(BigInteger)
    reward_sum: Mapped[float] = mapped_column(Float)
    offline_n: Mapped[int | None] = mapped_column(Integer)
    offline_successes: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class LearnerSample(Base):
    """A joined (trajectory, reward) sample waiting for a learner batch.

    Written in the transaction that advances the consumer offsets; deleted in the transaction
    that records the policy version trained on it.
    """

    __tablename__ = "learner_samples"
    id: Mapped[str] = mapped_column(String(KEY_CHARS), primary_key=True)
    prompt_id: Mapped[str] = mapped_column(String(PROMPT_ID_CHARS))
    payload: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Who sent it (``Sample.identity``): what the identity cap counts (learner/data/identity_cap.py);
    # NULL for samples without one (and those joined before revision 0012).
    identity: Mapped[str | None] = mapped_column(String(IDENTITY_CHARS))


class LearnerCounter(Base):
    """Monotone counters of the learner (expired trajectories, excluded samples, ...)."""

    __tablename__ = "learner_counters"
    name: Mapped[str] = mapped_column(String(NAME_CHARS), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


def bump_counter(conn: Connection, name: str, n: int) -> None:
    """Add ``n`` to the learner counter ``name`` (created at ``n``) in the caller's transaction."""
    res = conn.execute(
        update(LearnerCounter).where(LearnerCounter.name == name).values(value=LearnerCounter.value + n)
    )
    if res.rowcount == 0:
        conn.execute(insert(LearnerCounter).values(name=name, value=n))


class DeadLetter(Base):
    """A record (or a sample) the learner set aside instead of joining or training it, and why
    (``core/dead_letters.py``); written in the transaction that moves the consumer offsets past
    the record, or that deletes the samples. ``key``, ``prompt_id`` and the log position locate
    it (NULL where unknown; a value too long for its column is cut); ``payload`` is the record
    as read."""

    __tablename__ = "dead_letters"
    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(NAME_CHARS))
    reason: Mapped[str] = mapped_column(Text)
    key: Mapped[str | None] = mapped_column(String(KEY_CHARS))
    prompt_id: Mapped[str | None] = mapped_column(String(PROMPT_ID_CHARS))
    topic: Mapped[str | None] = mapped_column(String(NAME_CHARS))
    log_partition: Mapped[int | None] = mapped_column(Integer)
    log_offset: Mapped[int | None] = mapped_column(BigInteger)
    attempts: Mapped[int] = mapped_column(Integer)
    payload: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ControlFlag(Base):
    """Operator switches read by the learner (``paused``: 1 stops training, joins go on)."""

    __tablename__ = "control_flags"
    name: Mapped[str] = mapped_column(String(NAME_CHARS), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class TenantPolicyRow(Base):
    """A tenant with a policy of its own (``core.tenant_store``; docs/tenants.md, "Adding and
    removing a tenant policy"): the list every server replica serves and ``saoserve learn
    --all-tenants`` trains. Kept in the global database only, seeded from
    ``SAOSERVE_TENANT_POLICIES``, changed by ``/admin/tenant_policies``. ``removed_at``: when the
    route removed it (None while listed); the row stays, so forget and retention reach the
    namespace it leaves."""

    __tablename__ = "tenant_policies"
    name: Mapped[str] = mapped_column(String(NAME_CHARS), primary_key=True)
    added_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    removed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Episode(Base):
    """An episode and its start: the first chat with a new episode id starts it; the primary key
    makes exactly one of two racing first turns win. Later turns present the episode's token."""

    __tablename__ = "episodes"
    episode_id: Mapped[str] = mapped_column(String(EPISODE_ID_CHARS), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class EpisodeTurn(Base):
    """A turn of an episode: its number (``turn``, once per episode: the unique constraint makes
    one of two racing requests for a number win) and the trajectory holding it. ``logged_at``
    is NULL while the turn is in flight and set in the transaction that indexes its record; the
    episode's feedback waits while one is in flight, and rates the logged ones. A turn that
    failed before its record was logged (503, 500) is deleted, so its number can be sent again.
    Rows of turns in flight before revision 0006 have no number."""

    __tablename__ = "episode_turns"
    trajectory_id: Mapped[str] = mapped_column(String(ID_CHARS), primary_key=True)
    episode_id: Mapped[str] = mapped_column(String(EPISODE_ID_CHARS), index=True)
    dispatched_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    turn: Mapped[int | None] = mapped_column(Integer)
    logged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (UniqueConstraint("episode_id", "turn"),)


class ForgottenRecord(Base):
    """A tombstone of ``saoserve admin forget`` (docs/privacy.md): ``key`` is a trajectory id or
    ``e:<episode id>`` (the keys of ``pending_joins`` and ``learner_samples``). The learner drops
    every record it reads under a tombstoned key: a Kafka log keeps the records themselves until
    its retention. Holds no content and no user id."""

    __tablename__ = "forgotten_records"
    key: Mapped[str] = mapped_column(String(KEY_CHARS), primary_key=True)
    forgotten_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ApiKey(Base):
    """An API key of a tenant (``core/keys.py``): the sha256 of the key, never the key itself.
    ``revoked_at`` is NULL while the key is valid; ``train`` false: the key opts out of training
    (docs/privacy.md); ``trusted`` true: the identity caps do not bound it (docs/guard.md, "Who
    votes")."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(NAME_CHARS), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(NAME_CHARS), index=True)
    key_sha256: Mapped[str] = mapped_column(String(SHA256_CHARS))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    train: Mapped[bool] = mapped_column(Boolean, server_default=true())
    trusted: Mapped[bool] = mapped_column(Boolean, server_default=false())


class SubjectKey(Base):
    """The data key that seals the trajectory records of one subject in a log that keeps records
    (Kafka; ``core/sealing.py``, docs/privacy.md). A subject is an (API key id, ``user``) pair,
    either part NULL. ``holder``: sha256 of the pair, unique among live keys. A forget destroys
    the key: ``secret``, ``holder``, ``key_id`` and ``user_id`` become NULL and ``destroyed_at``
    is set, so every copy of the subject's records, wherever it lies, can no longer be read."""

    __tablename__ = "subject_keys"
    id: Mapped[str] = mapped_column(String(NAME_CHARS), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(SHA256_CHARS), unique=True)
    key_id: Mapped[str | None] = mapped_column(String(NAME_CHARS), index=True)
    user_id: Mapped[str | None] = mapped_column(String(USER_CHARS), index=True)
    secret: Mapped[bytes | None] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    destroyed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ForgetRequest(Base):
    """A forget (``saoserve admin forget``, docs/privacy.md), recorded before it is carried out
    so that a crash half-way is finished by the next forget or retention run (``core/forget``).

    ``kind``: ``user`` or ``key``; ``subject``: the user or key id, held only while the request
    is pending and cleared when it completes; ``subject_hash``: sha256 of kind and subject, kept.
    ``receipt``: rows removed per store, added to as each step commits; ``completed_at`` NULL
    while pending."""

    __tablename__ = "forget_requests"
    id: Mapped[str] = mapped_column(String(NAME_CHARS), primary_key=True)
    kind: Mapped[str] = mapped_column(String(STATE_CHARS))
    subject: Mapped[str | None] = mapped_column(String(USER_CHARS))
    subject_hash: Mapped[str] = mapped_column(String(SHA256_CHARS), index=True)
    requested_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    receipt: Mapped[dict] = mapped_column(JSON)
