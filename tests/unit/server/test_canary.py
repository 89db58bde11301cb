"""The canary share: routing each request to an arm (core.lifecycle.route), the arms in the
trajectory index (core.lifecycle_store.rated_rewards), the held control adapter
(server.adapters) and the router that follows the lifecycle in the database (server.canary).
The real engine's side is tests/integration/test_engine_adapters.py; the learner's verdict on the arms is
tests/unit/learner/test_lifecycle_learner.py."""

from __future__ import annotations

import asyncio
import random
import re
from datetime import timedelta
from pathlib import Path

import pytest

from core.control import CANARY_SHARE, GUARD_OFF, canary_share_flag, set_flag
from core.db import PolicyVersion, make_engine, migrate
from core.lifecycle import (
    CANARY_SHARE_MAX,
    CANARY_SHARE_MIN,
    Arm,
    CanarySplit,
    check_canary_share,
    healthy,
    route,
)
from core.lifecycle_store import answer_health, rated_rewards
from core.records import utcnow
from core.settings import Settings
from server.adapters import AdapterTable
from server.canary import CanaryRouter, read_plan
from server.metrics import ServerMetrics
from testing.fakes import RouterEngine, adapter_folder
from testing.guard import add_rated
from testing.guard import add_version as lifecycle_version

SPLIT = CanarySplit(lineage=frozenset({6, 7}), control=5, share=0.2)
BOUNDS = re.escape("share must be a number in [0.01, 0.99]")


def test_route_sends_draws_below_the_share_to_the_lineage_and_the_rest_to_control():
    assert route(SPLIT, 7, 0.0) == (7, Arm.CANARY)
    assert route(SPLIT, 7, 0.1999) == (7, Arm.CANARY)
    assert route(SPLIT, 7, 0.2) == (5, Arm.CONTROL)  # draw < share is strict
    assert route(SPLIT, 6, 0.9) == (5, Arm.CONTROL)  # the engine has not loaded 7 yet
    # The engine moved past the lineage (a promotion or rollback the split has not read yet):
    # every request gets the engine's version, no arm.
    assert route(SPLIT, 8, 0.0) == (8, None)
    assert route(None, 3, 0.5) == (3, None)
    # At the bounds each arm keeps its 1% of the draws in [0, 1).
    top, bottom = CanarySplit(frozenset({2}), 0, 0.99), CanarySplit(frozenset({2}), 0, 0.01)
    assert (route(top, 2, 0.9899), route(top, 2, 0.99)) == ((2, Arm.CANARY), (0, Arm.CONTROL))
    assert (route(bottom, 2, 0.0099), route(bottom, 2, 0.01)) == ((2, Arm.CANARY), (0, Arm.CONTROL))


@pytest.mark.parametrize("draw", [-0.1, 1.0, float("nan")])
def test_route_refuses_a_draw_outside_the_unit_interval(draw):
    with pytest.raises(ValueError, match="a draw is in"):
        route(SPLIT, 7, draw)


@pytest.mark.parametrize(
    "lineage, control, share, message",
    [
        ({6}, 5, 0.0, BOUNDS),
        ({6}, 5, 5e-324, BOUNDS),  # no arm collects min_samples ratings at that share
        ({6}, 5, 0.0099, BOUNDS),
        ({6}, 5, 1.0, BOUNDS),  # every draw is below 1: the control arm gets nothing
        ({6}, 5, 1.5, BOUNDS),
        ({6}, 5, float("nan"), BOUNDS),
        ({6}, 5, float("inf"), BOUNDS),
        ({6}, 5, True, BOUNDS),
        (set(), 5, 0.2, "needs a lineage"),
        ({5, 6}, 5, 0.2, "the control version 5 is in the lineage"),
    ],
)
def test_a_split_refuses_what_cannot_be_one(lineage, control, share, message):
    with pytest.raises(ValueError, match=message):
        CanarySplit(frozenset(lineage), control, share)


@pytest.mark.parametrize("share", [0.0, 5e-324, 0.0099, 0.991, 1.0, float("nan"), float("inf"), -0.5])
def test_one_bound_holds_the_share_at_every_entry(share):
    """The setting, the control flag and the split all take the one check of core.lifecycle."""
    with pytest.raises(ValueError, match=BOUNDS):
        check_canary_share(share)
    with pytest.raises(ValueError, match=re.escape("canary_share must be a number in [0.01, 0.99]")):
        Settings(canary_share=share)
    with pytest.raises(ValueError, match="canary_share must be a number"):
        Settings(canary_share=str(share))  # as SAOSERVE_CANARY_SHARE gives it
    assert canary_share_flag(repr(share)) is None


def test_the_bounds_themselves_are_shares():
    assert (CANARY_SHARE_MIN, CANARY_SHARE_MAX) == (0.01, 0.99)
    for share in (CANARY_SHARE_MIN, 0.2, CANARY_SHARE_MAX):
        assert check_canary_share(share) == Settings(canary_share=share).canary_share == share
        assert canary_share_flag(repr(share)) == share
    assert canary_share_flag(None) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("share", [0.1, 0.2, 0.5])
