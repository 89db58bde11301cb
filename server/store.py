"""The server's database edge: trajectory index and first-wins feedback claims (sync; callers
run these in a thread)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from core.claims import CLAIM_TIMEOUT, episode_key
from core.db import (
    Episode,
    EpisodeTurn,
    FeedbackClaim,
    LearnerCounter,
    LearnerStep,
    PolicyVersion,
    TrajectoryIndex,
)
from core.limits import MAX_EPISODE_TURNS
from core.records import TrajectoryRecord, as_utc, is_whole_answer, utcnow
from core.sealing import SubjectKeys

# A dispatched episode turn not indexed after this long never will be (the server died while
# answering it): it no longer holds the episode's feedback back, and its number may be sent again.
TURN_TIMEOUT = timedelta(minutes=5)
# The finish reasons of a record whose client got no answer (``server.fate.Fate``: ``abort`` when
# it left, ``error`` when the engine broke off): logged once like any record, but no turn of its
# episode, so its number is free for the client to send the turn again.
UNANSWERED_FINISHES = frozenset({"abort", "error"})


@dataclass(frozen=True)
class IndexedTrajectory:
    id: str
    prompt_id: str
    episode_id: str | None
    log_partition: int
    log_offset: int
    finish_reason: str
    turn: int | None = None


@dataclass(frozen=True)
class EpisodeState:
    """What episode feedback must know: its prompt id (None: unknown episode), its logged turns
    whose records are not whole answers, its turns dispatched but not yet indexed, and the ids of
    its logged turns in turn order (what the feedback rates: ``FeedbackRecord.turn_ids``)."""

    prompt_id: str | None
    not_whole_turns: int
    turns_in_flight: int
    turn_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Slot:
    """An ``episode_turns`` row as :func:`plan_turn` reads it."""

    turn: int
    trajectory_id: str
    dispatched_at: datetime
    logged_at: datetime | None


@dataclass(frozen=True)
class TurnStart:
    """What a chat on an episode may do (``ServerStore.start_episode_turn``).

    ``outcome``: ``ok`` (the turn is recorded as in flight), ``not_yours`` (the episode was
    started by another request), ``rated``, ``taken`` (the number is in flight or answered),
    ``in_progress`` (another turn, ``in_flight``, is still being answered), ``out_of_order``
    (not the next number), ``full`` (MAX_EPISODE_TURNS answered). ``turn``: the number asked
    for, or given when the request had none; ``next_turn``: the number the episode expects.
    ``takeover``: the trajectory of a turn in flight past TURN_TIMEOUT whose number this takes.
    """

    outcome: str
    turn: int | None = None
    next_turn: int | None = None
    in_flight: int | None = None
    takeover: str | None = None


def plan_turn(slots: list[Slot], turn: int | None, now: datetime) -> TurnStart:
    """Whether turn number ``turn`` (None: the next one) may start now, given the episode's
    numbered turns (pure).

    Turns are numbered 0, 1, 2... in order, each number once; a turn starts only once every
    earlier one is answered (logged), so at most one is in flight and a turn that fails before
    its record (its row deleted) leaves no gap. A turn in flight for longer than TURN_TIMEOUT
    never will be logged: its number is free again.
    """
    stale_before = now - TURN_TIMEOUT
    live = {s.turn: s for s in slots if s.logged_at is not None or as_utc(s.dispatched_at) > stale_before}
    nxt = 0
    while nxt in live:
        nxt += 1
    k = nxt if turn is None else turn
    in_flight = next((t for t, s in sorted(live.items()) if s.logged_at is None), None)
    if k in live:
        return TurnStart("taken", k, nxt, in_flight)
    if in_flight is not None:
        return TurnStart("in_progress", k, nxt, in_flight)
    if k != nxt:
        return TurnStart("out_of_order", k, nxt)
    if k >= MAX_EPISODE_TURNS:
        return TurnStart("full", k, nxt)
    stale = next((s.trajectory_id for s in slots if s.turn == k), None)
    return TurnStart("ok", k, nxt + 1, takeover=stale)


def _version_row(r) -> dict:
    return {
        "version": r.version,
        "path": r.path,
        "sha256": r.sha256,
        "status": r.status,
        "lifecycle": r.lifecycle,
        "parent_version": r.parent_version,
        "created_at": as_utc(r.created_at).isoformat(),
    }


def _held_by(feedback_id: str | None) -> list:
    """The condition that a claim belongs to ``feedback_id`` (none for a caller without ids)."""
    return [] if feedback_id is None else [FeedbackClaim.feedback_id == feedback_id]


def _free_turn(conn: Connection, trajectory_id: str) -> None:
    """In the caller's transaction: delete the turn row ``trajectory_id`` holds while it is not
    logged, and forget its episode when no turn and no answered record of it is left
    (``ServerStore.release_turn``)."""
    episode_id = conn.execute(
        select(EpisodeTurn.episode_id).where(
            EpisodeTurn.trajectory_id == trajectory_id, EpisodeTurn.logged_at.is_(None)
        )
    ).scalar_one_or_none()
    if episode_id is None:
        return
    conn.execute(delete(EpisodeTurn).where(EpisodeTurn.trajectory_id == trajectory_id))
    left = (
        conn.execute(
            select(EpisodeTurn.trajectory_id).where(EpisodeTurn.episode_id == episode_id).limit(1)
        ).first()
        or conn.execute(
            select(TrajectoryIndex.id)
            .where(
                TrajectoryIndex.episode_id == episode_id,
                TrajectoryIndex.finish_reason.not_in(UNANSWERED_FINISHES),
            )
            .limit(1)
        ).first()
    )
    if left is None:
        conn.execute(delete(Episode).where(Episode.episode_id == episode_id))


def _answered_prompt_id(episode_id: str):
    """The query of the prompt id of ``episode_id``'s answered turns (one row at most)."""
    return (
        select(TrajectoryIndex.prompt_id)
        .where(
            TrajectoryIndex.episode_id == episode_id,
            TrajectoryIndex.finish_reason.not_in(UNANSWERED_FINISHES),
        )
        .limit(1)
    )


