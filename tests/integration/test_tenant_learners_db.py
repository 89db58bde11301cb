"""Two tenant policies trained in one learner process on real parts (issue 39 item 3;
learner.tenants; docs/tenants.md, "Many tenants in one learner"): the prepared SmolLM2 model,
PostgreSQL with a schema per tenant namespace. Each tenant's feedback trains its own policy only,
and each publishes and announces its own version in its own namespace. The scheduling and the
isolation gate on tiny models: tests/unit/learner/test_tenant_learners.py. The list of tenant
policies on PostgreSQL: racing operators, and a tenant added while the learner runs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import select

from core import tenant_store
from core.db import LearnerStep, PolicyVersion, make_engine, migrate
from core.logbus import open_log
from core.policies import GLOBAL
from core.policy_store import Layout, layout
from core.records import TOPIC_POLICY
from learner.config import LearnerConfig
from learner.tenants import TenantLearners, listed_namespace, namespace_of
from testing.learner import feed
from testing.servers import make_settings
from testing.tenants import logged, tenant_settings

VOCAB = 49152  # SmolLM2's


def committed(settings) -> tuple[list[tuple[int, str]], list[str]]:
    """(version, folder) of every version row, and the sample ids its steps trained."""
    db = make_engine(settings.resolved_database_url)
    try:
        with db.connect() as conn:
            versions = [tuple(r) for r in conn.execute(select(PolicyVersion.version, PolicyVersion.path))]
            steps = [i for m in conn.execute(select(LearnerStep.metrics)).scalars() for i in m["sample_ids"]]
    finally:
        db.dispose()
    return sorted(versions), sorted(steps)


@pytest.mark.postgres
def test_two_tenants_in_one_process_each_publish_their_own_version_from_their_own_feedback(
    model_dir, pg_url, tmp_path
):
    settings = tenant_settings(tmp_path, database_url=pg_url, model_dir=model_dir, policy_dir=tmp_path / "p")
    ns = {name: namespace_of(settings, name) for name in (GLOBAL, "acme", "beta")}
    for s in ns.values():
        migrate(s.resolved_database_url)
    fed = {}
    for name, start in (("acme", 0), ("beta", 100)):
        log = open_log(ns[name].resolved_log_url)
        try:
            fed[name] = feed(log, 2, start, vocab=VOCAB)
        finally:
            log.close()
    config = LearnerConfig(batch_size=2, poll_s=0.01, max_steps=1, policy={"kind": "lora", "rank": 8})
    learners = TenantLearners(settings, ["acme", "beta"], config)
    learners.load()
    learners.run(threading.Event())
    for name in ("acme", "beta"):
        versions, trained = committed(ns[name])
        assert [v for v, _ in versions] == [0, 1] and trained == fed[name]
        folder = versions[1][1]
        assert (
            folder.startswith(str(tmp_path / "p" / "tenants" / name))
            and layout(Path(folder)) == Layout.ADAPTER
        )
        announced = [r["version"] for r in logged(ns[name], TOPIC_POLICY)]
        assert 1 in announced
    assert committed(ns[GLOBAL]) == ([], []) and logged(ns[GLOBAL], TOPIC_POLICY) == []
    acme, beta = (learners.learners[n].algorithm.policy for n in ("acme", "beta"))
    assert acme.get_input_embeddings().weight is beta.get_input_embeddings().weight


@pytest.mark.postgres
def test_racing_operators_on_postgres_get_one_outcome_each(pg_url):
    """Eight adds of one name: one True; eight adds of eight names at two free places: two added,
    six refused (the advisory lock orders the count and the insert); two removes: one True."""
    migrate(pg_url)
    db = make_engine(pg_url)
    try:
        tenant_store.seed(db, ["acme"])
        with ThreadPoolExecutor(8) as pool:
            same = list(pool.map(lambda _: tenant_store.add(db, "beta", limit=10), range(8)))

            def at_limit(i):
                try:
                    return tenant_store.add(db, f"t{i}", limit=4)
                except tenant_store.TenantPolicyLimit:
                    return "full"

            racing = list(pool.map(at_limit, range(8)))
            removes = list(pool.map(lambda _: tenant_store.remove(db, "acme"), range(2)))
        assert sorted(same) == [False] * 7 + [True]
        assert racing.count(True) == 2 and racing.count("full") == 6
        assert sorted(removes) == [False, True]
        assert len(tenant_store.read(db)) == 3 and "acme" not in tenant_store.read(db)
        # acme is kept, marked removed (forget and retention reach its namespace); two racing
        # adds at a free place list it again once; it keeps its first place.
        assert tenant_store.ever(db)[0] == "acme"
        with ThreadPoolExecutor(2) as pool:
            back = list(pool.map(lambda _: tenant_store.add(db, "acme", limit=4), range(2)))
        assert sorted(back) == [False, True]
        assert tenant_store.read(db)[0] == "acme" and len(tenant_store.read(db)) == 4
    finally:
        db.dispose()


@pytest.mark.postgres
def test_a_tenant_added_while_the_learner_follows_the_list_trains_in_its_own_schema(
    model_dir, pg_url, tmp_path
):
    """``--all-tenants``: beta, added to the database's list after the start, gets a learner on
    the shared base at the next round and publishes its version in its own namespace."""
    settings = make_settings(tmp_path, database_url=pg_url, model_dir=model_dir, policy_dir=tmp_path / "p")
    migrate(settings.resolved_database_url)
    db = make_engine(settings.resolved_database_url)
    config = LearnerConfig(batch_size=2, poll_s=0.01, max_steps=1, policy={"kind": "lora", "rank": 8})
    try:
        learners = TenantLearners(settings, [], config)
        learners.follow(lambda: tenant_store.read(db))
        assert learners.run_round() == 0 and learners.learners == {}
        assert tenant_store.add(db, "beta") is True
        beta = listed_namespace(settings, "beta")
        migrate(beta.resolved_database_url)
        log = open_log(beta.resolved_log_url)
        try:
            fed = feed(log, 2, 100, vocab=VOCAB)
        finally:
            log.close()
        learners.run(threading.Event())
        versions, trained = committed(beta)
        assert [v for v, _ in versions] == [0, 1] and trained == fed
        assert versions[1][1].startswith(str(tmp_path / "p" / "tenants" / "beta"))
        assert committed(settings) == ([], [])
    finally:
        db.dispose()
