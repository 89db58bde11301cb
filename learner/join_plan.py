"""The joiner's pure step: records read + the join state held in the database → what to commit.

``learner.joiner.Joiner.poll_once`` is read → :func:`plan_join` → commit. Reading (the log and
the ``pending_joins`` rows) and committing (one transaction, docs/design.md §8) stay in the Joiner; this
module does no I/O, so every joining rule is tested here without a database or an engine.

Rules (docs/design.md §4, §8):

* A trajectory waits (pending) for its feedback and a feedback for its trajectory; whichever
  comes second makes the sample, the same either way (also for feedback on one turn of an
  episode, which trains that turn alone). A joined trajectory id leaves a tombstone (kind ``joined``),
  so a re-sent copy is a ``duplicate_trajectories`` and a second feedback a
  ``duplicate_feedback``: the first feedback wins.
* Episode feedback joins the turns it lists (``FeedbackRecord.turn_ids``: the turns the server
  had logged when it accepted the feedback, in turn order) into one sample
  (``learner.samples.episode_sample``); its tombstone key is ``e:<episode_id>``. The Joiner's
  read order makes every listed turn present by then, in this read or pending
  (``learner.joiner.Joiner``). A turn of the episode it does not list was answered 503 (or
  500) and appended late by the log: dropped, counted ``void_episode_turns``. A listed turn
  that is absent (expired while pending) leaves the episode incomplete: no sample, counted
  ``episode_turns_missing``. Episode feedback logged before ``turn_ids`` joins the turns
  present, only if their numbers are 0..n-1, each once (else ``episode_turns_misnumbered``).
  A turn logged after its episode was joined is dropped and counted ``late_episode_turns``.
* A turn of an episode is rated only with its episode (the server answers 409
  ``rate_the_episode`` otherwise): feedback naming one by its trajectory id (logged before that
  rule) is dropped and counted ``episode_turn_feedback``, and the turn waits for its episode's.
* A joined result enters the prompt's evidence at the version that generated the answer's
  first token (``learner.samples.answer_version``), also when the sample itself is excluded
  for its sampling (greedy, truncated, empty), except when it is not a whole answer
  (aborted, errored, or an episode with such a turn): then neither sample nor evidence, and
  the reason is counted (``learner.samples.NotWholeAnswer``).
* A pending trajectory older than ``expire_s`` (by its ``created_at``) is dropped, counted
  ``expired``, and leaves a tombstone of kind ``expired``: its feedback, if it comes later (the
  server accepted it, 202), can never train and is set aside as a dead letter
  (``trajectory_expired``, counted ``late_feedback``), and a re-sent copy of the trajectory is a
  ``duplicate_trajectories``. Feedback pending for its trajectory for longer than ``expire_s``
  (by its ``received_at``; the trajectory expired before tombstones of expiry were kept) is set
  aside the same way. Tombstones are forgotten after :data:`TOMBSTONE_TTL`. Expiry runs in every
  poll, also one that read nothing.
* Dead letters (``core.dead_letters``), set aside in the commit that moves the offsets past
  them: a malformed record (``malformed``, also counted ``malformed_<topic>``); accepted
  feedback that cannot train: late for its trajectory (above), an episode's feedback whose
  turns are missing, none or misnumbered (``episode_incomplete``), one whose claim was never
  marked (``unconfirmed``); a pending row that no longer parses (``unreadable_pending``).
* Only the feedback record the server confirmed is joined: the one whose ``feedback_id`` its
  target's claim holds (``JoinState.claims``). A record whose claim is not yet marked waits
  (kind ``unconfirmed``, keyed by its id) until it is, or is dropped and counted
  ``expired_feedback`` after ``expire_s`` (by its ``received_at``); a record whose claim holds
  another id, or is gone, was answered 503 (or lost to a crash, no 202 sent) and is void:
  dropped and counted ``void_feedback``, whichever of the records is read first. So "the first
  feedback wins" means the confirmed one wins; records without an id (logged before ids) join
  as before.
* Privacy (docs/privacy.md): a trajectory whose request opted out of training, or an episode
  with such a turn, joins as usual but makes neither sample nor evidence, counted
  ``excluded_opted_out`` (``learner.samples.OptedOut``). A record of a forgotten trajectory or
  episode (``JoinState.forgotten``, the tombstones ``saoserve admin forget`` leaves, which the
  Kafka log needs until its retention deletes the records) is dropped as it is read, before
  any other rule, and counted ``forgotten``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError

from core.dead_letters import Letter
from core.logbus import LogEntry
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord
from learner.samples import (
    NotLearnable,
    NotWholeAnswer,
    OptedOut,
    Sample,
    answer_version,
    episode_sample,
    single_turn_sample,
)

TOMBSTONE_TTL = timedelta(days=2)
"""How long a ``joined`` tombstone is kept: it only guards against re-sent copies, which
arrive within minutes."""

Result = tuple[str, float, int]
"""An evidence result: (prompt id, reward in [0, 1], policy version credited)."""


def episode_key(episode_id: str) -> str:
    """The ``pending_joins`` key of an episode's tombstone."""
    return f"e:{episode_id}"


