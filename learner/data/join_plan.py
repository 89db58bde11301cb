"""The joiner's pure step: records read + the join state held in the database → what to commit.

``learner.data.joiner.Joiner.poll_once`` is read → :func:`plan_join` → commit. Reading (the log and
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
  (``learner.data.samples.episode_sample``); its tombstone key is ``e:<episode_id>``. The Joiner's
  read order makes every listed turn present by then, in this read or pending
  (``learner.data.joiner.Joiner``). A turn of the episode it does not list was answered 503 (or
  500) and appended late by the log, or aborted or failed after tokens (its client got no
  answer, and its number went to the retry: ``server.fate``): dropped, counted
  ``void_episode_turns`` (``late_episode_turns`` when it is logged after the episode joined).
  A listed turn
  that is absent (expired while pending) leaves the episode incomplete: no sample, counted
  ``episode_turns_missing``. Episode feedback logged before ``turn_ids`` joins the turns
  present, only if their numbers are 0..n-1, each once (else ``episode_turns_misnumbered``).
  A turn logged after its episode was joined is dropped and counted ``late_episode_turns``.
* A turn of an episode is rated only with its episode (the server answers 409
  ``rate_the_episode`` otherwise): feedback naming one by its trajectory id (logged before that
  rule) is dropped and counted ``episode_turn_feedback``, and the turn waits for its episode's.
* A joined result enters the prompt's evidence at the version that generated the answer's
  first token (``learner.data.samples.answer_version``), also when the sample itself is excluded
  for its sampling (greedy, truncated, empty), except when it is not a whole answer
  (aborted, errored, or an episode with such a turn): then neither sample nor evidence, and
  the reason is counted (``learner.data.samples.NotWholeAnswer``).
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
  as before. A claim past ``core.claims.CLAIM_TIMEOUT`` confirms the record it holds, marked or
  not (a 202 whose mark was lost), and the record a takeover superseded is confirmed too (it
  reached the log before the takeover, so it is the first; the takeover's own record is then a
  ``duplicate_feedback``): a 202 trains exactly once, the first (issue 40 item 9).
* Privacy (docs/privacy.md): a trajectory whose request opted out of training, or whose API
  key has opted out by the time it joins (``JoinState.opted_out``: the key's setting read at
  join time, also for a record logged before the opt-out or without a ``train`` flag), or an
  episode with such a turn, joins as usual but makes neither sample nor evidence, counted
  ``excluded_opted_out`` (``learner.data.samples.OptedOut``). A record of a forgotten trajectory or
  episode (``JoinState.forgotten``, the tombstones ``saoserve admin forget`` leaves, which the
  Kafka log needs until its retention deletes the records) is dropped as it is read, before
  any other rule, and counted ``forgotten``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pydantic import ValidationError

from core.claims import claim_target, episode_key, record_key
from core.dead_letters import Letter
from core.logbus import LogEntry
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, as_utc
from learner.data.samples import (
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
        return {claim_target(f.trajectory_id, f.episode_id) for f in [*self.feedback, *unconfirmed]}

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
    while claimed, not yet marked and within ``core.claims.CLAIM_TIMEOUT``; a target without a
    claim row is absent. ``superseded``: claim target → the first feedback id a takeover took
    its claim from (``core.claims``), for the targets that have one. ``forgotten``:
    keys among :meth:`Records.ids` and :meth:`Records.episode_keys` that ``saoserve admin
    forget`` tombstoned (``core.db.ForgottenRecord``). ``expired_before``: keys among
    :meth:`Records.ids` and :meth:`Records.listed_turns` that have a tombstone of expiry (kind
    ``expired``). ``stale_feedback``: every pending feedback received before
    :func:`expiry_cutoff`, by trajectory id. ``unreadable``: pending rows that did not parse.
    ``opted_out``: the identities (``key:<key id>``) of this read's and the pending
    trajectories whose API key has opted out of training now (``api_keys.train`` false).
    """

    joined: frozenset[str] = frozenset()
    trajectories: Mapping[str, TrajectoryRecord] = field(default_factory=dict)
    feedback: Mapping[str, FeedbackRecord] = field(default_factory=dict)
    expired: frozenset[str] = frozenset()
    unconfirmed: Mapping[str, FeedbackRecord] = field(default_factory=dict)
    claims: Mapping[str, str | None] = field(default_factory=dict)
    superseded: Mapping[str, str] = field(default_factory=dict)
    forgotten: frozenset[str] = frozenset()
    expired_before: frozenset[str] = frozenset()
    stale_feedback: Mapping[str, FeedbackRecord] = field(default_factory=dict)
    unreadable: tuple[Unreadable, ...] = ()
    opted_out: frozenset[str] = frozenset()


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


