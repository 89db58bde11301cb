"""The canary share of an engine serving adapters: keep the split in step with the lifecycle.

While the guard's candidate lineage is on canary (core/lifecycle.py), an engine that serves
versions as LoRA adapters (``AdapterServing.ADAPTER``) serves the lineage's newest version (its
current one, loaded by the policy watcher) to a share of new requests and the promoted version
to the rest; each request draws its arm once at dispatch (``core.lifecycle.route``) and is
served by that arm's version from its first token to its last. The promoted version is held
loaded and pinned beside the current one (``PolicyEngine.hold``) while the split lasts, and let
go when the lineage is promoted or rejected.

The router reads the lifecycle from the database (the learner and the admin routes write it)
every ``policy_poll_s``: the lineage, the promoted version and its files, the guard's switches
and the share (the ``canary_share`` control flag, else ``Settings.canary_share``). No split is
in effect when the guard is off, no lineage exists, the engine serves no adapters (merged or
full weights: probation, docs/guard.md), or the promoted version cannot be held (its files
pruned or refused: logged, and the lineage serves all traffic on probation until it can).

A rejected version never gets a new request (issue 40): while the engine's current version is
rejected (an operator's reject, the guard's, a rejection of an ancestor), every new request goes
to the promoted version, held for it, or to the base weights when that cannot be held, whether
or not a learner runs to publish the restore. docs/guard.md, "The canary share" and "Rejecting a
version".
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine

from core import lifecycle_store, policy_store
from core.control import CANARY_SHARE, GUARD_OFF, canary_share_flag
from core.db import ControlFlag, PolicyVersion
from core.lifecycle import Arm, CanarySplit, Stage, lineage, promoted, route, sticky_draw
from core.policies import GLOBAL
from core.policy_store import Layout
from server.engine import PolicyEngine, SwapRefused
from server.metrics import ServerMetrics
from server.policy_log import PolicyLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CanaryPlan:
    """What the database says this engine should serve: the lineage (empty: none), the promoted
    version with its published folder and checksum, the share (None: no split, the guard off or
    no lineage; else ``core.lifecycle.check_canary_share``'s) and the rejected versions."""

    lineage: frozenset[int]
    control: int
    path: Path
    sha256: str
    share: float | None
    rejected: frozenset[int]


def read_plan(db: Engine, default_share: float) -> CanaryPlan | None:
    """The plan the lifecycle asks for, or None (no version recorded).

    A ``canary_share`` flag that is not a share ``core.control.canary_share_flag`` accepts
    (written around the admin route) is ignored for ``default_share``.
    """
    with db.connect() as conn:
        stages = lifecycle_store.stages(conn)
        if not stages:
            return None
        members = lineage(stages)
        top = promoted(stages)
        row = conn.execute(
            select(PolicyVersion.path, PolicyVersion.sha256).where(PolicyVersion.version == top)
        ).one()
        flags = dict(
            conn.execute(
                select(ControlFlag.name, ControlFlag.value).where(
                    ControlFlag.name.in_([GUARD_OFF, CANARY_SHARE])
                )
            ).all()
        )
    rejected = frozenset(v.version for v in stages if v.stage == Stage.REJECTED)
    share = None
    if members and flags.get(GUARD_OFF) != "1":
        stored = canary_share_flag(flags.get(CANARY_SHARE))
        share = default_share if stored is None else stored
    return CanaryPlan(frozenset(members), top, Path(row.path), row.sha256, share, rejected)


class CanaryRouter:
    """The canary split of one engine: ``dispatch`` picks each request's version and arm,
    ``refresh`` follows the database. ``secret`` keys the sticky draws (``sticky_draw``), ``rng``
    draws the arms of requests without a key (seeded in tests); ``policy``
    (``core.policies.GLOBAL`` or a tenant) salts the draws and starts each of its log lines."""

    def __init__(
        self,
        db: Engine,
        engine: PolicyEngine,
        metrics: ServerMetrics,
        default_share: float,
        rng: random.Random | None = None,
        policy: str = GLOBAL,
        secret: str = "",
    ) -> None:
        self.db = db
        self.policy = policy
        self.secret = secret
        self.logger = PolicyLog(log, policy)
        self.engine = engine
        self.metrics = metrics
        self.default_share = default_share
        self.rng = rng or random.Random()
        self.split: CanarySplit | None = None
        self.rejected: frozenset[int] = frozenset()  # versions this router never dispatches to
        self.fallback: int | None = None  # where requests go while the current version is rejected
        self.held: int | None = None  # the control version this router pinned in the engine
        self._refused: int | None = None  # the control version whose hold was last refused
        self._stranded: int | None = None  # the rejected version last logged as unavoidable

    def dispatch(self, key: str | None = None) -> tuple[int, Arm | None]:
        """The version a new request is dispatched at and its arm (None: no split). ``key``
        (``core.lifecycle.arm_key``): the arm is sticky to it within the lineage
        (``sticky_draw``); None draws per request."""
        current = self.engine.version
        if key is not None and self.split is not None:
            draw = sticky_draw(self.secret, f"{self.policy}:{min(self.split.lineage)}", key)
        else:
            draw = self.rng.random()
        version, arm = route(self.split, current, draw, self.rejected, self.fallback)
        if arm is not None:
            self.metrics.canary_requests.labels(str(arm)).inc()
        if current in self.rejected and self.fallback is None and self._stranded != current:
            self._stranded = current
            self.logger.error(
                "version %d is rejected and nothing else can serve (the promoted version cannot "
                "be held, the base weights are rejected): it serves until a version is published",
                current,
            )
        return version, arm

    async def refresh(self) -> None:
        """Read the plan and make the engine match it: hold the promoted version beside the
        current one while a split needs it or the current version is rejected (or let the one
        held go), then set the split and where a rejected version's requests go. Raises what the
        read raises."""
        plan = None
        if self.engine.adapters is not None:
            plan = await asyncio.to_thread(read_plan, self.db, self.default_share)
        base = self.engine.weights_version
        rejected = plan.rejected if plan is not None else frozenset()
        needed = plan is not None and (plan.share is not None or self.engine.version in rejected)
        # The promoted version serves when it is the engine's full weights (the base, version
        # 0, for adapter serving) or its adapter is held.
        servable = needed and plan.control == base
        if needed and not servable:
            servable = self._holds(plan.control) or await self._hold(plan)
        kept = plan.control if servable and plan.control != base else None
        if self.held is not None and self.held != kept:
            self._let_go(self.held)
        self.held = kept
        self.rejected = rejected
        if servable:
            self.fallback = plan.control
        else:
            self.fallback = base if base not in rejected else None
        share = plan.share if plan is not None else None
        self.split = (
            CanarySplit(plan.lineage, plan.control, share) if servable and share is not None else None
        )
        self.metrics.canary_share.set(0.0 if self.split is None else self.split.share)

    async def _hold(self, plan: CanaryPlan) -> bool:
        """Hold the promoted version ``plan.control``; False (logged once per version) when its
        folder holds no adapter or the engine refuses it."""
        try:
            if policy_store.layout(plan.path) is not Layout.ADAPTER:
                raise SwapRefused(f"{plan.path} holds no adapter over the weights this engine serves")
            await self.engine.hold(plan.control, plan.path, plan.sha256)
        except SwapRefused as exc:
            if self._refused != plan.control:
                self.logger.error(
                    "canary: promoted version %d cannot be held, no split (a rejected version's "
                    "requests go to the base weights): %s",
                    plan.control,
                    exc,
                )
            self._refused = plan.control
            return False
        return True

    def _holds(self, version: int) -> bool:
        """Whether this router's hold on ``version`` still stands (loaded and pinned): then a
        refresh neither stats its folder nor takes the engine's swap lock again."""
        adapter = self.engine.adapters.find(version) if self.held == version else None
        return adapter is not None and adapter.pinned

    def release(self) -> None:
        """Let go of the control version this router holds (at the app's shutdown, once its
        tasks are cancelled): an engine that outlives the app (one shared by several apps, as
        the tests' is) keeps no pin of a router that is gone, which would take a slot for good."""
        if self.held is not None:
            self._let_go(self.held)

    def _let_go(self, version: int) -> None:
        self.held = None
        try:
            self.engine.pin(version, pinned=False)
        except KeyError:
            pass  # already removed (a full-weight swap cleared the table)

    async def run(self, poll_s: float) -> None:
        """``refresh`` every ``poll_s`` seconds; a failed read is logged and the split kept."""
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.logger.warning("canary: reading the lifecycle failed, the split is kept: %s", exc)
            await asyncio.sleep(poll_s)