def test_the_share_holds_within_three_points_over_a_thousand_requests(seed, share):
    # Binomial(1000, share): σ ≤ √(1000·0.25) ≈ 15.8 requests, so ±30 (3 points) is ≥ 1.9σ.
    rng = random.Random(seed)
    split = CanarySplit(frozenset({7}), 5, share)
    arms = [route(split, 7, rng.random())[1] for _ in range(1000)]
    canary = arms.count(Arm.CANARY)
    assert canary + arms.count(Arm.CONTROL) == 1000
    assert abs(canary - 1000 * share) <= 30


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def add_version(conn, version: int, lifecycle: str, root: str = "/p") -> None:
    """``tests.test_lifecycle.add_version`` with a checksum per version (``0…0<version>``)."""
    lifecycle_version(conn, version, lifecycle, root=root, sha256=f"{version:064d}")


def test_rated_rewards_of_one_arm_since_the_lineage_started(db):
    t0 = utcnow()
    with db.begin() as conn:
        add_rated(conn, "old", 5, 1.0, t0 - timedelta(seconds=10), arm="control")  # an earlier split
        add_rated(conn, "a", 5, 1.0, t0, arm="control")
        add_rated(conn, "b", 6, 0.0, t0 + timedelta(seconds=1), arm="canary")
        add_rated(conn, "c", 5, 0.0, t0 + timedelta(seconds=2), arm="control")
        add_rated(conn, "d", 6, 1.0, t0 + timedelta(seconds=3))  # probation: no arm
    with db.connect() as conn:
        assert rated_rewards(conn, [6], arm=Arm.CANARY) == [0.0]  # b (d has no arm)
        assert rated_rewards(conn, [5], arm=Arm.CONTROL, since=t0) == [1.0, 0.0]  # a, c; not old
        assert rated_rewards(conn, [5], arm=Arm.CONTROL) == [1.0, 1.0, 0.0]
        assert rated_rewards(conn, [5, 6], since=t0 + timedelta(seconds=1)) == [0.0, 0.0, 1.0]  # b, c, d


def test_a_held_adapter_is_pinned_never_current_and_let_go_by_unpinning():
    table = AdapterTable(3)
    cur, _ = table.loaded(table.reserve(), 7, Path("/a7"), "7")
    held, removable = table.loaded(table.reserve(), 5, Path("/a5"), "5", hold=True)
    assert table.current is cur and held.pinned and removable == []
    # A request dispatched at the control version is served by the held adapter.
    assert table.acquire(5) is held and held.users == 1
    assert table.release(held) == []  # still pinned
    assert table.pin(5, pinned=False) == [held]  # unused, not current, not pinned: removable
    # A held load of a version newer than the current one still never becomes current.
    newer, _ = table.loaded(table.reserve(), 9, Path("/a9"), "9", hold=True)
    assert table.current is cur and newer.pinned


def test_read_plan_follows_the_lineage_the_guard_switch_and_the_share_flag(db):
    assert read_plan(db, 0.2) is None  # no versions
    with db.begin() as conn:
        add_version(conn, 0, "promoted")
        add_version(conn, 5, "promoted")
        add_version(conn, 6, "canary")
        add_version(conn, 7, "candidate")
        add_version(conn, 8, "rejected")
    plan = read_plan(db, 0.2)
    assert (plan.lineage, plan.control, plan.path, plan.sha256, plan.share) == (
        frozenset({6, 7}),
        5,
        Path("/p/v5"),
        f"{5:064d}",
        0.2,
    )
    set_flag(db, CANARY_SHARE, "0.35")
    assert read_plan(db, 0.2).share == 0.35
    for bad in ("0", "5e-324", "1", "1.5", "nan", "inf", "lots"):  # not a share: the default applies
        set_flag(db, CANARY_SHARE, bad)
        assert read_plan(db, 0.2).share == 0.2
    set_flag(db, GUARD_OFF, "1")  # no split; the promoted version and the rejected ones still count
    plan = read_plan(db, 0.2)
    assert (plan.share, plan.control, plan.rejected) == (None, 5, frozenset({8}))