Join = tuple[Sample | None, Result | None, dict[str, int]]
"""A join's outcome: (sample or None, evidence result or None, counter increments)."""


def as_keyed(rec: TrajectoryRecord, state: JoinState) -> TrajectoryRecord:
    """``rec`` as it joins: marked ``train: false`` when its API key has opted out of training
    by now (``JoinState.opted_out``), whatever its own flag says (logged before the opt-out, or
    with no flag at all); else ``rec`` itself. Only the join sees the mark: a pending row keeps
    the record as logged."""
    if rec.train and rec.identity is not None and rec.identity in state.opted_out:
        return rec.model_copy(update={"train": False})
    return rec


def _join_single(rec: TrajectoryRecord, reward: float) -> Join:
    """A trajectory and its reward → (sample or None, evidence result or None, counters)."""
    result = (rec.prompt_id, reward, answer_version(rec))
    try:
        return single_turn_sample(rec, reward), result, {}
    except (NotWholeAnswer, OptedOut) as exc:
        return None, None, {str(exc): 1}
    except NotLearnable as exc:
        return None, result, {str(exc): 1}


def _join_episode(episode_id: str, turns: list[TrajectoryRecord], reward: float, in_order: bool) -> Join:
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


def _confirmation(fb: FeedbackRecord, claims: Mapping[str, str | None], superseded: Mapping[str, str]) -> str:
    """``confirmed``, ``unconfirmed`` (claim not yet marked) or ``void_feedback`` (module
    docstring). The record a takeover superseded is confirmed: it is in the log, so its request
    may have answered 202 (issue 40 item 9); the later record of the takeover, confirmed too,
    then finds the target joined or pending (``duplicate_feedback``), so the first wins."""
    if fb.feedback_id is None:
        return "confirmed"
    target = claim_target(fb.trajectory_id, fb.episode_id)
    if superseded.get(target) == fb.feedback_id:
        return "confirmed"
    if target not in claims:
        return "void_feedback"
    held = claims[target]
    if held is None:
        return "unconfirmed"
    return "confirmed" if held == fb.feedback_id else "void_feedback"


def _verdict(fb: FeedbackRecord, state: JoinState, cutoff: datetime) -> str:
    """What becomes of one feedback record before any join: ``forgotten`` (its target was
    forgotten, the first rule), else :func:`_confirmation`'s verdict, where ``unconfirmed``
    past ``cutoff`` (by ``received_at``) becomes ``expired_feedback``."""
    if record_key(fb.trajectory_id, fb.episode_id) in state.forgotten:
        return "forgotten"
    verdict = _confirmation(fb, state.claims, state.superseded)
    if verdict == "unconfirmed" and as_utc(fb.received_at) < cutoff:
        return "expired_feedback"
    return verdict


def _episode_incomplete(
    fb: FeedbackRecord, listed: list[str], turns: list[TrajectoryRecord], expired_before: frozenset[str]
) -> tuple[str, str] | None:
    """Why episode feedback listing ``listed`` cannot join the ``turns`` found of them, as
    (counter, dead-letter reason): ``episode_turns_missing`` (a listed turn is not pending) or
    ``episode_turns_misnumbered`` (feedback logged before turn lists whose turns are not
    numbered 0..n-1, each once); None when it can join."""
    found = {r.id for r in turns}
    if len(turns) < len(listed):
        missing = [tid for tid in listed if tid not in found]
        cause = (
            "expired before the feedback came"
            if all(tid in expired_before for tid in missing)
            else "are not pending (expired earlier?)"
        )
        return (
            "episode_turns_missing",
            f"{len(missing)} of its {len(listed)} turns {cause}: {', '.join(missing[:5])}",
        )
    numbers = sorted(r.turn for r in turns if r.turn is not None)
    if fb.turn_ids is None and numbers != list(range(len(turns))):
        return (
            "episode_turns_misnumbered",
            f"logged before turn lists, and its {len(turns)} turns are numbered {numbers[:8]}, "
            "not 0..n-1 each once",
        )
    return None


