"""Joining trajectories with feedback, exactly once (docs/design.md §8; SPO++ §2.2 for evidence).

``Joiner.poll_once`` is read → plan → commit. It reads new records from the stored offsets and
the ``pending_joins`` rows they touch, asks the pure :func:`learner.data.join_plan.plan_join` what
to do, and commits in ONE database transaction the new offsets, the pending joins, the produced
samples, the prompt evidence of the joined results (credited to the version that generated
each answer's first token) and the counters. The read also takes the feedback claims of the
feedback it joins (the server's confirmation of which record counts) and the feedback still
waiting for one. A crash before the commit re-reads the same records; after it, nothing is
read twice. The joining rules are in ``learner/data/join_plan.py``. What cannot be joined is set
aside in the same transaction (``core.dead_letters``): a record the database refuses is retried,
then joined alone, then set aside, so one record never stops the joins of the others. The read
takes the tombstones of ``saoserve admin forget`` among the keys it touches; the commit deletes
whatever it wrote under a tombstone that a forget committed beside it (``core.forget``).
A trajectory a Kafka log holds sealed (``core.sealing``) is opened with its subject's data key;
one whose key a forget destroyed is skipped, its offset passed and counted ``shredded``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime

from sqlalchemy import delete, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine

from core.claims import CLAIM_TIMEOUT, record_key
from core.db import ConsumerOffset, FeedbackClaim, LearnerSample, PendingJoin, bump_counter
from core.dead_letters import COUNTER as DEAD_LETTERS
from core.dead_letters import MAX_TRIES, Letter, describe, is_outage, set_aside
from core.evidence_store import EvidenceStore
from core.forget import forgotten_among
from core.keys import opted_out_identities
from core.logbus import LogEntry, LogTransport
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, as_utc, utcnow
from core.sealing import SubjectKeys
from learner.data.join_plan import (
    JoinPlan,
    JoinState,
    Records,
    Unreadable,
    expiry_cutoff,
    plan_join,
    why_invalid,
)

CONSUMER = "learner"

SHREDDED = "shredded"
"""The counter of sealed trajectory records skipped because a forget destroyed their key."""

log = logging.getLogger(__name__)


@dataclass
class JoinStats:
    """What one poll committed: samples made and counter increments (none zero; ``dead_letters``
    among them)."""

    samples: int = 0
    counters: dict[str, int] = field(default_factory=dict)


def _stats(plan: JoinPlan | None) -> JoinStats:
    if plan is None:
        return JoinStats()
    letters = {DEAD_LETTERS: len(plan.dead_letters)} if plan.dead_letters else {}
    return JoinStats(samples=len(plan.samples), counters=plan.counters | letters)


class Joiner:
    """The learner's consumer of the ``trajectories`` and ``feedback`` topics. ``keys_db``: the
    database of the API keys, whose training setting each join reads (default ``db``; a tenant
    namespace's learner passes the global one, ``Settings.keys_database_url``)."""

    def __init__(self, log: LogTransport, db: Engine, expire_s: float, keys_db: Engine | None = None):
        self.log = log
        self.db = db
        self.keys_db = keys_db or db
        self.expire_s = expire_s
        self.evidence = EvidenceStore(db)
        self.subject_keys = SubjectKeys(db)
        # Failed commits of the read starting at these offsets (only the latest read is kept).
        self._failures: tuple[frozenset, int] = (frozenset(), 0)

    def poll_once(self, max_records: int = 500) -> JoinStats:
        """Read new records, plan the join, commit offsets + joins + samples + evidence together.

        ``max_records``: at most this many records per (topic, partition) in one poll. Expiry
        runs in every poll, also one that reads nothing. A commit that fails for the data (not
        an outage, ``core.dead_letters.is_outage``) is raised; once the read from the same
        offsets has failed ``MAX_TRIES`` times, its records are joined one at a time
        (``_one_by_one``), and a record the database refuses ``MAX_TRIES`` times alone is set
        aside (kind ``unjoinable``), so one record never stops the joins of the others.
        """
        entries = self._read(max_records)
        starts: dict[tuple[str, int], int] = {}
        for e in entries:
            starts[(e.topic, e.partition)] = min(starts.get((e.topic, e.partition), e.offset), e.offset)
        head = frozenset(starts.items())
        try:
            plan = self._join(self._parse(entries))
        except Exception as exc:
            if is_outage(exc):
                raise
            tries = self._failures[1] + 1 if self._failures[0] == head else 1
            self._failures = (head, tries)
            if tries < MAX_TRIES or not entries:
                raise
            self._failures = (frozenset(), 0)
            return self._one_by_one(entries)
        self._failures = (frozenset(), 0)
        return _stats(plan)

    def _parse(self, entries: list[LogEntry]) -> Records:
        """``entries`` parsed (``Records.parse``) once their sealed trajectories are opened; those
        whose key a forget destroyed are left out, their offsets passed, counted ``shredded``."""
        readable, shredded = self.subject_keys.open_entries(entries)
        records = Records.parse(readable)
        if not shredded:
            return records
        offsets = dict(records.offsets)
        for e in shredded:
            offsets[(e.topic, e.partition)] = max(offsets.get((e.topic, e.partition), 0), e.offset + 1)
        counters = records.malformed | {SHREDDED: records.malformed.get(SHREDDED, 0) + len(shredded)}
        return replace(records, offsets=offsets, malformed=counters)

    def _join(self, records: Records) -> JoinPlan | None:
        """Plan ``records`` against the state they touch and commit; None when there was
        nothing to do (no record, nothing pending to expire or resolve)."""
        now = utcnow()
        state = self._state(records, now)
        if not records.offsets and state == JoinState():
            return None
        plan = plan_join(records, state, now, self.expire_s)
        self._commit(plan, now)
        return plan

    def _one_by_one(self, entries: list[LogEntry]) -> JoinStats:
        """Join ``entries`` one record at a time (trajectories first, each topic in log order,
        as ``plan_join`` takes them), each commit moving its partition's offset past its record.

        First the pending state alone (expiry, unconfirmed feedback): its failure is no record's,
        so it is raised and nothing is set aside. A record whose commit fails ``MAX_TRIES`` times
        alone (not an outage) is set aside with the error, its offset moved past it.
        """
        self._join(Records())
        stats = JoinStats()
        for e in sorted(entries, key=lambda e: e.topic != TOPIC_TRAJECTORIES):
            records = self._parse([e])
            for _ in range(MAX_TRIES):
                try:
                    plan = self._join(records)
                    break
                except Exception as exc:
                    if is_outage(exc):
                        raise
                    error = exc
            else:
                self._set_aside(e, records, error)
                stats.counters[DEAD_LETTERS] = stats.counters.get(DEAD_LETTERS, 0) + 1
                continue
            done = _stats(plan)
            stats.samples += done.samples
            for name, n in done.counters.items():
                stats.counters[name] = stats.counters.get(name, 0) + n
        return stats

    def _set_aside(self, e: LogEntry, records: Records, error: Exception) -> None:
        """Set ``e`` aside (kind ``unjoinable``) and move its offset past it, in one transaction."""
        rec = (records.trajectories or records.feedback or [None])[0]
        if isinstance(rec, TrajectoryRecord):
            key = rec.id
        elif isinstance(rec, FeedbackRecord):
            key = record_key(rec.trajectory_id, rec.episode_id)
        else:
            key = e.key
        letter = Letter(
            "unjoinable",
            f"the database refused its join {MAX_TRIES} times: {describe(error)}",
            key=key,
            prompt_id=rec.prompt_id if rec is not None else None,
            topic=e.topic,
            log_partition=e.partition,
            log_offset=e.offset,
            payload=e.value,
            attempts=MAX_TRIES,
        )
        log.error(
            "set aside the %s record at partition %d offset %d: %s",
            e.topic,
            e.partition,
            e.offset,
            letter.reason,
        )
        with self.db.begin() as conn:
            bump_counter(conn, DEAD_LETTERS, set_aside(conn, [letter], utcnow()))
            self._set_offset(conn, e.topic, e.partition, e.offset + 1)

    def _read(self, max_records: int) -> list[LogEntry]:
        """Feedback, then trajectories; the feedback only if no trajectory partition is behind.

        The server accepts feedback only for a trajectory (or an episode's turns) already in the
        log, so a trajectory read that starts after the feedback read and reaches the end of
        every partition holds the trajectory of each feedback read, and every turn of each
        episode rated: an episode is never joined without a turn that was still unread (one
        aborted, say). When a partition returns ``max_records`` (maybe more behind), this
        poll takes only trajectories and the feedback is read again by a later poll.
        """
        with self.db.connect() as conn:
            offsets = {
                (t, p): o
                for t, p, o in conn.execute(
                    select(ConsumerOffset.topic, ConsumerOffset.partition, ConsumerOffset.next_offset).where(
                        ConsumerOffset.consumer == CONSUMER
                    )
                )
            }
        batches = {
            (topic, p): self.log.read(topic, p, offsets.get((topic, p), 0), max_records, 0.05)
            for topic in (TOPIC_FEEDBACK, TOPIC_TRAJECTORIES)
            for p in self.log.partitions(topic)
        }
        behind = any(len(b) >= max_records for (t, _), b in batches.items() if t == TOPIC_TRAJECTORIES)
        return [
            e
            for (topic, _), batch in batches.items()
            if topic == TOPIC_TRAJECTORIES or not behind
            for e in batch
        ]

    def _state(self, records: Records, now: datetime) -> JoinState:
        """The pending rows, tombstones and feedback claims ``records`` touch (see ``JoinState``)."""
        cutoff = expiry_cutoff(now, self.expire_s)
        unreadable: list[Unreadable] = []

        def pending(model, kind: str, *where) -> dict:
            rows = conn.execute(
                select(PendingJoin.key, PendingJoin.prompt_id, PendingJoin.payload).where(
                    PendingJoin.kind == kind, *where
                )
            )
            out = {}
            for key, prompt_id, payload in rows:
                try:
                    out[key] = model.model_validate_json(payload)
                except ValueError as exc:
                    unreadable.append(Unreadable(key, kind, prompt_id, payload, why_invalid(exc)))
            return out

        def keys(kind: str, *where) -> frozenset[str]:
            return frozenset(
                conn.execute(select(PendingJoin.key).where(PendingJoin.kind == kind, *where)).scalars()
            )

        with self.db.connect() as conn:
            unconfirmed = pending(FeedbackRecord, "unconfirmed")
            # Expiry is due whatever was read (also in a poll that read nothing).
            expired = keys("trajectory", PendingJoin.received_at < cutoff)
            stale = pending(FeedbackRecord, "feedback", PendingJoin.received_at < cutoff)
            if not records.offsets and not unconfirmed and not expired and not stale and not unreadable:
                return JoinState()
            held = list(unconfirmed.values())
            ids = records.ids(held)
            prompts = records.episode_prompt_ids(held)
            rows = conn.execute(
                select(
                    FeedbackClaim.target,
                    FeedbackClaim.state,
                    FeedbackClaim.feedback_id,
                    FeedbackClaim.claimed_at,
                    FeedbackClaim.superseded_id,
                ).where(FeedbackClaim.target.in_(records.targets(held)))
            ).all()
            # A claim past the claim timeout is its request's last word: marked or not, the
            # record it holds is the target's (core.claims; its mark may have been lost).
            settled = now - CLAIM_TIMEOUT
            claims = {
                r.target: r.feedback_id if r.state == "received" or as_utc(r.claimed_at) < settled else None
                for r in rows
            }
            superseded = {r.target: r.superseded_id for r in rows if r.superseded_id is not None}
            joined = keys("joined", PendingJoin.key.in_(ids | records.episode_keys(held)))
            trajectories = pending(
                TrajectoryRecord,
                "trajectory",
                or_(PendingJoin.key.in_(ids), PendingJoin.prompt_id.in_(prompts)),
            )
            feedback = pending(FeedbackRecord, "feedback", PendingJoin.key.in_(ids))
            expired_before = keys("expired", PendingJoin.key.in_(ids | records.listed_turns(held)))
            forgotten = forgotten_among(conn, ids | records.episode_keys(held))
            senders = [r.identity for r in [*records.trajectories, *trajectories.values()]]
            if self.keys_db is self.db:
                opted_out = opted_out_identities(conn, senders)
            else:
                with self.keys_db.connect() as keys:
                    opted_out = opted_out_identities(keys, senders)
            return JoinState(
                joined=joined,
                trajectories=trajectories,
                feedback=feedback,
                expired=expired,
                unconfirmed=unconfirmed,
                claims=claims,
                superseded=superseded,
                forgotten=forgotten,
                expired_before=expired_before,
                stale_feedback=stale,
                unreadable=tuple({(u.key, u.kind): u for u in unreadable}.values()),
                opted_out=opted_out,
            )

    def _commit(self, plan: JoinPlan, now: datetime) -> None:
        with self.db.begin() as conn:
            # Evidence first: on SQLite the first statement takes the write lock.
            if plan.results:
                self.evidence.add_results(conn, plan.results)
            for key, kind in plan.deletes:
                conn.execute(delete(PendingJoin).where(PendingJoin.key == key, PendingJoin.kind == kind))
            if plan.expired:
                conn.execute(
                    delete(PendingJoin).where(
                        PendingJoin.kind == "trajectory", PendingJoin.key.in_(plan.expired)
                    )
                )
            if plan.inserts:
                conn.execute(insert(PendingJoin), [asdict(r) for r in plan.inserts])
            if plan.samples:
                conn.execute(
                    insert(LearnerSample),
                    [
                        dict(
                            id=s.id,
                            prompt_id=s.prompt_id,
                            payload=json.dumps(s.to_json()),
                            created_at=now,
                            identity=s.identity,
                        )
                        for s in plan.samples
                    ],
                )
            conn.execute(
                delete(PendingJoin).where(
                    PendingJoin.kind.in_(("joined", "expired")),
                    PendingJoin.received_at < plan.forget_joined_before,
                )
            )
            if plan.dead_letters:
                bump_counter(conn, DEAD_LETTERS, set_aside(conn, plan.dead_letters, now))
            self._drop_forgotten(conn, plan)
            for name, n in plan.counters.items():
                bump_counter(conn, name, n)
            for (topic, p), off in plan.offsets.items():
                self._set_offset(conn, topic, p, off)

    @staticmethod
    def _drop_forgotten(conn: Connection, plan: JoinPlan) -> None:
        """Delete the rows this commit wrote under a tombstone that a forget committed after the
        read: the forget's lock on PostgreSQL (SQLite's single writer) orders the two, so either
        the forget deletes them or this statement sees its tombstones."""
        written = {r.key for r in plan.inserts} | {s.id for s in plan.samples}
        if not written:
            return
        gone = forgotten_among(conn, written)
        if gone:
            conn.execute(delete(PendingJoin).where(PendingJoin.key.in_(gone)))
            conn.execute(delete(LearnerSample).where(LearnerSample.id.in_(gone)))

    @staticmethod
    def _set_offset(conn: Connection, topic: str, partition: int, offset: int) -> None:
        res = conn.execute(
            update(ConsumerOffset)
            .where(
                ConsumerOffset.consumer == CONSUMER,
                ConsumerOffset.topic == topic,
                ConsumerOffset.partition == partition,
            )
            .values(next_offset=offset)
        )
        if res.rowcount == 0:
            conn.execute(
                insert(ConsumerOffset).values(
                    consumer=CONSUMER, topic=topic, partition=partition, next_offset=offset
                )
            )
