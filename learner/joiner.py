"""Joining trajectories with feedback, exactly once (DESIGN §8; SPO++ §2.2 for evidence).

``Joiner.poll_once`` is read → plan → commit. It reads new records from the stored offsets and
the ``pending_joins`` rows they touch, asks the pure :func:`learner.join_plan.plan_join` what
to do, and commits in ONE database transaction the new offsets, the pending joins, the produced
samples, the prompt evidence of the joined results (credited to the version that generated
each answer's first token) and the counters. The read also takes the feedback claims of the
feedback it joins (the server's confirmation of which record counts) and the feedback still
waiting for one. A crash before the commit re-reads the same records; after it, nothing is
read twice. The joining rules are in ``learner/join_plan.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime

from sqlalchemy import delete, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine

from core.db import ConsumerOffset, FeedbackClaim, LearnerCounter, LearnerSample, PendingJoin
from core.evidence_store import EvidenceStore
from core.logbus import LogEntry, LogTransport
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, utcnow
from learner.join_plan import JoinPlan, JoinState, Records, expiry_cutoff, plan_join

CONSUMER = "learner"


@dataclass
class JoinStats:
    """What one poll committed: samples made and counter increments (none zero)."""

    samples: int = 0
    counters: dict[str, int] = field(default_factory=dict)


class Joiner:
    """The learner's consumer of the ``trajectories`` and ``feedback`` topics."""

    def __init__(self, log: LogTransport, db: Engine, expire_s: float):
        self.log = log
        self.db = db
        self.expire_s = expire_s
        self.evidence = EvidenceStore(db)

    def poll_once(self, max_records: int = 500) -> JoinStats:
        """Read new records, plan the join, commit offsets + joins + samples + evidence together.

        ``max_records``: at most this many records per (topic, partition) in one poll.
        """
        records = Records.parse(self._read(max_records))
        now = utcnow()
        state = self._state(records, now)
        if not records.offsets and not state.unconfirmed:
            return JoinStats()
        plan = plan_join(records, state, now, self.expire_s)
        self._commit(plan, now)
        return JoinStats(samples=len(plan.samples), counters=plan.counters)

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
        with self.db.connect() as conn:
            unconfirmed = {
                k: FeedbackRecord.model_validate_json(v)
                for k, v in conn.execute(
                    select(PendingJoin.key, PendingJoin.payload).where(PendingJoin.kind == "unconfirmed")
                )
            }
            if not records.offsets and not unconfirmed:
                return JoinState()
            held = list(unconfirmed.values())
            ids = records.ids(held)
            prompts = records.episode_prompt_ids(held)
            claims = {
                target: feedback_id if state == "received" else None
                for target, state, feedback_id in conn.execute(
                    select(FeedbackClaim.target, FeedbackClaim.state, FeedbackClaim.feedback_id).where(
                        FeedbackClaim.target.in_(records.targets(held))
                    )
                )
            }
            joined = (
                conn.execute(
                    select(PendingJoin.key).where(
                        PendingJoin.kind == "joined", PendingJoin.key.in_(ids | records.episode_keys(held))
                    )
                )
                .scalars()
                .all()
            )
            trajectories = conn.execute(
                select(PendingJoin.key, PendingJoin.payload).where(
                    PendingJoin.kind == "trajectory",
                    or_(PendingJoin.key.in_(ids), PendingJoin.prompt_id.in_(prompts)),
                )
            ).all()
            feedback = conn.execute(
                select(PendingJoin.key, PendingJoin.payload).where(
                    PendingJoin.kind == "feedback", PendingJoin.key.in_(ids)
                )
            ).all()
            expired = (
                conn.execute(
                    select(PendingJoin.key).where(
                        PendingJoin.kind == "trajectory",
                        PendingJoin.received_at < expiry_cutoff(now, self.expire_s),
                    )
                )
                .scalars()
                .all()
            )
            return JoinState(
                joined=frozenset(joined),
                trajectories={k: TrajectoryRecord.model_validate_json(v) for k, v in trajectories},
                feedback={k: FeedbackRecord.model_validate_json(v) for k, v in feedback},
                expired=frozenset(expired),
                unconfirmed=unconfirmed,
                claims=claims,
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
                        dict(id=s.id, prompt_id=s.prompt_id, payload=json.dumps(s.to_json()), created_at=now)
                        for s in plan.samples
                    ],
                )
            conn.execute(
                delete(PendingJoin).where(
                    PendingJoin.kind == "joined", PendingJoin.received_at < plan.forget_joined_before
                )
            )
            for name, n in plan.counters.items():
                self._bump(conn, name, n)
            for (topic, p), off in plan.offsets.items():
                self._set_offset(conn, topic, p, off)

    @staticmethod
    def _bump(conn: Connection, name: str, n: int) -> None:
        res = conn.execute(
            update(LearnerCounter).where(LearnerCounter.name == name).values(value=LearnerCounter.value + n)
        )
        if res.rowcount == 0:
            conn.execute(insert(LearnerCounter).values(name=name, value=n))

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