@dataclass
class _Draft:
    """A plan being built by :func:`plan_join`'s phases, which append to it in the order they
    run (the order of rows within the commit).

    ``joined_now``: keys tombstoned by this plan; ``waiting``: trajectories of this read that
    wait for feedback, by id; ``feedback_pending_now``: trajectory ids whose feedback this plan
    files as pending; ``joins``: the outcome of each join, in join order.
    """

    now: datetime
    expire_s: float
    counters: Counter[str]
    letters: list[Letter]
    deletes: list[tuple[str, str]] = field(default_factory=list)
    inserts: list[PendingRow] = field(default_factory=list)
    joins: list[Join] = field(default_factory=list)
    joined_now: set[str] = field(default_factory=set)
    waiting: dict[str, TrajectoryRecord] = field(default_factory=dict)
    feedback_pending_now: set[str] = field(default_factory=set)

    @property
    def cutoff(self) -> datetime:
        return expiry_cutoff(self.now, self.expire_s)

    def tombstone(self, key: str, prompt_id: str) -> None:
        """Leave a ``joined`` tombstone on ``key``."""
        self.joined_now.add(key)
        self.inserts.append(PendingRow(key, "joined", prompt_id, "", self.now))

    def set_aside(self, kind: str, fb: FeedbackRecord, why: str) -> None:
        """Set ``fb`` aside as a dead letter of ``kind``."""
        key = record_key(fb.trajectory_id, fb.episode_id)
        self.letters.append(Letter(kind, why, key=key, prompt_id=fb.prompt_id, payload=fb.to_json().decode()))

    def plan(self, records: Records, expired: list[str]) -> JoinPlan:
        """The finished plan: each join's sample, result and counters, after every phase's."""
        samples = [sample for sample, _, _ in self.joins if sample is not None]
        results = [result for _, result, _ in self.joins if result is not None]
        for _, _, reasons in self.joins:
            self.counters.update(reasons)
        return JoinPlan(
            deletes=self.deletes,
            expired=expired,
            inserts=self.inserts,
            samples=samples,
            results=results,
            counters={name: n for name, n in self.counters.items() if n},
            offsets=dict(records.offsets),
            forget_joined_before=self.now - TOMBSTONE_TTL,
            dead_letters=self.letters,
        )


def _drop_unreadable(draft: _Draft, unreadable: Iterable[Unreadable]) -> None:
    """Phase 1: delete each pending row that no longer parses and set it aside."""
    for u in unreadable:
        draft.deletes.append((u.key, u.kind))
        draft.letters.append(
            Letter(
                "unreadable_pending",
                f"a pending {u.kind} row that does not parse: {u.why}",
                key=u.key,
                prompt_id=u.prompt_id,
                payload=u.payload,
            )
        )


def _confirm(draft: _Draft, records: Records, state: JoinState) -> list[FeedbackRecord]:
    """Phase 2: the feedback that may join, in order (the pending unconfirmed first, then this
    read's). A re-sent copy of a record with an id is a ``duplicate_feedback``; each other
    record gets its :func:`_verdict`: a pending unconfirmed row that is decided is deleted, a
    new unconfirmed record is filed pending, the others are counted (``expired_feedback`` also
    set aside)."""
    confirmed: list[FeedbackRecord] = []
    seen: set[str] = set()
    for fb, held in [
        *((f, True) for f in state.unconfirmed.values()),
        *((f, False) for f in records.feedback),
    ]:
        if fb.feedback_id is not None:
            if fb.feedback_id in seen:
                # A re-sent copy of a record this poll has already decided (or that waits).
                draft.counters["duplicate_feedback"] += 1
                continue
            seen.add(fb.feedback_id)
        verdict = _verdict(fb, state, draft.cutoff)
        if held and verdict != "unconfirmed":
            draft.deletes.append((fb.feedback_id, "unconfirmed"))
        if verdict == "confirmed":
            confirmed.append(fb)
        elif verdict == "unconfirmed":
            if not held:
                draft.inserts.append(
                    PendingRow(
                        fb.feedback_id, "unconfirmed", fb.prompt_id, fb.to_json().decode(), fb.received_at
                    )
                )
        else:
            draft.counters[verdict] += 1
            if verdict == "expired_feedback":
                draft.set_aside(
                    "unconfirmed",
                    fb,
                    f"its claim was not marked received within expire_s ({draft.expire_s:g} s): the "
                    "server may have answered 202 and failed to mark it, or crashed before answering",
                )
    return confirmed


def _is_forgotten(rec: TrajectoryRecord, forgotten: frozenset[str]) -> bool:
    """Whether ``rec`` or its episode was forgotten."""
    return rec.id in forgotten or (rec.episode_id is not None and episode_key(rec.episode_id) in forgotten)