def feedback_target(fb: FeedbackRecord) -> str:
    """The feedback claim's target: ``t:<trajectory id>`` or ``e:<episode id>``."""
    return f"t:{fb.trajectory_id}" if fb.trajectory_id is not None else episode_key(fb.episode_id)


def expiry_cutoff(now: datetime, expire_s: float) -> datetime:
    """Pending trajectories created before this time are expired."""
    return now - timedelta(seconds=expire_s)


def why_invalid(exc: Exception, most: int = 5) -> str:
    """A one-line reason a record did not parse: the first ``most`` field errors of a pydantic
    ValidationError (``id: String should have at most 64 characters``), else the message."""
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False, include_input=False)
        text = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in errors[:most])
        return text + (f" (and {len(errors) - most} more)" if len(errors) > most else "")
    return (str(exc).splitlines() or [type(exc).__name__])[0]


@dataclass(frozen=True)
class Records:
    """One read of the log, parsed.

    ``trajectories``/``feedback``: the valid records in log order within each partition;
    ``malformed``: counter name (``malformed_<topic>``) → records that did not parse;
    ``rejected``: a ``malformed`` dead letter for each of them, with its position and why;
    ``offsets``: (topic, partition) → the next offset to read, for every partition that
    returned at least one record (parsed or not).
    """

    trajectories: list[TrajectoryRecord] = field(default_factory=list)
    feedback: list[FeedbackRecord] = field(default_factory=list)
    malformed: dict[str, int] = field(default_factory=dict)
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    rejected: list[Letter] = field(default_factory=list)

    @classmethod
    def parse(cls, entries: Iterable[LogEntry]) -> Records:
        """Parse entries of the ``trajectories`` and ``feedback`` topics (in read order).

        Raises ValueError for an entry of another topic.
        """
        models = {TOPIC_TRAJECTORIES: TrajectoryRecord, TOPIC_FEEDBACK: FeedbackRecord}
        parsed: dict[str, list] = {TOPIC_TRAJECTORIES: [], TOPIC_FEEDBACK: []}
        malformed: Counter[str] = Counter()
        offsets: dict[tuple[str, int], int] = {}
        rejected: list[Letter] = []
        for e in entries:
            if e.topic not in models:
                raise ValueError(f"the joiner reads {sorted(models)}, not {e.topic!r}")
            try:
                parsed[e.topic].append(models[e.topic].model_validate_json(e.value))
            except ValueError as exc:
                malformed[f"malformed_{e.topic}"] += 1
                rejected.append(
                    Letter(
                        "malformed",
                        f"not a {e.topic} record: {why_invalid(exc)}",
                        key=e.key,
                        topic=e.topic,
                        log_partition=e.partition,
                        log_offset=e.offset,
                        payload=e.value,
                    )
                )
            offsets[(e.topic, e.partition)] = max(offsets.get((e.topic, e.partition), 0), e.offset + 1)
        return cls(parsed[TOPIC_TRAJECTORIES], parsed[TOPIC_FEEDBACK], dict(malformed), offsets, rejected)

    def ids(self, unconfirmed: Iterable[FeedbackRecord] = ()) -> set[str]:
        """Trajectory ids whose join state the plan needs (records and single-turn feedback,
        also the feedback ``unconfirmed`` that may be confirmed now)."""
        return {t.id for t in self.trajectories} | {
            f.trajectory_id for f in [*self.feedback, *unconfirmed] if f.trajectory_id is not None
        }

    def episode_keys(self, unconfirmed: Iterable[FeedbackRecord] = ()) -> set[str]:
        """Tombstone keys of the episodes this read's feedback (or ``unconfirmed``) rates or its
        trajectories extend."""
        return {
            episode_key(r.episode_id)
            for r in [*self.feedback, *unconfirmed, *self.trajectories]
            if r.episode_id
        }

    def episode_prompt_ids(self, unconfirmed: Iterable[FeedbackRecord] = ()) -> set[str]:
        """Prompt ids whose pending trajectories may be turns of a rated episode."""
        return {f.prompt_id for f in [*self.feedback, *unconfirmed] if f.episode_id is not None}

    def targets(self, unconfirmed: Iterable[FeedbackRecord] = ()) -> set[str]:
        """Claim targets of this read's feedback and of ``unconfirmed`` (``JoinState.claims``)."""
        return {feedback_target(f) for f in [*self.feedback, *unconfirmed]}

    def listed_turns(self, unconfirmed: Iterable[FeedbackRecord] = ()) -> set[str]:
        """Trajectory ids the episode feedback of this read (or ``unconfirmed``) lists."""
        return {t for f in [*self.feedback, *unconfirmed] for t in f.turn_ids or ()}


