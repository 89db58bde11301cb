"""Forgetting: what is deleted of one subject from the database and the SQL-table log
(docs/privacy.md; docs/design.md §9.5: "retention and forgetting remove records from everything
the learner can read"), a few SQL deletes around a pure selection, with the delete helpers of
``core.retention``.

:func:`forget` (``saoserve admin forget USER`` or ``--api-key ID``, a :class:`ForgetTarget`):
the subject's trajectories, found through the index (``user_id``, or ``identity`` for a key), in
the SQL log itself (a record never indexed, :func:`_scan_log`) and in the learner's pending joins
(a Kafka record never indexed), with every turn of their episodes, their feedback, claims,
pending joins, waiting samples and dead letters; their prompts' evidence rows still keyed by a
client's id in clear move to the id's keyed hash; the subject's data keys (``core.sealing``) are
destroyed, so a Kafka log's copies can no longer be read. Tombstones
(``core.db.ForgottenRecord``) keep the learner from what a Kafka log still holds: the joiner
drops every record read under a tombstoned key (``learner.data.join_plan``), and deletes in its
own commit whatever it wrote that a forget running beside it tombstoned.

A forget is a durable request (``core.db.ForgetRequest``): recorded first
(:func:`record_request`), then carried out (:func:`carry_out`): the SQL log's rows, then the
database in one transaction that also completes the request. A crash anywhere leaves it pending,
and the next forget or retention run finishes it (:func:`finish_pending`); every step finds its
rows again, so running it twice removes nothing twice. Its :class:`ForgetReceipt` counts what was
removed, per store.

Times are tz-aware UTC; counts are rows.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from sqlalchemy import insert, select, text, update
from sqlalchemy.engine import Connection, Engine

from core.claims import episode_key
from core.db import (
    DeadLetter,
    Episode,
    EpisodeTurn,
    FeedbackClaim,
    ForgetRequest,
    ForgottenRecord,
    LearnerSample,
    LogRecord,
    PendingJoin,
    TrajectoryIndex,
)
from core.evidence_store import EvidenceStore
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, as_utc
from core.retention import BATCH_ROWS, chunks, claim_targets, delete_in
from core.sealing import destroy_keys


def forget_keys(trajectory_ids: Iterable[str], episode_ids: Iterable[str]) -> set[str]:
    """Tombstone keys of the trajectories and episodes forgotten."""
    return set(trajectory_ids) | {episode_key(e) for e in episode_ids}


class ForgetKind(StrEnum):
    """Whom a forget names: ``user``, the chat requests' ``user`` field; ``key``, an API key id
    (every request the key authenticated, with or without a ``user``)."""

    USER = "user"
    KEY = "key"


@dataclass(frozen=True)
class ForgetTarget:
    """The subject of one forget (docs/privacy.md, "Who is forgotten")."""

    kind: ForgetKind
    subject: str

    @property
    def identity(self) -> str:
        """``TrajectoryRecord.identity`` of the records this names alone: ``user:<user>`` or
        ``key:<key id>``."""
        return f"{self.kind.value}:{self.subject}"

    @property
    def subject_hash(self) -> str:
        """sha256 (hex) of kind and subject: what a completed request keeps of whom it forgot."""
        return hashlib.sha256(f"{self.kind.value}\0{self.subject}".encode()).hexdigest()

    def names(self, rec: dict) -> bool:
        """Whether a record (parsed JSON) is of this subject: its ``user`` (a user forget), or
        the key that sent it (``identity`` ``key:<id>``, a key forget)."""
        if self.kind is ForgetKind.USER:
            return rec.get("user") == self.subject
        return rec.get("identity") == self.identity

    def log_fragment(self) -> str:
        """The bytes every logged trajectory record of this subject holds, as the record's JSON
        spells them (``"user":"alice"``, ``"identity":"key:k…"``): a first filter of a scan of
        the SQL log, each row it passes then parsed and checked with :meth:`names`."""
        field_name = "user" if self.kind is ForgetKind.USER else "identity"
        value = self.subject if self.kind is ForgetKind.USER else self.identity
        return f'"{field_name}":' + json.dumps(value, ensure_ascii=False)


def concerns(
    payload: str | None, target: ForgetTarget, trajectory_ids: set[str], episode_ids: set[str]
) -> bool:
    """Whether a record's JSON (a trajectory, a feedback record, or one that did not validate)
    is of ``target`` or of one of these trajectories or episodes; anything else that is not a
    JSON object is not."""
    try:
        rec = json.loads(payload or "")
    except ValueError:
        return False
    if not isinstance(rec, dict):
        return False
    return (
        target.names(rec)
        or rec.get("id") in trajectory_ids
        or rec.get("trajectory_id") in trajectory_ids
        or rec.get("episode_id") in episode_ids
    )


@dataclass(frozen=True)
class ForgetReceipt:
    """What one forget removed (``forget_requests``; docs/privacy.md, "The receipt").

    ``id``: the request (``f`` + 32 hex digits); ``kind`` and ``subject_hash`` (sha256 of kind
    and subject: the receipt keeps no name in clear); ``completed_at`` None while it is still
    pending (a crash: the next forget or retention run finishes it). ``trajectories`` and
    ``episodes``: those found; ``tombstones``: new tombstones; ``deleted``: rows per store,
    ``log_records.<topic>`` for a SQL-table log, ``subject_keys`` for the data keys destroyed
    (each makes every record it sealed in a Kafka log unreadable), ``prompt_evidence`` for rows
    still keyed by a client's id in clear moved to its hash. Counts add up over the runs that
    carried it out; rows a run deleted from the SQL log just before it crashed are not counted.
    """

    id: str
    kind: ForgetKind
    subject_hash: str
    requested_at: datetime
    completed_at: datetime | None
    trajectories: int = 0
    episodes: int = 0
    tombstones: int = 0
    deleted: dict[str, int] = field(default_factory=dict)


def new_request_id() -> str:
    """A forget request's id: ``f`` + 32 random hex digits."""
    return "f" + secrets.token_hex(16)


