"""Two tenant policies trained in one learner process on real parts (issue 39 item 3;
learner.tenants; docs/tenants.md, "Many tenants in one learner"): the prepared SmolLM2 model,
PostgreSQL with a schema per tenant namespace. Each tenant's feedback trains its own policy only,
and each publishes and announces its own version in its own namespace. The scheduling and the
isolation gate on tiny models: tests/unit/learner/test_tenant_learners.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import select

from core.db import LearnerStep, PolicyVersion, make_engine, migrate
from core.logbus import open_log
from core.policies import GLOBAL
from core.policy_store import Layout, layout
from core.records import TOPIC_POLICY
from learner.config import LearnerConfig
from learner.tenants import TenantLearners, namespace_of
from testing.learner import feed
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