def _is_duplicate(rec: TrajectoryRecord, state: JoinState, draft: _Draft) -> bool:
    """Whether ``rec`` was joined, expired, is pending, or was read before in this read."""
    return (
        rec.id in state.joined
        or rec.id in state.expired_before
        or rec.id in draft.joined_now
        or rec.id in state.trajectories
        or rec.id in draft.waiting
    )


def _take_trajectory(draft: _Draft, rec: TrajectoryRecord, state: JoinState) -> None:
    """Phase 3, one trajectory of the read: dropped (forgotten, duplicate, a turn of an
    episode already joined), joined with its pending feedback, or left waiting. Pending
    feedback naming an episode's turn is deleted and counted ``episode_turn_feedback``."""
    if _is_forgotten(rec, state.forgotten):
        draft.counters["forgotten"] += 1
        return
    if _is_duplicate(rec, state, draft):
        draft.counters["duplicate_trajectories"] += 1
        return
    if rec.id in state.feedback:
        draft.deletes.append((rec.id, "feedback"))
        if rec.episode_id is None:
            draft.joins.append(_join_single(as_keyed(rec, state), state.feedback[rec.id].reward))
            draft.tombstone(rec.id, rec.prompt_id)
            return
        draft.counters["episode_turn_feedback"] += 1
    if rec.episode_id is not None and episode_key(rec.episode_id) in state.joined:
        # The server takes no turn once an episode is rated; one logged anyway cannot join.
        draft.counters["late_episode_turns"] += 1
        return
    draft.waiting[rec.id] = rec


def _episode_turns_present(draft: _Draft, fb: FeedbackRecord, state: JoinState) -> list[TrajectoryRecord]:
    """The turns of ``fb``'s episode at hand: those waiting in this read (taken out of
    :attr:`_Draft.waiting`), then the pending ones not joined by this plan (deleted)."""
    present = [r for r in draft.waiting.values() if r.episode_id == fb.episode_id]
    for r in present:
        del draft.waiting[r.id]
    for r in state.trajectories.values():
        if r.prompt_id == fb.prompt_id and r.episode_id == fb.episode_id and r.id not in draft.joined_now:
            present.append(r)
            draft.deletes.append((r.id, "trajectory"))
    return present


def _join_episode_feedback(draft: _Draft, fb: FeedbackRecord, state: JoinState) -> None:
    """Phase 4, confirmed feedback on an episode: joins the turns it lists (all present ones
    for feedback logged before turn lists), tombstones them and the episode, or sets the
    feedback aside when turns are none, missing or misnumbered (:func:`_episode_incomplete`)."""
    key = episode_key(fb.episode_id)
    if key in state.joined or key in draft.joined_now:
        draft.counters["duplicate_feedback"] += 1
        return
    present = _episode_turns_present(draft, fb, state)
    listed = fb.turn_ids if fb.turn_ids is not None else [r.id for r in present]
    if not listed:
        draft.counters["episode_feedback_without_turns"] += 1
        draft.set_aside("episode_incomplete", fb, "the feedback lists no turn of the episode")
        return
    by_id = {r.id: r for r in present}
    draft.counters["void_episode_turns"] += len(by_id.keys() - set(listed))
    turns = [by_id[tid] for tid in listed if tid in by_id]
    for r in turns:
        draft.tombstone(r.id, r.prompt_id)
    draft.tombstone(key, fb.prompt_id)
    incomplete = _episode_incomplete(fb, listed, turns, state.expired_before)
    if incomplete is not None:
        counter, why = incomplete
        draft.counters[counter] += 1
        draft.set_aside("episode_incomplete", fb, why)
    else:
        # Listed turns are in the server's turn order, which records logged before turn
        # numbers do not carry.
        keyed = [as_keyed(t, state) for t in turns]
        draft.joins.append(_join_episode(fb.episode_id, keyed, fb.reward, fb.turn_ids is not None))