def test_the_router_holds_the_promoted_version_and_routes_by_the_share(db, tmp_path):
    with db.begin() as conn:
        add_version(conn, 0, "promoted", root=str(tmp_path))
        add_version(conn, 5, "promoted", root=str(tmp_path))
        add_version(conn, 6, "canary", root=str(tmp_path))
    adapter_folder(tmp_path, 5)
    engine, metrics = RouterEngine(version=6), ServerMetrics()
    router = CanaryRouter(db, engine, metrics, 0.25, rng=random.Random(0))
    asyncio.run(router.refresh())
    assert router.split == CanarySplit(frozenset({6}), 5, 0.25) and engine.held == [5]
    assert router.held == 5 and metrics.canary_share._value.get() == 0.25
    # Once the engine holds it (loaded, pinned), later reads do not hold it again.
    asyncio.run(router.refresh())
    assert engine.held == [5] and router.split == CanarySplit(frozenset({6}), 5, 0.25)
    picks = [router.dispatch() for _ in range(400)]
    canary = sum(1 for p in picks if p == (6, Arm.CANARY))
    assert canary + sum(1 for p in picks if p == (5, Arm.CONTROL)) == 400
    assert abs(canary - 100) <= 20  # Binomial(400, 0.25): σ ≈ 8.7
    assert metrics.canary_requests.labels("canary")._value.get() == canary
    # The guard promotes the lineage: no split, the held version is let go.
    with db.begin() as conn:
        conn.execute(PolicyVersion.__table__.update().values(lifecycle="promoted"))
    asyncio.run(router.refresh())
    assert router.split is None and router.held is None and engine.unpinned == [5]
    assert metrics.canary_share._value.get() == 0.0
    assert router.dispatch() == (6, None)


def test_a_router_that_stops_lets_go_of_its_hold(db, tmp_path):
    # A shared engine outlives the app: the router's pin on the control must not outlive it
    # (it took one of the tests' three slots for good, and a later test's version was refused).
    with db.begin() as conn:
        add_version(conn, 0, "promoted", root=str(tmp_path))
        add_version(conn, 5, "promoted", root=str(tmp_path))
        add_version(conn, 6, "canary", root=str(tmp_path))
    adapter_folder(tmp_path, 5)
    engine = RouterEngine(version=6)
    router = CanaryRouter(db, engine, ServerMetrics(), 0.25, rng=random.Random(0))
    asyncio.run(router.refresh())
    assert router.held == 5
    router.release()
    assert router.held is None and engine.unpinned == [5]
    router.release()  # nothing held: nothing to let go
    assert engine.unpinned == [5]


def test_the_base_as_control_needs_no_hold_and_a_refused_hold_means_no_split(db, tmp_path):
    with db.begin() as conn:
        add_version(conn, 0, "promoted", root=str(tmp_path))
        add_version(conn, 1, "canary", root=str(tmp_path))
    engine = RouterEngine(version=1)
    router = CanaryRouter(db, engine, ServerMetrics(), 0.5, rng=random.Random(0))
    asyncio.run(router.refresh())
    # Version 0 is the full weights the engine serves: nothing to hold.
    assert router.split == CanarySplit(frozenset({1}), 0, 0.5) and engine.held == [] and router.held is None
    # Promoted version 5 without adapter files (pruned, or full weights): refused, no split.
    with db.begin() as conn:
        add_version(conn, 5, "promoted", root=str(tmp_path))
        add_version(conn, 6, "canary", root=str(tmp_path))
    engine.version = 6
    asyncio.run(router.refresh())
    assert router.split is None and engine.held == []
    # The files exist but the engine refuses them: still no split.
    adapter_folder(tmp_path, 5)
    engine.refuse = True
    asyncio.run(router.refresh())
    assert router.split is None
    # An engine that serves no adapters never splits (probation).
    engine.refuse, engine.adapters = False, None
    asyncio.run(router.refresh())
    assert router.split is None and engine.held == []


@pytest.mark.parametrize(
    "finish, n_tokens, expected",
    [
        ("stop", 4, True),  # ended by the model after min_tokens = 4
        ("stop", 3, False),  # a word or two, then end of sequence
        ("stop", 0, False),  # empty
        ("length", 1, True),  # cut by its budget (max_tokens 1): says nothing about the model
        ("repetition", 40, False),  # vLLM stopped a loop
    ],
)
def test_healthy_answers(finish, n_tokens, expected):
    assert healthy(finish, n_tokens, min_tokens=4) is expected


def test_answer_health_counts_every_ended_answer_rated_or_not(db):
    t0 = utcnow()
    with db.begin() as conn:
        add_rated(conn, "a", 6, 1.0, t0, arm="canary", n_tokens=12)  # sound, rated
        add_rated(conn, "b", 6, None, t0 + timedelta(seconds=1), state=None, arm="canary", n_tokens=1)
        add_rated(
            conn, "c", 6, None, t0 + timedelta(seconds=2), state=None, n_tokens=2, finish_reason="abort"
        )
        add_rated(conn, "d", 6, None, t0 + timedelta(seconds=3), state=None, finish_reason="repetition")
        add_rated(conn, "e", 5, None, t0 + timedelta(seconds=4), state=None, arm="control", n_tokens=30)
    with db.connect() as conn:
        # a sound, b degenerate (1 token), c aborted (not ended: left out), d a repetition.
        assert answer_health(conn, [6], 4) == [1.0, 0.0, 0.0]
        assert answer_health(conn, [6], 4, arm=Arm.CANARY) == [1.0, 0.0]
        assert answer_health(conn, [5], 4, arm=Arm.CONTROL, since=t0) == [1.0]
        assert answer_health(conn, [6], 4, limit=1) == [0.0]  # the newest: d
        assert rated_rewards(conn, [6]) == [1.0]  # only a was rated
