"""The list of tenant policies in the global database (core/tenant_store.py): seeded from the
setting without removing, added and removed by name with one outcome each, the limit of the
slots; SQLite (PostgreSQL's advisory lock: tests/integration/test_tenant_learners_db.py)."""

from __future__ import annotations

import threading

import pytest

from core import tenant_store
from core.db import make_engine, migrate
from core.keys import BadTenant


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'g.db'}"
    migrate(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def test_seed_adds_only_the_absent_names_and_removes_none(db):
    assert tenant_store.seed(db, ["acme", "beta"]) == ["acme", "beta"]
    assert tenant_store.add(db, "zeta") is True
    # An older setting (acme only) seeds nothing and keeps beta and zeta.
    assert tenant_store.seed(db, ["acme"]) == []
    assert tenant_store.read(db) == ["acme", "beta", "zeta"]
    with pytest.raises(BadTenant, match="'global' names the shared policy"):
        tenant_store.seed(db, ["global"])


def test_add_and_remove_answer_whether_this_call_changed_the_list(db):
    assert tenant_store.add(db, "acme") is True
    assert tenant_store.add(db, "acme") is False
    assert tenant_store.remove(db, "acme") is True
    assert tenant_store.remove(db, "acme") is False
    assert tenant_store.read(db) == []
    for bad in ("Acme", "global", "", "-x"):
        with pytest.raises(BadTenant):
            tenant_store.add(db, bad)


def test_the_limit_refuses_a_new_name_but_answers_one_already_there(db):
    tenant_store.seed(db, ["acme", "beta"])
    with pytest.raises(tenant_store.TenantPolicyLimit, match="^2 tenant policies are the most"):
        tenant_store.add(db, "zeta", limit=2)
    assert tenant_store.add(db, "beta", limit=2) is False
    assert tenant_store.add(db, "zeta", limit=3) is True
    assert tenant_store.read(db) == ["acme", "beta", "zeta"]


def test_racing_adds_of_one_name_record_one_row_and_answer_both(db):
    answers, start = [], threading.Barrier(4)

    def add():
        start.wait()
        answers.append(tenant_store.add(db, "acme", limit=5))

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [False, False, False, True]
    assert tenant_store.read(db) == ["acme"]


def test_racing_adds_at_the_last_place_admit_one(db):
    tenant_store.seed(db, ["acme"])
    outcomes, start = {}, threading.Barrier(3)

    def add(name):
        start.wait()
        try:
            outcomes[name] = tenant_store.add(db, name, limit=2)
        except tenant_store.TenantPolicyLimit:
            outcomes[name] = "full"

    threads = [threading.Thread(target=add, args=(n,)) for n in ("b1", "b2", "b3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes.values(), key=str) == [True, "full", "full"]
    assert len(tenant_store.read(db)) == 2


def test_a_removed_name_is_kept_for_forget_and_retention_and_can_come_back(db):
    # acme and beta listed; acme removed: read drops it, ever keeps it (its namespace still
    # holds data a forget must reach).
    tenant_store.seed(db, ["acme", "beta"])
    assert tenant_store.remove(db, "acme") is True
    assert tenant_store.read(db) == ["beta"]
    assert tenant_store.ever(db) == ["acme", "beta"]
    # A removed name does not count against the limit: 1 listed < 2.
    assert tenant_store.add(db, "zeta", limit=2) is True
    # Listing acme again (the route, or a start whose setting still names it) answers True
    # once, keeps its first place (added_at) and clears the mark.
    with pytest.raises(tenant_store.TenantPolicyLimit):
        tenant_store.add(db, "acme", limit=2)  # beta and zeta: 2 listed, full
    assert tenant_store.seed(db, ["acme"]) == ["acme"]
    assert tenant_store.seed(db, ["acme"]) == []
    assert tenant_store.read(db) == ["acme", "beta", "zeta"]
    assert tenant_store.remove(db, "zeta") is True
    assert tenant_store.add(db, "zeta") is True and tenant_store.add(db, "zeta") is False