class ServerStore:
    """Rows the server writes; the log holds the records themselves."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.subject_keys = SubjectKeys(engine)

    def log_bytes(self, rec: TrajectoryRecord, sealed: bool) -> bytes:
        """What the log gets for ``rec``: its JSON, sealed under its subject's data key when
        ``sealed`` (a log that keeps records, ``LogTransport.keeps_records``; ``core.sealing``)."""
        return self.subject_keys.encode(rec, utcnow()) if sealed else rec.to_json()

    def open_logged(self, value: bytes) -> bytes:
        """A trajectory's bytes as read from the log, opened if sealed. Raises
        ``core.sealing.Shredded`` when a forget destroyed its key."""
        return self.subject_keys.open(value)

    def index_trajectory(self, rec: TrajectoryRecord, partition: int, offset: int) -> None:
        """Index a logged record; an episode turn is marked logged in the same transaction, or,
        for a record whose client got no answer (``UNANSWERED_FINISHES``), its turn row is
        deleted there if ``Fate`` has not freed it yet (the number stays free whichever of the
        two writes the database takes first)."""
        last_version = rec.token_versions[-1][0] if rec.token_versions else rec.dispatch_version
        with self.engine.begin() as conn:
            if rec.episode_id is not None and rec.finish_reason in UNANSWERED_FINISHES:
                _free_turn(conn, rec.id)
            elif rec.episode_id is not None:
                conn.execute(
                    update(EpisodeTurn)
                    .where(EpisodeTurn.trajectory_id == rec.id, EpisodeTurn.logged_at.is_(None))
                    .values(logged_at=utcnow())
                )
            conn.execute(
                insert(TrajectoryIndex).values(
                    id=rec.id,
                    prompt_id=rec.prompt_id,
                    episode_id=rec.episode_id,
                    turn=rec.turn,
                    dispatch_version=rec.dispatch_version,
                    last_version=last_version,
                    n_response_tokens=len(rec.response_token_ids),
                    finish_reason=rec.finish_reason,
                    log_partition=partition,
                    log_offset=offset,
                    created_at=rec.created_at,
                    user_id=rec.user,
                    arm=None if rec.arm is None else str(rec.arm),
                    identity=rec.identity,
                    train=rec.train,
                )
            )

    def find_trajectory(self, trajectory_id: str) -> IndexedTrajectory | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(
                    TrajectoryIndex.id,
                    TrajectoryIndex.prompt_id,
                    TrajectoryIndex.episode_id,
                    TrajectoryIndex.log_partition,
                    TrajectoryIndex.log_offset,
                    TrajectoryIndex.finish_reason,
                    TrajectoryIndex.turn,
                ).where(TrajectoryIndex.id == trajectory_id)
            ).first()
        return IndexedTrajectory(*row) if row else None

    def episode_prompt_id(self, episode_id: str) -> str | None:
        """The prompt id of an episode (all its answered turns share it), or None if it has no
        answered turn: records of ``UNANSWERED_FINISHES`` are no turn of it, and a retry of its
        first turn may carry another prompt."""
        with self.engine.connect() as conn:
            return conn.execute(_answered_prompt_id(episode_id)).scalar_one_or_none()

    def start_episode_turn(
        self, episode_id: str, trajectory_id: str, token_ok: bool, turn: int | None = None
    ) -> TurnStart:
        """Record turn ``turn`` (None: the next number) of ``episode_id`` as dispatched, held by
        ``trajectory_id``, if it may start (:func:`plan_turn`); the outcome says why not.

        Without a valid episode token (``token_ok`` False) only a new episode may start, at
        turn 0: the primary key of ``episodes`` lets exactly one of two racing first turns win,
        and the unique turn number one of two racing later turns. A turn is refused once the
        episode's feedback is claimed. The turn row is committed before the claim is read
        again, and feedback takes its claim before it reads the turn rows, so of a turn and a
        feedback racing, at least one sees the other (``episode_state``).
        """
        now = utcnow()
        if not token_ok and turn not in (None, 0):
            with self.engine.connect() as conn:
                known = conn.execute(
                    select(Episode.episode_id).where(Episode.episode_id == episode_id)
                ).first()
            return TurnStart("not_yours") if known else TurnStart("out_of_order", turn, 0)
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(Episode).values(episode_id=episode_id, created_at=now))
        except IntegrityError:
            if not token_ok:
                return TurnStart("not_yours")
        if self._rated(episode_id):
            return TurnStart("rated")
        for _ in range(3):
            decision = plan_turn(self._slots(episode_id), turn, now)
            if decision.outcome != "ok":
                return decision
            if self._take(episode_id, trajectory_id, decision, now):
                break
        else:
            return plan_turn(self._slots(episode_id), turn, now)
        if not self._rated(episode_id):
            return decision
        self.release_turn(trajectory_id)
        return TurnStart("rated")

    def _rated(self, episode_id: str) -> bool:
        with self.engine.connect() as conn:
            return (
                conn.execute(
                    select(FeedbackClaim.target).where(FeedbackClaim.target == episode_key(episode_id))
                ).first()
                is not None
            )

    def _slots(self, episode_id: str) -> list[Slot]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(
                    EpisodeTurn.turn,
                    EpisodeTurn.trajectory_id,
                    EpisodeTurn.dispatched_at,
                    EpisodeTurn.logged_at,
                ).where(EpisodeTurn.episode_id == episode_id, EpisodeTurn.turn.is_not(None))
            ).all()
        return [Slot(*r) for r in rows]

    def _take(self, episode_id: str, trajectory_id: str, decision: TurnStart, now: datetime) -> bool:
        """Hold ``decision.turn`` for ``trajectory_id``; False when another request took it first."""
        try:
            with self.engine.begin() as conn:
                # A release of the episode's only turn (_free_turn) may have forgotten the episode
                # since this request passed its check: the turn taken here keeps it, so its row
                # is written again, and a request without the token still cannot start it anew.
                if (
                    conn.execute(select(Episode.episode_id).where(Episode.episode_id == episode_id)).first()
                    is None
                ):
                    conn.execute(insert(Episode).values(episode_id=episode_id, created_at=now))
                if decision.takeover is None:
                    conn.execute(
                        insert(EpisodeTurn).values(
                            trajectory_id=trajectory_id,
                            episode_id=episode_id,
                            turn=decision.turn,
                            dispatched_at=now,
                        )
                    )
                    return True
                # Compare-and-set: the stale turn is taken over only while it is still the same one.
                res = conn.execute(
                    update(EpisodeTurn)
                    .where(
                        EpisodeTurn.trajectory_id == decision.takeover,
                        EpisodeTurn.logged_at.is_(None),
                        EpisodeTurn.dispatched_at < now - TURN_TIMEOUT,
                    )
                    .values(trajectory_id=trajectory_id, dispatched_at=now)
                )
                return res.rowcount == 1
        except IntegrityError:
            return False

    def release_turn(self, trajectory_id: str) -> None:
        """Free the number of a turn whose client got no answer: it failed before its record
        was logged (the client was answered 503 or 500), or it was aborted or failed after
        tokens (``server.fate.Fate`` frees it before writing the record): the number may be sent
        again, and the episode's feedback no longer waits for it. An episode left with no turn
        at all (records of ``UNANSWERED_FINISHES`` are none) is forgotten too, so its first turn
        can be sent again without a token (the failure gave none). A logged turn is kept."""
        with self.engine.begin() as conn:
            _free_turn(conn, trajectory_id)

    def episode_state(self, episode_id: str) -> EpisodeState:
        """Read after taking the episode's feedback claim. Turns in flight are read before the
        logged ones: a turn logged in between is then seen logged (both change in one
        transaction), so no turn escapes both reads. The logged turns are the ones numbered (in
        number order); the not-whole count is theirs."""
        since = utcnow() - TURN_TIMEOUT
        with self.engine.connect() as conn:
            in_flight = conn.execute(
                select(func.count())
                .select_from(EpisodeTurn)
                .where(
                    EpisodeTurn.episode_id == episode_id,
                    EpisodeTurn.logged_at.is_(None),
                    EpisodeTurn.dispatched_at > since,
                )
            ).scalar_one()
            turns = conn.execute(
                select(EpisodeTurn.trajectory_id, TrajectoryIndex.finish_reason)
                .join(TrajectoryIndex, TrajectoryIndex.id == EpisodeTurn.trajectory_id)
                .where(
                    EpisodeTurn.episode_id == episode_id,
                    EpisodeTurn.logged_at.is_not(None),
                    EpisodeTurn.turn.is_not(None),
                )
                .order_by(EpisodeTurn.turn)
            ).all()
            prompt_id = conn.execute(_answered_prompt_id(episode_id)).scalar_one_or_none()
        not_whole = sum(not is_whole_answer(finish) for _, finish in turns)
        return EpisodeState(prompt_id, not_whole, in_flight, tuple(tid for tid, _ in turns))

    def claim(self, target: str, feedback_id: str | None = None) -> bool:
        """Take the first-wins claim on ``target`` for the record ``feedback_id``; False if
        feedback was already given.

        A claim stuck in ``claimed`` longer than ``core.claims.CLAIM_TIMEOUT`` belongs to a
        request that ended without marking it (a crash, or a 202 whose mark was lost) and is
        taken over with a compare-and-set; the claim then holds the new record's id, so the old
        request can neither release nor mark it, and keeps the first id taken over
        (``superseded_id``): if that record is in the log, the joiner trains it, not the new one
        (first wins, ``core.claims``).
        """
        now = utcnow()
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    insert(FeedbackClaim).values(
                        target=target, state="claimed", claimed_at=now, feedback_id=feedback_id
                    )
                )
            return True
        except IntegrityError:
            pass
        with self.engine.begin() as conn:
            res = conn.execute(
                update(FeedbackClaim)
                .where(
                    FeedbackClaim.target == target,
                    FeedbackClaim.state == "claimed",
                    FeedbackClaim.claimed_at < now - CLAIM_TIMEOUT,
                )
                .values(
                    claimed_at=now,
                    feedback_id=feedback_id,
                    superseded_id=func.coalesce(FeedbackClaim.superseded_id, FeedbackClaim.feedback_id),
                )
            )
            return res.rowcount == 1

    def release(self, target: str, feedback_id: str | None = None) -> None:
        """Drop a claim whose feedback could not be logged (the client got an error); with
        ``feedback_id``, only while the claim is still that record's."""
        with self.engine.begin() as conn:
            conn.execute(
                delete(FeedbackClaim).where(
                    FeedbackClaim.target == target, FeedbackClaim.state == "claimed", *_held_by(feedback_id)
                )
            )

    def mark_received(self, target: str, reward: float, feedback_id: str | None = None) -> None:
        """Confirm ``target``'s claim once its record is in the log: the joiner trains only the
        record whose ``feedback_id`` a ``received`` claim holds (``learner.data.join_plan``). With
        ``feedback_id``, a claim taken over by another record is left as it is."""
        with self.engine.begin() as conn:
            conn.execute(
                update(FeedbackClaim)
                .where(FeedbackClaim.target == target, *_held_by(feedback_id))
                .values(state="received", reward=reward, received_at=utcnow())
            )

    def policy_versions(self) -> list[dict]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(*PolicyVersion.__table__.columns).order_by(PolicyVersion.version)
            ).all()
        return [_version_row(r) for r in rows]

    def policy_version(self, version: int) -> dict | None:
        """The ``policy_versions`` row of ``version`` (``policy_versions``' shape), None if not recorded."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(*PolicyVersion.__table__.columns).where(PolicyVersion.version == version)
            ).first()
        return None if row is None else _version_row(row)

    def learner_status(self, limit: int) -> dict:
        """The last ``limit`` learner steps (oldest first) and the learner's counters."""
        with self.engine.connect() as conn:
            steps = conn.execute(
                select(LearnerStep.step, LearnerStep.version, LearnerStep.metrics, LearnerStep.created_at)
                .order_by(LearnerStep.id.desc())
                .limit(limit)
            ).all()
            counters = dict(conn.execute(select(LearnerCounter.name, LearnerCounter.value)).all())
        return {
            "steps": [
                {"step": s, "version": v, "created_at": as_utc(c).isoformat(), **m}
                for s, v, m, c in reversed(steps)
            ],
            "counters": counters,
        }

    def request_rate(self, bucket_s: int, buckets: int) -> list[float]:
        """Requests/s in the last ``buckets`` buckets of ``bucket_s`` seconds (oldest first),
        counted from the trajectory index."""
        now = utcnow()
        since = now - timedelta(seconds=bucket_s * buckets)
        with self.engine.connect() as conn:
            times = conn.execute(
                select(TrajectoryIndex.created_at).where(TrajectoryIndex.created_at >= since)
            ).scalars()
            counts = [0] * buckets
            for t in times:
                i = int((as_utc(t) - since).total_seconds() // bucket_s)
                counts[min(max(i, 0), buckets - 1)] += 1
        return [c / bucket_s for c in counts]
