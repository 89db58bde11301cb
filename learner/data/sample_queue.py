"""The samples waiting to train, as the trainer takes them: the next batch, and a batch set aside
(docs/design.md §8, §9.4; docs/guard.md for the quarantine; docs/tenants.md for the identity
cap).

The joiner commits samples into ``learner_samples``; a step takes the oldest ``batch_size`` of
them that are not quarantined (a quarantined sample trained a rejected version: never again)
and that the identity cap (``learner.data.identity_cap.select_batch``) admits, and its version's
commit deletes them. A batch that cannot be trained is deleted and written as dead letters of
kind ``untrainable`` in one transaction (``core.dead_letters``), so the next batch trains.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, func, select
from sqlalchemy.engine import Engine, Row

from core.db import LearnerSample, QuarantinedSample, bump_counter
from core.dead_letters import COUNTER as DEAD_LETTERS
from core.dead_letters import Letter, set_aside
from core.keys import opted_out_keys, trusted_keys
from core.learnable import OPTED_OUT
from core.records import utcnow
from learner.data.identity_cap import select_batch

log = logging.getLogger(__name__)


def waiting(db: Engine) -> int:
    """How many samples wait (quarantined ones included)."""
    with db.connect() as conn:
        return conn.execute(select(func.count()).select_from(LearnerSample)).scalar_one()


def next_batch(
    db: Engine, batch_size: int, max_identity_share: float | None, keys_db: Engine | None = None
) -> tuple[list[Row] | None, int]:
    """The rows of the next batch (``id``, ``prompt_id``, ``payload``, ``created_at``,
    ``identity``; oldest first) and how many samples the identity cap deferred, or ``(None, 0)``
    while the waiting samples cannot fill one: the oldest ``batch_size`` samples that are not
    quarantined and that ``select_batch`` admits under ``max_identity_share`` (None: no cap),
    which does not bound the trusted keys (``core.keys.trusted_keys``, read from ``keys_db``:
    the operator vouches that their traffic is many people's). The cap reads the identities of
    all waiting samples, and the payloads of the chosen only. First the samples of keys that have opted out of training since they joined are deleted
    (``drop_opted_out``; ``keys_db`` the database of the API keys, default ``db``)."""
    n, cap = batch_size, max_identity_share
    drop_opted_out(db, keys_db or db)
    cols = (LearnerSample.id, LearnerSample.prompt_id, LearnerSample.payload, LearnerSample.created_at)
    pool_query = (
        select(LearnerSample.id, LearnerSample.identity)
        .where(LearnerSample.id.not_in(select(QuarantinedSample.sample_id)))
        .order_by(LearnerSample.created_at, LearnerSample.id)
    )
    trusted: frozenset[str] = frozenset()
    if cap is not None:
        with (keys_db or db).connect() as conn:
            trusted = trusted_keys(conn)
    with db.connect() as conn:
        pool = conn.execute(pool_query if cap is not None else pool_query.limit(n)).all()
        # A trusted key's sample is its own identity to the cap, as an anonymous one is (None).
        pick = select_batch([None if r.identity in trusted else r.identity for r in pool], n, cap)
        if not pick.full:
            return None, 0
        ids = [pool[i].id for i in pick.chosen]
        found = conn.execute(select(*cols, LearnerSample.identity).where(LearnerSample.id.in_(ids))).all()
    by_id = {r.id: r for r in found}
    # A sample forgotten or expired between the two reads: the next iteration reads again.
    if len(by_id) < n:
        return None, 0
    return [by_id[i] for i in ids], len(pick.deferred)


def drop_opted_out(db: Engine, keys_db: Engine) -> int:
    """Delete the waiting samples whose API key has opted out of training since they joined
    (``core.keys.opted_out_keys``, read from ``keys_db``; docs/privacy.md), counted
    ``excluded_opted_out`` as the joiner counts the ones it excludes; returns how many. An
    opt-out so reaches every answer not yet trained, also those joined before it. Reads first
    and writes only when there is something to delete."""
    with keys_db.connect() as conn:
        opted_out = sorted(opted_out_keys(conn))
    if not opted_out:
        return 0
    gone = LearnerSample.identity.in_(opted_out)
    with db.connect() as conn:
        if conn.execute(select(LearnerSample.id).where(gone).limit(1)).first() is None:
            return 0
    with db.begin() as conn:
        n = conn.execute(delete(LearnerSample).where(gone)).rowcount
        bump_counter(conn, OPTED_OUT, n)
    log.info("%d waiting samples deleted: their keys opted out of training", n)
    return n


def set_aside_samples(db: Engine, rows: list[Row], reason: str, attempts: int) -> None:
    """Delete the samples ``rows`` (``next_batch``'s) and write them as dead letters of kind
    ``untrainable`` with ``reason`` after ``attempts`` tries, in one transaction."""
    log.error("set aside %d samples (%s): %s", len(rows), ", ".join(r.id for r in rows[:5]), reason)
    letters = [
        Letter("untrainable", reason, key=r.id, prompt_id=r.prompt_id, payload=r.payload, attempts=attempts)
        for r in rows
    ]
    with db.begin() as conn:
        conn.execute(delete(LearnerSample).where(LearnerSample.id.in_([r.id for r in rows])))
        bump_counter(conn, DEAD_LETTERS, set_aside(conn, letters, utcnow()))
