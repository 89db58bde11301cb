"""Canary arms sticky by identity (issue 40 item 1, routing): a request's arm is a keyed hash of
who sent it (``core.lifecycle.arm_key``: the API key, else the ``user`` field, else the client's
address) salted by the lineage, so retries and the turns of an episode land in one arm, an arm
cannot be chosen by retrying, and every replica routes a key alike."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import insert

from core.db import PolicyVersion, make_engine, migrate
from core.lifecycle import Arm, CanarySplit, arm_key, sticky_draw
from core.records import utcnow
from server.adapters import AdapterTable
from server.canary import CanaryRouter
from server.metrics import ServerMetrics

SECRET = "replicas-share-this"


class BaseOnlyEngine:
    """An adapter engine whose promoted version is the base (version 0): nothing to hold."""

    def __init__(self, version: int):
        self.version = version
        self.weights_version = 0
        self.adapters = AdapterTable(3)


@pytest.fixture
def db(tmp_path: Path):
    url = f"sqlite:///{tmp_path}/db.sqlite"
    migrate(url)
    engine = make_engine(url)
    with engine.begin() as conn:
        for v, stage in ((0, "promoted"), (6, "canary")):
            conn.execute(
                insert(PolicyVersion).values(
                    version=v,
                    path=f"/p/v{v}",
                    sha256="0" * 64,
                    status="published",
                    parent_version=None if v == 0 else 0,
                    metrics={},
                    created_at=utcnow(),
                    lifecycle=stage,
                )
            )
    yield engine
    engine.dispose()


def router(db, secret: str = SECRET) -> CanaryRouter:
    r = CanaryRouter(db, BaseOnlyEngine(version=6), ServerMetrics(), 0.2, rng=random.Random(0), secret=secret)
    asyncio.run(r.refresh())
    assert r.split == CanarySplit(frozenset({6}), 0, 0.2)
    return r


def test_the_arm_key_is_the_key_else_the_user_else_the_address():
    assert arm_key("k1", "bob", "10.0.0.1") == "key:k1"
    assert arm_key(None, "bob", "10.0.0.1") == "user:bob"
    assert arm_key(None, None, "10.0.0.1") == "addr:10.0.0.1"
    assert arm_key(None, None, None) is None


@given(st.text(max_size=40), st.text(max_size=40), st.text(max_size=40))
def test_a_draw_is_in_the_unit_interval_and_fixed_by_its_inputs(secret, salt, key):
    d = sticky_draw(secret, salt, key)
    assert 0.0 <= d < 1.0 and d == sticky_draw(secret, salt, key)


def test_retries_and_turns_keep_their_arm_and_the_share_holds_over_keys(db):
    """1,000 keys, each sending 5 requests (retries, turns of an episode): each key's 5 land in
    one arm. The canary's keys are Binomial(1000, 0.2): mean 200, σ = sqrt(1000 · 0.2 · 0.8) ≈ 12.6;
    the bound ±50 is about 4σ."""
    r = router(db)
    keys = [arm_key(f"k{i}", None, None) for i in range(1000)]
    arms = {k: {r.dispatch(k) for _ in range(5)} for k in keys}
    assert all(len(a) == 1 for a in arms.values())
    canary = sum(1 for a in arms.values() if a == {(6, Arm.CANARY)})
    control = sum(1 for a in arms.values() if a == {(0, Arm.CONTROL)})
    assert canary + control == 1000 and abs(canary - 200) <= 50


def test_replicas_agree_and_a_new_lineage_draws_a_new_cohort(db):
    """Two routers with one secret route every key alike (two replicas); another secret routes
    them otherwise. A lineage starting at another version salts the draws anew: the canary
    cohorts of lineages 6 and 9 overlap by about share² = 4% of the keys (40 of 1,000), not 20%."""
    keys = [f"key:k{i}" for i in range(1000)]
    a, b, other = router(db), router(db), router(db, secret="another")
    assert [a.dispatch(k) for k in keys] == [b.dispatch(k) for k in keys]
    assert [a.dispatch(k) for k in keys] != [other.dispatch(k) for k in keys]
    first = {k for k in keys if sticky_draw(SECRET, "global:6", k) < 0.2}
    later = {k for k in keys if sticky_draw(SECRET, "global:9", k) < 0.2}
    assert len(first & later) < 80


def test_a_request_without_a_key_draws_per_request(db):
    """No key (an internal caller): the router's own draw, as before; over 400 requests both arms
    come up (P(all 400 in one arm) = 0.8^400 + 0.2^400, about 1e-39)."""
    r = router(db)
    picks = {r.dispatch() for _ in range(400)}
    assert picks == {(6, Arm.CANARY), (0, Arm.CONTROL)}
