"""The lifecycle in the database: versions' stages, their transitions with who and when, the
rated answers the guard compares, and the quarantine of samples that trained a rejected version.

Every function works in the caller's connection or transaction, so a transition commits
together with whatever it belongs to (a version's row, a rollback's new version, the quarantine).
The rules are ``core/lifecycle.py``'s; docs/guard.md, "The lifecycle".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from sqlalchemy import func, insert, literal, select, update
from sqlalchemy.engine import Connection

from core.claims import TRAJECTORY_PREFIX
from core.control import GUARD_PIN, ROLLBACK_TO
from core.db import (
    ControlFlag,
    FeedbackClaim,
    LearnerStep,
    PolicyVersion,
    QuarantinedSample,
    TrajectoryIndex,
    VersionStatusEvent,
)
from core.lifecycle import (
    ENDED_FINISHES,
    Arm,
    Stage,
    TransitionError,
    VersionStage,
    check_transition,
    healthy,
)
from core.limits import NAME_CHARS
from core.records import PolicyEvent, as_utc, utcnow

QUARANTINED = "quarantined"
"""The learner counter of quarantined samples (``learner_counters``)."""


def stages(conn: Connection) -> list[VersionStage]:
    """Every recorded version with its stage, oldest first."""
    rows = conn.execute(
        select(PolicyVersion.version, PolicyVersion.lifecycle).order_by(PolicyVersion.version)
    )
    return [VersionStage(r.version, Stage(r.lifecycle)) for r in rows]


def parents(conn: Connection) -> dict[int, int | None]:
    """Every recorded version → the version it was trained from (or restores), None for the
    base (``core.lifecycle.descendants``' input)."""
    rows = conn.execute(select(PolicyVersion.version, PolicyVersion.parent_version))
    return {r.version: r.parent_version for r in rows}


def routable(conn: Connection) -> set[int]:
    """The versions whose published folders a server or the learner may still load, which the
    learner's prune keeps whatever their age (issue 40; docs/guard.md, "Rejecting a version"):

    * every ``promoted`` version: the promoted one is the control arm of a split and the target
      of a rejection's restore, and each older one becomes both if the ones after it are
      rejected (a rejection reaches a promoted version's descendants);
    * the newest version not rejected: the lineage's candidate that serves (a replica that
      restarts loads it);
    * the versions the ``guard_pin`` and ``rollback_to`` flags name.
    """
    st = stages(conn)
    keep = {v.version for v in st if v.stage == Stage.PROMOTED}
    head = max((v.version for v in st if v.stage != Stage.REJECTED), default=None)
    if head is not None:
        keep.add(head)
    flags = conn.execute(
        select(ControlFlag.value).where(ControlFlag.name.in_([GUARD_PIN, ROLLBACK_TO]))
    ).scalars()
    keep.update(int(f) for f in flags if f.isdigit())
    return keep


def record_event(
    conn: Connection,
    version: int,
    from_status: Stage | None,
    to_status: Stage,
    actor: str,
    reason: str,
    at: datetime,
) -> None:
    """Insert one ``version_status_events`` row (``actor`` is cut to the column's width)."""
    conn.execute(
        insert(VersionStatusEvent).values(
            version=version,
            from_status=None if from_status is None else str(from_status),
            to_status=str(to_status),
            actor=actor[:NAME_CHARS],
            reason=reason,
            at=at,
        )
    )


def transition(
    conn: Connection, version: int, target: Stage | str, actor: str, reason: str, at: datetime
) -> Stage:
    """Move ``version`` to ``target`` and record the event, in the caller's transaction.

    Raises:
        KeyError: ``version`` is not recorded.
        core.lifecycle.TransitionError: the move is not allowed (``check_transition``).
    """
    current = conn.execute(
        select(PolicyVersion.lifecycle).where(PolicyVersion.version == version)
    ).scalar_one_or_none()
    if current is None:
        raise KeyError(f"no policy version {version}")
    to = check_transition(version, current, target)
    _compare_and_set(conn, version, Stage(current), to)
    record_event(conn, version, Stage(current), to, actor, reason, at)
    return to


def confirm_stage(conn: Connection, version: int, stage: Stage) -> None:
    """In the caller's transaction, check that ``version`` is still at ``stage`` and hold it
    there until the commit (a write of the same stage takes the row's lock: a concurrent
    ``transition`` of it waits for this transaction, then finds what it wrote).

    Raises:
        core.lifecycle.TransitionError: ``version`` is not at ``stage`` (any more).
    """
    _compare_and_set(conn, version, stage, stage)


def _compare_and_set(conn: Connection, version: int, seen: Stage, to: Stage) -> None:
    """Move ``version`` from ``seen`` to ``to`` only if it is still at ``seen`` (issue 40 item 8).

    The read of the stage and this write are two statements: another transaction (an operator,
    the guard) may move the version between them. The ``WHERE lifecycle = seen`` makes the write
    a compare-and-set. On PostgreSQL a concurrent writer of the row waits for the first one's
    commit and then re-reads the row, so it updates nothing; on SQLite writers are serialised.
    Exactly one of two racing moves is recorded; the other raises.

    Raises:
        core.lifecycle.TransitionError: the version is no longer at ``seen``; the message names
            the stage it is at now.
    """
    res = conn.execute(
        update(PolicyVersion)
        .where(PolicyVersion.version == version, PolicyVersion.lifecycle == str(seen))
        .values(lifecycle=str(to))
    )
    if res.rowcount == 1:
        return
    now = conn.execute(
        select(PolicyVersion.lifecycle).where(PolicyVersion.version == version)
    ).scalar_one_or_none()
    raise TransitionError(
        f"version {version} was {seen} and is {now or 'gone'} now: another move of it was "
        "recorded first (read the lifecycle and try again if it still applies)"
    )


def stage_events(conn: Connection, versions: Iterable[int], stage: Stage, actor: str) -> list[PolicyEvent]:
    """The policy topic's notices (``PolicyEvent`` of kind ``stage``) that ``versions`` moved to
    ``stage`` by ``actor``, oldest version first; versions not recorded are left out."""
    wanted = sorted(set(versions))
    if not wanted:
        return []
    rows = conn.execute(
        select(PolicyVersion.version, PolicyVersion.path, PolicyVersion.sha256, PolicyVersion.parent_version)
        .where(PolicyVersion.version.in_(wanted))
        .order_by(PolicyVersion.version)
    ).all()
    now = utcnow()
    return [
        PolicyEvent(
            version=r.version,
            path=r.path,
            sha256=r.sha256,
            created_at=now,
            parent_version=r.parent_version,
            lifecycle=str(stage),
            kind="stage",
            actor=actor[:NAME_CHARS],
        )
        for r in rows
    ]


def answers_window(q, before: datetime | None, since: datetime | None, arm: Arm | None):
    """``q`` restricted to answers dispatched before ``before`` / at or after ``since`` and routed
    to ``arm`` (``trajectory_index``'s ``created_at`` and ``arm``)."""
    if before is not None:
        q = q.where(TrajectoryIndex.created_at < before)
    if since is not None:
        q = q.where(TrajectoryIndex.created_at >= since)
    if arm is not None:
        q = q.where(TrajectoryIndex.arm == str(arm))
    return q


def rated_rewards(
    conn: Connection,
    versions: Iterable[int],
    before: datetime | None = None,
    limit: int | None = None,
    since: datetime | None = None,
    arm: Arm | None = None,
) -> list[float]:
    """Rewards of the rated single-turn answers that ``versions`` dispatched (the version of the
    first token, ``trajectory_index.dispatch_version``), oldest rating first.

    ``before`` / ``since``: only answers dispatched before / at or after this time; ``arm``:
    only answers a canary split routed to that arm (``trajectory_index.arm``); ``limit``: only
    the newest ``limit`` ratings (still returned oldest first). Episodes' feedback rates several
    answers at once and is not counted (docs/guard.md, "The lifecycle").
    """
    wanted = list(versions)
    if not wanted:
        return []
    q = (
        select(FeedbackClaim.reward, FeedbackClaim.received_at)
        .join(TrajectoryIndex, FeedbackClaim.target == literal(TRAJECTORY_PREFIX) + TrajectoryIndex.id)
        .where(
            FeedbackClaim.state == "received",
            FeedbackClaim.reward.is_not(None),
            TrajectoryIndex.dispatch_version.in_(wanted),
        )
    )
    q = answers_window(q, before, since, arm).order_by(
        FeedbackClaim.received_at.desc(), FeedbackClaim.target.desc()
    )
    if limit is not None:
        q = q.limit(limit)
    return [float(r.reward) for r in reversed(conn.execute(q).all())]


def answer_health(
    conn: Connection,
    versions: Iterable[int],
    min_tokens: int,
    before: datetime | None = None,
    limit: int | None = None,
    since: datetime | None = None,
    arm: Arm | None = None,
) -> list[float]:
    """1.0 for each sound answer ``versions`` dispatched, 0.0 for each degenerate one
    (``core.lifecycle.healthy`` with ``min_tokens``), rated or not, oldest first: every answer
    that ended (``ENDED_FINISHES``), single-turn or an episode's turn. ``before``, ``since``,
    ``arm`` and ``limit`` (the newest answers) as for ``rated_rewards``."""
    wanted = list(versions)
    if not wanted:
        return []
    q = select(TrajectoryIndex.finish_reason, TrajectoryIndex.n_response_tokens).where(
        TrajectoryIndex.dispatch_version.in_(wanted), TrajectoryIndex.finish_reason.in_(ENDED_FINISHES)
    )
    q = answers_window(q, before, since, arm).order_by(
        TrajectoryIndex.created_at.desc(), TrajectoryIndex.id.desc()
    )
    if limit is not None:
        q = q.limit(limit)
    return [
        float(healthy(r.finish_reason, r.n_response_tokens, min_tokens))
        for r in reversed(conn.execute(q).all())
    ]


def trained_sample_ids(conn: Connection, versions: Iterable[int]) -> dict[int, list[str]]:
    """The sample ids each of ``versions`` was trained on (``learner_steps.metrics.sample_ids``);
    a version with no step (a rollback's) is absent."""
    wanted = list(versions)
    out: dict[int, list[str]] = {}
    if not wanted:
        return out
    rows = conn.execute(
        select(LearnerStep.version, LearnerStep.metrics).where(LearnerStep.version.in_(wanted))
    )
    for r in rows:
        out.setdefault(r.version, []).extend((r.metrics or {}).get("sample_ids") or [])
    return out


def step_metric(conn: Connection, versions: Iterable[int], name: str) -> dict[int, float | None]:
    """The metric ``name`` of the step that trained each of ``versions``
    (``learner_steps.metrics``); None where the step did not record it as a number, and a
    version with no step (a rollback's) absent."""
    wanted = list(versions)
    if not wanted:
        return {}
    rows = conn.execute(
        select(LearnerStep.version, LearnerStep.metrics).where(LearnerStep.version.in_(wanted))
    )
    out: dict[int, float | None] = {}
    for r in rows:
        value = (r.metrics or {}).get(name)
        out[r.version] = float(value) if isinstance(value, int | float) else None
    return out


def set_step_metric(conn: Connection, version: int, name: str, value: float) -> int:
    """Add (or replace) the metric ``name`` = ``value`` in the metrics of the step that trained
    ``version`` (``learner_steps.metrics``), where ``step_metric`` reads it; returns how many
    step rows were updated (0: ``version`` has no step, e.g. a rollback's)."""
    rows = conn.execute(
        select(LearnerStep.id, LearnerStep.metrics).where(LearnerStep.version == version)
    ).all()
    for r in rows:
        # A new dict: the JSON column is written whole.
        metrics = dict(r.metrics or {}) | {name: value}
        conn.execute(update(LearnerStep).where(LearnerStep.id == r.id).values(metrics=metrics))
    return len(rows)


def quarantine(conn: Connection, by_version: Mapping[int, Iterable[str]], reason: str, at: datetime) -> int:
    """Quarantine the sample ids of ``by_version`` (version → the ids that trained it); returns
    how many were new (an id already quarantined keeps its first row)."""
    rows = {sid: v for v, ids in sorted(by_version.items()) for sid in ids}
    if not rows:
        return 0
    known = set(
        conn.execute(
            select(QuarantinedSample.sample_id).where(QuarantinedSample.sample_id.in_(list(rows)))
        ).scalars()
    )
    new = [
        {"sample_id": s, "version": v, "reason": reason, "at": at} for s, v in rows.items() if s not in known
    ]
    if new:
        conn.execute(insert(QuarantinedSample), new)
    return len(new)


def quarantined(conn: Connection, limit: int) -> tuple[int, list[dict]]:
    """``(total, rows)``: how many samples are quarantined, and the newest ``limit`` of them
    (sample id, version, reason, ISO time)."""
    total = conn.execute(select(func.count()).select_from(QuarantinedSample)).scalar_one()
    rows = conn.execute(
        select(*QuarantinedSample.__table__.columns)
        .order_by(QuarantinedSample.at.desc(), QuarantinedSample.sample_id)
        .limit(limit)
    )
    return total, [
        {"sample_id": r.sample_id, "version": r.version, "reason": r.reason, "at": as_utc(r.at).isoformat()}
        for r in rows
    ]


def events(conn: Connection, limit: int, version: int | None = None) -> list[dict]:
    """The newest ``limit`` transitions (of ``version`` only, when given), newest first."""
    q = select(*VersionStatusEvent.__table__.columns).order_by(VersionStatusEvent.id.desc()).limit(limit)
    if version is not None:
        q = q.where(VersionStatusEvent.version == version)
    return [
        {
            "version": e.version,
            "from_status": e.from_status,
            "to_status": e.to_status,
            "actor": e.actor,
            "reason": e.reason,
            "at": as_utc(e.at).isoformat(),
        }
        for e in conn.execute(q)
    ]