def record_request(db: Engine, request_id: str, target: ForgetTarget, now: datetime) -> None:
    """Record the forget ``request_id`` of ``target`` as pending (idempotent: a request already
    recorded is left as it is). Done first, so a crash at any later point leaves a request that
    the next forget or retention run carries out (:func:`finish_pending`)."""
    with db.begin() as conn:
        if conn.execute(select(ForgetRequest.id).where(ForgetRequest.id == request_id)).first() is None:
            conn.execute(
                insert(ForgetRequest).values(
                    id=request_id,
                    kind=target.kind.value,
                    subject=target.subject,
                    subject_hash=target.subject_hash,
                    requested_at=now,
                    completed_at=None,
                    receipt={},
                )
            )


def _lock_request(conn: Connection, request_id: str) -> datetime | None:
    """Lock the request's row in the caller's transaction (a write first: SQLite's write lock,
    PostgreSQL's row lock) and read its ``completed_at`` after the lock: of two runs of one
    request at once (two forgets finishing it), the second waits, then reads what the first
    wrote, so neither overwrites the other's receipt."""
    conn.execute(update(ForgetRequest).where(ForgetRequest.id == request_id).values(kind=ForgetRequest.kind))
    return conn.execute(select(ForgetRequest.completed_at).where(ForgetRequest.id == request_id)).scalar_one()


def _add_to_receipt(
    conn: Connection, request_id: str, deleted: dict[str, int], found: dict[str, int], now: datetime | None
) -> None:
    """Add ``deleted`` (rows per store) and ``found`` (``FOUND_COUNTS``) to the request's receipt
    in the caller's transaction; ``now``: mark it completed then, and drop its subject (only the
    hash stays)."""
    _lock_request(conn, request_id)
    row = conn.execute(select(ForgetRequest.receipt).where(ForgetRequest.id == request_id)).one()
    receipt = {"deleted": {}} | dict(row.receipt or {})
    rows = dict(receipt["deleted"])
    for name, n in deleted.items():
        rows[name] = rows.get(name, 0) + n
    receipt["deleted"] = rows
    for name, n in found.items():
        receipt[name] = receipt.get(name, 0) + n
    values: dict = {"receipt": receipt}
    if now is not None:
        values |= {"completed_at": now, "subject": None}
    conn.execute(update(ForgetRequest).where(ForgetRequest.id == request_id).values(**values))