def _join_trajectory_feedback(draft: _Draft, fb: FeedbackRecord, state: JoinState) -> None:
    """Phase 4, confirmed feedback on one trajectory: joins it with its trajectory (waiting or
    pending), or drops it (a duplicate, a turn of an episode, its trajectory expired: set
    aside), or files it pending for a trajectory not yet read."""
    tid = fb.trajectory_id
    if tid in state.joined or tid in draft.joined_now:
        draft.counters["duplicate_feedback"] += 1
        return
    known = draft.waiting.get(tid) or state.trajectories.get(tid)
    if known is not None and known.episode_id is not None:
        # Rated by its episode only; the turn stays where it is and waits for that feedback.
        draft.counters["episode_turn_feedback"] += 1
        return
    rec = draft.waiting.pop(tid, None)
    if rec is None and tid in state.trajectories:
        rec = state.trajectories[tid]
        draft.deletes.append((tid, "trajectory"))
    if rec is not None:
        draft.joins.append(_join_single(as_keyed(rec, state), fb.reward))
        draft.tombstone(tid, rec.prompt_id)
    elif tid in state.expired_before:
        draft.counters["late_feedback"] += 1
        draft.set_aside(
            "trajectory_expired",
            fb,
            f"its trajectory had expired (no feedback within expire_s = {draft.expire_s:g} s) before "
            "this feedback was read",
        )
    elif tid in state.feedback or tid in draft.feedback_pending_now:
        # The first feedback already waits for this trajectory: first wins.
        draft.counters["duplicate_feedback"] += 1
    else:
        draft.feedback_pending_now.add(tid)
        draft.inserts.append(PendingRow(tid, "feedback", fb.prompt_id, fb.to_json().decode(), draft.now))


def _park_waiting(draft: _Draft) -> None:
    """Phase 5: each trajectory still waiting is filed pending, or expired (tombstone of
    kind ``expired``) when created before the cutoff."""
    for rec in draft.waiting.values():
        if as_utc(rec.created_at) < draft.cutoff:
            draft.counters["expired"] += 1
            draft.inserts.append(PendingRow(rec.id, "expired", rec.prompt_id, "", draft.now))
        else:
            draft.inserts.append(
                PendingRow(rec.id, "trajectory", rec.prompt_id, rec.to_json().decode(), rec.created_at)
            )


def _expire_pending(draft: _Draft, state: JoinState) -> list[str]:
    """Phase 5: the pending trajectories that expire (those past the cutoff that this plan
    neither joined nor deleted as unreadable), sorted, each leaving a tombstone of expiry."""
    consumed = {key for key, kind in draft.deletes if kind == "trajectory"}
    expired = sorted(state.expired - consumed - {u.key for u in state.unreadable})
    draft.counters["expired"] += len(expired)
    draft.inserts.extend(PendingRow(key, "expired", "", "", draft.now) for key in expired)
    return expired


def _set_aside_stale_feedback(draft: _Draft, state: JoinState) -> None:
    """Phase 5: pending feedback past the cutoff that this plan did not join is deleted,
    counted ``late_feedback`` and set aside."""
    consumed = {key for key, kind in draft.deletes if kind == "feedback"}
    for tid, fb in sorted(state.stale_feedback.items()):
        if tid not in consumed:
            draft.deletes.append((tid, "feedback"))
            draft.counters["late_feedback"] += 1
            draft.set_aside(
                "trajectory_expired",
                fb,
                f"no trajectory joined it within expire_s ({draft.expire_s:g} s): its trajectory had "
                "expired before it came",
            )


def plan_join(records: Records, state: JoinState, now: datetime, expire_s: float) -> JoinPlan:
    """Join one read against the committed state (module docstring for the rules).

    Phases, in order (each appends to one draft): unreadable pending rows are set aside;
    feedback is confirmed against its claim; this read's trajectories join pending feedback or
    wait (a prompt's trajectory precedes its feedback in the log); confirmed feedback joins
    its episode's turns or its trajectory; what still waits is filed pending or expires, and
    stale feedback is set aside.

    Args:
        records: what the read returned.
        state: the pending rows and tombstones it touches (:class:`JoinState`).
        now: the commit time (tz-aware): tombstones' ``received_at`` and the expiry clock.
        expire_s: seconds a trajectory waits for its feedback.

    Returns:
        The :class:`JoinPlan`. Pure: no I/O, ``records`` and ``state`` are not modified.
    """
    draft = _Draft(now, expire_s, Counter(records.malformed), list(records.rejected))
    _drop_unreadable(draft, state.unreadable)
    confirmed = _confirm(draft, records, state)
    for rec in records.trajectories:
        _take_trajectory(draft, rec, state)
    for fb in confirmed:
        if fb.episode_id is not None:
            _join_episode_feedback(draft, fb, state)
        else:
            _join_trajectory_feedback(draft, fb, state)
    _park_waiting(draft)
    expired = _expire_pending(draft, state)
    _set_aside_stale_feedback(draft, state)
    return draft.plan(records, expired)
