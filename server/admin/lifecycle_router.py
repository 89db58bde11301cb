"""``/admin/lifecycle/*`` and ``/admin/quarantine``: the operators' moves of the version lifecycle
(promote, reject, pin, unpin, the guard's switch, the canary share), each recorded with who
(``X-Operator``) and when, and what they read back (the lifecycle, the quarantined samples).
Behind the admin key as every ``/admin`` route (``server.admin.api_router.require_admin``), in the
namespace of the policy ``?policy=`` names. ``saoserve admin`` is their client (the moves:
saoserve/admin/lifecycle.py; the quarantine: saoserve/admin/records.py); docs/guard.md ("The
lifecycle") says what each move does."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from core.control import GUARD_OFF, GUARD_PIN
from core.lifecycle import Stage
from server.admin.api_router import ADMIN_ERRORS, POLICY_ERRORS, require_admin
from server.admin.lifecycle import (
    announce_moves,
    follow_now,
    lifecycle_state,
    operator_move,
    operator_of,
    pin_version,
    quarantine,
    serving_mode,
    set_canary_share,
    switch,
)
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
from server.errors import errors
from server.scope import PolicyState

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])

LIFECYCLE_ERRORS = ADMIN_ERRORS | errors(404, 409)


@router.post("/lifecycle/promote", response_model=VersionsMoved, responses=LIFECYCLE_ERRORS | errors(413))
async def admin_promote(body: VersionAction, request: Request, s: PolicyState) -> dict:
    """Promote a candidate or canary version (and the lineage before it): 404 unknown, 409 a
    move the lifecycle does not allow (a rejected version never serves again). ``announced``:
    whether the policy topic's stage notices went out."""
    return await operator_move(request, s, body.version, Stage.PROMOTED, body.reason)


@router.post("/lifecycle/reject", response_model=VersionsMoved, responses=LIFECYCLE_ERRORS | errors(413))
async def admin_reject(body: VersionAction, request: Request, s: PolicyState) -> dict:
    """Reject a version and its descendants (the versions trained from it, whatever their
    stage): none of them serves again. On replicas that serve adapters, their new requests go to
    the newest promoted version left (this replica's at once, the others' at their next read);
    the learner, when it runs, publishes that version's weights as a new version and quarantines
    the samples that trained the rejected ones. A pin of a rejected version is lifted. 404
    unknown, 409 already rejected, version 0, or moved by another writer first."""
    return await operator_move(request, s, body.version, Stage.REJECTED, body.reason)


@router.post("/lifecycle/pin", response_model=VersionPinned, responses=LIFECYCLE_ERRORS | errors(413))
async def admin_pin(body: VersionAction, request: Request, s: PolicyState) -> dict:
    """Pin ``version`` (promoted first if it is a candidate or canary): the guard decides nothing
    by itself until ``unpin``. Pinning a version older than the promoted one does not make it
    the promoted one or serve it (``/admin/rollback`` does). 404 unknown, 409 rejected."""
    who = operator_of(request)
    done = await asyncio.to_thread(pin_version, s.store.engine, body.version, who, body.reason)
    await follow_now(s)
    return done | {"announced": await announce_moves(s, done["promoted"], Stage.PROMOTED, who)}


@router.post("/lifecycle/unpin", response_model=Unpinned, responses=POLICY_ERRORS)
async def admin_unpin(request: Request, s: PolicyState) -> dict:
    """Let the guard decide again."""
    who = operator_of(request)
    await asyncio.to_thread(switch, s.store.engine, GUARD_PIN, None, who, "unpinned: the guard decides again")
    return {"pinned": None, "actor": who}


@router.post("/lifecycle/guard", response_model=GuardSwitched, responses=POLICY_ERRORS)
async def admin_guard(body: GuardSwitch, request: Request, s: PolicyState) -> dict:
    """Turn the guard on or off (off: no gate, every new version promoted when recorded)."""
    who = operator_of(request)
    value, said = (None, "on") if body.on else ("1", "off")
    await asyncio.to_thread(switch, s.store.engine, GUARD_OFF, value, who, f"guard turned {said}")
    return {"guard": said, "actor": who}


@router.post("/lifecycle/canary", response_model=CanaryShareSet, responses=POLICY_ERRORS)
async def admin_canary(body: CanaryShare, request: Request, s: PolicyState) -> dict:
    """Set the canary share: the share of new requests the candidate lineage gets on replicas
    that serve adapters (from their next read of the lifecycle, ``policy_poll_s``). A replica
    with a full-weight engine has no canary: the newest version serves all traffic on
    probation, and the share is only stored."""
    return await asyncio.to_thread(
        set_canary_share, s.store.engine, body.share, operator_of(request), serving_mode(s)
    )


@router.get("/lifecycle", response_model=LifecycleState, responses=POLICY_ERRORS)
async def admin_lifecycle(s: PolicyState, limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict:
    """The promoted version, the lineage under watch, the guard's switches, this replica's
    canary split (``split``: lineage, control version and share; None when none is in effect)
    and the newest ``limit`` transitions (who and when)."""
    split = s.canary.split if s.canary is not None else None
    return await asyncio.to_thread(lifecycle_state, s.store.engine, serving_mode(s), split, limit)


@router.get("/quarantine", response_model=Quarantine, responses=POLICY_ERRORS)
async def admin_quarantine(s: PolicyState, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> dict:
    """The samples that trained a rejected version, which the learner never trains again:
    ``total`` and the newest ``limit``."""
    return await asyncio.to_thread(quarantine, s.store.engine, limit)
