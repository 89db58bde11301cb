"""API keys and tenants: a key belongs to a tenant; the server stores only its hash (docs/tenants.md).

A key as shown to its holder, once, at creation: ``sao-<key id>.<secret>``, where the key id is
``k`` + 16 hex digits (64 random bits, public: it names the key in listings, on trajectory
records and in revocations) and the secret is 48 hex digits (192 random bits from ``secrets``).
The table ``api_keys`` (``core.db.ApiKey``) holds the id, the tenant and the sha256 of the whole
key. A presented key is looked up by its id and its hash compared with ``hmac.compare_digest``,
so the comparison takes the same time whatever the bytes that differ; the lookup by id reveals
only whether an id exists, which a key id never keeps secret.

Why sha256 and not bcrypt/scrypt/argon2: those are slow on purpose so that a leaked hash of a
*human-chosen* password cannot be brute-forced. A key here is 192 random bits: no guess list
exists, and 2^192 sha256 evaluations are out of reach at any speed. A slow hash would add tens
of milliseconds of CPU to every chat and feedback request (each one authenticates) and protect
nothing more.

Nothing is cached: each request reads its key's row (a primary-key read), so a key revoked on
any replica is refused on its next request everywhere, and a key's training opt-out
(``KeyInfo.train``, docs/privacy.md) holds from its next request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection, Engine

from core.db import ApiKey
from core.limits import NAME_CHARS
from core.records import as_utc

KEY_PREFIX = "sao-"
"""How every saoserve key begins: a bearer token without it is not one of ours (docs/tenants.md)."""

KEY_ID_HEX = 16
SECRET_HEX = 48

TENANT_REGEX = rf"^[a-z0-9][a-z0-9._-]{{0,{NAME_CHARS - 1}}}$"
TENANT_PATTERN = re.compile(TENANT_REGEX)
"""A tenant name: 1 to ``NAME_CHARS`` characters, lower-case letters, digits, ``.``, ``_``, ``-``,
beginning with a letter or digit (it becomes a metrics label and a path segment)."""

_KEY_SHAPE = re.compile(rf"{KEY_PREFIX}(k[0-9a-f]{{{KEY_ID_HEX}}})\.([0-9a-f]{{{SECRET_HEX}}})")


class BadTenant(ValueError):
    """A tenant name that `check_tenant` refuses; the message says why."""


class KeyRevoked(ValueError):
    """A change to a revoked key: a revocation is final, so nothing about the key changes any
    more (``KeyStore.configure``). ``key``: the key as it stays."""

    def __init__(self, key: KeyInfo):
        super().__init__(
            f"API key {key.id} is revoked (at {as_utc(key.revoked_at).isoformat()}): a revoked key is "
            "final and its settings no longer change; create a new key instead"
        )
        self.key = key


@dataclass(frozen=True)
class KeyInfo:
    """A key as listed: never its secret or its hash. ``revoked_at`` None while it is valid;
    ``train`` False: the key opts out of training, every answer it is sent is logged marked
    ``train: false`` (docs/privacy.md); ``trusted`` True: the operator vouches that the key's
    traffic is many people's (a backend relaying its users) or a judge's, and the identity caps
    on training batches and on the guard's votes do not bound it (``trusted_keys``;
    docs/guard.md, "Who votes")."""

    id: str
    tenant: str
    created_at: datetime
    revoked_at: datetime | None
    train: bool
    trusted: bool = False

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "created_at": as_utc(self.created_at).isoformat(),
            "revoked_at": None if self.revoked_at is None else as_utc(self.revoked_at).isoformat(),
            "train": self.train,
            "trusted": self.trusted,
        }


@dataclass(frozen=True)
class Check:
    """The outcome of presenting a key: ``ok`` (``key`` set), ``revoked`` (``key`` set: the
    presenter holds the secret of a revoked key), ``invalid`` (malformed, unknown id, or a
    secret that does not match)."""

    outcome: str
    key: KeyInfo | None = None


def check_tenant(name: str) -> str:
    """``name`` if it is a valid tenant name (``TENANT_PATTERN``); raises BadTenant otherwise."""
    if not TENANT_PATTERN.fullmatch(name):
        raise BadTenant(
            f"tenant {name!r} is not a valid name: 1 to {NAME_CHARS} characters of a-z, 0-9, '.', '_', '-', "
            "beginning with a letter or digit"
        )
    return name


def key_hash(key: str) -> str:
    """sha256 of the whole presented key, hex (64 characters)."""
    return hashlib.sha256(key.encode()).hexdigest()


def looks_like_key(token: str) -> bool:
    """Whether a bearer token claims to be a saoserve key (begins with ``KEY_PREFIX``)."""
    return token.startswith(KEY_PREFIX)


KEY_IDENTITY = "key:"
"""How an identity that names an API key begins (``identity_of``)."""


def identity_of(key_id: str | None, user: str | None) -> str | None:
    """Who sent a request (``TrajectoryRecord.identity``): ``key:<key id>`` when a key
    authenticated it, else ``user:<user field>`` when the request gave one, else None."""
    if key_id is not None:
        return f"{KEY_IDENTITY}{key_id}"
    if user is not None:
        return f"user:{user}"
    return None


_LISTED = (ApiKey.id, ApiKey.tenant, ApiKey.created_at, ApiKey.revoked_at, ApiKey.train, ApiKey.trusted)


def _info(row) -> KeyInfo:
    return KeyInfo(
        id=row.id,
        tenant=row.tenant,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        train=row.train,
        trusted=row.trusted,
    )


class KeyStore:
    """The key registry in the database (``api_keys``)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def create(
        self, tenant: str, now: datetime, train: bool = True, trusted: bool = False
    ) -> tuple[KeyInfo, str]:
        """A new key of ``tenant`` (BadTenant for a bad name), opted out of training when
        ``train`` is False, unbounded by the identity caps when ``trusted`` (``KeyInfo``): its
        listing and the key itself, which is not stored and cannot be shown again."""
        check_tenant(tenant)
        key_id = "k" + secrets.token_hex(KEY_ID_HEX // 2)
        key = f"{KEY_PREFIX}{key_id}.{secrets.token_hex(SECRET_HEX // 2)}"
        with self.engine.begin() as conn:
            conn.execute(
                insert(ApiKey).values(
                    id=key_id,
                    tenant=tenant,
                    key_sha256=key_hash(key),
                    created_at=now,
                    train=train,
                    trusted=trusted,
                )
            )
        info = KeyInfo(
            id=key_id, tenant=tenant, created_at=now, revoked_at=None, train=train, trusted=trusted
        )
        return info, key

    def listed(self, tenant: str | None = None) -> list[KeyInfo]:
        """Every key (of ``tenant``), oldest first, revoked ones included."""
        q = select(*_LISTED)
        if tenant is not None:
            q = q.where(ApiKey.tenant == tenant)
        with self.engine.connect() as conn:
            return [_info(r) for r in conn.execute(q.order_by(ApiKey.created_at, ApiKey.id)).all()]

    def revoke(self, key_id: str, now: datetime) -> KeyInfo | None:
        """Revoke ``key_id`` (idempotent: a revoked key keeps its first revocation time); None
        for an unknown id."""
        with self.engine.begin() as conn:
            conn.execute(
                update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=now)
            )
            row = conn.execute(select(*_LISTED).where(ApiKey.id == key_id)).one_or_none()
        return None if row is None else _info(row)

    def set_train(self, key_id: str, train: bool) -> KeyInfo | None:
        """Opt ``key_id`` out of training (``train`` False) or back in; its next request on any
        replica follows the setting (nothing is cached). ``configure`` with ``train`` only."""
        return self.configure(key_id, train=train)

    def configure(
        self, key_id: str, *, train: bool | None = None, trusted: bool | None = None
    ) -> KeyInfo | None:
        """Set ``key_id``'s training setting and whether it is trusted (``KeyInfo``; None: left
        as it is), in one update: the next request, or the learner's next read, on any replica
        follows them (nothing is cached). Idempotent. None for an unknown id.

        Raises:
            KeyRevoked: the key is revoked (a revocation is final: nothing is changed). The
                update only touches a key not revoked, so a revocation racing it wins either
                way: the settings are changed before it, or refused after it.
            ValueError: neither setting given.
        """
        values = {k: v for k, v in (("train", train), ("trusted", trusted)) if v is not None}
        if not values:
            raise ValueError("give train, trusted or both")
        with self.engine.begin() as conn:
            conn.execute(
                update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(**values)
            )
            row = conn.execute(select(*_LISTED).where(ApiKey.id == key_id)).one_or_none()
            info = None if row is None else _info(row)
            if info is not None and info.revoked:
                raise KeyRevoked(info)  # inside the transaction: whatever it wrote is rolled back
        return info

    def check(self, presented: str) -> Check:
        """Authenticate a presented key (module docstring: lookup by id, constant-time hash
        comparison)."""
        m = _KEY_SHAPE.fullmatch(presented)
        if m is None:
            return Check("invalid")
        with self.engine.connect() as conn:
            row = conn.execute(
                select(*_LISTED, ApiKey.key_sha256).where(ApiKey.id == m.group(1))
            ).one_or_none()
        if row is None or not hmac.compare_digest(key_hash(presented).encode(), row.key_sha256.encode()):
            return Check("invalid")
        info = _info(row)
        return Check("revoked" if info.revoked else "ok", info)


