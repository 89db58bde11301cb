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
docs/guard.md, "The canary share".
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
from core.lifecycle import Arm, CanarySplit, lineage, promoted, route
from core.policies import GLOBAL
from core.policy_store import Layout
from server.engine import PolicyEngine, SwapRefused
from server.metrics import ServerMetrics
from server.policy_log import PolicyLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CanaryPlan:
    """What the database says a split should be: the lineage, the promoted version with its
    published folder and checksum, and the share (``core.lifecycle.check_canary_share``)."""

    lineage: frozenset[int]
    control: int
    path: Path
    sha256: str
    share: float


def read_plan(db: Engine, default_share: float) -> CanaryPlan | None:
    """The split the lifecycle asks for, or None (the guard off, no lineage, no versions).

    A ``canary_share`` flag that is not a share ``core.control.canary_share_flag`` accepts
    (written around the admin route) is ignored for ``default_share``.
    """
    with db.connect() as conn:
        stages = lifecycle_store.stages(conn)
        members = lineage(stages) if stages else []
        if not members:
            return None
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
    if flags.get(GUARD_OFF) == "1":
        return None
    stored = canary_share_flag(flags.get(CANARY_SHARE))
    share = default_share if stored is None else stored
    return CanaryPlan(frozenset(members), top, Path(row.path), row.sha256, share)


class CanaryRouter:
    """The canary split of one engine: ``dispatch`` picks each request's version and arm,
    ``refresh`` follows the database. ``rng`` draws the arms (seeded in tests); ``policy``
    (``core.policies.GLOBAL`` or a tenant) starts each of its log lines."""

    def __init__(
        self,
        db: Engine,
        engine: PolicyEngine,
        metrics: ServerMetrics,
        default_share: float,
        rng: random.Random | None = None,
        policy: str = GLOBAL,
    ) -> None:
        self.db = db
        self.logger = PolicyLog(log, policy)
        self.engine = engine
        self.metrics = metrics
        self.default_share = default_share
        self.rng = rng or random.Random()
        self.split: CanarySplit | None = None
        self.held: int | None = None  # the control version this router pinned in the engine
        self._refused: int | None = None  # the control version whose hold was last refused

    def dispatch(self) -> tuple[int, Arm | None]:
        """The version a new request is dispatched at and its arm (None: no split)."""
        version, arm = route(self.split, self.engine.version, self.rng.random())
        if arm is not None:
            self.metrics.canary_requests.labels(str(arm)).inc()
        return version, arm

    async def refresh(self) -> None:
        """Read the plan and make the engine match it: hold the promoted version beside the
        lineage (or let the one held go), then set the split. Raises what the read raises."""
        plan = None
        if self.engine.adapters is not None:
            plan = await asyncio.to_thread(read_plan, self.db, self.default_share)
        control = plan.control if plan is not None else None
        if control is not None and control != self.engine.weights_version and not self._holds(control):
            try:
                if policy_store.layout(plan.path) is not Layout.ADAPTER:
                    raise SwapRefused(f"{plan.path} holds no adapter over the weights this engine serves")
                await self.engine.hold(control, plan.path, plan.sha256)
            except SwapRefused as exc:
                if self._refused != control:
                    self.logger.error(
                        "canary: promoted version %d cannot be held, no split: %s", control, exc
                    )
                self._refused = control
                control = None
        if self.held is not None and self.held != control:
            self._let_go(self.held)
        if control is not None and control != self.engine.weights_version:
            self.held = control
        self.split = None if control is None else CanarySplit(plan.lineage, control, plan.share)
        self.metrics.canary_share.set(0.0 if self.split is None else self.split.share)

    def _holds(self, version: int) -> bool:
        """Whether this router's hold on ``version`` still stands (loaded and pinned): then a
        refresh neither stats its folder nor takes the engine's swap lock again."""
        adapter = self.engine.adapters.find(version) if self.held == version else None
        return adapter is not None and adapter.pinned

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
