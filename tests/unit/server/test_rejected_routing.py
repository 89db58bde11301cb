"""A rejected version never serves beyond its share (issue 40 item 3): the router sends a
rejected current version's requests to the promoted version (else the base) from its next read,
with no learner running; a rejection reaches the rejected version's descendants; the learner's
prune keeps every folder the router may need. SQLite and a small stand-in for the engine (the
real engine: tests/integration/test_rejected_serving.py)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from sqlalchemy import insert

from core import lifecycle_store
from core.control import GUARD_PIN, ROLLBACK_TO, set_flag
from core.db import PolicyVersion, make_engine, migrate
from core.lifecycle import Arm, CanarySplit, Stage, descendants, route
from core.policy_store import version_dir, version_dirs
from core.records import utcnow
from learner.publish import prune
from server.canary import CanaryRouter
from server.metrics import ServerMetrics
from testing.fakes import RouterEngine, adapter_folder


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path}/db.sqlite"
    migrate(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def add(conn, version: int, stage: str, parent: int | None, root: Path) -> None:
    """A published version ``version`` at ``root``/v<version> trained from ``parent``."""
    conn.execute(
        insert(PolicyVersion).values(
            version=version,
            path=str(root / f"v{version}"),
            sha256=f"{version:064d}",
            status="published",
            parent_version=parent,
            metrics={},
            created_at=utcnow(),
            lifecycle=stage,
        )
    )


def reject(db, *versions: int) -> None:
    """Record the rejection of ``versions``, as an operator's route or the guard does; no learner
    runs after it."""
    with db.begin() as conn:
        for v in versions:
            lifecycle_store.transition(conn, v, Stage.REJECTED, "alice", "by alice", utcnow())


def test_route_never_dispatches_to_a_rejected_current_version():
    split = CanarySplit(frozenset({6}), 5, 0.2)
    # 0.1 < 0.2 would be the canary arm; 6 is rejected: the fallback, no arm.
    assert route(split, 6, 0.1, frozenset({6}), 5) == (5, None)
    assert route(None, 6, 0.9, frozenset({6}), 5) == (5, None)
    assert route(None, 6, 0.9, frozenset({6}), 0) == (0, None)  # the base
    # Nothing else can serve: the current version, as before.
    assert route(None, 6, 0.9, frozenset({6}), None) == (6, None)
    # A version not rejected is routed as before.
    assert route(split, 6, 0.1, frozenset({4}), 5) == (6, Arm.CANARY)
    assert route(split, 6, 0.2, frozenset({4}), 5) == (5, Arm.CONTROL)


def test_descendants_follow_the_parents_through_rollbacks():
    # 4 is a rollback's version restoring 1 (its parent is 1), 5 trained from 4.
    parents = {0: None, 1: 0, 2: 1, 3: 2, 4: 1, 5: 4}
    assert descendants(parents, 2) == [3]
    assert descendants(parents, 1) == [2, 3, 4, 5]
    assert descendants(parents, 4) == [5]
    assert descendants(parents, 5) == []


def test_an_operators_reject_with_the_learner_down_sends_every_request_to_the_control(db, tmp_path):
    """Lineage [6] on canary, 5 promoted (held). Before the fix the rejection emptied the
    lineage, the router dropped the split, and 50 of 50 requests went to the rejected 6."""
    with db.begin() as conn:
        add(conn, 0, "promoted", None, tmp_path)
        add(conn, 5, "promoted", 0, tmp_path)
        add(conn, 6, "canary", 5, tmp_path)
    adapter_folder(tmp_path, 5)
    engine = RouterEngine(version=6)
    router = CanaryRouter(db, engine, ServerMetrics(), 0.2, rng=random.Random(0))
    asyncio.run(router.refresh())
    assert router.split == CanarySplit(frozenset({6}), 5, 0.2) and engine.held == [5]
    reject(db, 6)
    asyncio.run(router.refresh())
    assert router.split is None and router.held == 5 and engine.unpinned == []
    assert [router.dispatch() for _ in range(50)] == [(5, None)] * 50


def test_rejecting_a_promoted_version_serves_the_newest_promoted_one_left(db, tmp_path):
    """0, 1, 2 promoted; 3, 4 the lineage (3 trained from 2). Rejecting 2 rejects 3 and 4 with
    it (``descendants``); the control is then 1, whose folder the prune kept: 30 of 30 requests
    go to 1 (before the fix: 30 of 30 to the newest descendant, 4)."""
    with db.begin() as conn:
        for v, stage in enumerate(["promoted", "promoted", "promoted", "canary", "canary"]):
            add(conn, v, stage, v - 1 if v else None, tmp_path)
    for v in (1, 2):
        adapter_folder(tmp_path, v)
    engine = RouterEngine(version=4)
    router = CanaryRouter(db, engine, ServerMetrics(), 0.2, rng=random.Random(1))
    asyncio.run(router.refresh())
    assert router.split == CanarySplit(frozenset({3, 4}), 2, 0.2)
    with db.connect() as conn:
        heirs = descendants(lifecycle_store.parents(conn), 2)
    assert heirs == [3, 4]
    reject(db, 2, *heirs)
    asyncio.run(router.refresh())
    assert engine.held == [2, 1] and engine.unpinned == [2] and router.split is None
    assert [router.dispatch() for _ in range(30)] == [(1, None)] * 30


def test_a_control_that_cannot_be_held_leaves_the_base_weights(db, tmp_path):
    """The promoted version's adapter is refused (its files gone): a rejected current version's
    requests go to version 0, the base weights the engine serves under every adapter."""
    with db.begin() as conn:
        add(conn, 0, "promoted", None, tmp_path)
        add(conn, 5, "promoted", 0, tmp_path)
        add(conn, 6, "canary", 5, tmp_path)
    engine = RouterEngine(version=6, refuse=True)
    router = CanaryRouter(db, engine, ServerMetrics(), 0.2, rng=random.Random(0))
    asyncio.run(router.refresh())
    assert router.split is None and router.dispatch() == (6, None)  # not rejected: probation
    reject(db, 6)
    asyncio.run(router.refresh())
    assert [router.dispatch() for _ in range(10)] == [(0, None)] * 10


def test_the_prune_keeps_every_folder_the_router_may_need(db, tmp_path):
    """Folders v1..v12, ``keep_versions`` 2, newest 12. Stages: 0, 2, 4 promoted; 3 rejected; 5
    promoted then rejected; 6..9 rejected (a lineage); 10 promoted (a rollback's version); 11
    canary; 12 rejected (the gate's). Pinned 4, a rollback to 7 requested (it will be refused,
    but its folder is not the prune's to take). Kept: the newest two folders (11, 12), the
    promoted 2, 4, 10, the newest not rejected (11), the pin (4) and the rollback target (7):
    {2, 4, 7, 10, 11, 12}; deleted: 1, 3, 5, 6, 8, 9."""
    stages = {
        0: "promoted",
        1: "promoted",
        2: "promoted",
        3: "rejected",
        4: "promoted",
        5: "rejected",
        6: "rejected",
        7: "rejected",
        8: "rejected",
        9: "rejected",
        10: "promoted",
        11: "canary",
        12: "rejected",
    }
    policies = tmp_path / "policies"
    with db.begin() as conn:
        for v, stage in stages.items():
            add(conn, v, stage, v - 1 if v else None, policies)
    # 1 is rejected later in this story (an operator), after its folder was written.
    reject(db, 1)
    for v in range(1, 13):
        version_dir(policies, v).mkdir(parents=True)
    set_flag(db, GUARD_PIN, "4")
    set_flag(db, ROLLBACK_TO, "7")
    prune(db, policies, keep=2, newest=12)
    assert [v for v, _ in version_dirs(policies)] == [2, 4, 7, 10, 11, 12]