FOUND_COUNTS = ("trajectories", "episodes", "tombstones")
"""Receipt entries that are not rows of a table."""


def _receipt(row) -> ForgetReceipt:
    counts = dict(row.receipt or {})
    found = {name: counts.get(name, 0) for name in FOUND_COUNTS}
    return ForgetReceipt(
        id=row.id,
        kind=ForgetKind(row.kind),
        subject_hash=row.subject_hash,
        requested_at=as_utc(row.requested_at),
        completed_at=None if row.completed_at is None else as_utc(row.completed_at),
        deleted=dict(sorted(counts.get("deleted", {}).items())),
        **found,
    )


def receipt_of(db: Engine, request_id: str) -> ForgetReceipt | None:
    """The receipt of the forget ``request_id``; None if this database has no such request."""
    with db.connect() as conn:
        row = conn.execute(select(ForgetRequest.__table__).where(ForgetRequest.id == request_id)).first()
    return None if row is None else _receipt(row)


@dataclass
class _Found:
    """What a forget removes: trajectory ids, episode ids, prompt ids, and the SQL log's rows
    of those trajectories (offsets)."""

    ids: set[str] = field(default_factory=set)
    episodes: set[str] = field(default_factory=set)
    prompts: set[str] = field(default_factory=set)
    offsets: set[int] = field(default_factory=set)

    def add(self, tid: str, episode: str | None, prompt: str | None, offset: int | None = None) -> None:
        self.ids.add(tid)
        if episode is not None:
            self.episodes.add(episode)
        if prompt is not None:
            self.prompts.add(prompt)
        if offset is not None:
            self.offsets.add(offset)


_INDEX_COLS = (
    TrajectoryIndex.id,
    TrajectoryIndex.episode_id,
    TrajectoryIndex.prompt_id,
    TrajectoryIndex.log_partition,
    TrajectoryIndex.log_offset,
)


def _scan_log(log_engine: Engine, target: ForgetTarget, found: _Found) -> None:
    """Add the trajectory records of ``target`` the SQL log holds, indexed or not (a record
    whose index row was never written: the server died between the append and the index).
    Pages of BATCH_ROWS rows by id; each row the fragment filter passes is parsed and checked."""
    after = -1
    fragment = target.log_fragment()
    while True:
        with log_engine.connect() as conn:
            rows = conn.execute(
                select(LogRecord.offset, LogRecord.payload)
                .where(
                    LogRecord.topic == TOPIC_TRAJECTORIES,
                    LogRecord.offset > after,
                    LogRecord.payload.contains(fragment, autoescape=True),
                )
                .order_by(LogRecord.offset)
                .limit(BATCH_ROWS)
            ).all()
        for offset, payload in rows:
            try:
                rec = json.loads(payload)
            except ValueError:
                continue
            if isinstance(rec, dict) and target.names(rec) and isinstance(rec.get("id"), str):
                found.add(rec["id"], rec.get("episode_id"), rec.get("prompt_id"), offset)
        if len(rows) < BATCH_ROWS:
            return
        after = rows[-1][0]


def _find(db: Engine, log_engine: Engine | None, target: ForgetTarget) -> _Found:
    """Everything of ``target``: its indexed trajectories (``user_id``, or ``identity`` for a
    key), its records in the SQL log (indexed or not), its trajectories waiting in the learner's
    pending joins (a Kafka record never indexed), then every turn of their episodes."""
    found = _Found()
    on_log = log_engine is not None
    where = (
        TrajectoryIndex.user_id == target.subject
        if target.kind is ForgetKind.USER
        else (TrajectoryIndex.identity == target.identity)
    )
    with db.connect() as conn:
        for tid, episode, prompt, partition, offset in conn.execute(select(*_INDEX_COLS).where(where)):
            found.add(tid, episode, prompt, offset if on_log and partition == 0 else None)
        for payload in conn.execute(
            select(PendingJoin.payload).where(PendingJoin.kind == "trajectory")
        ).scalars():
            try:
                rec = json.loads(payload)
            except ValueError:
                continue
            if isinstance(rec, dict) and target.names(rec) and isinstance(rec.get("id"), str):
                found.add(rec["id"], rec.get("episode_id"), rec.get("prompt_id"))
    if log_engine is not None:
        _scan_log(log_engine, target, found)
    with db.connect() as conn:
        for part in chunks(found.episodes):
            for tid, episode, prompt, partition, offset in conn.execute(
                select(*_INDEX_COLS).where(TrajectoryIndex.episode_id.in_(part))
            ):
                found.add(tid, episode, prompt, offset if on_log and partition == 0 else None)
    return found


