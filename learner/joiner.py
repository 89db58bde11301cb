"""Joining trajectories with feedback, exactly once (DESIGN §8; SPO++ §2.2 for evidence).

``Joiner.poll_once`` reads new records from the stored offsets and, in ONE database
transaction, commits the new offsets, the pending joins, the produced samples, the prompt
evidence of the joined results (attributed to the dispatch version) and the counters. A crash
before the commit re-reads the same records; after it, nothing is read twice. A trajectory id
joined once leaves a tombstone (kind ``joined``) so a re-sent copy is ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection, Engine

from core.db import ConsumerOffset, LearnerCounter, LearnerSample, PendingJoin
from core.evidence_store import EvidenceStore
from core.logbus import LogTransport
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, utcnow
from learner.samples import NotLearnable, Sample, episode_sample, single_turn_sample

CONSUMER = "learner"


@dataclass
class JoinStats:
    samples: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n


class Joiner:
    """The learner's consumer of the ``trajectories`` and ``feedback`` topics."""

    def __init__(self, log: LogTransport, db: Engine, expire_s: float):
        self.log = log
        self.db = db
        self.expire_s = expire_s
        self.evidence = EvidenceStore(db)

    def _offsets(self) -> dict[tuple[str, int], int]:
        with self.db.connect() as conn:
            rows = conn.execute(
                select(ConsumerOffset.topic, ConsumerOffset.partition, ConsumerOffset.next_offset).where(
                    ConsumerOffset.consumer == CONSUMER
                )
            ).all()
        return {(t, p): o for t, p, o in rows}

    def _pending(self, keys: list[str], kind: str) -> dict[str, PendingJoin]:
        if not keys:
            return {}
        with self.db.connect() as conn:
            rows = conn.execute(
                select(
                    PendingJoin.key,
                    PendingJoin.kind,
                    PendingJoin.prompt_id,
                    PendingJoin.payload,
                    PendingJoin.received_at,
                ).where(PendingJoin.key.in_(keys), PendingJoin.kind == kind)
            ).all()
        return {r[0]: r for r in rows}

    def _pending_episode_turns(self, prompt_ids: set[str]) -> list:
        if not prompt_ids:
            return []
        with self.db.connect() as conn:
            return conn.execute(
                select(PendingJoin.key, PendingJoin.payload).where(
                    PendingJoin.kind == "trajectory", PendingJoin.prompt_id.in_(prompt_ids)
                )
            ).all()

    def poll_once(self, max_records: int = 500) -> JoinStats:
        """Read new records, join, and commit offsets + joins + samples + evidence together."""
        offsets = self._offsets()
        new_offsets: dict[tuple[str, int], int] = {}
        trajectories: list[TrajectoryRecord] = []
        feedback: list[FeedbackRecord] = []
        stats = JoinStats()
        # Trajectories first: a prompt's trajectory precedes its feedback in the log.
        for topic, sink, model in (
            (TOPIC_TRAJECTORIES, trajectories, TrajectoryRecord),
            (TOPIC_FEEDBACK, feedback, FeedbackRecord),
        ):
            for p in self.log.partitions(topic):
                start = offsets.get((topic, p), 0)
                batch = self.log.read(topic, p, start, max_records, 0.05)
                for e in batch:
                    try:
                        sink.append(model.model_validate_json(e.value))
                    except ValueError:
                        stats.count(f"malformed_{topic}")
                if batch:
                    new_offsets[(topic, p)] = batch[-1].offset + 1
        if not new_offsets:
            return stats

        now = utcnow()
        traj_ids = [t.id for t in trajectories] + [f.trajectory_id for f in feedback if f.trajectory_id]
        seen = self._pending(traj_ids, "joined")
        pend_traj = self._pending(traj_ids, "trajectory")
        pend_fb = self._pending([t.id for t in trajectories], "feedback")
        inserts: list[dict] = []
        deletes: list[tuple[str, str]] = []
        samples: list[Sample] = []
        results: list[tuple[str, float, int]] = []
        new_traj: dict[str, TrajectoryRecord] = {}

        def joined(tid: str, prompt_id: str) -> None:
            inserts.append(dict(key=tid, kind="joined", prompt_id=prompt_id, payload="", received_at=now))

        def make_sample(rec: TrajectoryRecord, reward: float) -> None:
            results.append((rec.prompt_id, reward, rec.dispatch_version))
            try:
                samples.append(single_turn_sample(rec, reward))
            except NotLearnable as exc:
                stats.count(str(exc))

        for rec in trajectories:
            if rec.id in seen or rec.id in pend_traj or rec.id in new_traj:
                stats.count("duplicate_trajectories")
                continue
            fb = pend_fb.get(rec.id)
            if fb is not None and rec.episode_id is None:
                make_sample(rec, FeedbackRecord.model_validate_json(fb[3]).reward)
                deletes.append((rec.id, "feedback"))
                joined(rec.id, rec.prompt_id)
                continue
            new_traj[rec.id] = rec
        for fb in feedback:
            if fb.episode_id is not None:
                self._join_episode(fb, new_traj, samples, results, inserts, deletes, stats, now)
                continue
            tid = fb.trajectory_id
            if tid in seen or any(i["key"] == tid and i["kind"] == "joined" for i in inserts):
                stats.count("duplicate_feedback")
                continue
            rec = new_traj.pop(tid, None)
            if rec is None and tid in pend_traj:
                rec = TrajectoryRecord.model_validate_json(pend_traj[tid][3])
                deletes.append((tid, "trajectory"))
            if rec is None:
                inserts.append(
                    dict(
                        key=tid,
                        kind="feedback",
                        prompt_id=fb.prompt_id,
                        payload=fb.to_json().decode(),
                        received_at=now,
                    )
                )
                continue
            make_sample(rec, fb.reward)
            joined(tid, rec.prompt_id)
        for rec in new_traj.values():
            inserts.append(
                dict(
                    key=rec.id,
                    kind="trajectory",
                    prompt_id=rec.prompt_id,
                    payload=rec.to_json().decode(),
                    received_at=rec.created_at,
                )
            )

        with self.db.begin() as conn:
            # Evidence first: on SQLite the first statement takes the write lock.
            if results:
                self.evidence.add_results(conn, results)
            for key, kind in deletes:
                conn.execute(delete(PendingJoin).where(PendingJoin.key == key, PendingJoin.kind == kind))
            if inserts:
                conn.execute(insert(PendingJoin), inserts)
            if samples:
                conn.execute(
                    insert(LearnerSample),
                    [
                        dict(id=s.id, prompt_id=s.prompt_id, payload=json.dumps(s.to_json()), created_at=now)
                        for s in samples
                    ],
                )
            stats.count("expired", self._expire(conn, now))
            for name, n in stats.counters.items():
                if n:
                    self._bump(conn, name, n)
            for (topic, p), off in new_offsets.items():
                self._set_offset(conn, topic, p, off)
        stats.samples = len(samples)
        return stats

    def _join_episode(self, fb, new_traj, samples, results, inserts, deletes, stats, now) -> None:
        key = f"e:{fb.episode_id}"
        if self._pending([key], "joined") or any(i["key"] == key for i in inserts):
            stats.count("duplicate_feedback")
            return
        turns = [r for r in new_traj.values() if r.episode_id == fb.episode_id]
        for r in turns:
            new_traj.pop(r.id)
        for tkey, payload in self._pending_episode_turns({fb.prompt_id}):
            rec = TrajectoryRecord.model_validate_json(payload)
            if rec.episode_id == fb.episode_id:
                turns.append(rec)
                deletes.append((tkey, "trajectory"))
        if not turns:
            stats.count("episode_feedback_without_turns")
            return
        for r in turns:
            inserts.append(dict(key=r.id, kind="joined", prompt_id=r.prompt_id, payload="", received_at=now))
        inserts.append(dict(key=key, kind="joined", prompt_id=fb.prompt_id, payload="", received_at=now))
        try:
            sample, misaligned = episode_sample(fb.episode_id, turns, fb.reward)
        except NotLearnable as exc:
            stats.count(str(exc))
            return
        results.append((sample.prompt_id, fb.reward, sample.result_version))
        stats.count("episode_turns_not_aligned", misaligned)
        samples.append(sample)

    def _expire(self, conn: Connection, now) -> int:
        cutoff = now - timedelta(seconds=self.expire_s)
        res = conn.execute(
            delete(PendingJoin).where(PendingJoin.kind == "trajectory", PendingJoin.received_at < cutoff)
        )
        # Tombstones only guard against re-sent copies, which arrive within minutes.
        conn.execute(
            delete(PendingJoin).where(
                PendingJoin.kind == "joined", PendingJoin.received_at < now - timedelta(days=2)
            )
        )
        return res.rowcount or 0

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
