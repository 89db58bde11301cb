"""``/admin/lifecycle/*`` and ``/admin/quarantine``: the operators' moves of the version lifecycle
(promote, reject, pin, unpin, the guard's switch, the canary share), each recorded with who
(``X-Operator``) and when, and what they read back (the lifecycle, the quarantined samples).
Behind the admin key as every ``/admin`` route (``server.admin.api_router.require_admin``), in the
namespace of the policy ``?policy=`` names. ``saoserve admin`` is their client (the moves:
saoserve/admin/lifecycle.py; the quarantine: saoserve/admin/records.py); docs/guard.md ("The
lifecycle") says what each move does."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from core import lifecycle_store
from core.control import (
    CANARY_SHARE,
    GUARD_OFF,
    GUARD_PIN,
    canary_share_flag,
    flag_value,
    get_flag,
    write_flag,
)
from core.lifecycle import (
    Stage,
    TransitionError,
    descendants,
    lineage,
    promoted,
)
from core.limits import NAME_CHARS
from core.records import POLICY_KEY, TOPIC_POLICY, utcnow
from server.admin.api_router import ADMIN_ERRORS, POLICY_ERRORS, require_admin
from server.admin.protocol import (
    CanaryShare,
    CanaryShareSet,
    GuardSwitch,
    GuardSwitched,
    LifecycleState,
    Quarantine,
    Unpinned,
    VersionAction,
    VersionPinned,
    VersionsMoved,
)
from server.errors import ApiError, errors
from server.scope import PolicyState
from server.state import ServerState

log = logging.getLogger(__name__)

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])

OPERATOR_HEADER = "x-operator"
"""Who the operator is (the admin key names no one): recorded with each lifecycle action."""

LIFECYCLE_ERRORS = ADMIN_ERRORS | errors(404, 409)


def operator_of(request: Request) -> str:
    """The ``X-Operator`` header (1–64 printable characters), ``operator`` when absent; 400
    otherwise."""
    name = request.headers.get(OPERATOR_HEADER)
    if name is None:
        return "operator"
    name = name.strip()
    if not name or len(name) > NAME_CHARS or not name.isprintable():
        raise ApiError(400, "X-Operator must be 1 to 64 printable characters", param="X-Operator")
    return name


def _move(conn, version: int, target: Stage, actor: str, reason: str, now) -> list[int]:
    """In the caller's transaction, move ``version`` to ``target`` by ``actor``; returns the
    versions moved, oldest first. 404 unknown, 409 a move not allowed or one another writer
    recorded first (``core.lifecycle_store.transition`` is a compare-and-set).

    Promoting a version promotes the versions of its lineage before it too, as the guard does.
    Rejecting a version rejects its descendants with it, whatever their stage
    (``core.lifecycle.descendants``; docs/guard.md, "Rejecting a version")."""
    st = lifecycle_store.stages(conn)
    stage_of = {v.version: v.stage for v in st}
    if version not in stage_of:
        raise ApiError(404, f"no policy version {version}", code="not_found", param="version")
    why = reason or f"by {actor}"
    moves = [(version, why)]
    if target == Stage.PROMOTED and version in lineage(st):
        moves = [(v, why) for v in lineage(st) if v <= version]
    elif target == Stage.REJECTED and stage_of[version] != Stage.REJECTED:
        heir = f"descends from version {version}, rejected by {actor}" + (f": {reason}" if reason else "")
        moves += [
            (v, heir)
            for v in descendants(lifecycle_store.parents(conn), version)
            if stage_of.get(v) != Stage.REJECTED
        ]
    try:
        for v, why_v in moves:
            lifecycle_store.transition(conn, v, target, actor, why_v, now)
    except TransitionError as exc:
        raise ApiError(409, str(exc), code="transition_refused", param="version") from None
    return [v for v, _ in moves]


def _operator_transition(db, version: int, target: Stage, actor: str, reason: str) -> dict:
    """``_move`` in a transaction of its own. A rejection that reaches the pinned version lifts
    the pin in the same transaction (a pin holds a promoted version; a rejected one never serves
    again), so a pin and a reject racing end the same whichever commits first."""
    with db.begin() as conn:
        moved = _move(conn, version, target, actor, reason, utcnow())
        # Read after the moves: they hold the rows' locks, so a pin committed meanwhile is seen.
        pinned = flag_value(conn, GUARD_PIN) if target == Stage.REJECTED else None
        if pinned in {str(v) for v in moved}:
            write_flag(conn, GUARD_PIN, None)
            _note(conn, actor, f"unpinned: the pinned version {pinned} is rejected")
    return {"versions": moved, "lifecycle": str(target), "actor": actor}


def _note(conn, actor: str, reason: str, version: int | None = None) -> None:
    """Record an operator's switch (pin, guard, share) as an event on ``version`` (default: the
    promoted version), its stage unchanged, in the caller's transaction (the one that writes the
    switch's flag, so the events are in the order the flag took its values)."""
    st = lifecycle_store.stages(conn)
    if not st:
        return  # no version recorded yet (a fresh database): nothing to attach the note to
    v = promoted(st) if version is None else version
    stage = next((x.stage for x in st if x.version == v), None)
    if stage is not None:
        lifecycle_store.record_event(conn, v, stage, stage, actor, reason, utcnow())