@dataclass(frozen=True)
class Unreadable:
    """A ``pending_joins`` row whose payload no longer parses (``why``): deleted, set aside."""

    key: str
    kind: str
    prompt_id: str
    payload: str
    why: str


@dataclass(frozen=True)
class JoinState:
    """The ``pending_joins`` rows a read touches, as committed before the plan.

    ``joined``: keys among :meth:`Records.ids` and :meth:`Records.episode_keys` that have a
    tombstone. ``trajectories``: pending trajectories whose id is in :meth:`Records.ids` or
    whose prompt id is in :meth:`Records.episode_prompt_ids`, by id. ``feedback``: pending
    feedback by trajectory id, for :meth:`Records.ids`. ``expired``: ids of all pending
    trajectories received before :func:`expiry_cutoff`. ``unconfirmed``: every pending feedback
    record waiting for its claim to be marked, by feedback id (the ids above include theirs).
    ``claims``: claim target (:meth:`Records.targets`) → the feedback id its claim holds, None
    while claimed and not yet marked; a target without a claim row is absent. ``forgotten``:
    keys among :meth:`Records.ids` and :meth:`Records.episode_keys` that ``saoserve admin
    forget`` tombstoned (``core.db.ForgottenRecord``). ``expired_before``: keys among
    :meth:`Records.ids` and :meth:`Records.listed_turns` that have a tombstone of expiry (kind
    ``expired``). ``stale_feedback``: every pending feedback received before
    :func:`expiry_cutoff`, by trajectory id. ``unreadable``: pending rows that did not parse.
    """

    joined: frozenset[str] = frozenset()
    trajectories: Mapping[str, TrajectoryRecord] = field(default_factory=dict)
    feedback: Mapping[str, FeedbackRecord] = field(default_factory=dict)
    expired: frozenset[str] = frozenset()
    unconfirmed: Mapping[str, FeedbackRecord] = field(default_factory=dict)
    claims: Mapping[str, str | None] = field(default_factory=dict)
    forgotten: frozenset[str] = frozenset()
    expired_before: frozenset[str] = frozenset()
    stale_feedback: Mapping[str, FeedbackRecord] = field(default_factory=dict)
    unreadable: tuple[Unreadable, ...] = ()


@dataclass(frozen=True)
class PendingRow:
    """A ``pending_joins`` row to insert (``kind``: trajectory, feedback, unconfirmed, or a
    tombstone: joined, expired)."""

    key: str
    kind: str
    prompt_id: str
    payload: str
    received_at: datetime