def opted_out_identities(conn: Connection, identities: Iterable[str | None]) -> frozenset[str]:
    """Those of ``identities`` (``identity_of``'s ``key:<key id>``; others and None are
    ignored) whose key has opted out of training now (``api_keys.train`` false), read in the
    caller's connection: what the learner checks at join time, so that an opt-out reaches the
    answers logged before it (docs/privacy.md). A revoked key keeps its last setting."""
    ids = {i.removeprefix(KEY_IDENTITY) for i in identities if i is not None and i.startswith(KEY_IDENTITY)}
    if not ids:
        return frozenset()
    rows = conn.execute(select(ApiKey.id).where(ApiKey.id.in_(sorted(ids)), ApiKey.train.is_(False)))
    return frozenset(KEY_IDENTITY + r.id for r in rows)


def opted_out_keys(conn: Connection) -> frozenset[str]:
    """The identities (``key:<key id>``) of every key whose training is off now, read in the
    caller's connection to the key registry: what the guard's votes and the learner's batches
    leave out (docs/guard.md, "Who votes"; docs/privacy.md). Keys that opt out are few; the set
    is read whole at each use."""
    rows = conn.execute(select(ApiKey.id).where(ApiKey.train.is_(False)))
    return frozenset(KEY_IDENTITY + r.id for r in rows)


def trusted_keys(conn: Connection) -> frozenset[str]:
    """The identities (``key:<key id>``) of every trusted key (``KeyInfo.trusted``) not revoked,
    read in the caller's connection to the key registry: the senders the identity caps on
    training batches (``learner.data.sample_queue``) and on the guard's votes
    (``learner.guard.guard_votes``) do not bound. A revoked key is bound again: whoever holds its
    answers' feedback tokens can still rate them after the revocation (a leaked key is revoked,
    and its trust must end with it, while its settings no longer change). Trusted keys are few;
    the set is read whole at each use."""
    rows = conn.execute(select(ApiKey.id).where(ApiKey.trusted.is_(True), ApiKey.revoked_at.is_(None)))
    return frozenset(KEY_IDENTITY + r.id for r in rows)