def _switch(db, name: str, value: str | None, actor: str, reason: str) -> None:
    """Write the flag ``name`` (one upsert; None clears it) and its note in one transaction:
    two operators switching at once both succeed, the flag holds the last one's value and the
    last note says so."""
    with db.begin() as conn:
        write_flag(conn, name, value)
        _note(conn, actor, reason)


async def _announce_moves(s, versions: list[int], stage: Stage, actor: str) -> bool:
    """Append the policy topic's stage notices of an operator's move (committed already);
    returns whether they went out. A log that refuses them is logged, not answered as an
    error: the move stands, and a notice changes nothing served."""

    def read() -> list:
        with s.store.engine.connect() as conn:
            return lifecycle_store.stage_events(conn, versions, stage, actor)

    try:
        for e in await asyncio.to_thread(read):
            await s.append(TOPIC_POLICY, POLICY_KEY, e.to_json())
    except Exception as exc:
        log.warning("stage notices of versions %s (%s) not sent: %s", versions, stage, exc)
        return False
    return True


async def _follow_now(s: ServerState) -> None:
    """Make this replica's canary router follow a move at once (a rejected version's requests go
    to the control from this instant on; other replicas follow at their next read,
    ``policy_poll_s``). A failed read is logged: the router's own loop reads again."""
    if s.canary is None:
        return
    try:
        await s.canary.refresh()
    except Exception as exc:
        log.warning("canary: reading the lifecycle after an operator's move failed: %s", exc)


async def _operator_move(request: Request, s: ServerState, version: int, target: Stage, reason: str) -> dict:
    who = operator_of(request)
    moved = await asyncio.to_thread(_operator_transition, s.store.engine, version, target, who, reason)
    await _follow_now(s)
    return moved | {"announced": await _announce_moves(s, moved["versions"], target, who)}


@router.post("/lifecycle/promote", response_model=VersionsMoved, responses=LIFECYCLE_ERRORS | errors(413))
async def admin_promote(body: VersionAction, request: Request, s: PolicyState) -> dict:
    """Promote a candidate or canary version (and the lineage before it): 404 unknown, 409 a
    move the lifecycle does not allow (a rejected version never serves again). ``announced``:
    whether the policy topic's stage notices went out."""
    return await _operator_move(request, s, body.version, Stage.PROMOTED, body.reason)


@router.post("/lifecycle/reject", response_model=VersionsMoved, responses=LIFECYCLE_ERRORS | errors(413))
async def admin_reject(body: VersionAction, request: Request, s: PolicyState) -> dict:
    """Reject a version and its descendants (the versions trained from it, whatever their
    stage): none of them serves again. On replicas that serve adapters, their new requests go to
    the newest promoted version left (this replica's at once, the others' at their next read);
    the learner, when it runs, publishes that version's weights as a new version and quarantines
    the samples that trained the rejected ones. A pin of a rejected version is lifted. 404
    unknown, 409 already rejected, version 0, or moved by another writer first."""
    return await _operator_move(request, s, body.version, Stage.REJECTED, body.reason)


@router.post("/lifecycle/pin", response_model=VersionPinned, responses=LIFECYCLE_ERRORS | errors(413))
async def admin_pin(body: VersionAction, request: Request, s: PolicyState) -> dict:
    """Pin ``version`` (promoted first if it is a candidate or canary): the guard decides nothing
    by itself until ``unpin``. Pinning a version older than the promoted one does not make it
    the promoted one or serve it (``/admin/rollback`` does). 404 unknown, 409 rejected."""
    who = operator_of(request)

    def pin() -> dict:
        now = utcnow()
        with s.store.engine.begin() as conn:
            stage = {v.version: v.stage for v in lifecycle_store.stages(conn)}.get(body.version)
            if stage is None:
                raise ApiError(404, f"no policy version {body.version}", code="not_found", param="version")
            if stage == Stage.REJECTED:
                raise ApiError(
                    409,
                    f"version {body.version} is rejected: it never serves again",
                    code="transition_refused",
                )
            moved = []
            if stage != Stage.PROMOTED:
                moved = _move(conn, body.version, Stage.PROMOTED, who, body.reason or "pinned", now)
            else:
                try:
                    # Hold it promoted until the flag is written: a reject waits for this commit.
                    lifecycle_store.confirm_stage(conn, body.version, Stage.PROMOTED)
                except TransitionError as exc:
                    raise ApiError(409, str(exc), code="transition_refused", param="version") from None
            write_flag(conn, GUARD_PIN, str(body.version))
            _note(conn, who, body.reason or "pinned: the guard decides nothing by itself", body.version)
        return {"pinned": body.version, "actor": who, "promoted": moved}

    done = await asyncio.to_thread(pin)
    await _follow_now(s)
    return done | {"announced": await _announce_moves(s, done["promoted"], Stage.PROMOTED, who)}


