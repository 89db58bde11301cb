"""The version lifecycle's handling for its routes (``server.admin.lifecycle_router``): who the
operator is, the moves and switches written in one transaction each (``core.lifecycle_store``),
their stage notices on the policy topic, and what the routes read back."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from sqlalchemy.engine import Engine

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
from core.lifecycle import CanarySplit, Stage, TransitionError, descendants, lineage, promoted
from core.limits import NAME_CHARS
from core.records import POLICY_KEY, TOPIC_POLICY, utcnow
from server.errors import ApiError
from server.state import ServerState

log = logging.getLogger(__name__)


OPERATOR_HEADER = "x-operator"
"""Who the operator is (the admin key names no one): recorded with each lifecycle action."""


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


def move(conn, version: int, target: Stage, actor: str, reason: str, now) -> list[int]:
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


def operator_transition(db, version: int, target: Stage, actor: str, reason: str) -> dict:
    """``move`` in a transaction of its own. A rejection that reaches the pinned version lifts
    the pin in the same transaction (a pin holds a promoted version; a rejected one never serves
    again), so a pin and a reject racing end the same whichever commits first."""
    with db.begin() as conn:
        moved = move(conn, version, target, actor, reason, utcnow())
        # Read after the moves: they hold the rows' locks, so a pin committed meanwhile is seen.
        pinned = flag_value(conn, GUARD_PIN) if target == Stage.REJECTED else None
        if pinned in {str(v) for v in moved}:
            write_flag(conn, GUARD_PIN, None)
            note(conn, actor, f"unpinned: the pinned version {pinned} is rejected")
    return {"versions": moved, "lifecycle": str(target), "actor": actor}


def note(conn, actor: str, reason: str, version: int | None = None) -> None:
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


def switch(db, name: str, value: str | None, actor: str, reason: str) -> None:
    """Write the flag ``name`` (one upsert; None clears it) and its note in one transaction:
    two operators switching at once both succeed, the flag holds the last one's value and the
    last note says so."""
    with db.begin() as conn:
        write_flag(conn, name, value)
        note(conn, actor, reason)


async def announce_moves(s, versions: list[int], stage: Stage, actor: str) -> bool:
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


async def follow_now(s: ServerState) -> None:
    """Make this replica's canary router follow a move at once (a rejected version's requests go
    to the control from this instant on; other replicas follow at their next read,
    ``policy_poll_s``). A failed read is logged: the router's own loop reads again."""
    if s.canary is None:
        return
    try:
        await s.canary.refresh()
    except Exception as exc:
        log.warning("canary: reading the lifecycle after an operator's move failed: %s", exc)


async def operator_move(request: Request, s: ServerState, version: int, target: Stage, reason: str) -> dict:
    """Move ``version`` of ``s``'s policy to ``target`` as the request's operator says
    (``operator_transition``), have this replica's canary router follow, announce the moves."""
    who = operator_of(request)
    moved = await asyncio.to_thread(operator_transition, s.store.engine, version, target, who, reason)
    await follow_now(s)
    return moved | {"announced": await announce_moves(s, moved["versions"], target, who)}


def serving_mode(s) -> str:
    """``canary`` when this replica's engine serves adapters (a canary share splits the traffic),
    else ``probation`` (a single full-weight engine: the newest version serves all of it)."""
    return "canary" if s.engine.adapters is not None else "probation"


def pin_version(db: Engine, version: int, who: str, reason: str) -> dict:
    """Pin ``version`` by ``who`` in one transaction (promoted first if it is a candidate or
    canary): 404 unknown, 409 rejected, or moved by another writer first. Returns the answer
    of ``/admin/lifecycle/pin`` less ``announced``."""
    now = utcnow()
    with db.begin() as conn:
        stage = {v.version: v.stage for v in lifecycle_store.stages(conn)}.get(version)
        if stage is None:
            raise ApiError(404, f"no policy version {version}", code="not_found", param="version")
        if stage == Stage.REJECTED:
            raise ApiError(
                409,
                f"version {version} is rejected: it never serves again",
                code="transition_refused",
            )
        moved = []
        if stage != Stage.PROMOTED:
            moved = move(conn, version, Stage.PROMOTED, who, reason or "pinned", now)
        else:
            try:
                # Hold it promoted until the flag is written: a reject waits for this commit.
                lifecycle_store.confirm_stage(conn, version, Stage.PROMOTED)
            except TransitionError as exc:
                raise ApiError(409, str(exc), code="transition_refused", param="version") from None
        write_flag(conn, GUARD_PIN, str(version))
        note(conn, who, reason or "pinned: the guard decides nothing by itself", version)
    return {"pinned": version, "actor": who, "promoted": moved}


def set_canary_share(db: Engine, share: float, who: str, mode: str) -> dict:
    """Store the canary ``share`` by ``who`` (``switch``); the answer of
    ``/admin/lifecycle/canary`` for a replica in ``mode`` (``serving_mode``)."""
    stored = "" if mode == "canary" else " (stored; probation mode has no share)"
    switch(db, CANARY_SHARE, repr(share), who, f"canary share set to {share:g}{stored}")
    message = (
        f"new requests go to the candidate lineage with probability {share:g}, to the "
        "promoted version otherwise"
        if mode == "canary"
        else "a single full-weight engine has no canary share: each new version serves all "
        "traffic on probation; the share is stored for adapter deployments"
    )
    return {
        "canary_share": share,
        "mode": mode,
        "applied": mode == "canary",
        "message": message,
        "actor": who,
    }


def lifecycle_state(db: Engine, mode: str, split: CanarySplit | None, limit: int) -> dict:
    """The answer of ``GET /admin/lifecycle``: the replica's ``mode`` and canary ``split``, the
    promoted version, the lineage, the guard's switches and the newest ``limit`` transitions."""
    with db.connect() as conn:
        st = lifecycle_store.stages(conn)
        recent = lifecycle_store.events(conn, limit)
    pin, share = get_flag(db, GUARD_PIN), get_flag(db, CANARY_SHARE)
    return {
        "mode": mode,
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


def quarantine(db: Engine, limit: int) -> dict:
    """The answer of ``GET /admin/quarantine``: ``total`` quarantined samples and the newest
    ``limit``."""
    with db.connect() as conn:
        total, rows = lifecycle_store.quarantined(conn, limit)
    return {"total": total, "samples": rows}