def _forget_log(log_engine: Engine, target: ForgetTarget, found: _Found) -> dict[str, int]:
    """Delete the SQL log's rows of ``found``: the trajectory records, and the feedback records
    on them (found by their prompt's key, then checked)."""
    deleted: dict[str, int] = {}
    with log_engine.begin() as conn:
        deleted[f"log_records.{TOPIC_TRAJECTORIES}"] = delete_in(
            conn, LogRecord.__table__, LogRecord.offset, found.offsets
        )
        feedback = []
        for part in chunks(found.prompts):
            rows = conn.execute(
                select(LogRecord.offset, LogRecord.payload).where(
                    LogRecord.topic == TOPIC_FEEDBACK, LogRecord.key.in_(part)
                )
            ).all()
            feedback += [o for o, payload in rows if concerns(payload, target, found.ids, found.episodes)]
        deleted[f"log_records.{TOPIC_FEEDBACK}"] = delete_in(
            conn, LogRecord.__table__, LogRecord.offset, feedback
        )
    return deleted


def _forget_database(
    conn: Connection, target: ForgetTarget, found: _Found, secret: str, now: datetime
) -> tuple[dict[str, int], dict[str, int]]:
    """In the caller's transaction: tombstone ``found`` and delete its rows from every table,
    re-key its prompts' evidence still held under a client's id in clear, destroy the
    subject's data keys. Returns the receipt's (rows deleted per table, ``FOUND_COUNTS``)."""
    ids, episodes = found.ids, found.episodes
    if conn.dialect.name == "postgresql":
        # A joiner committing beside this waits, or is waited for, and then sees the
        # tombstones (its commit deletes what it wrote under them): learner.data.joiner.
        conn.execute(text("LOCK TABLE pending_joins, learner_samples IN SHARE ROW EXCLUSIVE MODE"))
    keys = forget_keys(ids, episodes)
    new = sorted(keys - forgotten_among(conn, keys))
    if new:
        conn.execute(insert(ForgottenRecord), [{"key": k, "forgotten_at": now} for k in new])
    pending = [
        k
        for k, payload in conn.execute(
            select(PendingJoin.key, PendingJoin.payload).where(
                PendingJoin.kind.in_(("unconfirmed", "trajectory"))
            )
        )
        if concerns(payload, target, ids, episodes)
    ]
    counts: dict[str, int] = {}
    counts["trajectory_index"] = delete_in(conn, TrajectoryIndex.__table__, TrajectoryIndex.id, ids)
    counts["feedback_claims"] = delete_in(
        conn, FeedbackClaim.__table__, FeedbackClaim.target, claim_targets(ids, episodes)
    )
    counts["pending_joins"] = delete_in(conn, PendingJoin.__table__, PendingJoin.key, keys | set(pending))
    counts["learner_samples"] = delete_in(conn, LearnerSample.__table__, LearnerSample.id, keys)
    # Letters of the subject's records: by key, or (a malformed record, keyed by its prompt)
    # by what its payload names.
    named = keys | claim_targets(ids, episodes)
    letters = {
        i
        for i, k, payload in conn.execute(select(DeadLetter.id, DeadLetter.key, DeadLetter.payload))
        if k in named or concerns(payload, target, ids, episodes)
    }
    counts["dead_letters"] = delete_in(conn, DeadLetter.__table__, DeadLetter.id, letters)
    counts["episode_turns"] = delete_in(
        conn, EpisodeTurn.__table__, EpisodeTurn.episode_id, episodes
    ) + delete_in(conn, EpisodeTurn.__table__, EpisodeTurn.trajectory_id, ids)
    counts["episodes"] = delete_in(conn, Episode.__table__, Episode.episode_id, episodes)
    counts["prompt_evidence"] = EvidenceStore.rekey_clear_ids(conn, secret, found.prompts)
    by = {"user": target.subject} if target.kind is ForgetKind.USER else {"key_id": target.subject}
    counts["subject_keys"] = destroy_keys(conn, now, **by)
    return counts, {"trajectories": len(ids), "episodes": len(episodes), "tombstones": len(new)}