@dataclass(frozen=True)
class JoinPlan:
    """What one poll commits, in one transaction.

    ``deletes``: (key, kind) of pending rows consumed by a join, or unconfirmed feedback
    resolved or expired, stale or unreadable rows; ``expired``: pending
    trajectory ids dropped as expired; ``inserts``: new pending rows and tombstones;
    ``samples``: the learner samples; ``results``: the evidence results; ``counters``: learner
    counter increments (none zero); ``offsets``: next offsets;
    ``forget_joined_before``: tombstones received before this time are deleted;
    ``dead_letters``: what is set aside (``core.dead_letters``).
    """

    deletes: list[tuple[str, str]]
    expired: list[str]
    inserts: list[PendingRow]
    samples: list[Sample]
    results: list[Result]
    counters: dict[str, int]
    offsets: dict[tuple[str, int], int]
    forget_joined_before: datetime
    dead_letters: list[Letter] = field(default_factory=list)


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _join_single(rec: TrajectoryRecord, reward: float) -> tuple[Sample | None, Result | None, dict[str, int]]:
    """A trajectory and its reward → (sample or None, evidence result or None, counters)."""
    result = (rec.prompt_id, reward, answer_version(rec))
    try:
        return single_turn_sample(rec, reward), result, {}
    except (NotWholeAnswer, OptedOut) as exc:
        return None, None, {str(exc): 1}
    except NotLearnable as exc:
        return None, result, {str(exc): 1}


def _join_episode(
    episode_id: str, turns: list[TrajectoryRecord], reward: float, in_order: bool
) -> tuple[Sample | None, Result | None, dict[str, int]]:
    """An episode's turns and its reward → (sample or None, evidence result or None, counters);
    ``in_order``: the turns are in the order the feedback lists them."""
    try:
        sample, misaligned = episode_sample(episode_id, turns, reward, in_order)
    except NotLearnable as exc:
        return None, None, {str(exc): 1}
    return (
        sample,
        (sample.prompt_id, reward, sample.result_version),
        {"episode_turns_not_aligned": misaligned},
    )


def _confirmation(fb: FeedbackRecord, claims: Mapping[str, str | None]) -> str:
    """``confirmed``, ``unconfirmed`` (claim not yet marked) or ``void_feedback`` (module
    docstring)."""
    if fb.feedback_id is None:
        return "confirmed"
    target = feedback_target(fb)
    if target not in claims:
        return "void_feedback"
    held = claims[target]
    if held is None:
        return "unconfirmed"
    return "confirmed" if held == fb.feedback_id else "void_feedback"


