"""Crypto-shredding of a log that keeps records: each subject's trajectory records sealed under a
data key held in the database, which a forget destroys (docs/privacy.md, "The Kafka log").

Why sealing and not a compacted topic with tombstones. Kafka cannot delete one record; a
compacted topic drops a key's older records once a newer one (a tombstone) follows it, but only
when the log cleaner gets to that segment, never in the active segment, and never in the
broker's replicas' or backups' copies that were taken before. The tansu broker the project tests
on (0.6) has no log cleaner: a topic created with ``cleanup.policy=compact`` (and
``segment.ms``, ``min.cleanable.dirty.ratio``, ``delete.retention.ms`` as low as they go)
describes no config back, and a key's older records and its tombstone all stay readable (tried
when this was chosen). A data key per subject, kept in
the database and destroyed by a forget, makes every copy of the subject's records unreadable at
once, in the broker, its replicas and its backups, on any broker.

What is sealed: the whole JSON of a trajectory record that has a subject (an API key or a
``user``): prompt and answer token ids, the ``user`` and ``identity`` fields, the stop strings.
A record with neither identifies nobody to forget and is logged as before. Feedback records hold
ids, a reward and the (hashed, ``core.evidence_store.stored_prompt_id``) prompt id and are not
sealed. The SQL-table log is not sealed: a forget deletes its rows (``core.forget``).

A subject is the pair (API key id, ``user``), either part absent: a forget by user destroys the
keys of every pair with that user, a forget by key every pair with that key, so both reach all of
the records they name and nothing else. Records sealed before a forget stay sealed under the
destroyed key; the next record of the subject gets a new key.

The cipher is AES-256-GCM from ``cryptography`` (pyca), a well-kept library; nothing here is a
cipher of its own. The envelope binds the subject id as associated data, so a record cannot be
moved under another subject's key. The envelope is JSON with the marker first::

    {"sealed":"saoserve.sealed/1","subject":"s…","nonce":"<base64, 12 bytes>","data":"<base64>"}

so a reader tells a sealed record from a plain one (records logged before sealing, records
without a subject) by its first bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError

from core.db import SubjectKey
from core.logbus import LogEntry
from core.records import TOPIC_TRAJECTORIES, TrajectoryRecord

SEALED_SCHEMA = "saoserve.sealed/1"
SEALED_PREFIX = b'{"sealed":'
"""The first bytes of every sealed record (the envelope's marker comes first)."""

_SUBJECT_ID = re.compile(r"s[0-9a-f]{1,63}")

KEY_BYTES = 32
"""AES-256: a data key is 32 random bytes (``os.urandom``)."""

NONCE_BYTES = 12
"""GCM's 96-bit nonce, random per record: 2^32 records under one key keep the collision chance
below 2^-32 (NIST SP 800-38D §8.3)."""

KEY_PREFIX = "key:"


class Shredded(LookupError):
    """A sealed record whose subject's key was destroyed by a forget: it can never be read."""


@dataclass(frozen=True)
class Subject:
    """Whose records one data key seals: an API key id and a ``user``, either None, not both."""

    key_id: str | None
    user: str | None

    @property
    def holder(self) -> str:
        """sha256 (hex) of the pair: the unique column of the live key, no name in clear."""
        return hashlib.sha256(json.dumps([self.key_id, self.user]).encode()).hexdigest()


def subject_of(rec: TrajectoryRecord) -> Subject | None:
    """The subject of a trajectory record: its API key (``identity`` ``key:<id>``) and its
    ``user``; None when it has neither (nothing to seal)."""
    key_id = (
        rec.identity.removeprefix(KEY_PREFIX)
        if rec.identity and rec.identity.startswith(KEY_PREFIX)
        else None
    )
    if key_id is None and rec.user is None:
        return None
    return Subject(key_id, rec.user)


def seal(subject_id: str, secret: bytes, plaintext: bytes) -> bytes:
    """The envelope of ``plaintext`` sealed under ``secret`` (32 bytes), bound to ``subject_id``.

    The JSON is put together from its parts: the subject id is ``s`` + hex digits and the rest
    base64, none of which JSON escapes, and ``json.dumps`` would scan the whole ciphertext again
    for characters to escape (most of a seal's time on a trajectory-sized record)."""
    if not _SUBJECT_ID.fullmatch(subject_id):
        raise ValueError(f"a subject id is s and hex digits, not {subject_id!r}")
    nonce = os.urandom(NONCE_BYTES)
    data = AESGCM(secret).encrypt(nonce, plaintext, subject_id.encode())
    return b"".join(
        (
            SEALED_PREFIX,
            b'"' + SEALED_SCHEMA.encode() + b'","subject":"',
            subject_id.encode(),
            b'","nonce":"',
            base64.b64encode(nonce),
            b'","data":"',
            base64.b64encode(data),
            b'"}',
        )
    )


def is_sealed(value: bytes) -> bool:
    """Whether a log value is a sealed envelope (else a plain record, or something malformed)."""
    return value.startswith(SEALED_PREFIX)


def envelope(value: bytes) -> tuple[str, bytes, bytes]:
    """(subject id, nonce, ciphertext) of a sealed value. Raises ValueError if it is not one."""
    try:
        env = json.loads(value)
        if env.get("sealed") != SEALED_SCHEMA:
            raise ValueError(f"not {SEALED_SCHEMA}")
        return env["subject"], base64.b64decode(env["nonce"]), base64.b64decode(env["data"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a sealed record: {exc}") from exc


def unseal(value: bytes, secret: bytes) -> bytes:
    """The plaintext of a sealed value. Raises ValueError when it is not an envelope, or does not
    open under ``secret`` (tampered, or another subject's key)."""
    subject_id, nonce, data = envelope(value)
    try:
        return AESGCM(secret).decrypt(nonce, data, subject_id.encode())
    except InvalidTag as exc:
        raise ValueError(f"sealed record of {subject_id} does not open under its key") from exc


KEY_CACHE_S = 10.0
"""Seconds a server seals a subject's records with the key it last read, without reading it
again. A forget on another replica reaches this server's new records of the subject within
this time; a record it seals meanwhile under the destroyed key can never be read, and is
forgotten with the rest (docs/privacy.md)."""

KEY_CACHE_SIZE = 10_000
"""Subjects a server keeps keys of; past this the cache starts afresh."""


class SubjectKeys:
    """The data keys in ``subject_keys`` (``core.db.SubjectKey``).

    ``key_for`` keeps each subject's key for ``cache_s`` seconds (``KEY_CACHE_S``), and past
    that while the database does not answer (a record already generated is still sealed and
    logged when it can be: the server's outage rules, docs/reliability.md). Reads for opening
    records (``secrets_of``, ``open``, ``open_entries``) are never cached: a destroyed key is
    never used to open a record."""

    def __init__(self, engine: Engine, cache_s: float = KEY_CACHE_S):
        self.engine = engine
        self.cache_s = cache_s
        self._cache: dict[str, tuple[str, bytes, float]] = {}
        self._lock = threading.Lock()

    def key_for(self, subject: Subject, now: datetime) -> tuple[str, bytes]:
        """(id, secret) of ``subject``'s live key (cached, see the class), made when it has none.
        Raises the driver's error when the database fails and no key of the subject is cached."""
        holder = subject.holder
        with self._lock:
            hit = self._cache.get(holder)
        if hit is not None and time.monotonic() - hit[2] < self.cache_s:
            return hit[0], hit[1]
        try:
            key_id, secret = self._read_or_make(subject, now)
        except (OperationalError, InterfaceError):
            if hit is None:
                raise
            return hit[0], hit[1]
        with self._lock:
            if len(self._cache) >= KEY_CACHE_SIZE:
                self._cache.clear()
            self._cache[holder] = (key_id, secret, time.monotonic())
        return key_id, secret

    def drop_cached(self) -> None:
        """Forget every cached key (after a forget on this server: its next records read theirs)."""
        with self._lock:
            self._cache.clear()

    def _read_or_make(self, subject: Subject, now: datetime) -> tuple[str, bytes]:
        """(id, secret) of ``subject``'s live key in the database, made when it has none (two
        replicas making one at once: the unique ``holder`` keeps the first, the other reads it)."""
        holder = subject.holder
        for _ in range(3):
            with self.engine.connect() as conn:
                row = conn.execute(
                    select(SubjectKey.id, SubjectKey.secret).where(SubjectKey.holder == holder)
                ).first()
            if row is not None:
                return row.id, row.secret
            key_id, secret = "s" + secrets.token_hex(16), os.urandom(KEY_BYTES)
            try:
                with self.engine.begin() as conn:
                    conn.execute(
                        insert(SubjectKey).values(
                            id=key_id,
                            holder=holder,
                            key_id=subject.key_id,
                            user_id=subject.user,
                            secret=secret,
                            created_at=now,
                        )
                    )
                return key_id, secret
            except IntegrityError:
                continue
        raise RuntimeError(f"no data key could be made or read for holder {holder}")

    def encode(self, rec: TrajectoryRecord, now: datetime) -> bytes:
        """The bytes to log for ``rec``: sealed under its subject's key, or plain without one."""
        subject = subject_of(rec)
        if subject is None:
            return rec.to_json()
        subject_id, secret = self.key_for(subject, now)
        return seal(subject_id, secret, rec.to_json())

    def secrets_of(self, subject_ids: Iterable[str]) -> dict[str, bytes]:
        """The live secrets among ``subject_ids`` (a destroyed one is absent)."""
        wanted = sorted(set(subject_ids))
        out: dict[str, bytes] = {}
        with self.engine.connect() as conn:
            for i in range(0, len(wanted), 500):
                out |= {
                    k: s
                    for k, s in conn.execute(
                        select(SubjectKey.id, SubjectKey.secret).where(
                            SubjectKey.id.in_(wanted[i : i + 500]), SubjectKey.secret.is_not(None)
                        )
                    )
                }
        return out

    def open(self, value: bytes) -> bytes:
        """The plaintext of a log value (a plain one as it is). Raises Shredded when its key was
        destroyed, ValueError when it does not open."""
        if not is_sealed(value):
            return value
        subject_id, _, _ = envelope(value)
        secret = self.secrets_of([subject_id]).get(subject_id)
        if secret is None:
            raise Shredded(f"the key of subject {subject_id} was destroyed by a forget")
        return unseal(value, secret)

    def open_entries(self, entries: list[LogEntry]) -> tuple[list[LogEntry], list[LogEntry]]:
        """(readable, shredded) of a read: sealed trajectory entries opened with one query for
        their keys; those whose key was destroyed in ``shredded``. An envelope that does not
        parse or open is passed on as it is, for the reader to set aside as malformed."""
        sealed: dict[int, str] = {}
        for i, e in enumerate(entries):
            if e.topic == TOPIC_TRAJECTORIES and is_sealed(e.value):
                try:
                    sealed[i] = envelope(e.value)[0]
                except ValueError:
                    continue
        if not sealed:
            return entries, []
        keys = self.secrets_of(sealed.values())
        readable, shredded = [], []
        for i, e in enumerate(entries):
            if i not in sealed:
                readable.append(e)
            elif sealed[i] not in keys:
                shredded.append(e)
            else:
                try:
                    readable.append(replace(e, value=unseal(e.value, keys[sealed[i]])))
                except ValueError:
                    readable.append(e)
        return readable, shredded


def destroy_keys(conn: Connection, now: datetime, user: str | None = None, key_id: str | None = None) -> int:
    """In the caller's transaction: destroy the live keys of every subject with ``user`` (or
    with ``key_id``); returns how many. The row stays, without secret or names, as the record
    that the key existed and when it was destroyed."""
    if (user is None) == (key_id is None):
        raise ValueError("destroy the keys of a user or of an API key, exactly one")
    where = SubjectKey.user_id == user if user is not None else SubjectKey.key_id == key_id
    return conn.execute(
        update(SubjectKey)
        .where(where, SubjectKey.secret.is_not(None))
        .values(secret=None, holder=None, key_id=None, user_id=None, destroyed_at=now)
    ).rowcount