def carry_out(
    db: Engine, log_engine: Engine | None, request_id: str, secret: str, now: datetime
) -> ForgetReceipt:
    """Carry out the recorded forget ``request_id`` (module docstring), idempotently: the SQL
    log's rows first (they are found again by reading the log), then the database in one
    transaction with the request's completion, so a crash at any point leaves it pending, and
    running it again finishes it. ``secret``: the server's, for the keyed hash of prompt ids
    (``core.evidence_store.stored_prompt_id``). A completed request is returned as it is.

    Raises LookupError for an unknown request; the driver's error when the database fails.
    """
    with db.connect() as conn:
        req = conn.execute(select(ForgetRequest.__table__).where(ForgetRequest.id == request_id)).first()
    if req is None:
        raise LookupError(f"no forget request {request_id!r}")
    if req.completed_at is not None:
        return _receipt(req)
    target = ForgetTarget(ForgetKind(req.kind), req.subject)
    found = _find(db, log_engine, target)
    if log_engine is not None:
        removed = _forget_log(log_engine, target, found)
        with db.begin() as conn:
            _add_to_receipt(conn, request_id, removed, {}, None)
    with db.begin() as conn:
        if _lock_request(conn, request_id) is None:
            deleted, counts = _forget_database(conn, target, found, secret, now)
            _add_to_receipt(conn, request_id, deleted, counts, now)
    receipt = receipt_of(db, request_id)
    assert receipt is not None  # recorded above, and requests are never deleted
    return receipt


def pending_requests(db: Engine) -> list[str]:
    """Forget requests recorded and not completed (a crash), oldest first."""
    with db.connect() as conn:
        return list(
            conn.execute(
                select(ForgetRequest.id)
                .where(ForgetRequest.completed_at.is_(None))
                .order_by(ForgetRequest.requested_at, ForgetRequest.id)
            ).scalars()
        )


def finish_pending(db: Engine, log_engine: Engine | None, secret: str, now: datetime) -> list[ForgetReceipt]:
    """Carry out every pending forget request (:func:`carry_out`); what each forget and each
    retention run does first. Returns their receipts."""
    return [carry_out(db, log_engine, rid, secret, now) for rid in pending_requests(db)]


def forget(
    db: Engine,
    log_engine: Engine | None,
    target: ForgetTarget,
    secret: str,
    now: datetime,
    request_id: str | None = None,
) -> ForgetReceipt:
    """Forget ``target`` (module docstring): finish the requests a crash left pending, record
    this one (``request_id``, or a new id), carry it out and return its receipt. Idempotent: a
    subject with nothing (left) gets a receipt of zeros."""
    finish_pending(db, log_engine, secret, now)
    rid = request_id or new_request_id()
    record_request(db, rid, target, now)
    return carry_out(db, log_engine, rid, secret, now)


def forgotten_among(conn: Connection, keys: Sequence[str] | set[str]) -> frozenset[str]:
    """The keys among ``keys`` that a forget tombstoned."""
    found: set[str] = set()
    for part in chunks(keys):
        found |= set(conn.execute(select(ForgottenRecord.key).where(ForgottenRecord.key.in_(part))).scalars())
    return frozenset(found)


def all_forgotten(db: Engine) -> frozenset[str]:
    """Every tombstoned key (for readers of the whole log, such as critic pretraining)."""
    with db.connect() as conn:
        return frozenset(conn.execute(select(ForgottenRecord.key)).scalars())