def plan_join(records: Records, state: JoinState, now: datetime, expire_s: float) -> JoinPlan:
    """Join one read against the committed state (module docstring for the rules).

    Args:
        records: what the read returned.
        state: the pending rows and tombstones it touches (:class:`JoinState`).
        now: the commit time (tz-aware): tombstones' ``received_at`` and the expiry clock.
        expire_s: seconds a trajectory waits for its feedback.

    Returns:
        The :class:`JoinPlan`. Pure: no I/O, ``records`` and ``state`` are not modified.
    """
    counters: Counter[str] = Counter(records.malformed)
    deletes: list[tuple[str, str]] = []
    inserts: list[PendingRow] = []
    samples: list[Sample] = []
    results: list[Result] = []
    joined_now: set[str] = set()
    feedback_pending_now: set[str] = set()
    waiting: dict[str, TrajectoryRecord] = {}
    joins: list[tuple[Sample | None, Result | None, dict[str, int]]] = []
    letters: list[Letter] = list(records.rejected)

    def tombstone(key: str, prompt_id: str) -> None:
        joined_now.add(key)
        inserts.append(PendingRow(key, "joined", prompt_id, "", now))

    def set_aside(kind: str, fb: FeedbackRecord, why: str) -> None:
        key = episode_key(fb.episode_id) if fb.episode_id is not None else fb.trajectory_id
        letters.append(Letter(kind, why, key=key, prompt_id=fb.prompt_id, payload=fb.to_json().decode()))

    for u in state.unreadable:
        deletes.append((u.key, u.kind))
        letters.append(
            Letter(
                "unreadable_pending",
                f"a pending {u.kind} row that does not parse: {u.why}",
                key=u.key,
                prompt_id=u.prompt_id,
                payload=u.payload,
            )
        )

    cutoff = expiry_cutoff(now, expire_s)
    confirmed: list[FeedbackRecord] = []
    seen: set[str] = set()
    for fb, held in [
        *((f, True) for f in state.unconfirmed.values()),
        *((f, False) for f in records.feedback),
    ]:
        if fb.feedback_id is not None:
            if fb.feedback_id in seen:
                # A re-sent copy of a record this poll has already decided (or that waits).
                counters["duplicate_feedback"] += 1
                continue
            seen.add(fb.feedback_id)
        if (fb.trajectory_id or episode_key(fb.episode_id)) in state.forgotten:
            counters["forgotten"] += 1
            if held:
                deletes.append((fb.feedback_id, "unconfirmed"))
            continue
        verdict = _confirmation(fb, state.claims)
        if verdict == "unconfirmed" and _aware(fb.received_at) < cutoff:
            verdict = "expired_feedback"
        if held and verdict != "unconfirmed":
            deletes.append((fb.feedback_id, "unconfirmed"))
        if verdict == "confirmed":
            confirmed.append(fb)
        elif verdict == "unconfirmed":
            if not held:
                inserts.append(
                    PendingRow(
                        fb.feedback_id, "unconfirmed", fb.prompt_id, fb.to_json().decode(), fb.received_at
                    )
                )
        else:
            counters[verdict] += 1
            if verdict == "expired_feedback":
                set_aside(
                    "unconfirmed",
                    fb,
                    f"its claim was not marked received within expire_s ({expire_s:g} s): the server "
                    "may have answered 202 and failed to mark it, or crashed before answering",
                )

    # Trajectories first: a prompt's trajectory precedes its feedback in the log.
    for rec in records.trajectories:
        if rec.id in state.forgotten or (
            rec.episode_id is not None and episode_key(rec.episode_id) in state.forgotten
        ):
            counters["forgotten"] += 1
            continue
        if (
            rec.id in state.joined
            or rec.id in state.expired_before
            or rec.id in joined_now
            or rec.id in state.trajectories
            or rec.id in waiting
        ):
            counters["duplicate_trajectories"] += 1
            continue
        fb = state.feedback.get(rec.id)
        if fb is not None and rec.episode_id is not None:
            deletes.append((rec.id, "feedback"))
            counters["episode_turn_feedback"] += 1
        elif fb is not None:
            joins.append(_join_single(rec, fb.reward))
            deletes.append((rec.id, "feedback"))
            tombstone(rec.id, rec.prompt_id)
            continue
        if rec.episode_id is not None and episode_key(rec.episode_id) in state.joined:
            # The server takes no turn once an episode is rated; one logged anyway cannot join.
            counters["late_episode_turns"] += 1
            continue
        waiting[rec.id] = rec

    for fb in confirmed:
        if fb.episode_id is not None:
            key = episode_key(fb.episode_id)
            if key in state.joined or key in joined_now:
                counters["duplicate_feedback"] += 1
                continue
            present = [r for r in waiting.values() if r.episode_id == fb.episode_id]
            for r in present:
                del waiting[r.id]
            for r in state.trajectories.values():
                if r.prompt_id == fb.prompt_id and r.episode_id == fb.episode_id and r.id not in joined_now:
                    present.append(r)
                    deletes.append((r.id, "trajectory"))
            listed = fb.turn_ids if fb.turn_ids is not None else [r.id for r in present]
            if not listed:
                counters["episode_feedback_without_turns"] += 1
                set_aside("episode_incomplete", fb, "the feedback lists no turn of the episode")
                continue
            by_id = {r.id: r for r in present}
            counters["void_episode_turns"] += len(by_id.keys() - set(listed))
            for tid in listed:
                if tid in by_id:
                    tombstone(tid, by_id[tid].prompt_id)
            tombstone(key, fb.prompt_id)
            turns = [by_id[tid] for tid in listed if tid in by_id]
            numbers = sorted(r.turn for r in turns if r.turn is not None)
            if len(turns) < len(listed):
                counters["episode_turns_missing"] += 1
                missing = [tid for tid in listed if tid not in by_id]
                expired_first = all(tid in state.expired_before for tid in missing)
                set_aside(
                    "episode_incomplete",
                    fb,
                    f"{len(missing)} of its {len(listed)} turns "
                    + (
                        "expired before the feedback came"
                        if expired_first
                        else "are not pending (expired earlier?)"
                    )
                    + f": {', '.join(missing[:5])}",
                )
            elif fb.turn_ids is None and numbers != list(range(len(turns))):
                counters["episode_turns_misnumbered"] += 1
                set_aside(
                    "episode_incomplete",
                    fb,
                    f"logged before turn lists, and its {len(turns)} turns are numbered {numbers[:8]}, "
                    "not 0..n-1 each once",
                )
            else:
                # Listed turns are in the server's turn order, which records logged before turn
                # numbers do not carry.
                joins.append(_join_episode(fb.episode_id, turns, fb.reward, fb.turn_ids is not None))
            continue
        tid = fb.trajectory_id
        if tid in state.joined or tid in joined_now:
            counters["duplicate_feedback"] += 1
            continue
        known = waiting.get(tid) or state.trajectories.get(tid)
        if known is not None and known.episode_id is not None:
            # Rated by its episode only; the turn stays where it is and waits for that feedback.
            counters["episode_turn_feedback"] += 1
            continue
        rec = waiting.pop(tid, None)
        if rec is None and tid in state.trajectories:
            rec = state.trajectories[tid]
            deletes.append((tid, "trajectory"))
        if rec is None and tid in state.expired_before:
            counters["late_feedback"] += 1
            set_aside(
                "trajectory_expired",
                fb,
                f"its trajectory had expired (no feedback within expire_s = {expire_s:g} s) before this "
                "feedback was read",
            )
            continue
        if rec is None:
            if tid in state.feedback or tid in feedback_pending_now:
                # The first feedback already waits for this trajectory: first wins.
                counters["duplicate_feedback"] += 1
                continue
            feedback_pending_now.add(tid)
            inserts.append(PendingRow(tid, "feedback", fb.prompt_id, fb.to_json().decode(), now))
            continue
        joins.append(_join_single(rec, fb.reward))
        tombstone(tid, rec.prompt_id)

    consumed = {key for key, kind in deletes if kind == "trajectory"}
    expired = sorted(state.expired - consumed - {u.key for u in state.unreadable})
    for rec in waiting.values():
        if _aware(rec.created_at) < cutoff:
            counters["expired"] += 1
            inserts.append(PendingRow(rec.id, "expired", rec.prompt_id, "", now))
        else:
            inserts.append(
                PendingRow(rec.id, "trajectory", rec.prompt_id, rec.to_json().decode(), rec.created_at)
            )
    counters["expired"] += len(expired)
    inserts.extend(PendingRow(key, "expired", "", "", now) for key in expired)
    consumed_feedback = {key for key, kind in deletes if kind == "feedback"}
    for tid, fb in sorted(state.stale_feedback.items()):
        if tid not in consumed_feedback:
            deletes.append((tid, "feedback"))
            counters["late_feedback"] += 1
            set_aside(
                "trajectory_expired",
                fb,
                f"no trajectory joined it within expire_s ({expire_s:g} s): its trajectory had expired "
                "before it came",
            )

    for sample, result, reasons in joins:
        if sample is not None:
            samples.append(sample)
        if result is not None:
            results.append(result)
        counters.update(reasons)
    return JoinPlan(
        deletes=deletes,
        expired=expired,
        inserts=inserts,
        samples=samples,
        results=results,
        counters={name: n for name, n in counters.items() if n},
        offsets=dict(records.offsets),
        forget_joined_before=now - TOMBSTONE_TTL,
        dead_letters=letters,
    )