@router.post("/lifecycle/unpin", response_model=Unpinned, responses=POLICY_ERRORS)
async def admin_unpin(request: Request, s: PolicyState) -> dict:
    """Let the guard decide again."""
    who = operator_of(request)

    def unpin() -> dict:
        _switch(s.store.engine, GUARD_PIN, None, who, "unpinned: the guard decides again")
        return {"pinned": None, "actor": who}

    return await asyncio.to_thread(unpin)


@router.post("/lifecycle/guard", response_model=GuardSwitched, responses=POLICY_ERRORS)
async def admin_guard(body: GuardSwitch, request: Request, s: PolicyState) -> dict:
    """Turn the guard on or off (off: no gate, every new version promoted when recorded)."""
    who = operator_of(request)

    def switch() -> dict:
        _switch(
            s.store.engine,
            GUARD_OFF,
            None if body.on else "1",
            who,
            f"guard turned {'on' if body.on else 'off'}",
        )
        return {"guard": "on" if body.on else "off", "actor": who}

    return await asyncio.to_thread(switch)


def serving_mode(s) -> str:
    """``canary`` when this replica's engine serves adapters (a canary share splits the traffic),
    else ``probation`` (a single full-weight engine: the newest version serves all of it)."""
    return "canary" if s.engine.adapters is not None else "probation"


@router.post("/lifecycle/canary", response_model=CanaryShareSet, responses=POLICY_ERRORS)
async def admin_canary(body: CanaryShare, request: Request, s: PolicyState) -> dict:
    """Set the canary share: the share of new requests the candidate lineage gets on replicas
    that serve adapters (from their next read of the lifecycle, ``policy_poll_s``). A replica
    with a full-weight engine has no canary: the newest version serves all traffic on
    probation, and the share is only stored."""
    who = operator_of(request)
    mode = serving_mode(s)

    def store() -> dict:
        stored = "" if mode == "canary" else " (stored; probation mode has no share)"
        _switch(
            s.store.engine, CANARY_SHARE, repr(body.share), who, f"canary share set to {body.share:g}{stored}"
        )
        message = (
            f"new requests go to the candidate lineage with probability {body.share:g}, to the "
            "promoted version otherwise"
            if mode == "canary"
            else "a single full-weight engine has no canary share: each new version serves all "
            "traffic on probation; the share is stored for adapter deployments"
        )
        return {
            "canary_share": body.share,
            "mode": mode,
            "applied": mode == "canary",
            "message": message,
            "actor": who,
        }

    return await asyncio.to_thread(store)


@router.get("/lifecycle", response_model=LifecycleState, responses=POLICY_ERRORS)
async def admin_lifecycle(s: PolicyState, limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict:
    """The promoted version, the lineage under watch, the guard's switches, this replica's
    canary split (``split``: lineage, control version and share; None when none is in effect)
    and the newest ``limit`` transitions (who and when)."""
    db = s.store.engine
    split = s.canary.split if s.canary is not None else None

    def read() -> dict:
        with db.connect() as conn:
            st = lifecycle_store.stages(conn)
            recent = lifecycle_store.events(conn, limit)
        pin, share = get_flag(db, GUARD_PIN), get_flag(db, CANARY_SHARE)
        return {
            "mode": serving_mode(s),
            "guard": "off" if get_flag(db, GUARD_OFF) == "1" else "on",
            "promoted": promoted(st) if st else None,
            "lineage": lineage(st) if st else [],
            "pinned": None if pin is None else int(pin),
            "canary_share": canary_share_flag(share),
            "split": None
            if split is None
            else {"lineage": sorted(split.lineage), "control": split.control, "share": split.share},
            "events": recent,
        }

    return await asyncio.to_thread(read)


@router.get("/quarantine", response_model=Quarantine, responses=POLICY_ERRORS)
async def admin_quarantine(s: PolicyState, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict:
    """The samples that trained a rejected version, which the learner never trains again:
    ``total`` and the newest ``limit``."""
    db = s.store.engine

    def read() -> dict:
        with db.connect() as conn:
            total, rows = lifecycle_store.quarantined(conn, limit)
        return {"total": total, "samples": rows}

    return await asyncio.to_thread(read)
